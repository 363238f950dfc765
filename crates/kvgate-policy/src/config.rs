//! Policy configuration: the one declaration of every policy option (CLI flag, YAML key, default,
//! range, help), its validation, and the factory that builds a policy from it.

use std::sync::Arc;

use kvgate_config::{Checks, FieldError, Range, ValidationErrors};
pub use kvgate_index::PrefixIndexMode;
use kvgate_index::{TierWeights, TreeSettings};
use serde::{Deserialize, Serialize};

use crate::{
    AssignmentMode, BucketPolicy, CacheAwarePolicy, ConsistentHashingPolicy, KvAwarePolicy, LeastLoadPolicy,
    LeastLoadSettings, ManualPolicy, Policy, PowerOfTwoPolicy, PrefixHashPolicy, RandomPolicy,
    RoundRobinPolicy,
};

/// The routing policies kvgate knows, by their configuration names (snake_case; the reference
/// gateway's CamelCase names are accepted too).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each request to the next worker in turn.
    #[serde(alias = "RoundRobin")]
    #[value(alias = "RoundRobin")]
    RoundRobin,
    /// Each request to a uniformly random worker.
    #[serde(alias = "Random")]
    #[value(alias = "Random")]
    Random,
    /// Longest prefix match while the pool is balanced; load balancing when it is not.
    #[serde(alias = "CacheAware")]
    #[value(alias = "CacheAware")]
    CacheAware,
    /// The less loaded of two random workers.
    #[serde(alias = "PowerOfTwo")]
    #[value(alias = "PowerOfTwo")]
    PowerOfTwo,
    /// The worker with the least expected wait (queued prefill, KV pressure).
    #[serde(alias = "LeastLoad")]
    #[value(alias = "LeastLoad")]
    LeastLoad,
    /// The worker where the request's predicted time to first token is lowest.
    #[serde(alias = "KvAware")]
    #[value(alias = "KvAware")]
    KvAware,
    /// A consistent-hash ring keyed by the prompt's first tokens, with bounded load.
    #[serde(alias = "PrefixHash")]
    #[value(alias = "PrefixHash")]
    PrefixHash,
    /// A consistent-hash ring keyed by the session key (header or `user`).
    #[serde(alias = "ConsistentHashing", alias = "ConsistentHash")]
    #[value(alias = "ConsistentHashing", alias = "ConsistentHash")]
    ConsistentHashing,
    /// Sticky sessions keyed by the session key.
    #[serde(alias = "Manual")]
    #[value(alias = "Manual")]
    Manual,
    /// Prompt-length buckets with adaptive boundaries (prefill pools).
    #[serde(alias = "Bucket")]
    #[value(alias = "Bucket")]
    Bucket,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::KvAware => "kv_aware",
            PolicyKind::PrefixHash => "prefix_hash",
            PolicyKind::ConsistentHashing => "consistent_hashing",
            PolicyKind::Manual => "manual",
            PolicyKind::Bucket => "bucket",
        }
    }
}

/// Where a cache-aware miss (no worker matches enough of the prompt) is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum MissStrategy {
    /// The worker with the fewest in-flight requests.
    LeastLoad,
    /// The worker with the lowest KV usage (needs fresh loads; else least_load).
    MostFreeKv,
    /// The worker holding the least prompt text in the prefix tree.
    SmallestTree,
}

/// Every policy option. Flattened into `kvgate launch` and `kvgate sim`, read from YAML.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, clap::Args, derive_builder::Builder)]
#[serde(default, deny_unknown_fields)]
#[builder(default, setter(into, strip_option), build_fn(private, name = "assemble"), derive(Debug))]
pub struct PolicyConfig {
    /// Routing policy.
    #[arg(long = "policy", value_enum, default_value = "cache_aware")]
    pub policy: PolicyKind,

