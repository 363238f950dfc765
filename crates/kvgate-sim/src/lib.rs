//! kvgate-sim: `kvgate sim`, a deterministic discrete-event simulator that replays a trace in virtual time through kvgate's routing policies onto simulated engines.
//!
//! The policies are the gateway's own objects ([`kvgate_policy::build_policy`]), called exactly
//! as the gateway calls them: the candidates are all workers with the in-flight counts the gateway
//! would track (+1 when routed, -1 when the request finishes), their load is the latest sample of
//! a simulated load monitor that polls every engine every `--load-monitor-interval-ms` of virtual
//! time (only for policies that read loads, as the gateway polls only then), and
//! `Policy::maintain` runs every virtual second. The engines are [`kvgate_engine::Engine`]s with
//! the reference replica's parameters unless flags say otherwise.
//!
//! Trace lines become prompts as `shared/bench/SCENARIOS.md` describes ([`trace`]); the same
//! prompts rendered as text drive `kvgate replay` over HTTP.
//!
//! The report sets each run's cache hit rate beside the trace's references: the infinite-cache
//! ceiling, and the pooled-LRU reference and pooled-Belady bound of one cache as large as the
//! whole fleet's KV (`--workers` x `--kv-capacity-tokens`; [`CacheReference`]).
//!
//! `--prefill-workers N --decode-workers M` simulates a prefill/decode disaggregated fleet
//! instead ([`Fleet::Disaggregated`]): the run's policy routes the prefill engines, the decode
//! side's policy (`--decode-policy`) the decode engines, and the prompt's KV moves between them
//! over a link of `--kv-transfer-gbps`; the pooled references then take the prefill engines' KV.
//!
//! A trace whose lines name sessions is replayed closed loop: a session's later turn arrives once
//! its previous turn ended plus its think time, and the report adds the sessions' makespans.
//!
//! [`scenarios`] holds the scenarios S1-S11 as data, and [`guard`] the routing regression guard
//! that runs them all under every built-in policy against a committed baseline (`routing-guard`).
//!
//! Same trace, options and seed: byte-identical markdown and JSON.

mod args;
pub mod guard;
mod kv_out;
mod markdown;
pub mod outside;
mod plot;
mod report;
pub mod scenarios;
mod sim;
mod tenants;

#[cfg(test)]
mod tests;

use std::time::{Duration, Instant};

pub use args::{entry, policy_config, Override, RunSpec, SimArgs};
pub use kvgate_config::{FieldError, ValidationErrors};
pub use kvgate_trace::{percentile, CacheReference};
pub use kvgate_trace::{CacheCeiling, Trace, TraceError, TraceFormat, TraceRequest};
pub use outside::{OutsideCandidate, OutsidePolicy, OutsideRequest};
pub use report::{
    BestSetting, Metrics, PdMetrics, RunReport, SetupInfo, SimReport, TraceInfo, WorkerOverload,
    SWEEP_METRICS,
};
pub use sim::{
    simulate, simulate_outside, AdmissionSetup, Fleet, KvTick, PdOutcome, PdSetup, Prompts, SimOutcome,
    SimPool, SimSetup, TtftParts, MAINTAIN_INTERVAL_US,
};
pub use tenants::TenantMetrics;

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid sim options: {0}")]
    InvalidOptions(#[from] ValidationErrors),
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("writing {path}: {message}")]
    Output { path: String, message: String },
    #[error("--tokenizer-path {path}: {message}")]
    Tokenizer { path: String, message: String },
}

/// Each trace request's prompt as the real engines behind `kvgate replay` compute it
/// (`--tokenizer-path`): the body replay sends for `--endpoint`, rendered and tokenized with the
/// engines' tokenizer. `None` without the option (the simulated engines' words).
fn tokenized_prompts(args: &SimArgs, trace: &Trace) -> Result<Option<sim::Prompts>, SimError> {
    let Some(path) = &args.tokenizer_path else { return Ok(None) };
    let problem = |message: String| SimError::Tokenizer { path: path.display().to_string(), message };
    let tokenizer =
        kvgate_tokenizer::Tokenizer::from_path(path, None).map_err(|error| problem(error.to_string()))?;
    let mut prompts = Vec::with_capacity(trace.requests.len());
    for (line, request) in trace.requests.iter().enumerate() {
        let mut body = serde_json::json!({});
        args.endpoint.put_prompt(&mut body, kvgate_trace::prompt_text(request));
        let tokens = match args.endpoint {
            kvgate_trace::Endpoint::Completions => {
                tokenizer.encode_prompt(body["prompt"].as_str().unwrap_or_default())
            }
            kvgate_trace::Endpoint::Chat => {
                let bytes = serde_json::to_vec(&body).expect("a JSON value always serializes");
                tokenizer.encode_chat_request(&bytes)
            }
        };
        let tokens = tokens.map_err(|error| problem(format!("request {}: {error}", line + 1)))?;
        if tokens.is_empty() {
            return Err(problem(format!("request {}: no tokens", line + 1)));
        }
        prompts.push(tokens);
    }
    Ok(Some(sim::Prompts::new(prompts)))
}

