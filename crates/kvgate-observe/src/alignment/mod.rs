//! The alignment probe and the index repair: one background loop, built from the parts it needs
//! (the registry, the tokenizer, the background client, the metrics, the clock).
//!
//! Every [`TICK`] it acts on the disagreements the closed loop raised since (`repair.rs`), then
//! probes the workers that are due, one at a time (`probe.rs`): a worker joining is due as soon
//! as its KV events flow (or [`JOIN_GRACE`] after it was first seen, to name events that never
//! do), then every `--alignment-probe-interval-secs`, and [`REPROBE_AFTER`] after a repair
//! (once per failure: a cause that persists is probed again at the interval). Only regular
//! workers whose pool routes on the exact index with KV events are probed, and only with a
//! tokenizer: elsewhere there is no index to align.
//!
//! Cost, bounded: at most one probe in flight for the whole gateway; a probe is at most five
//! requests of one output token (the previous probe's prompt once, the completion's
//! [`canary::COMPLETION_TOKENS`]-token prompt twice, the chat's ~90-token prompt twice), about
//! 600 prompt tokens of which the engine serves about 400 from its cache; each worker is probed
//! once per interval, plus once at its join and once after each repair.

mod canary;
mod probe;
mod repair;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_index::{IndexRepair, Verdict};
use kvgate_policy::WorkerId;
use tokio::sync::watch;

use crate::kv_map::KvMap;
use kvgate_fleet::registry::{ModelPool, PoolSnapshot, Registry};
use kvgate_fleet::tokenize::Tokenization;
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::clock::Clock;
use kvgate_gateway_core::metrics::Metrics;
use kvgate_gateway_core::upstream::HttpClient;
use kvgate_protocol::role::WorkerRole;
use probe::Prober;
use repair::{Finding, Source};

/// How often the loop looks for work.
const TICK: Duration = Duration::from_millis(250);
/// A worker whose KV events do not flow is probed this long after it was first seen (at most
/// the interval), which names `events_not_flowing`.
const JOIN_GRACE: Duration = Duration::from_secs(10);
/// After a repair, the next probe comes this soon (the resync's replay has run by then).
const REPROBE_AFTER: Duration = Duration::from_secs(1);
/// Each probe request's deadline.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a first answer's KV events may take to reach the index.
const EVENTS_WAIT: Duration = Duration::from_secs(3);

/// The options the loop runs with.
#[derive(Clone, Copy, Debug)]
pub struct AlignmentSettings {
    /// `--alignment-probe`.
    pub probe: bool,
    /// `--alignment-probe-interval-secs`.
    pub interval: Duration,
    /// `--index-repair`.
    pub repair: IndexRepair,
    /// `--max-tokenize-chars` (the canaries are tokenized as client requests are).
    pub max_tokenize_chars: usize,
}

/// The loop's parts.
pub struct Alignment {
    pub registry: Arc<Registry>,
    /// Without a tokenizer nothing is probed (the closed loop's findings are still acted on).
    pub tokenization: Option<Arc<Tokenization>>,
    pub client: HttpClient,
    /// `--api-key`, sent to workers as the proxy sends it.
    pub bearer: Option<String>,
    pub metrics: Arc<Metrics>,
    /// Told the probe's own blocks (left out of the fleet's KV map).
    pub kv_map: Arc<KvMap>,
    pub clock: Clock,
    pub settings: AlignmentSettings,
}

/// When a worker is probed next.
struct Due {
    first_seen: Instant,
    /// `None` until its first probe.
    next: Option<Instant>,
}

