//! Engine configuration: the reference replica's parameters as defaults, and validation that reports every problem at once.

use kvgate_config::{Checks, FieldError, Range, ValidationErrors};
use serde::{Deserialize, Serialize};

/// Parameters of one simulated engine replica.
///
/// `Default` is the reference replica of `shared/bench/SCENARIOS.md`: 8,000 prefill tokens/s,
/// 2,048-token prefill chunks, decode steps of 6 ms + 0.35 ms per running request, at most 256
/// running requests, 262,144 tokens of KV cache in 16-token blocks, prefix cache on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Uncached prompt tokens computed per second of prefill.
    pub prefill_tokens_per_sec: f64,
    /// Most uncached prompt tokens computed in one prefill step.
    pub prefill_chunk_tokens: u32,
    /// Fixed cost of one prefill step (a chunk), in milliseconds, besides its tokens at
    /// `prefill_tokens_per_sec` (a step that also carries decodes pays the larger of this and
    /// `decode_base_ms` once).
    pub prefill_base_ms: f64,
    /// Nanoseconds per (new token, context token) pair of a prefill step: attention's cost,
    /// which grows with the context each new token attends to (its prompt's cached prefix and
    /// earlier chunks, and the tokens before it in its own chunk). 0: a step's cost is its
    /// token count alone (what GPUs show at these lengths); vLLM's CPU build pays it visibly.
    pub prefill_context_ns: f64,
    /// Fixed cost of one decode step, in milliseconds.
    pub decode_base_ms: f64,
    /// Added cost of one decode step per request in the batch, in milliseconds.
    pub decode_per_request_ms: f64,
    /// Most requests admitted (prefilling or decoding) at once.
    pub max_running_requests: u32,
    /// KV cache size in tokens (rounded down to whole blocks).
    pub kv_capacity_tokens: u64,
    /// Tokens per KV block (page).
    pub block_size: u32,
    /// Reuse the KV blocks of previously computed prompt prefixes.
    pub prefix_cache: bool,
    /// Emit `EngineOutput::Token` for every decoded token (switch off in virtual-time simulation).
    pub emit_token_events: bool,
    /// Record KV events for `Engine::drain_kv_events` (switch off when nobody consumes them).
    pub emit_kv_events: bool,
    /// Host-memory (CPU) KV tier in tokens (0: none): blocks entering the prefix cache are also
    /// copied there, and a prefix found there loads back instead of being recomputed.
    pub cpu_offload_tokens: u64,
    /// Tokens per second loaded back from the host tier (default: 25 GB/s of PCIe at 128 KiB of
    /// KV per token, Llama-3-8B in fp16).
    pub cpu_load_tokens_per_sec: f64,
    /// Serve waiting requests by priority (`EngineRequest::priority`, lower first), as vLLM's
    /// `--scheduling-policy priority` and SGLang's `--enable-priority-scheduling` do; off:
    /// first come, first served.
    pub priority_scheduling: bool,
    /// Carry the running decodes in every step, prefill chunks filling the rest of the step's
    /// token budget (vLLM v1's scheduler, `vllm/v1/core/sched/scheduler.py`: the running
    /// requests first, one token per decode, then the waiting ones while `token_budget > 0`;
    /// SGLang's `--enable-mixed-chunk`); off: a prefill step goes before the running decodes
    /// and carries none of them (SGLang's default). A mixed step takes its prefill tokens' and
    /// its decodes' time plus the larger of the two fixed costs (`prefill_base_ms`,
    /// `decode_base_ms`).
    pub mixed_batching: bool,
    /// Milliseconds between a request's submission and its arrival in the scheduler's queue:
    /// the engine's own server (HTTP, tokenization, the hop to the engine core, and the first
    /// token's way back), which a client sees in every time to first token.
    pub frontend_latency_ms: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            prefill_tokens_per_sec: 8000.0,
            prefill_chunk_tokens: 2048,
            prefill_base_ms: 0.0,
            prefill_context_ns: 0.0,
            decode_base_ms: 6.0,
            decode_per_request_ms: 0.35,
            max_running_requests: 256,
            kv_capacity_tokens: 262_144,
            block_size: 16,
            prefix_cache: true,
            emit_token_events: true,
            emit_kv_events: true,
            cpu_offload_tokens: 0,
            cpu_load_tokens_per_sec: 190_000.0,
            priority_scheduling: false,
            mixed_batching: false,
            frontend_latency_ms: 0.0,
        }
    }
}

