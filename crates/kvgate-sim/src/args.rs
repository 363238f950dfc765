//! `kvgate sim` options (one clap declaration), the engine configuration they give, and the run list they expand to (policies x sweep grid).

use std::path::PathBuf;

use clap::ValueEnum;
use kvgate_engine::{EngineConfig, EngineFlags};
use kvgate_policy::{OverloadSettings, PolicyConfig, PolicyKind, TenantsConfig};

use crate::SimError;
use kvgate_config::{Checks, FieldError, ValidationErrors};
use kvgate_trace::Endpoint;
use kvgate_trace::TraceFormat;

pub mod entry;
mod fleet;

pub use entry::Override;
use entry::{grid, Entry, SweepAxis};

/// Options of `kvgate sim`: replay a trace in virtual time through kvgate's routing policies
/// onto a fleet of simulated engines.
///
/// Engine-model flags left unset take the reference replica's value (`EngineConfig::default()`),
/// as in `kvgate mock` (the same `EngineFlags`); the engine's KV block size is `--kv-block-size`
/// because `--block-size` is the cache_aware policy's.
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct SimArgs {
    /// Trace file.
    #[arg(long)]
    pub trace: PathBuf,
    /// Trace file format.
    #[arg(long, value_enum, default_value_t = TraceFormat::Mooncake)]
    pub trace_format: TraceFormat,
    /// Number of simulated engines (workers). Ignored with --prefill-workers / --decode-workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// A prefill/decode disaggregated fleet instead of --workers: N prefill engines (give
    /// --decode-workers too). Each --policies entry routes the prefill side; the same engine
    /// flags apply to both sides.
    #[arg(long, value_name = "N")]
    pub prefill_workers: Option<usize>,
    /// M decode engines of the disaggregated fleet (with --prefill-workers), routed by
    /// --decode-policy.
    #[arg(long, value_name = "M")]
    pub decode_workers: Option<usize>,
    /// The decode side's policy in every run of a disaggregated fleet: a policy name,
    /// optionally with `:flag=value` overrides as in --policies (sweeps do not apply to it).
    #[arg(long, value_name = "POLICY", default_value = "least_load")]
    pub decode_policy: String,
    /// Policies to compare, comma-separated. Each is a policy name, optionally followed by
    /// `:flag=value` overrides of the policy flags below (snake_case or command-line names), e.g.
    /// `cache_aware:balance_token_usage_threshold=0.2:overload_token_usage_threshold=0.9`, and
    /// optionally by `@LABEL`, the run's name in the report (default: the name and overrides).
    /// (`--policy` is ignored: every run takes its policy from this list.)
    #[arg(long, value_delimiter = ',', default_value = "round_robin,cache_aware")]
    pub policies: Vec<String>,
    #[command(flatten)]
    pub policy: PolicyConfig,

    /// Engine-model flags (shared with `kvgate mock`).
    #[command(flatten)]
    pub engine: EngineFlags,

    /// Count prompts in this tokenizer's tokens (a Hugging Face tokenizer.json or its folder, with
    /// the model's chat template), as the real engines behind `kvgate replay` will: each
    /// request's prompt is the body `kvgate replay --endpoint` sends (the text, or one user
    /// message rendered with the chat template), tokenized, so the simulated engines compute and
    /// cache exactly the engines' tokens (default: one token per word, the simulated engines' own
    /// tokenizer).
    #[arg(long, value_name = "PATH")]
    pub tokenizer_path: Option<PathBuf>,
    /// With --tokenizer-path: the endpoint whose prompt is tokenized, as `kvgate replay
    /// --endpoint`.
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,

    /// Trace timestamps are divided by this (2 = twice the request rate; `--speedup` is an alias,
    /// as in `kvgate replay`).
    #[arg(long, visible_alias = "speedup", default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Replay only the first K requests (in arrival order).
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Simulated load monitor: every engine's load is sampled this often (virtual ms).
    #[arg(long, default_value_t = 1000)]
    pub load_monitor_interval_ms: u64,
    /// Seed of the policies' random draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The gateway's concurrency cap (`kvgate launch --max-concurrent-requests`): requests beyond
    /// it wait in the gateway's admission queue (priority classes, then weighted fair queuing
    /// on tokens per tenant, the tenant and class from the trace line's `tenant` and
    /// `priority`; no queue timeout here). Unset: every request goes straight to its engine.
    /// Regular fleets only.
    #[arg(long, value_name = "N")]
    pub max_concurrent_requests: Option<usize>,
    /// Locality-aware fairness, as `kvgate launch --fairness-locality-bound`: within this many
    /// tokens of virtual-time deficit the admission queue serves first the request with the
    /// most prompt tokens the routing policy predicts cached (0: strict fair order).
    #[arg(long, value_name = "TOKENS", default_value_t = 0)]
    pub fairness_locality_bound: u64,
    /// Per-worker overload protection, as `kvgate launch --worker-overload-waiting-requests`: an
    /// engine whose last load sample shows at least this many waiting requests is left out of
    /// routing while another is under the bounds (every policy; unset: off).
    #[arg(long, value_name = "N")]
    pub worker_overload_waiting_requests: Option<u64>,
    /// Per-worker overload protection, as `kvgate launch --worker-overload-token-usage`: an engine
    /// whose last load sample shows at least this KV usage (0-1] is left out (unset: off).
    #[arg(long, value_name = "USAGE")]
    pub worker_overload_token_usage: Option<f64>,
    /// As `kvgate launch --worker-overload-shed`: when every engine is over the bounds, the request
    /// is refused (counted unrouted) instead of sent to the least loaded one.
    #[arg(long)]
    pub worker_overload_shed: bool,
    /// Queue every request as tenant `default` (what a gateway sees when clients name no
    /// tenant: one queue in arrival order); the report still groups by the trace's tenants.
    #[arg(long)]
    pub ignore_tenants: bool,
    /// The gateway's `tenants:` section, as `kvgate launch` reads it from its config file (a YAML
    /// file holding the section itself, or a gateway config file with a `tenants:` key): each
    /// tenant's `weight` and `class` (a trace line's `priority` overrides the class, as the
    /// priority header does), each class's `reserved_concurrency` (with
    /// --max-concurrent-requests). Quotas are not simulated.
    #[arg(long, value_name = "FILE")]
    pub tenants: Option<PathBuf>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the simulated engines' KV events to this file, one JSON line per engine batch in
    /// the order emitted: run label, engine, seq, timestamp_us and the events, each stored
    /// block's token ids as one 64-bit digest (block_digests). The index bench replays it
    /// (benches/dynamo-index, BENCH_EVENTS=FILE).
    #[arg(long, value_name = "FILE")]
    pub kv_events_out: Option<PathBuf>,
    /// Draw TTFT CDFs and per-engine KV usage over time into this PNG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Sweep a policy flag over values, `NAME=V1,V2,...` (snake_case or command-line name);
    /// repeat for a grid.
    /// Every listed policy runs at every grid point; the report names the best setting per metric.
    #[arg(long = "sweep", value_name = "NAME=V1,V2,...")]
    pub sweep: Vec<String>,
}