    /// cache_aware: minimum matched fraction of the prompt for a cache hit, in (0, 1].
    #[arg(long, default_value_t = 0.3)]
    pub cache_threshold: f64,
    /// cache_aware: in-flight spread (max - min) above which the pool may be imbalanced, > 0.
    #[arg(long, default_value_t = 64.0)]
    pub balance_abs_threshold: f64,
    /// cache_aware: ratio max / min in-flight above which the pool may be imbalanced, >= 1.
    #[arg(long, default_value_t = 1.5)]
    pub balance_rel_threshold: f64,
    /// cache_aware: KV usage spread (hottest - coldest engine) that makes the pool imbalanced,
    /// in (0, 1]; 1.0 disables the term.
    #[arg(long, default_value_t = 1.0)]
    pub balance_token_usage_threshold: f64,
    /// cache_aware: KV usage of the hottest engine that makes the pool imbalanced, in (0, 1];
    /// 1.0 disables the term.
    #[arg(long, default_value_t = 1.0)]
    pub overload_token_usage_threshold: f64,
    /// cache_aware: seconds between prefix-tree evictions, > 0.
    #[arg(long, default_value_t = 120.0)]
    pub eviction_interval: f64,
    /// cache_aware: most prompt characters (or tokens) the tree keeps per worker, > 0.
    #[arg(long, default_value_t = 67_108_864)]
    pub max_tree_size: usize,
    /// cache_aware: token-id prompts are matched in whole blocks of this many tokens, > 0.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// cache_aware: add the prompt tokens routed to a worker since its last load sample to its
    /// KV usage estimate.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub kv_inflight_correction: bool,
    /// cache_aware: when the pool is imbalanced, prefer the best prefix match among workers
    /// inside the acceptable load band before the plain least-loaded worker.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub rebalance_affinity: bool,
    /// cache_aware: where a cache miss goes.
    #[arg(long, value_enum, default_value = "least_load")]
    pub cache_miss_strategy: MissStrategy,
    /// cache_aware: the prefix index requests are matched against: the exact index built from
    /// the engines' KV events, or the approximate tree of what was routed where.
    #[arg(long, value_enum, default_value = "auto")]
    pub prefix_index: PrefixIndexMode,
    /// cache_aware, kv_aware: the share of a GPU hit that a hit in each cache tier earns in the
    /// exact index, MEDIUM=WEIGHT pairs by the medium names the engines send (`*`: any other):
    /// a block held only in host memory or on disk is loaded back, which costs transfer time,
    /// not a prefill. `*=1` counts every tier as the GPU.
    #[arg(long, default_value_t = TierWeights::default(), value_name = "MEDIUM=WEIGHT,...")]
    #[serde(with = "tier_weights_text")]
    pub kv_tier_weights: TierWeights,

    /// least_load: weight of the KV pressure term k / (1 - k), in seconds, > 0.
    #[arg(long, default_value_t = 0.15)]
    pub least_load_kv_pressure_weight: f64,
    /// least_load: prompt tokens assumed for a request whose size is unknown, > 0.
    #[arg(long, default_value_t = 1024.0)]
    pub least_load_mean_prefill_tokens: f64,
    /// least_load: tokens/s assumed when an engine reports less (or no) generation throughput:
    /// it is prefilling or nearly idle, not slow, > 0.
    #[arg(long, default_value_t = 2000.0)]
    pub least_load_default_throughput: f64,

