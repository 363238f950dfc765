//! The index repair (`--index-repair`): what the gateway does with a worker whose index the
//! probe or the closed loop found wrong. `resync` drops its holdings from the exact index and
//! replays them from its engine (the subscriptions do it, `kv_events/subscriber.rs`);
//! `quarantine` sets its holdings aside for routing (`Worker::kv_events_trusted`: its pool
//! routes on the approximate tree under `--prefix-index auto`) until a probe of it passes;
//! `warn` only says so. Each action is logged with its cause and counted in
//! `kvgate_index_repairs_total{model,source,cause,action}`; resync and quarantine also empty the
//! worker's closed-loop window, since what it measured was about the holdings set aside (and a
//! disagreement it had raised goes with it: `kvgate_prefix_index_disagreement` back to 0, as
//! `/workers` shows it).

use kvgate_index::IndexRepair;

use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::metrics::{AlignmentMetrics, Metrics};

/// What found the index wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    Probe,
    ClosedLoop,
}

impl Source {
    fn as_str(self) -> &'static str {
        match self {
            Source::Probe => "probe",
            Source::ClosedLoop => "closed_loop",
        }
    }
}

/// One finding: where, what found it, its cause and what to check.
pub(super) struct Finding<'a> {
    pub worker: &'a Worker,
    pub model: &'a str,
    pub source: Source,
    pub cause: &'a str,
    pub advice: &'a str,
}

/// Acts on a finding; returns whether an action was taken (false: already quarantined).
pub(super) fn repair(finding: &Finding<'_>, action: IndexRepair, all: &Metrics) -> bool {
    let Finding { worker, model, source, cause, advice } = *finding;
    let metrics = &all.alignment;
    let health = &worker.index_health;
    let taken = match action {
        IndexRepair::Warn => true,
        IndexRepair::Resync => {
            health.request_resync();
            empty_window(worker, model, all);
            true
        }
        IndexRepair::Quarantine => {
            let changed = health.set_quarantined(true);
            if changed {
                worker.series.write(|url| metrics.quarantined.with_label_values(&[model, url]).set(1));
                empty_window(worker, model, all);
            }
            changed
        }
    };
    if !taken {
        tracing::debug!(worker = %worker.url, model, source = source.as_str(), cause, "index still quarantined");
        return false;
    }
    metrics.repairs.with_label_values(&[model, source.as_str(), cause, action.as_str()]).inc();
    let done = match action {
        IndexRepair::Warn => "nothing done (--index-repair warn)",
        IndexRepair::Resync => {
            "its holdings are dropped and replayed from the engine (--index-repair resync)"
        }
        IndexRepair::Quarantine => {
            "its pool routes on the approximate tree until a probe of it passes (--index-repair quarantine)"
        }
    };
    tracing::warn!(
        worker = %worker.url,
        model,
        source = source.as_str(),
        cause,
        action = action.as_str(),
        "the worker's KV index does not describe its engine: {advice}; {done}"
    );
    true
}

/// Empties the worker's closed-loop window; the disagreement it had raised, if any, is no longer
/// in force (its gauge, left at 1, would never be cleared: only a raised window clears).
fn empty_window(worker: &Worker, model: &str, metrics: &Metrics) {
    if worker.reset_accuracy() {
        worker.series.write(|url| metrics.prefix_index_disagreement.with_label_values(&[model, url]).set(0));
    }
}

/// A probe of a quarantined worker passed: its holdings route again.
pub(super) fn release(worker: &Worker, model: &str, metrics: &AlignmentMetrics) {
    if !worker.index_health.set_quarantined(false) {
        return;
    }
    worker.series.write(|url| metrics.quarantined.with_label_values(&[model, url]).set(0));
    metrics.repairs.with_label_values(&[model, Source::Probe.as_str(), "probe_passed", "release"]).inc();
    tracing::info!(worker = %worker.url, model, "alignment probe passed: the worker's quarantine ends, its KV index routes again");
}