impl EngineConfig {
    /// Checks every field; returns all problems found, not only the first. Fields are named by
    /// their keys here and by the `kvgate mock`/`kvgate sim` flags that set them.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        checks.in_range("prefill_tokens_per_sec", self.prefill_tokens_per_sec, Range::POSITIVE);
        checks.at_least("prefill_chunk_tokens", self.prefill_chunk_tokens.into(), 1);
        checks.in_range("prefill_base_ms", self.prefill_base_ms, Range::NON_NEGATIVE);
        checks.in_range("prefill_context_ns", self.prefill_context_ns, Range::NON_NEGATIVE);
        checks.in_range("decode_base_ms", self.decode_base_ms, Range::NON_NEGATIVE);
        checks.in_range("decode_per_request_ms", self.decode_per_request_ms, Range::NON_NEGATIVE);
        checks.at_least("max_running_requests", self.max_running_requests.into(), 1);
        checks.in_range("cpu_load_tokens_per_sec", self.cpu_load_tokens_per_sec, Range::POSITIVE);
        checks.in_range("frontend_latency_ms", self.frontend_latency_ms, Range::NON_NEGATIVE);
        if self.block_size == 0 {
            checks.push(
                FieldError::new("block_size", "must be at least 1").got(0).with_flag(Some("--kv-block-size")),
            );
        }
        if self.kv_capacity_tokens < u64::from(self.block_size.max(1)) {
            checks.push(
                FieldError::new(
                    "kv_capacity_tokens",
                    format!("must hold at least one block of {} tokens", self.block_size),
                )
                .got(self.kv_capacity_tokens),
            );
        }
        checks.finish()
    }

    /// This engine at `speed` times the speed: prefill rate multiplied, step times divided (the
    /// front end's latency is not the engine's speed).
    pub fn scaled(self, speed: f64) -> EngineConfig {
        EngineConfig {
            prefill_tokens_per_sec: self.prefill_tokens_per_sec * speed,
            prefill_base_ms: self.prefill_base_ms / speed,
            prefill_context_ns: self.prefill_context_ns / speed,
            decode_base_ms: self.decode_base_ms / speed,
            decode_per_request_ms: self.decode_per_request_ms / speed,
            ..self
        }
    }

    /// KV capacity in whole blocks.
    pub fn capacity_blocks(&self) -> u64 {
        self.kv_capacity_tokens / u64::from(self.block_size.max(1))
    }

    /// Host-memory tier capacity in whole blocks (0: no tier).
    pub fn cpu_offload_blocks(&self) -> u64 {
        self.cpu_offload_tokens / u64::from(self.block_size.max(1))
    }

    /// Prefill-equivalent tokens of loading `tokens` back from the host tier: the load holds the
    /// request as long as computing this many tokens would.
    pub fn load_work_tokens(&self, tokens: u32) -> u32 {
        let work = f64::from(tokens) * self.prefill_tokens_per_sec / self.cpu_load_tokens_per_sec;
        if work.is_finite() {
            work.ceil().min(f64::from(u32::MAX)) as u32
        } else {
            tokens
        }
    }

    /// Duration of a prefill step computing `tokens` uncached tokens, in microseconds (at least 1).
    pub fn prefill_step_us(&self, tokens: u64) -> u64 {
        duration_us(self.prefill_base_ms * 1e3 + tokens as f64 / self.prefill_tokens_per_sec * 1e6)
    }

    /// Duration of a step computing `tokens` prefill tokens while carrying `batch` decodes
    /// (`mixed_batching`): both parts' work, and the larger fixed cost once.
    pub fn mixed_step_us(&self, tokens: u64, batch: usize) -> u64 {
        let fixed_ms = self.prefill_base_ms.max(self.decode_base_ms);
        let work_ms =
            tokens as f64 / self.prefill_tokens_per_sec * 1e3 + self.decode_per_request_ms * batch as f64;
        duration_us((fixed_ms + work_ms) * 1e3)
    }

    /// Attention's added time, in microseconds, for a step whose new tokens attend to `pairs`
    /// (new token, context token) pairs in all (see [`EngineConfig::prefill_context_ns`]).
    pub fn context_us(&self, pairs: u64) -> u64 {
        let micros = pairs as f64 * self.prefill_context_ns / 1e3;
        if micros.is_finite() && micros > 0.0 {
            micros.round() as u64
        } else {
            0
        }
    }

    /// The (new token, context token) pairs of computing `tokens` prompt tokens after `context`
    /// tokens already in the KV cache: each new token attends to the context and to the new
    /// tokens before it (and itself).
    pub fn context_pairs(context: u32, tokens: u32) -> u64 {
        let (context, tokens) = (u64::from(context), u64::from(tokens));
        tokens * context + tokens * (tokens + 1) / 2
    }

    /// The front end's latency in microseconds.
    pub fn frontend_latency_us(&self) -> u64 {
        if self.frontend_latency_ms.is_finite() && self.frontend_latency_ms > 0.0 {
            (self.frontend_latency_ms * 1e3).round() as u64
        } else {
            0
        }
    }

    /// Duration of a decode step over `batch` requests, in microseconds (at least 1).
    pub fn decode_step_us(&self, batch: usize) -> u64 {
        duration_us((self.decode_base_ms + self.decode_per_request_ms * batch as f64) * 1e3)
    }
}