impl SimArgs {
    /// Defaults for everything but the trace (as an empty command line would give).
    pub fn new(trace: impl Into<PathBuf>) -> SimArgs {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: SimArgs,
        }
        let mut args = <Command as clap::Parser>::parse_from(["kvgate-sim", "--trace", "-"]).args;
        args.trace = trace.into();
        args
    }

    /// The engines' configuration: the reference replica with the flags given applied, and no
    /// per-token or KV events (the simulator consumes neither).
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig { emit_token_events: false, emit_kv_events: false, ..self.engine.config() }
    }

    /// Engine `engine`'s configuration (fleet order: a disaggregated fleet's prefill engines
    /// first): [`SimArgs::engine_config`] with its `--worker-speeds` and
    /// `--worker-kv-capacity-tokens` entries.
    pub fn engine_config_for(&self, engine: usize) -> EngineConfig {
        EngineConfig { emit_token_events: false, emit_kv_events: false, ..self.engine.config_for(engine) }
    }

    /// The gateway's admission in front of the fleet.
    pub fn admission(&self) -> Result<crate::AdmissionSetup, SimError> {
        Ok(crate::AdmissionSetup {
            max_concurrent: self.max_concurrent_requests,
            fairness_locality_bound: self.fairness_locality_bound,
            ignore_tenants: self.ignore_tenants,
            tenants: self
                .tenants_config()
                .map_err(|errors| SimError::InvalidOptions(ValidationErrors(errors)))?,
        })
    }

    /// The gateway's per-worker overload protection (`--worker-overload-*`), as the plan applies it.
    pub fn overload(&self) -> OverloadSettings {
        OverloadSettings {
            waiting_requests: self.worker_overload_waiting_requests,
            token_usage: self.worker_overload_token_usage,
            shed: self.worker_overload_shed,
        }
    }

    /// `--tenants`' section, checked as the gateway checks it (empty without the option).
    pub fn tenants_config(&self) -> Result<TenantsConfig, Vec<FieldError>> {
        let Some(path) = &self.tenants else { return Ok(TenantsConfig::default()) };
        let problem = |message: String| vec![flag_error(format!("--tenants {}: {message}", path.display()))];
        let text = std::fs::read_to_string(path).map_err(|error| problem(error.to_string()))?;
        let value: serde_norway::Value =
            serde_norway::from_str(&text).map_err(|error| problem(error.to_string()))?;
        // A gateway config file: its `tenants:` key.
        let value = match value {
            serde_norway::Value::Mapping(mut map) if map.contains_key("tenants") => {
                map.remove("tenants").unwrap_or_default()
            }
            other => other,
        };
        let config: TenantsConfig =
            serde_norway::from_value(value).map_err(|error| problem(error.to_string()))?;
        let mut checks = Checks::new();
        config.validate(self.max_concurrent_requests, &mut checks);
        checks.finish().map_err(|errors| errors.0)?;
        Ok(config)
    }

    /// Checks the options and expands them into the runs to simulate, in report order: for each
    /// grid point (first sweep axis slowest), each listed policy. Reports every problem at once.
    pub fn runs(&self) -> Result<Vec<RunSpec>, SimError> {
        let mut problems = Vec::new();
        if let Err(fleet_problems) = self.parse_fleet() {
            problems.extend(fleet_problems);
        }
        if !(self.rate_scale.is_finite() && self.rate_scale > 0.0) {
            problems.push(format!("--rate-scale must be a finite number > 0, got {}", self.rate_scale));
        }
        if self.load_monitor_interval_ms == 0 {
            problems.push("--load-monitor-interval-ms must be at least 1".to_string());
        }
        if self.max_requests == Some(0) {
            problems.push("--max-requests must be at least 1".to_string());
        }
        if self.max_concurrent_requests == Some(0) {
            problems.push("--max-concurrent-requests must be at least 1".to_string());
        }
        if self.max_concurrent_requests.is_some() && self.prefill_workers.is_some() {
            problems.push(
                "--max-concurrent-requests is for a regular fleet (not with --prefill-workers)".to_string(),
            );
        }
        let n_engines = self.parse_fleet().map_or(self.workers, |fleet| fleet.n_engines());
        let engine_errors = self.engine.validate(n_engines).err().map(|e| e.0).unwrap_or_default();
        let entries: Vec<PolicyEntry> = self
            .policies
            .iter()
            .map(|text| text.trim())
            .filter(|text| !text.is_empty())
            .filter_map(|text| PolicyEntry::parse(text).map_err(|e| problems.push(e)).ok())
            .collect();
        if entries.is_empty() && problems.is_empty() && engine_errors.is_empty() {
            problems.push("--policies names no policy".to_string());
        }
        let axes: Vec<SweepAxis> = self
            .sweep
            .iter()
            .filter_map(|text| SweepAxis::parse(text, "--sweep").map_err(|e| problems.push(e)).ok())
            .collect();
        // An unknown flag is reported once, not once per grid point and entry it appears in.
        let fields = serde_json::to_value(&self.policy).expect("PolicyConfig serializes to an object");
        let fields = fields.as_object().expect("PolicyConfig serializes to an object");
        let mut unknown: Vec<&str> = entries
            .iter()
            .flat_map(|entry| entry.entry.overrides.iter().map(|(key, _)| key.as_str()))
            .chain(axes.iter().map(|axis| axis.name.as_str()))
            .filter(|key| !is_policy_flag(fields, key))
            .collect();
        unknown.sort_unstable();
        unknown.dedup();
        if !unknown.is_empty() {
            problems.push(unknown_flags(fields, &unknown));
        }
        let mut runs = Vec::new();
        // No run is expanded while a flag is unknown: each would repeat the same problem.
        let points = if unknown.is_empty() { grid(&axes) } else { Vec::new() };
        for point in points {
            for PolicyEntry { entry, kind } in &entries {
                let (label, overrides) = entry.at(&point);
                match policy_config(&self.policy, *kind, &overrides) {
                    Ok(policy) => runs.push(RunSpec {
                        label,
                        entry: entry.text.clone(),
                        policy,
                        sweep_point: point.clone(),
                    }),
                    Err(error) => problems.push(format!("{label}: {error}")),
                }
            }
        }
        problems.dedup();
        let mut errors: Vec<FieldError> = problems.into_iter().map(flag_error).collect();
        errors.extend(engine_errors);
        errors.extend(self.tenants_config().err().unwrap_or_default());
        errors.extend(self.overload().check().err().map(|e| e.0).unwrap_or_default());
        if errors.is_empty() {
            Ok(runs)
        } else {
            Err(SimError::InvalidOptions(ValidationErrors(errors)))
        }
    }
}

