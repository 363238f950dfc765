//! The routing regression guard (`routing-guard`, `scripts/routing_guard.sh`): every scenario
//! S1-S11 ([`crate::scenarios`], at the guard's size) under every built-in policy in `kvgate sim`,
//! its TTFT mean, TTFT p99, session makespan p99 (where the trace has sessions) and cache hit rate
//! compared with a committed baseline file. A figure more than `--tolerance-pct` (3%) worse than
//! its baseline fails the guard; a better one does not; every move is printed either way. The
//! simulator is deterministic: a move is a change in routing (or in the engine model), never
//! noise. `--update` rewrites the baseline with the figures of this run, the deliberate step
//! whose commit says which figures moved and why.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::scenarios::{built_in_policies, scenario, Scenario, SCENARIOS};
use crate::{run_on_trace, SimError};
use kvgate_trace::{Trace, TraceFormat};

/// Options of `routing-guard`.
#[derive(clap::Parser, Clone, Debug, PartialEq)]
#[command(
    name = "routing-guard",
    about = "Compare every scenario under every policy with the routing baseline"
)]
pub struct GuardArgs {
    /// The baseline file.
    #[arg(long, default_value = "bench-baseline/routing.json")]
    pub baseline: PathBuf,
    /// Rewrite the baseline with this run's figures (the scenarios and policies run; others
    /// kept) instead of failing on a move.
    #[arg(long)]
    pub update: bool,
    /// The conversation trace S1-S4 and S6 take their first requests from.
    #[arg(long, default_value = "bench-baseline/conversation-head.jsonl")]
    pub conversation_trace: PathBuf,
    /// Scenarios to run, comma-separated (default: S1-S11).
    #[arg(long, value_delimiter = ',')]
    pub scenarios: Vec<String>,
    /// Policies to run, comma-separated (default: every built-in policy).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Seed of the generated traces and the policies' draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A figure this many percent worse than its baseline fails the guard.
    #[arg(long, default_value_t = 3.0)]
    pub tolerance_pct: f64,
    /// Simulations run at once (default: the machine's cores).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Run the scenarios at full size (the documented commands' traces: give the whole
    /// conversation trace with --conversation-trace) instead of the guard's; with --update and
    /// --baseline, a file of full-size figures to compare later runs with.
    #[arg(long)]
    pub full_size: bool,
}

/// The figures guarded, of one policy on one scenario. Latencies in ms of virtual time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
    pub cache_hit_rate: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_makespan_p99_ms: Option<f64>,
}

/// One scenario's baseline: the size of the trace it was measured on, and each policy's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScenarioBaseline {
    pub id: String,
    pub requests: usize,
    pub prompt_tokens: u64,
    pub policies: BTreeMap<String, Figures>,
}

/// The baseline file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// How the file was made and is remade.
    pub about: String,
    pub seed: u64,
    pub scenarios: Vec<ScenarioBaseline>,
}

const ABOUT: &str = "Routing guard baseline (scripts/routing_guard.sh): kvgate sim figures of every \
scenario at the guard's size under every built-in policy. Regenerate with `scripts/routing_guard.sh \
--update` and say in the commit message which figures moved and why.";

/// Why the guard could not run (a failed comparison is not an error: see [`GuardReport`]).
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("{0}")]
    Options(String),
    #[error("reading the baseline {path}: {message}")]
    Baseline { path: String, message: String },
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// One figure's move against the baseline.
#[derive(Clone, Debug, PartialEq)]
pub struct Move {
    pub scenario: String,
    pub policy: String,
    pub figure: &'static str,
    pub baseline: Option<f64>,
    pub current: Option<f64>,
    /// Relative change, positive = worse (for the hit rate, a lower rate).
    pub worse_by: f64,
    pub fails: bool,
}