    /// kv_aware: prefill tokens per second an engine computes (the time-to-first-token
    /// prediction's rate), > 0.
    #[arg(long, default_value_t = 8000.0)]
    pub kv_aware_prefill_tokens_per_sec: f64,
    /// kv_aware: learn the engines' prefill and decode rates from their load reports (between
    /// two reports with prefill queued, what each computed over the interval; with none queued,
    /// its generation throughput), starting from --kv-aware-prefill-tokens-per-sec and
    /// --kv-aware-decode-ms-per-request; where the reports say no prefill is queued (vLLM), from
    /// the streamed answers' measured times to first token; an engine's fixed cost from those
    /// always. Counts only the prompts this gateway routed (behind several replicas the estimate
    /// is low: configure the rates and turn this off).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub kv_aware_learn_prefill_rate: bool,
    /// kv_aware: learn a prefill and a decode rate per engine (an unequal fleet's fast engines
    /// are used, its slow ones measured); false predicts every engine at one fleet-wide rate
    /// (the mean of the engines' estimates), the default: per-engine rates made kv_aware worse
    /// on S6 and S7 (docs/BENCHMARKS.md). Each rate is on a grid (--kv-aware-rate-grid-step)
    /// with hysteresis, so estimation noise never steers between equal engines.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub kv_aware_per_engine_rates: bool,
    /// kv_aware: busy intervals (load reports with prefill queued) before an engine is predicted
    /// at its own rates; until then at the fleet's, never at the configured one, so an engine
    /// not yet measured gets work and is measured, >= 1.
    #[arg(long, default_value_t = 5)]
    pub kv_aware_rate_min_observations: u32,
    /// kv_aware: how fast an engine's learned rates forget: each load report multiplies the
    /// work and busy time summed so far by 1 - this, in (0, 1] (0.1: about the last 10 reports).
    #[arg(long, default_value_t = 0.1)]
    pub kv_aware_rate_smoothing: f64,
    /// kv_aware: ratio between two rates of the grid the learned rates are snapped to, > 1
    /// (an engine twice as fast is three steps of 1.25 away).
    #[arg(long, default_value_t = 1.25)]
    pub kv_aware_rate_grid_step: f64,
    /// kv_aware, per-engine rates: how many observations of the fleet's rate an engine's own
    /// estimate is weighed against (credibility weighting: its estimate is the fleet's rate times
    /// its measured speed ratio to the power n / (n + this), n its recent busy intervals, the
    /// decayed count of --kv-aware-rate-smoothing), >= 0; 0 uses its own estimate alone.
    #[arg(long, default_value_t = 0.0)]
    pub kv_aware_rate_prior_observations: f64,
    /// kv_aware: one busy interval's prefill rate counts at most this factor from the fleet's
    /// rate either way (a burst of prompts the engine found cached, where the index did not,
    /// reads as a huge rate), >= 1; 0 (the default) bounds no interval.
    #[arg(long, default_value_t = 0.0)]
    pub kv_aware_rate_max_ratio: f64,
    /// kv_aware: learn the prefill rate only from intervals whose starting queue alone keeps the
    /// engine computing the whole interval at the fleet's rate (an engine that drained and
    /// idled inside an interval reads as slow: work over time, idle time included).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub kv_aware_rate_saturated_intervals: bool,
    /// kv_aware: weight of the request's own uncached prefill time in the cost, beyond its own
    /// wait (the prefill delays requests queued behind it and duplicates a cached prefix), >= 0;
    /// 0 minimises the predicted time to first token alone.
    #[arg(long, default_value_t = 8.0)]
    pub kv_aware_prefill_cost_weight: f64,
    /// kv_aware: weight of the congestion in the recompute cost: the request's own prefill time
    /// counts once more for each request expected to arrive at the engine before its queue and
    /// this prefill are done (the pool's arrival rate per engine x that time), so under a burst
    /// a prefix is recomputed elsewhere only for a larger gain, >= 0.
    #[arg(long, default_value_t = 1.0)]
    pub kv_aware_queue_cost_weight: f64,
    /// kv_aware: weight of (requests running on the engine x the request's own prefill time) in
    /// the cost: an engine prefilling stalls its running requests' decode steps, so a long
    /// prefill is cheaper where fewer requests decode, >= 0.
    #[arg(long, default_value_t = 0.0)]
    pub kv_aware_decode_stall_weight: f64,
    /// kv_aware: a candidate whose queued prefill alone (in seconds) exceeds this many times the
    /// best predicted time to first token among the candidates, plus --kv-aware-wait-slack-ms,
    /// is not chosen: the request recomputes its prefix elsewhere rather than wait that long for
    /// its holder, and a hot prefix is replicated (reason `kv_aware_replicate`), >= 1.
    #[arg(long, default_value_t = 4.0)]
    pub kv_aware_wait_margin: f64,
    /// kv_aware: the slack of --kv-aware-wait-margin, in milliseconds, >= 0.
    #[arg(long, default_value_t = 1000.0)]
    pub kv_aware_wait_slack_ms: f64,
    /// kv_aware: milliseconds each request running on an engine adds to a new request's wait, >= 0.
    #[arg(long, default_value_t = 0.35)]
    pub kv_aware_decode_ms_per_request: f64,
    /// kv_aware: weight in seconds of the KV-pressure term k / (1 - k) (k = the engine's KV
    /// usage), >= 0.
    #[arg(long, default_value_t = 0.15)]
    pub kv_aware_kv_pressure_weight: f64,
    /// kv_aware: 0 routes to the lowest predicted time to first token; above 0, samples among
    /// candidates with weights exp(-(t - t_best) / (temperature * t_best)), >= 0.
    #[arg(long, default_value_t = 0.0)]
    pub router_temperature: f64,

