//! The mock fleet's options (one clap declaration, also the library's configuration) and their validation.

use kvgate_config::{Checks, FieldError, Range, ValidationErrors};
use kvgate_engine::{EngineConfig, EngineFlags};
use kvgate_protocol::WorkerRole;

/// How each simulated engine answers.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// A `kvgate-engine` model in real time: prefill, decode, KV cache, prefix reuse.
    #[default]
    Realistic,
    /// A fixed small answer after `--gen-ms` (no model), for gateway overhead benchmarks.
    Canned,
}

/// Which engine version's KV event wire format the mock speaks (the formats of
/// `crates/kvgate-kv-events/testdata/kv-wire/`, captured from the engines' own publishers).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvEventEncoding {
    /// vLLM 0.26 to 0.33 (today's): events as maps with 0.33's fields, replay replies with the
    /// topic frame.
    #[default]
    #[value(name = "vllm-0.33", alias = "current")]
    Vllm033,
    /// vLLM 0.2x up to 0.25: events as maps, replay replies without the topic frame.
    #[value(name = "vllm-0.25", alias = "map")]
    Vllm025,
    /// vLLM 0.10: events as positional arrays (`["BlockStored", hashes, parent, tokens, size,
    /// lora_id]`), no medium, replay replies without the topic frame.
    #[value(name = "vllm-0.10", alias = "array")]
    Vllm010,
    /// SGLang 0.5: events as maps with SGLang's fields, signed hashes, replay with the topic.
    #[value(name = "sglang-0.5")]
    Sglang05,
}

/// Options of `kvgate mock`: a fleet of simulated SGLang/vLLM engines on loopback.
///
/// Engine-model flags left unset take the reference replica's value (`EngineConfig::default()`).
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct MockArgs {
    /// Number of simulated engines (one HTTP listener each).
    #[arg(long = "workers", visible_alias = "count", default_value_t = 1)]
    pub count: usize,
    /// First HTTP port; engine i listens on base_port + i (0 = pick free ports).
    #[arg(long, default_value_t = 0)]
    pub base_port: u16,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Model name served on /v1/models and in responses.
    #[arg(long, default_value = "mock-model")]
    pub model: String,
    /// Data-parallel ranks per engine, as SGLang's `--dp-size`: each rank is an engine model of
    /// its own (its own KV cache and queue) behind the one HTTP port; `GET /server_info` reports
    /// `dp_size`, `GET /v1/loads` one entry per rank, and a request's `data_parallel_rank` picks
    /// its rank (absent: round robin, SGLang's default; out of range: 400).
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
    /// LoRA adapters every engine serves besides the base model (listed on /v1/models with the
    /// base model as `parent`, as vLLM's --lora-modules): a request whose `model` is one runs
    /// with it, and its KV blocks (and their events) are the adapter's.
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub lora_adapters: Vec<String>,
    /// Engine behaviour.
    #[arg(long, value_enum, default_value_t = EngineKind::Realistic)]
    pub engine: EngineKind,
    /// Canned engine: delay before answering, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub gen_ms: u64,
    /// Model time runs this many times faster than wall time (2.0 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Publish KV events over ZMQ PUB on kv_events_base_port + i (0 = pick free ports).
    #[arg(long)]
    pub kv_events_base_port: Option<u16>,
    /// ZMQ topic of the KV event messages.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// The engine version whose KV event wire format the mock speaks.
    #[arg(long, value_enum, default_value_t = KvEventEncoding::Vllm033)]
    pub kv_events_encoding: KvEventEncoding,
    /// Serve vLLM's KV event replay (ZMQ ROUTER) on kv_events_replay_base_port + i (0 = pick free
    /// ports); needs --kv-events-base-port.
    #[arg(long)]
    pub kv_events_replay_base_port: Option<u16>,
    /// KV event batches each worker keeps for replay (the most recent ones).
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// Fault injection: every K-th KV event batch is numbered and kept for replay but not
    /// published, so subscribers see a sequence gap.
    #[arg(long, value_name = "K")]
    pub kv_events_drop_every: Option<u64>,
    /// Fault injection: the KV events state this block size instead of the engine's (their
    /// token ids and hashes are the engine's blocks as stored), as a publisher configured apart
    /// from its cache would.
    #[arg(long, value_name = "TOKENS")]
    pub kv_events_block_size_override: Option<u32>,
    /// Always generate exactly max_tokens (as if every request set "ignore_eos": true).
    #[arg(long)]
    pub force_max_tokens: bool,
    /// max_tokens of requests that give none.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u32,

    /// Engine model parameters (each unset flag keeps the reference replica's value).
    #[command(flatten)]
    pub engine_flags: EngineFlags,

    /// Prefill/decode disaggregation role of every engine of this fleet.
    #[arg(long, value_enum, default_value_t = WorkerRole::Regular)]
    pub role: WorkerRole,
    /// Prefill engines serve their KV bootstrap (transfer) channel on bootstrap_base_port + i
    /// (0 or absent = pick free ports); --role prefill only.
    #[arg(long)]
    pub bootstrap_base_port: Option<u16>,
    /// Bandwidth of the KV link from prefill to decode engines, in GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub kv_transfer_gbps: f64,
    /// KV bytes per prompt token moved by a transfer (default: Llama-3-8B fp16, 32 layers x 8 KV
    /// heads x 128 dims x 2 (K and V) x 2 bytes).
    #[arg(long, default_value_t = 131_072)]
    pub kv_bytes_per_token: u64,
    /// Seconds (model time) a prefill engine holds a prefilled KV nobody pulls, and a decode
    /// engine waits for its KV before answering 502.
    #[arg(long, default_value_t = 30.0)]
    pub kv_hold_timeout_secs: f64,

    /// Fraction of generation requests answered with HTTP 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Fraction of generation responses whose connection is cut mid-body.
    #[arg(long, default_value_t = 0.0)]
    pub cut_stream_rate: f64,
    /// Cut every streamed answer's connection after this many tokens (an engine killed
    /// mid-stream at a known point; a continuation counts its own tokens).
    #[arg(long, value_name = "TOKENS")]
    pub cut_after_tokens: Option<u32>,
    /// Added delay before handling each generation request, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub extra_latency_ms: u64,
    /// /health answers 503 once this many seconds have passed since start.
    #[arg(long)]
    pub unhealthy_after_secs: Option<f64>,
    /// Seed of the fault-injection draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Worker `worker_idx`'s port given a base port (0 stays 0: a free port).
pub(crate) fn worker_port(base: u16, worker_idx: usize) -> u16 {
    if base == 0 {
        return 0;
    }
    u16::try_from(usize::from(base) + worker_idx).unwrap_or(u16::MAX)
}

impl Default for MockArgs {
    /// The command-line defaults (parsed from an empty command line, so they cannot drift).
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: MockArgs,
        }
        <Command as clap::Parser>::parse_from(["kvgate-mock"]).args
    }
}