/// One simulation to run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    /// Policy name and every override, e.g. `cache_aware balance_token_usage_threshold=0.2`.
    pub label: String,
    /// The `--policies` entry it came from.
    pub entry: String,
    pub policy: PolicyConfig,
    /// The sweep grid point (empty without `--sweep`).
    pub sweep_point: Vec<(String, String)>,
}

/// A `--policies` entry naming one of kvgate's policies.
#[derive(Clone, Debug)]
struct PolicyEntry {
    entry: Entry,
    kind: PolicyKind,
}

impl PolicyEntry {
    fn parse(text: &str) -> Result<PolicyEntry, String> {
        let entry = Entry::parse(text)?;
        let kind = PolicyKind::from_str(&entry.name, false).map_err(|_| {
            let known: Vec<String> = PolicyKind::value_variants()
                .iter()
                .filter_map(|kind| kind.to_possible_value().map(|value| value.get_name().to_string()))
                .collect();
            format!("unknown policy `{}` in --policies (known: {})", entry.name, known.join(", "))
        })?;
        Ok(PolicyEntry { entry, kind })
    }
}

/// Whether `key` names a policy flag of `fields` (the serialized `PolicyConfig`; `policy` is
/// chosen by the entry's name, not overridden).
fn is_policy_flag(fields: &serde_json::Map<String, serde_json::Value>, key: &str) -> bool {
    key != "policy" && fields.contains_key(key)
}

