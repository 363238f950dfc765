//! The engine model's command-line flags, declared once and shared by `kvgate mock` and
//! `kvgate sim`: each flag left unset keeps the value of the `--engine-profile` (by default the
//! reference replica's; the defaults shown are the reference's).

use kvgate_config::{Checks, FieldError, Range, ValidationErrors};

use crate::{EngineConfig, EngineProfile};

#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct EngineFlags {
    /// The engines' parameters before the flags below: `reference` (the routing scenarios'
    /// replica) or `vllm-cpu-tiny` (vLLM 0.32's CPU build serving the real-engine harness's tiny
    /// model, as measured; see docs/BENCHMARKS.md). Each engine flag given overrides its value.
    #[arg(long, value_enum, default_value_t = EngineProfile::Reference)]
    pub engine_profile: EngineProfile,
    /// Fixed cost of a prefill step (a chunk) in ms [default: 0].
    #[arg(long)]
    pub prefill_base_ms: Option<f64>,
    /// Ns per (new token, context token) pair of a prefill step: attention's cost, growing with
    /// the context each new token attends to [default: 0].
    #[arg(long)]
    pub prefill_context_ns: Option<f64>,
    /// Ms from a request's submission to the engine's scheduler queue: its server's HTTP,
    /// tokenization and first token back [default: 0].
    #[arg(long)]
    pub frontend_latency_ms: Option<f64>,
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
    /// An unequal fleet: engine i runs this many times the speed of the others (its prefill
    /// rate multiplied, its decode step times divided), one factor per engine in order,
    /// comma-separated; engines past the list run at 1.
    #[arg(long, value_delimiter = ',', value_name = "F,...")]
    pub worker_speeds: Vec<f64>,
    /// An unequal fleet: engine i's KV cache capacity in tokens, one per engine in order,
    /// comma-separated; engines past the list have --kv-capacity-tokens.
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    pub worker_kv_capacity_tokens: Vec<u64>,
    /// A host-memory (CPU) KV tier of this many tokens per engine, as vLLM's offloading connector
    /// keeps one: cached blocks are copied there, and a prefix found there loads back over PCIe
    /// instead of being recomputed [default: 0, no tier].
    #[arg(long, value_name = "N")]
    pub cpu_offload_tokens: Option<u64>,
    /// Tokens per second loaded back from the host tier [default: 190000, 25 GB/s at 128 KiB per
    /// token].
    #[arg(long)]
    pub cpu_load_tokens_per_sec: Option<f64>,
    /// Serve waiting requests by their priority (a request's `priority` field, lower first, as
    /// vLLM's `--scheduling-policy priority`), a more urgent prefill taking each step's budget
    /// ahead of less urgent ones already prefilling; off: first come, first served.
    #[arg(long)]
    pub priority_scheduling: bool,
    /// Carry the running decodes in every step, prefill chunks filling the rest of its token
    /// budget (vLLM v1's scheduler, SGLang's `--enable-mixed-chunk`); off: a prefill step goes
    /// before the running decodes and carries none of them (SGLang's default).
    #[arg(long)]
    pub mixed_batching: bool,
}

impl EngineFlags {
    /// The profile's engines with the given flags applied (event switches left at their defaults).
    pub fn config(&self) -> EngineConfig {
        let default = self.engine_profile.config();
        EngineConfig {
            prefill_base_ms: self.prefill_base_ms.unwrap_or(default.prefill_base_ms),
            prefill_context_ns: self.prefill_context_ns.unwrap_or(default.prefill_context_ns),
            frontend_latency_ms: self.frontend_latency_ms.unwrap_or(default.frontend_latency_ms),
            prefill_tokens_per_sec: self.prefill_tokens_per_sec.unwrap_or(default.prefill_tokens_per_sec),
            prefill_chunk_tokens: self.prefill_chunk_tokens.unwrap_or(default.prefill_chunk_tokens),
            decode_base_ms: self.decode_base_ms.unwrap_or(default.decode_base_ms),
            decode_per_request_ms: self.decode_per_request_ms.unwrap_or(default.decode_per_request_ms),
            max_running_requests: self.max_running_requests.unwrap_or(default.max_running_requests),
            kv_capacity_tokens: self.kv_capacity_tokens.unwrap_or(default.kv_capacity_tokens),
            block_size: self.kv_block_size.unwrap_or(default.block_size),
            prefix_cache: default.prefix_cache && !self.disable_prefix_cache,
            cpu_offload_tokens: self.cpu_offload_tokens.unwrap_or(default.cpu_offload_tokens),
            cpu_load_tokens_per_sec: self.cpu_load_tokens_per_sec.unwrap_or(default.cpu_load_tokens_per_sec),
            priority_scheduling: self.priority_scheduling || default.priority_scheduling,
            mixed_batching: self.mixed_batching || default.mixed_batching,
            ..default
        }
    }