    /// prefix_hash, consistent_hashing: prompt tokens (characters for text) hashed into the key, > 0.
    #[arg(long, default_value_t = 256)]
    pub prefix_token_count: usize,
    /// prefix_hash: a worker whose in-flight count would exceed this times the mean is walked
    /// past on the ring, >= 1.
    #[arg(long, default_value_t = 1.25)]
    pub prefix_hash_load_factor: f64,
    /// prefix_hash, consistent_hashing: points per worker on the hash ring, > 0.
    #[arg(long, default_value_t = 160)]
    pub hash_virtual_nodes: usize,
    /// manual: how a new session picks its worker.
    #[arg(long, value_enum, default_value = "min_load")]
    pub assignment_mode: AssignmentMode,
    /// manual: seconds after which an idle session is forgotten, > 0.
    #[arg(long, default_value_t = 14_400.0)]
    pub max_idle_secs: f64,
    /// manual: most sessions remembered (the least recently used are forgotten first), > 0.
    #[arg(long, default_value_t = 1_000_000)]
    pub max_sessions: usize,
    /// bucket: seconds between adjustments of the prompt-length boundaries, > 0.
    #[arg(long, default_value_t = 5.0)]
    pub bucket_adjust_interval_secs: f64,

    /// Prefill/decode fleets: decide per request between a (prefill, decode) pair and
    /// prefilling in place on the decode engine, which the decode side's policy picks first:
    /// in place when the prompt's part that engine does not hold is short
    /// (--pd-max-local-prefill-tokens) or a small share of the prompt
    /// (--pd-max-local-prefill-fraction), or when the prefill side is busy
    /// (--pd-max-prefill-queue). Read from the prefill side's options.
    #[arg(long)]
    pub pd_conditional: bool,
    /// pd_conditional: an uncached part shorter than this many tokens is prefilled in place.
    #[arg(long, default_value_t = 2048, value_name = "TOKENS")]
    pub pd_max_local_prefill_tokens: u64,
    /// pd_conditional: an uncached part under this share of the prompt is prefilled in place,
    /// in [0, 1].
    #[arg(long, default_value_t = 0.7)]
    pub pd_max_local_prefill_fraction: f64,
    /// pd_conditional: when the least busy prefill engine has more requests in flight than
    /// this, the request is prefilled in place.
    #[arg(long, default_value_t = 8, value_name = "REQUESTS")]
    pub pd_max_prefill_queue: u64,
    /// pd_conditional with kv_aware on both sides: bandwidth of the KV link from a prefill to a
    /// decode engine, in GB/s, for the predicted transfer time of a pair (prompt tokens x
    /// --kv-bytes-per-token / this), > 0. The default is the simulated engines' link.
    #[arg(long, default_value_t = 25.0, value_name = "GBPS")]
    pub kv_transfer_gbps: f64,
    /// pd_conditional with kv_aware on both sides: KV bytes per prompt token a transfer moves
    /// (default: Llama-3-8B fp16, 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes), >= 1.
    #[arg(long, default_value_t = 131_072, value_name = "BYTES")]
    pub kv_bytes_per_token: u64,
    /// pd_conditional with kv_aware on both sides: weight of each path's cost to the other
    /// requests (kv_aware's recompute and stall terms, on the decode engine in place and on the
    /// prefill engine for a pair) against the predicted time to first token, >= 0.
    #[arg(long, default_value_t = 1.0, value_name = "WEIGHT")]
    pub pd_cost_to_others_weight: f64,
    /// pd_conditional with kv_aware on both sides: seconds a decode engine holds a pair's slot
    /// waiting for its KV (SGLang: SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 by default); a
    /// pair whose KV is predicted to arrive later (prefill queue and prefill + transfer) is not
    /// taken, the request is prefilled in place, > 0.
    #[arg(long, default_value_t = 300.0, value_name = "SECS")]
    pub pd_kv_hold_secs: f64,
}