/// The problem for flags `unknown`, with the known ones listed.
fn unknown_flags(fields: &serde_json::Map<String, serde_json::Value>, unknown: &[&str]) -> String {
    let mut known: Vec<&str> = fields.keys().map(String::as_str).filter(|k| *k != "policy").collect();
    known.sort_unstable();
    let names: Vec<String> = unknown.iter().map(|key| format!("`{key}`")).collect();
    format!("unknown policy flag {} (known: {})", names.join(", "), known.join(", "))
}

/// `base` with `policy` and the overrides applied (by serialized field name), validated. Every
/// problem is reported, separated by "; ".
pub fn policy_config(
    base: &PolicyConfig,
    kind: PolicyKind,
    overrides: &[Override],
) -> Result<PolicyConfig, String> {
    let mut value = serde_json::to_value(base).map_err(|e| e.to_string())?;
    let mut problems = Vec::new();
    for (key, raw) in overrides {
        let fields = value.as_object_mut().expect("PolicyConfig serializes to an object");
        if !is_policy_flag(fields, key) {
            problems.push(unknown_flags(fields, &[key.as_str()]));
            continue;
        }
        let previous = fields.insert(key.clone(), parse_value(raw));
        if let Err(error) = serde_json::from_value::<PolicyConfig>(value.clone()) {
            problems.push(format!("invalid value `{raw}` for {key}: {error}"));
            let fields = value.as_object_mut().expect("still an object");
            fields.insert(key.clone(), previous.expect("the field exists"));
        }
    }
    let mut config: PolicyConfig = serde_json::from_value(value).map_err(|e| e.to_string())?;
    config.policy = kind;
    if let Err(errors) = config.validate() {
        problems.extend(errors.iter().map(ToString::to_string));
    }
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(problems.join("; "))
    }
}