    /// Engine `worker`'s configuration: [`EngineFlags::config`] with its entries of
    /// `--worker-speeds` and `--worker-kv-capacity-tokens` applied.
    pub fn config_for(&self, worker: usize) -> EngineConfig {
        let mut config = self.config();
        if let Some(&kv) = self.worker_kv_capacity_tokens.get(worker) {
            config.kv_capacity_tokens = kv;
        }
        match self.worker_speeds.get(worker) {
            Some(&speed) => config.scaled(speed),
            None => config,
        }
    }

    /// Whether the engines differ (a per-worker list is given).
    pub fn is_unequal(&self) -> bool {
        !self.worker_speeds.is_empty() || !self.worker_kv_capacity_tokens.is_empty()
    }

    /// Checks the configuration of each of `n_workers` engines (each problem once: the shared
    /// flags' under their own names, a worker's entries as `worker_speeds[i]` /
    /// `worker_kv_capacity_tokens[i]`).
    pub fn validate(&self, n_workers: usize) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        checks.nested(self.config().validate());
        for (worker, &speed) in self.worker_speeds.iter().enumerate() {
            if !Range::POSITIVE.contains(speed) {
                checks.push(
                    FieldError::new(format!("worker_speeds[{worker}]"), "must be a finite number > 0")
                        .got(speed)
                        .with_flag(Some("--worker-speeds")),
                );
            }
        }
        let block = u64::from(self.config().block_size.max(1));
        for (worker, &kv) in self.worker_kv_capacity_tokens.iter().enumerate() {
            if kv < block {
                checks.push(
                    FieldError::new(
                        format!("worker_kv_capacity_tokens[{worker}]"),
                        format!("must hold at least one block of {block} tokens"),
                    )
                    .got(kv)
                    .with_flag(Some("--worker-kv-capacity-tokens")),
                );
            }
        }
        for (flag, given) in [
            ("--worker-speeds", self.worker_speeds.len()),
            ("--worker-kv-capacity-tokens", self.worker_kv_capacity_tokens.len()),
        ] {
            if given > n_workers {
                checks.push(
                    FieldError::new(
                        flag.trim_start_matches("--").replace('-', "_"),
                        format!("lists {given} engines but the fleet has {n_workers}"),
                    )
                    .with_flag(Some(flag)),
                );
            }
        }
        checks.finish()
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

    #[test]
    fn a_profile_is_the_base_and_flags_override_it() {
        let profile = EngineFlags { engine_profile: EngineProfile::VllmCpuTiny, ..Default::default() };
        assert_eq!(profile.config(), EngineProfile::VllmCpuTiny.config());
        let tuned = EngineFlags {
            engine_profile: EngineProfile::VllmCpuTiny,
            prefill_tokens_per_sec: Some(4_000.0),
            frontend_latency_ms: Some(0.0),
            ..Default::default()
        };
        let config = tuned.config();
        assert_eq!((config.prefill_tokens_per_sec, config.frontend_latency_ms), (4_000.0, 0.0));
        assert_eq!((config.block_size, config.mixed_batching), (32, true), "the rest is the profile's");
    }

    #[test]
    fn an_unequal_fleet_scales_each_listed_engine() {
        let flags = EngineFlags {
            worker_speeds: vec![2.0, 1.0],
            worker_kv_capacity_tokens: vec![1_048_576, 1_048_576, 131_072],
            kv_capacity_tokens: Some(1_048_576),
            ..Default::default()
        };
        let fast = flags.config_for(0);
        assert_eq!(
            (fast.prefill_tokens_per_sec, fast.decode_base_ms, fast.decode_per_request_ms),
            (16_000.0, 3.0, 0.175)
        );
        assert_eq!(flags.config_for(1), flags.config());
        assert_eq!(flags.config_for(2).kv_capacity_tokens, 131_072);
        assert_eq!(flags.config_for(2).prefill_tokens_per_sec, 8_000.0, "past the speeds: 1x");
        assert_eq!(flags.config_for(7), flags.config());
        assert!(flags.validate(8).is_ok() && flags.is_unequal() && !EngineFlags::default().is_unequal());
        let bad = EngineFlags {
            worker_speeds: vec![0.0, f64::NAN],
            worker_kv_capacity_tokens: vec![8],
            ..Default::default()
        };
        let fields: Vec<String> = bad.validate(1).unwrap_err().0.into_iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            ["worker_speeds[0]", "worker_speeds[1]", "worker_kv_capacity_tokens[0]", "worker_speeds"]
        );
    }
}