impl MockArgs {
    /// The engine model's configuration: the reference replica with the flags given applied.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            emit_token_events: true,
            emit_kv_events: self.kv_events_base_port.is_some(),
            ..self.engine_flags.config()
        }
    }

    /// Engine `worker`'s configuration: [`MockArgs::engine_config`] with its entries of
    /// `--worker-speeds` and `--worker-kv-capacity-tokens` applied.
    pub fn engine_config_for(&self, worker: usize) -> EngineConfig {
        EngineConfig {
            emit_token_events: true,
            emit_kv_events: self.kv_events_base_port.is_some(),
            ..self.engine_flags.config_for(worker)
        }
    }

    /// Checks every option; returns all problems found.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        if self.count == 0 {
            checks.push(FieldError::new("count", "must be at least 1").got(0).with_flag(Some("--workers")));
        }
        self.check_port_range(&mut checks, "base_port", Some(self.base_port));
        self.kv_event_problems(&mut checks);
        self.pd_problems(&mut checks);
        checks.at_least("dp_size", self.dp_size.into(), 1);
        if self.dp_size > 64 {
            checks.push(FieldError::new("dp_size", "must be at most 64").got(self.dp_size));
        }
        if self.dp_size > 1 && (self.kv_events_base_port.is_some() || self.role != WorkerRole::Regular) {
            checks.push(
                FieldError::new(
                    "dp_size",
                    "more than one rank is simulated for regular engines without KV events only \
                     (no --kv-events-base-port, no --role)",
                )
                .got(self.dp_size),
            );
        }
        checks.in_range("time_scale", self.time_scale, Range::POSITIVE);
        checks.in_range("fail_rate", self.fail_rate, Range::PROBABILITY);
        checks.in_range("cut_stream_rate", self.cut_stream_rate, Range::PROBABILITY);
        if let Some(tokens) = self.cut_after_tokens {
            checks.at_least("cut_after_tokens", tokens.into(), 1);
        }
        if let Some(secs) = self.unhealthy_after_secs {
            checks.in_range("unhealthy_after_secs", secs, Range::NON_NEGATIVE);
        }
        checks.at_least("default_max_tokens", self.default_max_tokens.into(), 1);
        checks.nested(self.engine_flags.validate(self.count));
        checks.finish()
    }

    /// Engine i of `count` listens on `base + i`: the last one must fit in the port range.
    pub(crate) fn check_port_range(&self, checks: &mut Checks, field: &str, base: Option<u16>) {
        if base.is_some_and(|port| port != 0 && usize::from(port) + self.count > 65_536) {
            checks.push(
                FieldError::new(field, format!("+ --workers ({}) exceeds the port range", self.count))
                    .got(base.unwrap_or_default()),
            );
        }
    }

    fn kv_event_problems(&self, checks: &mut Checks) {
        self.check_port_range(checks, "kv_events_base_port", self.kv_events_base_port);
        self.check_port_range(checks, "kv_events_replay_base_port", self.kv_events_replay_base_port);
        if self.kv_events_base_port.is_none() {
            if self.kv_events_replay_base_port.is_some() {
                checks.push(FieldError::new("kv_events_replay_base_port", "needs --kv-events-base-port"));
            }
            if self.kv_events_drop_every.is_some() {
                checks.push(FieldError::new("kv_events_drop_every", "needs --kv-events-base-port"));
            }
            if self.kv_events_block_size_override.is_some() {
                checks.push(FieldError::new("kv_events_block_size_override", "needs --kv-events-base-port"));
            }
        }
        checks.at_least("kv_events_buffer_steps", self.kv_events_buffer_steps as u64, 1);
        if let Some(every) = self.kv_events_drop_every {
            checks.at_least("kv_events_drop_every", every, 1);
        }
        // The host tier announces its blocks as vLLM's offloading connector does.
        let offloading = self.engine_flags.cpu_offload_tokens.is_some_and(|tokens| tokens > 0);
        let vllm_media =
            matches!(self.kv_events_encoding, KvEventEncoding::Vllm033 | KvEventEncoding::Vllm025);
        if offloading && self.kv_events_base_port.is_some() && !vllm_media {
            checks.push(
                FieldError::new(
                    "kv_events_encoding",
                    "--cpu-offload-tokens publishes vLLM's offloading events: use vllm-0.33 or vllm-0.25",
                )
                .got(format!("{:?}", self.kv_events_encoding)),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_reference_replica() {
        let args = MockArgs::default();
        assert_eq!(args.count, 1);
        assert_eq!(args.host, "127.0.0.1");
        assert_eq!(args.engine, EngineKind::Realistic);
        assert_eq!(args.engine_config(), EngineConfig { emit_kv_events: false, ..EngineConfig::default() });
        assert_eq!(args.validate(), Ok(()));
    }

    #[test]
    fn an_unequal_fleet_gives_each_engine_its_own_configuration() {
        let args = MockArgs {
            count: 3,
            engine_flags: EngineFlags {
                worker_speeds: vec![2.0, 2.0],
                worker_kv_capacity_tokens: vec![262_144, 262_144, 131_072],
                ..EngineFlags::default()
            },
            ..MockArgs::default()
        };
        assert_eq!(args.validate(), Ok(()));
        assert_eq!(args.engine_config_for(0).prefill_tokens_per_sec, 16_000.0);
        assert_eq!(args.engine_config_for(2).prefill_tokens_per_sec, 8_000.0);
        assert_eq!(args.engine_config_for(2).kv_capacity_tokens, 131_072);
        let too_many = MockArgs { count: 1, ..args };
        assert!(too_many.validate().unwrap_err().to_string().contains("--worker-speeds"));
    }

    #[test]
    fn validate_lists_every_problem() {
        let args = MockArgs {
            count: 0,
            time_scale: 0.0,
            fail_rate: 2.0,
            engine_flags: EngineFlags { kv_block_size: Some(0), ..EngineFlags::default() },
            ..MockArgs::default()
        };
        let problems = args.validate().unwrap_err();
        assert_eq!(problems.errors().len(), 4, "{problems}");
        assert!(
            problems.to_string().contains("invalid count (--workers): must be at least 1, got 0"),
            "{problems}"
        );
    }

    #[test]
    fn kv_event_flags_are_checked_together() {
        let defaults = MockArgs::default();
        assert_eq!(defaults.kv_events_encoding, KvEventEncoding::Vllm033);
        assert_eq!(defaults.kv_events_buffer_steps, 10_000);
        let orphans = MockArgs {
            kv_events_replay_base_port: Some(0),
            kv_events_drop_every: Some(0),
            kv_events_buffer_steps: 0,
            ..MockArgs::default()
        };
        let problems = orphans.validate().unwrap_err();
        assert_eq!(problems.errors().len(), 4, "{problems}");
        let full = MockArgs {
            count: 2,
            kv_events_base_port: Some(5557),
            kv_events_replay_base_port: Some(65_535),
            kv_events_drop_every: Some(3),
            ..MockArgs::default()
        };
        assert_eq!(
            full.validate().unwrap_err().errors()[0].to_string(),
            "invalid kv_events_replay_base_port (--kv-events-replay-base-port): + --workers (2) exceeds the port range, got 65535"
        );
    }
}