/// Loads `--trace` and runs every policy (and sweep point) on it. Prints progress on stderr.
pub fn run(args: &SimArgs) -> Result<SimReport, SimError> {
    args.runs()?;
    let trace = Trace::load(&args.trace, args.trace_format)?;
    run_on_trace(args, &trace, true)
}

/// Runs every policy (and sweep point) of `args` on `trace` (`args.trace` only names it in the
/// report). With `show_progress`, runs longer than a few seconds report progress on stderr.
pub fn run_on_trace(args: &SimArgs, trace: &Trace, show_progress: bool) -> Result<SimReport, SimError> {
    let runs = args.runs()?;
    let fleet = args.fleet()?;
    let trace = trace.truncated(args.max_requests);
    let ceiling = trace.cache_ceiling();
    let engines: Vec<_> = (0..fleet.n_engines()).map(|engine| args.engine_config_for(engine)).collect();
    let pooled_kv_tokens = engines[..fleet.prompt_engines()].iter().map(|e| e.kv_capacity_tokens).sum();
    let pooled_lru = trace.pooled_lru(pooled_kv_tokens);
    let pooled_belady = trace.pooled_belady(pooled_kv_tokens);
    let setup = sim_setup(args, fleet, engines, &trace)?;
    let times: Vec<f64> = trace.requests.iter().map(|r| r.timestamp_ms).collect();
    let span_ms = times.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        - times.iter().copied().fold(f64::INFINITY, f64::min);
    let trace_info = TraceInfo {
        path: args.trace.display().to_string(),
        requests: trace.requests.len(),
        prompt_tokens: ceiling.prompt_tokens,
        ceiling_cached_tokens: ceiling.cached_tokens,
        ceiling_hit_rate: ceiling.rate(),
        pooled_kv_tokens,
        pooled_lru_cached_tokens: pooled_lru.cached_tokens,
        pooled_lru_hit_rate: pooled_lru.rate(),
        pooled_belady_cached_tokens: pooled_belady.cached_tokens,
        pooled_belady_hit_rate: pooled_belady.rate(),
        span_s: span_ms.max(0.0) / 1000.0 / args.rate_scale,
    };
    let mut reports = Vec::with_capacity(runs.len());
    let n_runs = runs.len();
    let mut kv_out = match &args.kv_events_out {
        Some(path) => Some(kv_out::KvEventsOut::create(path)?),
        None => None,
    };
    for (run_index, spec) in runs.into_iter().enumerate() {
        let started = Instant::now();
        let mut last_print = started;
        let total = trace.requests.len();
        let mut progress = |arrived: usize, now_us: u64| {
            if show_progress && arrived.is_multiple_of(256) && last_print.elapsed() >= Duration::from_secs(3)
            {
                last_print = Instant::now();
                eprintln!(
                    "sim [{}/{n_runs}] {}: {arrived}/{total} requests, virtual {:.0} s, wall {:.1} s",
                    run_index + 1,
                    spec.label,
                    now_us as f64 / 1e6,
                    started.elapsed().as_secs_f64()
                );
            }
        };
        let outcome = match kv_out.as_mut() {
            Some(out) => {
                let mut sink = |engine: usize, batch: &kvgate_engine::KvEventBatch| {
                    out.write(&spec.label, engine, batch)
                };
                let outcome =
                    sim::simulate_with_kv_sink(&trace, &setup, &spec.policy, &mut progress, Some(&mut sink));
                out.finish_run()?;
                outcome
            }
            None => simulate(&trace, &setup, &spec.policy, &mut progress),
        };
        if show_progress && started.elapsed() >= Duration::from_secs(3) {
            eprintln!(
                "sim [{}/{n_runs}] {}: done in {:.1} s wall",
                run_index + 1,
                spec.label,
                started.elapsed().as_secs_f64()
            );
        }
        let (mut metrics, ttft_ms_sorted) =
            Metrics::from_outcome(&outcome, ceiling.rate(), pooled_lru.rate());
        metrics.tenants = tenants::per_tenant(&outcome, &trace, metrics.makespan_s);
        let kv_series = outcome
            .kv_ticks
            .iter()
            .map(|tick| ((tick.at_us - outcome.first_arrival_us) as f64 / 1e6, tick.token_usage.clone()))
            .collect();
        reports.push(RunReport {
            label: spec.label,
            entry: spec.entry,
            sweep_point: spec.sweep_point,
            policy: spec.policy,
            metrics,
            decisions: report::decision_counts(&outcome),
            decode_decisions: report::decode_decision_counts(&outcome),
            ttft_by_reason: report::ttft_by_reason(&outcome),
            ttft_ms_sorted,
            kv_series,
        });
    }
    let sweep_best = if args.sweep.is_empty() { Vec::new() } else { report::best_settings(&reports) };
    Ok(SimReport {
        trace: trace_info,
        setup: SetupInfo {
            workers: setup.fleet.n_engines(),
            pd: match setup.fleet {
                Fleet::Disaggregated(pd) => Some(*pd),
                Fleet::Regular { .. } => None,
            },
            rate_scale: setup.rate_scale,
            load_monitor_interval_ms: setup.load_monitor_interval_ms,
            seed: setup.seed,
            engine: setup.engine,
            worker_speeds: args.engine.worker_speeds.clone(),
            worker_kv_capacity_tokens: args.engine.worker_kv_capacity_tokens.clone(),
            admission: args.max_concurrent_requests.is_some().then(|| args.admission()).transpose()?,
            worker_overload: setup.overload.enabled().then_some(report::WorkerOverload {
                waiting_requests: setup.overload.waiting_requests,
                token_usage: setup.overload.token_usage,
                shed: setup.overload.shed,
            }),
        },
        runs: reports,
        sweep_best,
    })
}