fn duration_us(micros: f64) -> u64 {
    if micros.is_finite() {
        (micros.round() as u64).max(1)
    } else {
        u64::MAX / 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_reference_replica() {
        let config = EngineConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.capacity_blocks(), 16_384);
        assert_eq!(config.prefill_step_us(2048), 256_000);
        assert_eq!(config.decode_step_us(10), 9_500);
        assert_eq!(config.context_us(1_000_000), 0, "no context cost by default");
    }

    #[test]
    fn context_cost_counts_every_new_token_against_what_it_attends_to() {
        assert_eq!(EngineConfig::context_pairs(0, 4), 4 + 3 + 2 + 1);
        assert_eq!(EngineConfig::context_pairs(1000, 2), 2 * 1000 + 3);
        let config = EngineConfig { prefill_context_ns: 25.0, ..EngineConfig::default() };
        // 256 new tokens after 4,096 cached: 1,081,472 pairs at 25 ns.
        assert_eq!(config.context_us(EngineConfig::context_pairs(4096, 256)), 27_037);
        assert_eq!(config.clone().scaled(2.0).context_us(1_000_000), 12_500);
    }

    #[test]
    fn validate_reports_every_error() {
        let config = EngineConfig {
            prefill_tokens_per_sec: 0.0,
            prefill_chunk_tokens: 0,
            decode_base_ms: f64::NAN,
            decode_per_request_ms: -1.0,
            max_running_requests: 0,
            kv_capacity_tokens: 8,
            block_size: 16,
            ..EngineConfig::default()
        };
        let fields: Vec<_> = config.validate().unwrap_err().0.into_iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            [
                "prefill_tokens_per_sec",
                "prefill_chunk_tokens",
                "decode_base_ms",
                "decode_per_request_ms",
                "max_running_requests",
                "kv_capacity_tokens"
            ]
        );
    }

    #[test]
    fn partial_json_fills_defaults_and_unknown_fields_fail() {
        let config: EngineConfig = serde_json::from_str(r#"{"block_size": 32}"#).unwrap();
        assert_eq!(config.block_size, 32);
        assert_eq!(config.prefill_chunk_tokens, 2048);
        assert!(serde_json::from_str::<EngineConfig>(r#"{"blocksize": 32}"#).is_err());
    }
}