/// What the guard found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GuardReport {
    /// Every figure that differs from its baseline (or has none), in scenario and policy order.
    pub moves: Vec<Move>,
    /// Problems that fail the guard besides moves (a scenario's trace changed size, ...).
    pub problems: Vec<String>,
    /// Figures compared.
    pub compared: usize,
    /// The baseline with this run's figures merged in.
    pub updated: Baseline,
}

impl GuardReport {
    pub fn failed(&self) -> bool {
        !self.problems.is_empty() || self.moves.iter().any(|m| m.fails)
    }

    /// The table of moves and the verdict (with `updating`, what the rewritten baseline takes),
    /// as markdown.
    pub fn markdown(&self, tolerance_pct: f64, updating: bool) -> String {
        let mut out = String::new();
        if self.moves.is_empty() {
            let _ = writeln!(out, "No figure moved ({} compared).", self.compared);
        } else {
            let _ = writeln!(
                out,
                "| scenario | policy | figure | baseline | now | worse by | |\n| --- | --- | --- | ---: | ---: | ---: | --- |"
            );
            for m in &self.moves {
                let show = |value: Option<f64>| match value {
                    Some(value) if m.figure == "cache_hit_rate" => format!("{:.2}%", value * 100.0),
                    Some(value) => format!("{value:.1}"),
                    None => "-".to_string(),
                };
                let verdict = match (m.fails, m.worse_by > 0.0) {
                    (true, _) => "**worse: fails**",
                    (false, true) => "worse, within tolerance",
                    (false, false) => "better",
                };
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {:+.2}% | {verdict} |",
                    m.scenario,
                    m.policy,
                    m.figure,
                    show(m.baseline),
                    show(m.current),
                    m.worse_by * 100.0
                );
            }
            let _ = writeln!(out, "\n{} of {} figures moved.", self.moves.len(), self.compared);
        }
        for problem in &self.problems {
            let _ = writeln!(out, "- **{problem}**");
        }
        let failing = self.moves.iter().filter(|m| m.fails).count();
        if updating {
            let _ = writeln!(
                out,
                "\nThe baseline takes these figures ({failing} were more than {tolerance_pct}% worse): say in \
                 the commit message which moved and why."
            );
        } else if self.failed() {
            let _ = writeln!(
                out,
                "\nThe routing guard FAILS: {failing} figures more than {tolerance_pct}% worse than the baseline{}. \
                 If the change is meant, run `scripts/routing_guard.sh --update` and say in the commit \
                 message which figures moved and why.",
                if self.problems.is_empty() { "" } else { ", and the problems above" }
            );
        } else {
            let _ = writeln!(out, "\nThe routing guard passes (tolerance {tolerance_pct}%).");
        }
        out
    }
}

/// Absolute changes below these are not moves: latencies in ms, hit rates as fractions.
const LATENCY_EPSILON_MS: f64 = 0.5;
const RATE_EPSILON: f64 = 0.0005;

/// How much worse `current` is than `baseline`, relative (positive = worse), or `None` when the
/// two are the same within the figure's absolute epsilon.
fn worse_by(figure: &str, baseline: f64, current: f64) -> Option<f64> {
    let (higher_is_better, epsilon) = match figure {
        "cache_hit_rate" => (true, RATE_EPSILON),
        _ => (false, LATENCY_EPSILON_MS),
    };
    if (current - baseline).abs() <= epsilon {
        return None;
    }
    let change = (current - baseline) / baseline.abs().max(epsilon);
    Some(if higher_is_better { -change } else { change })
}

