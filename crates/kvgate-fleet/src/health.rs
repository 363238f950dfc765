//! The background health loop: probes every worker on an interval (spread over it, less often
//! while its probes keep passing, not at all while it answers live traffic), applies the
//! failure/success thresholds, closes half-open circuits whose worker passes a probe, learns
//! models that were not known yet, and refreshes the health and circuit gauges.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use tokio::sync::watch;

use crate::load_snapshot::LoadSnapshot;
use crate::poll_schedule::{Due, PollSchedule, Visits};
use crate::registry::Registry;
use crate::worker::{CircuitState, Worker};
use kvgate_gateway_core::metrics::Metrics;
use kvgate_gateway_core::upstream::{HealthCheck, Via};

/// What the health loop is built from.
pub struct HealthLoop {
    pub registry: Arc<Registry>,
    /// An unhealthy worker's load sample is dropped at once.
    pub loads: Arc<LoadSnapshot>,
    pub check: HealthCheck,
    /// The workers' health and circuit gauges.
    pub metrics: Arc<Metrics>,
    pub interval: Duration,
    /// Consecutive failed probes that mark a worker unhealthy, and passed ones that mark it
    /// healthy again.
    pub failure_threshold: u32,
    pub success_threshold: u32,
    /// `--disable-health-check`: models are still learned, nobody is probed.
    pub probes_disabled: bool,
}

/// Ticks per interval: each probes the workers then due, so probes spread over the interval.
const TICKS_PER_INTERVAL: u32 = 10;
/// A worker whose probes keep passing is probed less often, at most 2^2 = 4 intervals apart
/// (traffic it answers, passive health, and a request's failure, the circuit, see it sooner).
const MAX_BACKOFF: u32 = 2;

impl HealthLoop {
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let tick = (self.interval / TICKS_PER_INTERVAL).max(Duration::from_millis(1));
        let mut interval = tokio::time::interval(tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval.tick().await; // workers were probed when they were added
        let mut schedule = PollSchedule::new(self.interval, MAX_BACKOFF);
        // Each tick's probes run as one batch beside the later ticks' (a slow or hung worker
        // holds back no tick).
        let mut batches = FuturesUnordered::new();
        let mut visits = Visits::default();
        let mut round = 0u32;
        loop {
            tokio::select! {
                _ = interval.tick() => {
                    round = round.wrapping_add(1);
                    let full_round = round.is_multiple_of(TICKS_PER_INTERVAL);
                    let due = self.start_due(&mut schedule, &mut visits, full_round);
                    if !due.is_empty() {
                        batches.push(self.check_batch(due));
                    }
                }
                Some(outcomes) = batches.next() => self.apply(&mut schedule, outcomes),
                _ = shutdown.changed() => return,
            }
        }
    }

    /// The workers due now, each marked in flight: a worker that answered live traffic since its
    /// last probe passes without one. Once an interval (`full_round`) every worker's gauges are
    /// refreshed and removed workers forgotten. Every worker is visited once an interval and
    /// whenever anything moved, else only those whose time came (as the load monitor's ticks).
    fn start_due(
        &self,
        schedule: &mut PollSchedule,
        visits: &mut Visits,
        full_round: bool,
    ) -> Vec<(Arc<Worker>, u64)> {
        // Read before any worker's state: a change made after it is seen by the next tick.
        let activity = crate::worker::activity();
        let snapshot = self.registry.snapshot();
        let now = Instant::now();
        let every = visits.every_worker(&snapshot, activity, full_round);
        let visited: Vec<Arc<Worker>> = if every {
            snapshot.workers.clone()
        } else {
            schedule.due_by_time(now).iter().filter_map(|id| visits.by_id.get(id).cloned()).collect()
        };
        let mut attention = false;
        let mut due = Vec::new();
        for worker in &visited {
            if every {
                worker.settle();
            }
            let answers = worker.answers();
            // A worker out of its steady state (unhealthy, its model unknown, its circuit open or
            // half-open) is probed every interval: a half-open circuit closes at its next passed
            // probe, not after a back-off.
            let steady = worker.is_healthy()
                && worker.model().is_some()
                && worker.circuit.state(now) == CircuitState::Closed;
            if !steady {
                schedule.hurry(worker.id);
                attention = true;
            }
            match schedule.due(worker.id, answers, now) {
                Due::NotYet => {}
                Due::Active if steady => {
                    worker.record_health(true, self.failure_threshold, self.success_threshold);
                    schedule.polled(worker.id, answers, true, now);
                }
                _ => {
                    schedule.started(worker.id);
                    due.push((worker.clone(), answers));
                }
            }
        }
        if every {
            visits.attention = attention;
        }
        if full_round {
            schedule.retain(&snapshot.workers.iter().map(|w| w.id).collect());
            snapshot.workers.iter().for_each(|worker| self.write_gauges(worker, now));
        }
        due
    }