fn sim_setup(
    args: &SimArgs,
    fleet: Fleet,
    engines: Vec<kvgate_engine::EngineConfig>,
    trace: &Trace,
) -> Result<SimSetup, SimError> {
    Ok(SimSetup {
        prompts: tokenized_prompts(args, trace)?,
        fleet,
        engine: args.engine_config(),
        engines,
        rate_scale: args.rate_scale,
        load_monitor_interval_ms: args.load_monitor_interval_ms,
        seed: args.seed,
        admission: args.admission()?,
        overload: args.overload(),
    })
}

/// Runs `trace` with `args`' fleet, engines, rate and load monitor, routed by `outside`
/// instead of kvgate's policies (`args.policies` and `--sweep` are not used), and reports it
/// under `label` as a run of `run_on_trace`'s report is (its `policy` is `args.policy`,
/// unused; its decisions are empty: an outside policy gives no reasons). A regular fleet only.
pub fn run_outside(
    args: &SimArgs,
    trace: &Trace,
    label: &str,
    outside: &mut dyn OutsidePolicy,
) -> Result<RunReport, SimError> {
    let mut checked = args.clone();
    checked.policies = vec!["round_robin".to_string()];
    checked.sweep.clear();
    checked.runs()?;
    let fleet = args.fleet()?;
    if matches!(fleet, Fleet::Disaggregated(_)) {
        let problem = "--prefill-workers an outside policy runs on a regular fleet (--workers), not a disaggregated one";
        return Err(SimError::InvalidOptions(ValidationErrors(vec![args::flag_error(problem.to_string())])));
    }
    let trace = trace.truncated(args.max_requests);
    let engines: Vec<_> = (0..fleet.n_engines()).map(|engine| args.engine_config_for(engine)).collect();
    let pooled_kv_tokens = engines.iter().map(|e| e.kv_capacity_tokens).sum();
    let setup = sim_setup(args, fleet, engines, &trace)?;
    let outcome = simulate_outside(&trace, &setup, outside, &mut |_, _| {});
    let (metrics, ttft_ms_sorted) = Metrics::from_outcome(
        &outcome,
        trace.cache_ceiling().rate(),
        trace.pooled_lru(pooled_kv_tokens).rate(),
    );
    let kv_series = outcome
        .kv_ticks
        .iter()
        .map(|tick| ((tick.at_us - outcome.first_arrival_us) as f64 / 1e6, tick.token_usage.clone()))
        .collect();
    Ok(RunReport {
        label: label.to_string(),
        entry: label.to_string(),
        sweep_point: Vec::new(),
        policy: args.policy.clone(),
        metrics,
        decisions: Vec::new(),
        decode_decisions: Vec::new(),
        ttft_by_reason: Vec::new(),
        ttft_ms_sorted,
        kv_series,
    })
}

/// Writes the report's outputs: `--json` and `--plot` files.
pub fn write_outputs(args: &SimArgs, report: &SimReport) -> Result<(), SimError> {
    if let Some(path) = &args.json {
        std::fs::write(path, report.to_json() + "\n")
            .map_err(|e| SimError::Output { path: path.display().to_string(), message: e.to_string() })?;
    }
    if let Some(path) = &args.plot {
        plot::draw(report, path)
            .map_err(|message| SimError::Output { path: path.display().to_string(), message })?;
    }
    Ok(())
}

/// `kvgate sim`: runs, prints the markdown report on stdout, writes `--json` / `--plot`.
pub fn run_cli(args: SimArgs) -> Result<(), SimError> {
    let report = run(&args)?;
    print!("{}", report.markdown());
    write_outputs(&args, &report)?;
    Ok(())
}