impl Default for PolicyConfig {
    /// The command-line defaults (parsed from an empty command line, so they cannot drift).
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Defaults {
            #[command(flatten)]
            config: PolicyConfig,
        }
        <Defaults as clap::Parser>::parse_from(["kvgate"]).config
    }
}

impl PolicyConfig {
    /// A builder reaching every policy option (unset ones keep the command line's defaults).
    pub fn builder() -> PolicyConfigBuilder {
        PolicyConfigBuilder::default()
    }

    /// Check every option; returns all problems at once (fields named by their keys here; the
    /// gateway nests them under `routing.`).
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        for (field, value, range) in [
            ("cache_threshold", self.cache_threshold, Range::FRACTION),
            ("balance_abs_threshold", self.balance_abs_threshold, Range::POSITIVE),
            ("balance_rel_threshold", self.balance_rel_threshold, Range::AT_LEAST_ONE),
            ("balance_token_usage_threshold", self.balance_token_usage_threshold, Range::FRACTION),
            ("overload_token_usage_threshold", self.overload_token_usage_threshold, Range::FRACTION),
            ("eviction_interval", self.eviction_interval, Range::POSITIVE),
            ("least_load_kv_pressure_weight", self.least_load_kv_pressure_weight, Range::POSITIVE),
            ("least_load_mean_prefill_tokens", self.least_load_mean_prefill_tokens, Range::POSITIVE),
            ("least_load_default_throughput", self.least_load_default_throughput, Range::POSITIVE),
            ("prefix_hash_load_factor", self.prefix_hash_load_factor, Range::AT_LEAST_ONE),
            ("max_idle_secs", self.max_idle_secs, Range::POSITIVE),
            ("bucket_adjust_interval_secs", self.bucket_adjust_interval_secs, Range::POSITIVE),
            ("kv_aware_prefill_tokens_per_sec", self.kv_aware_prefill_tokens_per_sec, Range::POSITIVE),
            ("kv_aware_prefill_cost_weight", self.kv_aware_prefill_cost_weight, Range::NON_NEGATIVE),
            ("kv_aware_decode_ms_per_request", self.kv_aware_decode_ms_per_request, Range::NON_NEGATIVE),
            ("kv_aware_kv_pressure_weight", self.kv_aware_kv_pressure_weight, Range::NON_NEGATIVE),
            ("router_temperature", self.router_temperature, Range::NON_NEGATIVE),
            ("kv_aware_rate_smoothing", self.kv_aware_rate_smoothing, Range::FRACTION),
            ("kv_aware_decode_stall_weight", self.kv_aware_decode_stall_weight, Range::NON_NEGATIVE),
            ("kv_aware_queue_cost_weight", self.kv_aware_queue_cost_weight, Range::NON_NEGATIVE),
            ("kv_aware_wait_margin", self.kv_aware_wait_margin, Range::AT_LEAST_ONE),
            ("kv_aware_rate_prior_observations", self.kv_aware_rate_prior_observations, Range::NON_NEGATIVE),
            ("kv_aware_wait_slack_ms", self.kv_aware_wait_slack_ms, Range::NON_NEGATIVE),
            ("pd_max_local_prefill_fraction", self.pd_max_local_prefill_fraction, Range::PROBABILITY),
            ("kv_transfer_gbps", self.kv_transfer_gbps, Range::POSITIVE),
            ("pd_cost_to_others_weight", self.pd_cost_to_others_weight, Range::NON_NEGATIVE),
            ("pd_kv_hold_secs", self.pd_kv_hold_secs, Range::POSITIVE),
        ] {
            checks.in_range(field, value, range);
        }
        for (field, value) in [
            ("max_tree_size", self.max_tree_size),
            ("block_size", self.block_size),
            ("prefix_token_count", self.prefix_token_count),
            ("hash_virtual_nodes", self.hash_virtual_nodes),
            ("max_sessions", self.max_sessions),
            ("kv_aware_rate_min_observations", self.kv_aware_rate_min_observations as usize),
            ("kv_bytes_per_token", self.kv_bytes_per_token as usize),
        ] {
            checks.at_least(field, value as u64, 1);
        }
        if !(self.kv_aware_rate_grid_step.is_finite() && self.kv_aware_rate_grid_step > 1.0) {
            checks.push(
                FieldError::new("kv_aware_rate_grid_step", "must be a finite number > 1")
                    .got(self.kv_aware_rate_grid_step),
            );
        }
        let ratio = self.kv_aware_rate_max_ratio;
        if !(ratio == 0.0 || (ratio.is_finite() && ratio >= 1.0)) {
            checks.push(
                FieldError::new("kv_aware_rate_max_ratio", "must be 0 (off) or a finite number >= 1")
                    .got(ratio),
            );
        }
        checks.finish()
    }

    /// The exact index of a model routed with this configuration (the host keeps one per model
    /// and feeds it the engines' events): tiers credited at `kv_tier_weights`.
    pub fn block_index(&self) -> kvgate_index::BlockIndex {
        kvgate_index::BlockIndex::with_tier_weights(self.kv_tier_weights.clone())
    }

    /// The approximate index's settings (the host keeps one tree index per model).
    pub fn tree_settings(&self) -> TreeSettings {
        TreeSettings {
            max_elements_per_tenant: self.max_tree_size,
            eviction_interval_ms: (self.eviction_interval * 1000.0) as u64,
            block_size: self.block_size,
        }
    }

    /// The conditional-disaggregation rule of these options (`None` when `pd_conditional` is off).
    pub fn pd_rule(&self) -> Option<crate::PdRule> {
        self.pd_conditional.then_some(crate::PdRule {
            max_local_prefill_tokens: self.pd_max_local_prefill_tokens,
            max_local_prefill_fraction: self.pd_max_local_prefill_fraction,
            max_prefill_queue: self.pd_max_prefill_queue,
            transfer_secs_per_token: self.kv_bytes_per_token as f64 / (self.kv_transfer_gbps * 1e9),
            others_weight: self.pd_cost_to_others_weight,
            kv_hold_s: self.pd_kv_hold_secs,
        })
    }

    /// Whether requests are matched against the exact event-fed index when one exists: the host
    /// then tokenizes prompts and feeds the index.
    pub fn uses_exact_index(&self) -> bool {
        matches!(self.policy, PolicyKind::CacheAware | PolicyKind::KvAware)
            && self.prefix_index != PrefixIndexMode::Approximate
    }

    /// Whether a policy built from this configuration reads engine loads (the host then polls).
    pub fn needs_loads(&self) -> bool {
        match self.policy {
            PolicyKind::RoundRobin
            | PolicyKind::Random
            | PolicyKind::PrefixHash
            | PolicyKind::ConsistentHashing
            | PolicyKind::Manual
            | PolicyKind::Bucket => false,
            PolicyKind::PowerOfTwo | PolicyKind::LeastLoad | PolicyKind::KvAware => true,
            PolicyKind::CacheAware => {
                self.balance_token_usage_threshold < 1.0
                    || self.overload_token_usage_threshold < 1.0
                    || self.cache_miss_strategy == MissStrategy::MostFreeKv
            }
        }
    }
}