/// A problem written as `--flag what is wrong` as a field error of that flag's field; any other
/// text is a problem of `--policies` (a policy entry or its overrides).
pub(crate) fn flag_error(text: String) -> FieldError {
    match text.strip_prefix("--").and_then(|rest| rest.split_once(' ')) {
        Some((flag, message)) => {
            FieldError::new(flag.replace('-', "_"), message).with_flag(Some(&format!("--{flag}")))
        }
        None => FieldError::new("policies", text),
    }
}

/// A flag value as JSON: a bool, an integer, a float, else a string (enum names).
fn parse_value(raw: &str) -> serde_json::Value {
    if let Ok(flag) = raw.parse::<bool>() {
        return flag.into();
    }
    if let Ok(integer) = raw.parse::<u64>() {
        return integer.into();
    }
    if let Ok(integer) = raw.parse::<i64>() {
        return integer.into();
    }
    match raw.parse::<f64>() {
        Ok(float) if float.is_finite() => float.into(),
        _ => raw.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(extra: &[&str]) -> Result<Vec<RunSpec>, SimError> {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: SimArgs,
        }
        let mut argv = vec!["kvgate-sim", "--trace", "t.jsonl"];
        argv.extend_from_slice(extra);
        <Command as clap::Parser>::try_parse_from(argv).unwrap().args.runs()
    }

    #[test]
    fn defaults_are_round_robin_and_cache_aware_on_the_reference_replica() {
        let args = SimArgs::new("t.jsonl");
        assert_eq!(args.workers, 8);
        assert_eq!(args.load_monitor_interval_ms, 1000);
        let engine = args.engine_config();
        assert_eq!(
            engine,
            EngineConfig { emit_token_events: false, emit_kv_events: false, ..EngineConfig::default() }
        );
        let labels: Vec<String> = args.runs().unwrap().into_iter().map(|run| run.label).collect();
        assert_eq!(labels, ["round_robin", "cache_aware"]);
    }

    #[test]
    fn engine_and_policy_block_sizes_are_separate_flags() {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: SimArgs,
        }
        let argv = ["kvgate-sim", "--trace", "t", "--kv-block-size", "32", "--block-size", "64"];
        let args = <Command as clap::Parser>::try_parse_from(argv).unwrap().args;
        assert_eq!(args.engine_config().block_size, 32);
        assert_eq!(args.runs().unwrap()[1].policy.block_size, 64);
    }

    #[test]
    fn entries_take_overrides_and_sweeps_make_a_grid() {
        let runs = runs(&[
            "--policies",
            "random,cache_aware:overload_token_usage_threshold=0.9:rebalance_affinity=false,\
             cache_aware:cache_threshold=0.5@strict",
            "--sweep",
            "balance_token_usage_threshold=0.1,0.2",
            "--sweep",
            "max_tree_size=1000",
        ])
        .unwrap();
        let labels: Vec<&str> = runs.iter().map(|run| run.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "random balance_token_usage_threshold=0.1 max_tree_size=1000",
                "cache_aware overload_token_usage_threshold=0.9 rebalance_affinity=false balance_token_usage_threshold=0.1 max_tree_size=1000",
                "strict balance_token_usage_threshold=0.1 max_tree_size=1000",
                "random balance_token_usage_threshold=0.2 max_tree_size=1000",
                "cache_aware overload_token_usage_threshold=0.9 rebalance_affinity=false balance_token_usage_threshold=0.2 max_tree_size=1000",
                "strict balance_token_usage_threshold=0.2 max_tree_size=1000",
            ]
        );
        assert_eq!(runs[5].policy.cache_threshold, 0.5);
        assert_eq!(runs[5].entry, "cache_aware:cache_threshold=0.5@strict");
        let tuned = &runs[4].policy;
        assert_eq!(tuned.policy, PolicyKind::CacheAware);
        assert_eq!((tuned.balance_token_usage_threshold, tuned.overload_token_usage_threshold), (0.2, 0.9));
        assert!(!tuned.rebalance_affinity);
        assert_eq!(tuned.max_tree_size, 1000);
    }

    #[test]
    fn every_problem_is_reported() {
        let Err(SimError::InvalidOptions(problems)) = runs(&[
            "--workers",
            "0",
            "--policies",
            "round_robin,nope,cache_aware:cache_threshold=2",
            "--sweep",
            "no_such_flag=1",
            "--sweep",
            "block_size=0.5",
        ]) else {
            panic!("expected invalid options");
        };
        let all = problems.to_string();
        for needle in ["--workers", "unknown policy `nope`", "unknown policy flag `no_such_flag`"] {
            assert!(all.contains(needle), "{all}");
        }
        // Once, however many runs it would have reached; named as written on the command line,
        // a flag is the same field.
        let Err(SimError::InvalidOptions(problems)) = runs(&[
            "--policies",
            "round_robin,cache_aware:kv-aware-wait-margin=2",
            "--sweep",
            "no_such_flag=1,2,3",
        ]) else {
            panic!("expected invalid options");
        };
        assert_eq!(problems.to_string().matches("no_such_flag").count(), 1, "{problems}");
        assert!(!problems.to_string().contains("kv_aware_wait_margin`"), "{problems}");
        let dashed =
            runs(&["--policies", "kv_aware:kv-aware-wait-margin=2", "--sweep", "block-size=32,64"]).unwrap();
        assert_eq!((dashed[1].policy.kv_aware_wait_margin, dashed[1].policy.block_size), (2.0, 64));
        assert_eq!(dashed[1].label, "kv_aware kv_aware_wait_margin=2 block_size=64");
        let Err(SimError::InvalidOptions(problems)) =
            runs(&["--policies", "cache_aware:cache_threshold=2", "--sweep", "block_size=0.5"])
        else {
            panic!("expected invalid options");
        };
        assert!(
            problems
                .iter()
                .any(|p| p.to_string().contains("cache_threshold") && p.to_string().contains("(0, 1]")),
            "{problems:?}"
        );
        assert!(
            problems.iter().any(|p| p.to_string().contains("invalid value `0.5` for block_size")),
            "{problems:?}"
        );
    }
}
