//! The engine model's command-line flags, declared once and shared by `kvgate mock` and
//! `kvgate sim`: each flag left unset keeps the reference replica's value.

use crate::EngineConfig;

#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct EngineFlags {
    /// Uncached prompt tokens prefilled per second [default: 8000].
    #[arg(long)]
    pub prefill_tokens_per_sec: Option<f64>,
    /// Most prompt tokens per prefill step [default: 2048].
    #[arg(long)]
    pub prefill_chunk_tokens: Option<u32>,
    /// Fixed decode step time in ms [default: 6.0].
    #[arg(long)]
    pub decode_base_ms: Option<f64>,
    /// Decode step time per running request in ms [default: 0.35].
    #[arg(long)]
    pub decode_per_request_ms: Option<f64>,
    /// Most running requests per engine [default: 256].
    #[arg(long)]
    pub max_running_requests: Option<u32>,
    /// KV cache capacity per engine in tokens [default: 262144].
    #[arg(long)]
    pub kv_capacity_tokens: Option<u64>,
    /// Tokens per KV block of the engines [default: 16].
    #[arg(long)]
    pub kv_block_size: Option<u32>,
    /// Turn the engines' prefix cache off.
    #[arg(long)]
    pub disable_prefix_cache: bool,
    /// A host-memory (CPU) KV tier of this many tokens per engine, as vLLM's offloading connector
    /// keeps one: cached blocks are copied there, and a prefix found there loads back over PCIe
    /// instead of being recomputed [default: 0, no tier].
    #[arg(long, value_name = "N")]
    pub cpu_offload_tokens: Option<u64>,
    /// Tokens per second loaded back from the host tier [default: 190000, 25 GB/s at 128 KiB per
    /// token].
    #[arg(long)]
    pub cpu_load_tokens_per_sec: Option<f64>,
}

impl EngineFlags {
    /// The reference replica with the given flags applied (event switches left at their defaults).
    pub fn config(&self) -> EngineConfig {
        let default = EngineConfig::default();
        EngineConfig {
            prefill_tokens_per_sec: self.prefill_tokens_per_sec.unwrap_or(default.prefill_tokens_per_sec),
            prefill_chunk_tokens: self.prefill_chunk_tokens.unwrap_or(default.prefill_chunk_tokens),
            decode_base_ms: self.decode_base_ms.unwrap_or(default.decode_base_ms),
            decode_per_request_ms: self.decode_per_request_ms.unwrap_or(default.decode_per_request_ms),
            max_running_requests: self.max_running_requests.unwrap_or(default.max_running_requests),
            kv_capacity_tokens: self.kv_capacity_tokens.unwrap_or(default.kv_capacity_tokens),
            block_size: self.kv_block_size.unwrap_or(default.block_size),
            prefix_cache: !self.disable_prefix_cache,
            cpu_offload_tokens: self.cpu_offload_tokens.unwrap_or(default.cpu_offload_tokens),
            cpu_load_tokens_per_sec: self.cpu_load_tokens_per_sec.unwrap_or(default.cpu_load_tokens_per_sec),
            ..default
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_flags_keep_the_reference_replica() {
        assert_eq!(EngineFlags::default().config(), EngineConfig::default());
        let flags =
            EngineFlags { kv_capacity_tokens: Some(1024), disable_prefix_cache: true, ..Default::default() };
        let config = flags.config();
        assert_eq!((config.kv_capacity_tokens, config.prefix_cache), (1024, false));
        assert_eq!(config.prefill_chunk_tokens, EngineConfig::default().prefill_chunk_tokens);
    }
}