/// Compares `current` (scenario, policy, figures; with each scenario's trace size) with
/// `baseline`: the moves, the problems, and the baseline with `current` merged in.
pub fn compare(baseline: &Baseline, current: &[ScenarioBaseline], tolerance_pct: f64) -> GuardReport {
    let mut report = GuardReport { updated: baseline.clone(), ..GuardReport::default() };
    report.updated.about = ABOUT.to_string();
    let tolerance = tolerance_pct / 100.0;
    for now in current {
        let before = baseline.scenarios.iter().find(|s| s.id == now.id);
        match before {
            None => report.problems.push(format!("{}: not in the baseline", now.id)),
            Some(before) if (before.requests, before.prompt_tokens) != (now.requests, now.prompt_tokens) => {
                report.problems.push(format!(
                    "{}: the trace changed ({} requests, {} prompt tokens; the baseline's: {}, {}): \
                     its figures are not comparable",
                    now.id, now.requests, now.prompt_tokens, before.requests, before.prompt_tokens
                ))
            }
            Some(_) => {}
        }
        let comparable =
            before.filter(|b| (b.requests, b.prompt_tokens) == (now.requests, now.prompt_tokens));
        for (policy, figures) in now.policies.iter().filter(|_| before.is_none() || comparable.is_some()) {
            let old = before.and_then(|b| b.policies.get(policy));
            if before.is_some() && old.is_none() {
                report.problems.push(format!("{} {policy}: not in the baseline", now.id));
            }
            let pairs = [
                ("ttft_mean_ms", old.map(|o| o.ttft_mean_ms), Some(figures.ttft_mean_ms)),
                ("ttft_p99_ms", old.map(|o| o.ttft_p99_ms), Some(figures.ttft_p99_ms)),
                (
                    "session_makespan_p99_ms",
                    old.and_then(|o| o.session_makespan_p99_ms),
                    figures.session_makespan_p99_ms,
                ),
                ("cache_hit_rate", old.map(|o| o.cache_hit_rate), Some(figures.cache_hit_rate)),
            ];
            for (figure, old_value, new_value) in pairs {
                if old_value.is_none() && new_value.is_none() {
                    continue;
                }
                report.compared += 1;
                let (worse, fails) = match (old_value, new_value) {
                    (Some(old_value), Some(new_value)) => match worse_by(figure, old_value, new_value) {
                        None => continue,
                        Some(worse) => (worse, worse > tolerance),
                    },
                    // A figure appeared or disappeared: the scenario's shape changed.
                    _ => (0.0, old.is_some()),
                };
                report.moves.push(Move {
                    scenario: now.id.clone(),
                    policy: policy.clone(),
                    figure,
                    baseline: old_value,
                    current: new_value,
                    worse_by: worse,
                    fails,
                });
            }
        }
        match report.updated.scenarios.iter_mut().find(|s| s.id == now.id) {
            Some(slot) if (slot.requests, slot.prompt_tokens) == (now.requests, now.prompt_tokens) => {
                slot.policies.extend(now.policies.clone());
            }
            Some(slot) => *slot = now.clone(),
            None => report.updated.scenarios.push(now.clone()),
        }
    }
    let order = |id: &str| SCENARIOS.iter().position(|s| s.id == id).unwrap_or(usize::MAX);
    report.updated.scenarios.sort_by_key(|s| order(&s.id));
    report
}

/// Rounds a figure for the baseline file (the comparison's epsilons are far coarser).
fn rounded(value: f64) -> f64 {
    (value * 1e4).round() / 1e4
}

/// Runs `policies` on `scenario` at the guard's size (or its full size): its trace size and each policy's figures.
fn measure(
    scenario: &Scenario,
    conversation: Option<&Trace>,
    policies: &[&str],
    seed: u64,
    full_size: bool,
) -> Result<ScenarioBaseline, GuardError> {
    let trace = scenario.trace(conversation, seed, !full_size).map_err(GuardError::Options)?;
    let args = scenario.sim_args(policies, seed);
    let report = run_on_trace(&args, &trace, false)?;
    let policies = report
        .runs
        .iter()
        .map(|run| {
            let m = &run.metrics;
            let figures = Figures {
                ttft_mean_ms: rounded(m.ttft_mean_ms),
                ttft_p99_ms: rounded(m.ttft_p99_ms),
                cache_hit_rate: rounded(m.cache_hit_rate),
                session_makespan_p99_ms: m.sessions.as_ref().map(|s| rounded(s.makespan_p99_ms)),
            };
            (run.label.clone(), figures)
        })
        .collect();
    Ok(ScenarioBaseline {
        id: scenario.id.to_string(),
        requests: report.trace.requests,
        prompt_tokens: report.trace.prompt_tokens,
        policies,
    })
}

