//! `dynamo-sim`: `kvgate sim` with Dynamo's selection core as one more policy. Same options as `kvgate sim`; `--policies` may name `dynamo[:weight=value...][@label]` entries beside kvgate's policies, and `--dynamo-sweep NAME=V1,V2,...` runs every `dynamo` entry over a grid of Dynamo's weights.
//!
//! kvgate's policies run through `kvgate_sim::run_on_trace` as in `kvgate sim`; each `dynamo`
//! entry runs through `kvgate_sim::run_outside` on the same trace, fleet, engines and clock
//! (`peer.rs`), and its run joins the same report. After the report, a summary names
//! Dynamo's best swept setting (lowest TTFT mean, and lowest p99) and sets every kvgate run
//! beside it.
//!
//! Run: `cargo run --release --manifest-path benches/dynamo-sim/Cargo.toml -- --trace T
//! --policies dynamo,kv_aware,cache_aware --dynamo-sweep overlap_score_weight=0.5,1,2`.

mod peer;

use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use clap::Parser;
use kvgate_sim::entry::{grid, Entry, SweepAxis};
use kvgate_sim::{run_on_trace, run_outside, write_outputs, RunReport, SimArgs, Trace};
use peer::{DynamoPolicy, DynamoSettings, DynamoWorker};

#[derive(Parser)]
#[command(
    name = "dynamo-sim",
    about = "kvgate sim with Dynamo's selection core (dynamo-kv-router) as a policy"
)]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
    /// Run every `dynamo` entry at every point of a grid of Dynamo weights, `NAME=V1,V2,...`
    /// (repeat for more axes). Names: overlap_score_weight (Dynamo maps it to
    /// prefill_load_scale), prefill_load_scale, overlap_score_credit,
    /// overlap_score_credit_decay, temperature, decode_active_request_weight.
    #[arg(long = "dynamo-sweep", value_name = "NAME=V1,V2,...")]
    dynamo_sweep: Vec<String>,
}

/// Dynamo's run for one setting, with what its selections saw on stderr.
fn run_dynamo(
    sim: &SimArgs,
    trace: &Trace,
    label: &str,
    settings: &DynamoSettings,
) -> anyhow::Result<RunReport> {
    let workers: Vec<DynamoWorker> = (0..sim.workers)
        .map(|engine| {
            let config = sim.engine_config_for(engine);
            DynamoWorker {
                block_size: config.block_size,
                max_num_batched_tokens: u64::from(config.prefill_chunk_tokens),
                total_kv_blocks: config.kv_capacity_tokens / u64::from(config.block_size.max(1)),
            }
        })
        .collect();
    let started = Instant::now();
    let mut policy = DynamoPolicy::new(settings, &workers, sim.seed)?;
    let run = run_outside(sim, trace, label, &mut policy).map_err(|e| anyhow!("{label}: {e}"))?;
    eprintln!(
        "dynamo-sim {label}: done in {:.1} s wall; {} selections, Dynamo's device overlap {:.1}% of prompt tokens, {} refused{}",
        started.elapsed().as_secs_f64(),
        policy.selections,
        100.0 * policy.overlap_tokens as f64 / policy.prompt_tokens.max(1) as f64,
        policy.refused,
        policy.first_error.as_deref().map(|e| format!(" (first error: {e})")).unwrap_or_default(),
    );
    Ok(run)
}

/// Of Dynamo's runs, the one with the lowest `metric`.
fn best(dynamo: &[RunReport], metric: impl Fn(&RunReport) -> f64) -> Option<&RunReport> {
    dynamo.iter().min_by(|a, b| metric(a).total_cmp(&metric(b)))
}

/// The summary table: every run against Dynamo's best (its runs are `runs[first_dynamo..]`).
fn summary(runs: &[RunReport], first_dynamo: usize) -> String {
    let dynamo = &runs[first_dynamo..];
    let (Some(by_mean), Some(by_p99)) =
        (best(dynamo, |r| r.metrics.ttft_mean_ms), best(dynamo, |r| r.metrics.ttft_p99_ms))
    else {
        return String::new();
    };
    let mut out = String::from("\n## Against Dynamo's best setting\n\n");
    out.push_str(&format!(
        "Dynamo's best TTFT mean: `{}` ({:.2} s, p99 {:.2} s, hit {:.1}%); best TTFT p99: `{}` ({:.2} s).\n\n",
        by_mean.label,
        by_mean.metrics.ttft_mean_ms / 1000.0,
        by_mean.metrics.ttft_p99_ms / 1000.0,
        100.0 * by_mean.metrics.cache_hit_rate,
        by_p99.label,
        by_p99.metrics.ttft_p99_ms / 1000.0,
    ));
    out.push_str(
        "| policy | TTFT mean (s) | TTFT p99 (s) | hit | mean / Dynamo's best mean | p99 / Dynamo's best p99 |\n",
    );
    out.push_str("| --- | ---: | ---: | ---: | ---: | ---: |\n");
    for run in runs {
        out.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.1}% | {:.3} | {:.3} |\n",
            run.label,
            run.metrics.ttft_mean_ms / 1000.0,
            run.metrics.ttft_p99_ms / 1000.0,
            100.0 * run.metrics.cache_hit_rate,
            run.metrics.ttft_mean_ms / by_mean.metrics.ttft_mean_ms,
            run.metrics.ttft_p99_ms / by_p99.metrics.ttft_p99_ms,
        ));
    }
    out
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut dynamo = Vec::new();
    let mut kvgate = Vec::new();
    for text in cli.sim.policies.iter().map(|p| p.trim()).filter(|p| !p.is_empty()) {
        let entry = Entry::parse(text).map_err(|e| anyhow!(e))?;
        if entry.name == "dynamo" {
            dynamo.push(entry);
        } else {
            kvgate.push(text.to_string());
        }
    }
    if kvgate.is_empty() {
        bail!(
            "--policies: name at least one kvgate policy beside `dynamo` (the report sets them side by side)"
        );
    }
    let axes: Vec<SweepAxis> = cli
        .dynamo_sweep
        .iter()
        .map(|text| SweepAxis::parse(text, "--dynamo-sweep"))
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!(e))?;
    let mut settings = Vec::new();
    for point in grid(&axes) {
        for entry in &dynamo {
            let (label, overrides) = entry.at(&point);
            settings.push((label, DynamoSettings::new(&overrides)?));
        }
    }
    let trace = Trace::load(&cli.sim.trace, cli.sim.trace_format).context("loading --trace")?;
    let mut own = cli.sim.clone();
    own.policies = kvgate;
    let mut report = run_on_trace(&own, &trace, true)?;
    let first_dynamo = report.runs.len();
    for (label, setting) in &settings {
        report.runs.push(run_dynamo(&cli.sim, &trace, label, setting)?);
    }
    print!("{}", report.markdown());
    print!("{}", summary(&report.runs, first_dynamo));
    write_outputs(&cli.sim, &report)?;
    Ok(())
}