impl PolicyConfigBuilder {
    /// The policy options, validated (every problem at once).
    pub fn build(&self) -> Result<PolicyConfig, ValidationErrors> {
        let config =
            self.assemble().map_err(|e| FieldError::new("builder", e.to_string()).with_flag(None))?;
        config.validate()?;
        Ok(config)
    }
}

/// Build a fresh policy instance (one per model) from a validated configuration.
pub fn build_policy(config: &PolicyConfig) -> Arc<dyn Policy> {
    match config.policy {
        PolicyKind::RoundRobin => Arc::new(RoundRobinPolicy::new()),
        PolicyKind::Random => Arc::new(RandomPolicy),
        PolicyKind::CacheAware => Arc::new(CacheAwarePolicy::new(config)),
        PolicyKind::KvAware => Arc::new(KvAwarePolicy::new(config)),
        PolicyKind::PowerOfTwo => Arc::new(PowerOfTwoPolicy),
        PolicyKind::LeastLoad => Arc::new(LeastLoadPolicy::new(LeastLoadSettings {
            kv_pressure_weight: config.least_load_kv_pressure_weight,
            mean_prefill_tokens: config.least_load_mean_prefill_tokens,
            default_throughput: config.least_load_default_throughput,
        })),
        PolicyKind::PrefixHash => Arc::new(PrefixHashPolicy::new(
            config.prefix_token_count,
            config.prefix_hash_load_factor,
            config.hash_virtual_nodes,
        )),
        PolicyKind::ConsistentHashing => {
            Arc::new(ConsistentHashingPolicy::new(config.prefix_token_count, config.hash_virtual_nodes))
        }
        PolicyKind::Manual => {
            Arc::new(ManualPolicy::new(config.assignment_mode, config.max_idle_secs, config.max_sessions))
        }
        PolicyKind::Bucket => Arc::new(BucketPolicy::new(
            config.bucket_adjust_interval_secs,
            config.balance_abs_threshold,
            config.balance_rel_threshold,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(config: PolicyConfig) -> Vec<String> {
        config.validate().err().map(|e| e.0).unwrap_or_default().into_iter().map(|e| e.field).collect()
    }

    #[test]
    fn defaults_are_valid_and_count_only() {
        let config = PolicyConfig::default();
        config.validate().unwrap();
        assert!(!config.needs_loads(), "both KV terms default to 1.0, which disables them");
        assert_eq!(config.policy, PolicyKind::CacheAware);
    }

    #[test]
    fn nan_inf_and_non_positive_thresholds_are_rejected_by_name() {
        let bad = PolicyConfig {
            cache_threshold: f64::NAN,
            balance_abs_threshold: 0.0,
            balance_rel_threshold: f64::INFINITY,
            balance_token_usage_threshold: -0.1,
            overload_token_usage_threshold: 1.5,
            eviction_interval: f64::NEG_INFINITY,
            max_tree_size: 0,
            ..PolicyConfig::default()
        };
        assert_eq!(
            fields(bad.clone()),
            [
                "cache_threshold",
                "balance_abs_threshold",
                "balance_rel_threshold",
                "balance_token_usage_threshold",
                "overload_token_usage_threshold",
                "eviction_interval",
                "max_tree_size"
            ]
        );
        let message = bad.validate().unwrap_err().0[0].to_string();
        assert_eq!(
            message,
            "invalid cache_threshold (--cache-threshold): must be a finite number in (0, 1], got NaN"
        );
    }

    #[test]
    fn camel_case_policy_names_are_accepted() {
        use clap::ValueEnum;
        for (camel, kind) in [
            ("CacheAware", PolicyKind::CacheAware),
            ("RoundRobin", PolicyKind::RoundRobin),
            ("PowerOfTwo", PolicyKind::PowerOfTwo),
            ("ConsistentHashing", PolicyKind::ConsistentHashing),
            ("PrefixHash", PolicyKind::PrefixHash),
        ] {
            assert_eq!(PolicyKind::from_str(camel, false).unwrap(), kind, "flag {camel}");
            let yaml: PolicyKind = serde_json::from_value(serde_json::json!(camel)).unwrap();
            assert_eq!(yaml, kind, "file {camel}");
            let snake: PolicyKind = serde_json::from_value(serde_json::json!(kind.as_str())).unwrap();
            assert_eq!(snake, kind);
        }
    }

    #[test]
    fn every_policy_builds_under_its_name() {
        use clap::ValueEnum;
        for kind in PolicyKind::value_variants() {
            let policy = build_policy(&PolicyConfig { policy: *kind, ..PolicyConfig::default() });
            assert_eq!(policy.name(), kind.as_str());
        }
    }

    #[test]
    fn a_kv_threshold_below_one_needs_loads() {
        let spread = PolicyConfig { balance_token_usage_threshold: 0.3, ..PolicyConfig::default() };
        let overload = PolicyConfig { overload_token_usage_threshold: 0.9, ..PolicyConfig::default() };
        assert!(spread.needs_loads() && overload.needs_loads());
        let round_robin = PolicyConfig { policy: PolicyKind::RoundRobin, ..spread };
        assert!(!round_robin.needs_loads());
        let most_free_kv =
            PolicyConfig { cache_miss_strategy: MissStrategy::MostFreeKv, ..PolicyConfig::default() };
        assert!(most_free_kv.needs_loads(), "a miss strategy that reads KV usage needs loads too");
    }
}

/// `kv_tier_weights` in YAML and JSON: the flag's text (`GPU=1,CPU=0.95,...`).
mod tier_weights_text {
    use kvgate_index::TierWeights;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(weights: &TierWeights, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(weights)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<TierWeights, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}