    /// Probe a tick's workers concurrently: each with its mark, whether its model was learned and
    /// whether the probe found it as before.
    async fn check_batch(&self, due: Vec<(Arc<Worker>, u64)>) -> Vec<(Arc<Worker>, u64, bool, bool)> {
        let outcomes = join_all(due.iter().map(|(worker, _)| self.check_worker(worker))).await;
        due.into_iter()
            .zip(outcomes)
            .map(|((worker, mark), (learned, quiet))| (worker, mark, learned, quiet))
            .collect()
    }

    fn apply(&self, schedule: &mut PollSchedule, outcomes: Vec<(Arc<Worker>, u64, bool, bool)>) {
        let now = Instant::now();
        let mut learned = false;
        for (worker, answers, model_learned, quiet) in &outcomes {
            learned |= model_learned;
            schedule.polled(worker.id, *answers, *quiet, now);
            self.write_gauges(worker, now);
        }
        if learned {
            self.registry.refresh();
        }
    }

    fn write_gauges(&self, worker: &Worker, now: Instant) {
        let circuit = worker.circuit.state(now).as_metric();
        worker.series.write(|url| {
            self.metrics.worker_healthy.with_label_values(&[url]).set(worker.is_healthy() as i64);
            self.metrics.circuit_state.with_label_values(&[url]).set(circuit);
        });
    }

    /// Whether the worker's model was learned in this round, and whether the probe found it as
    /// before (healthy, its model known, its health unchanged).
    async fn check_worker(&self, worker: &Arc<Worker>) -> (bool, bool) {
        let mut learned = false;
        if worker.model().is_none() {
            if let Ok(served) = self.check.discover_model(Via::Worker(&worker.conns)).await {
                tracing::info!(worker = %worker.url, model = %served.id, "learned the worker's model");
                if let Some(len) = served.max_model_len {
                    worker.set_max_model_len(len);
                }
                learned = worker.set_model(served.id);
            }
        }
        if self.probes_disabled {
            return (learned, worker.model().is_some());
        }
        let passed = self.check.probe(Via::Worker(&worker.conns)).await;
        // Active half-open probing: a worker whose circuit waits half-open may get no request for a
        // long time (e.g. its prefixes are cached elsewhere); a passed probe closes it.
        // An open one turns half-open at the first passing probe (a restarted engine need not wait
        // out --cb-timeout-duration-secs), and closes at the next.
        if passed {
            match worker.circuit.state(Instant::now()) {
                CircuitState::HalfOpen if worker.circuit.record_success() => {
                    tracing::info!(worker = %worker.url, "circuit closed: the half-open worker passed a health probe");
                    worker.series.write(|url| self.metrics.circuit_state.with_label_values(&[url]).set(0));
                }
                CircuitState::Open if worker.circuit.probe_passed() => {
                    tracing::info!(worker = %worker.url, "circuit half-open: the worker passed a health probe");
                    worker.series.write(|url| self.metrics.circuit_state.with_label_values(&[url]).set(2));
                }
                _ => {}
            }
        }
        let changed = worker.record_health(passed, self.failure_threshold, self.success_threshold);
        match changed {
            Some(true) => tracing::info!(worker = %worker.url, "worker is healthy again"),
            Some(false) => {
                self.loads.forget(worker.id);
                tracing::warn!(worker = %worker.url, "worker marked unhealthy");
            }
            None => {}
        }
        let closed = worker.circuit.state(Instant::now()) == CircuitState::Closed;
        let quiet = passed && changed.is_none() && closed && worker.is_healthy() && worker.model().is_some();
        (learned, quiet)
    }
}