impl Alignment {
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut schedule: HashMap<WorkerId, Due> = HashMap::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            let snapshot = self.registry.snapshot();
            schedule.retain(|id, _| snapshot.workers.iter().any(|worker| worker.id == *id));
            for worker in &snapshot.workers {
                if let Some(cause) = worker.index_health.take_disagreement() {
                    self.on_disagreement(worker, cause);
                }
            }
            let Some(tokenization) = self.tokenization.as_ref().filter(|_| self.settings.probe) else {
                continue;
            };
            let prober = Prober {
                client: &self.client,
                bearer: self.bearer.as_deref(),
                tokenization,
                metrics: &self.metrics,
                max_chars: self.settings.max_tokenize_chars,
                timeout: REQUEST_TIMEOUT,
                events_wait: EVENTS_WAIT,
                kv_map: &self.kv_map,
            };
            for worker in &snapshot.workers {
                let Some(pool) = probed_pool(worker, &snapshot) else { continue };
                let now = Instant::now();
                let due = schedule.entry(worker.id).or_insert(Due { first_seen: now, next: None });
                let grace = JOIN_GRACE.min(self.settings.interval);
                let is_due = match due.next {
                    None => worker.kv_events_flowing() || now >= due.first_seen + grace,
                    Some(at) => now >= at,
                };
                if !(is_due || worker.index_health.take_probe_request()) {
                    continue;
                }
                let probed = prober.probe(worker, pool, || self.clock.now_ms()).await;
                let soon = self.conclude(worker, pool, probed);
                let wait = if soon { REPROBE_AFTER } else { self.settings.interval };
                due.next = Some(Instant::now() + wait);
                if *shutdown.borrow() {
                    return;
                }
            }
        }
    }

    /// The closed loop raised a disagreement on `worker`: the repair acts, and a probe checks.
    fn on_disagreement(&self, worker: &Worker, cause: &'static str) {
        let model = worker.model().unwrap_or("");
        let advice = "the closed loop's predicted and engine-reported cached tokens disagree (see its \
                      warning and /workers' index_accuracy)";
        let finding = Finding { worker, model, source: Source::ClosedLoop, cause, advice };
        repair::repair(&finding, self.settings.repair, &self.metrics);
        worker.index_health.request_probe();
    }

    /// Records a probe's report, counts it, and acts on it; returns whether the worker should be
    /// probed again soon (a repair was just made for a new failure).
    fn conclude(&self, worker: &Worker, pool: &ModelPool, probed: probe::Probed) -> bool {
        let model = pool.model.as_str();
        let metrics = &self.metrics.alignment;
        let report = probed.report;
        let earlier = worker.index_health.report();
        worker.index_health.set_sentinel(probed.sentinel);
        let result = match report.verdict {
            Verdict::Passed => "passed",
            Verdict::Failed(_) => "failed",
            Verdict::Inconclusive => "inconclusive",
        };
        worker.series.write(|url| {
            metrics.probes.with_label_values(&[model, url, result]).inc();
            match report.verdict {
                Verdict::Passed => metrics.aligned.with_label_values(&[model, url]).set(1),
                Verdict::Failed(cause) => {
                    metrics.failures.with_label_values(&[model, url, cause.as_str()]).inc();
                    metrics.aligned.with_label_values(&[model, url]).set(0);
                }
                Verdict::Inconclusive => {}
            }
        });
        let soon = match report.verdict {
            Verdict::Passed => {
                tracing::debug!(worker = %worker.url, model, "alignment probe passed");
                repair::release(worker, model, metrics);
                false
            }
            Verdict::Failed(cause) => {
                let finding = Finding {
                    worker,
                    model,
                    source: Source::Probe,
                    cause: cause.as_str(),
                    advice: cause.advice(),
                };
                let repaired = repair::repair(&finding, self.settings.repair, &self.metrics);
                let repeated = earlier.and_then(|earlier| earlier.cause()) == Some(cause);
                repaired && !repeated && self.settings.repair != IndexRepair::Warn
            }
            Verdict::Inconclusive => {
                tracing::info!(worker = %worker.url, model, error = report.error.as_deref().unwrap_or(""), "alignment probe inconclusive");
                false
            }
        };
        worker.index_health.set_report(report);
        soon
    }
}

/// The pool a worker is probed in: a regular worker publishing KV events, routable, whose pool
/// routes on the exact index.
fn probed_pool<'a>(worker: &Worker, snapshot: &'a PoolSnapshot) -> Option<&'a Arc<ModelPool>> {
    if worker.role != WorkerRole::Regular || worker.kv_events.is_none() || !worker.is_routable(Instant::now())
    {
        return None;
    }
    snapshot.pool_of(worker).filter(|pool| pool.has_kv_events && pool.config.uses_exact_index())
}