/// Reads the baseline (an empty one when `--update` makes it anew).
pub fn read_baseline(path: &Path, missing_ok: bool) -> Result<Baseline, GuardError> {
    let problem = |message: String| GuardError::Baseline { path: path.display().to_string(), message };
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| problem(e.to_string())),
        Err(error) if missing_ok && error.kind() == std::io::ErrorKind::NotFound => Ok(Baseline::default()),
        Err(error) => Err(problem(error.to_string())),
    }
}

/// Runs the guard: every scenario and policy asked, `--jobs` simulations at once, compared with
/// the baseline (and with `--update`, the baseline rewritten).
pub fn run(args: &GuardArgs) -> Result<GuardReport, GuardError> {
    let scenarios: Vec<&Scenario> = if args.scenarios.is_empty() {
        SCENARIOS.iter().collect()
    } else {
        args.scenarios
            .iter()
            .map(|id| scenario(id).ok_or_else(|| GuardError::Options(format!("unknown scenario {id:?}"))))
            .collect::<Result<_, _>>()?
    };
    let all_policies = built_in_policies();
    let policies: Vec<&str> = if args.policies.is_empty() {
        all_policies
    } else {
        args.policies.iter().map(String::as_str).collect()
    };
    if !(args.tolerance_pct.is_finite() && args.tolerance_pct >= 0.0) {
        return Err(GuardError::Options(format!("--tolerance-pct must be >= 0, got {}", args.tolerance_pct)));
    }
    let baseline = read_baseline(&args.baseline, args.update)?;
    if baseline.seed != args.seed && !args.update && !baseline.scenarios.is_empty() {
        return Err(GuardError::Options(format!(
            "the baseline was measured at seed {}, not {}",
            baseline.seed, args.seed
        )));
    }
    let conversation = if scenarios.iter().any(|s| s.gen_args(0, None).is_none()) {
        Some(Trace::load(&args.conversation_trace, TraceFormat::Mooncake).map_err(SimError::from)?)
    } else {
        None
    };
    // One job per (scenario, policy), the longest scenarios first.
    let jobs: Vec<(usize, &str)> =
        (0..scenarios.len()).flat_map(|s| policies.iter().map(move |&p| (s, p))).collect();
    let results: Mutex<Vec<Option<Result<ScenarioBaseline, GuardError>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, jobs.len().max(1)) {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&(s, policy)) = jobs.get(index) else { break };
                let started = std::time::Instant::now();
                let result =
                    measure(scenarios[s], conversation.as_ref(), &[policy], args.seed, args.full_size);
                eprintln!(
                    "routing guard: {} {policy}: {:.1} s",
                    scenarios[s].id,
                    started.elapsed().as_secs_f64()
                );
                results.lock().expect("no job panics holding the lock")[index] = Some(result);
            });
        }
    });
    let mut current: Vec<ScenarioBaseline> = Vec::new();
    for ((s, _), result) in jobs.iter().zip(results.into_inner().expect("the jobs are done")) {
        let measured = result.expect("every job ran")?;
        match current.iter_mut().find(|c| c.id == scenarios[*s].id) {
            Some(slot) => slot.policies.extend(measured.policies),
            None => current.push(measured),
        }
    }
    let mut report = compare(&baseline, &current, args.tolerance_pct);
    report.updated.seed = args.seed;
    if args.update {
        let text = serde_json::to_string_pretty(&report.updated).expect("a baseline serializes") + "\n";
        std::fs::write(&args.baseline, text).map_err(|e| GuardError::Baseline {
            path: args.baseline.display().to_string(),
            message: e.to_string(),
        })?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests;
