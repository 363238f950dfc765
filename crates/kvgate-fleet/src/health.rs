//! The background health loop: probes every worker on an interval, applies the failure/success
//! thresholds, closes half-open circuits whose worker passes a probe, learns models that were not
//! known yet, and refreshes the health and circuit gauges.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::sync::watch;

use crate::load_snapshot::LoadSnapshot;
use crate::registry::Registry;
use crate::worker::{CircuitState, Worker};
use kvgate_gateway_core::metrics::Metrics;
use kvgate_gateway_core::upstream::HealthCheck;

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

impl HealthLoop {
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut interval = tokio::time::interval(self.interval);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval.tick().await; // workers were probed when they were added
        loop {
            tokio::select! {
                _ = interval.tick() => {}
                _ = shutdown.changed() => return,
            }
            self.check_all().await;
        }
    }

    /// One round over every registered worker, concurrently.
    async fn check_all(&self) {
        let snapshot = self.registry.snapshot();
        let learned = join_all(snapshot.workers.iter().map(|w| self.check_worker(w))).await;
        if learned.into_iter().any(|model_learned| model_learned) {
            self.registry.refresh();
        }
        let now = Instant::now();
        for worker in &snapshot.workers {
            let circuit = worker.circuit.state(now).as_metric();
            worker.series.write(|url| {
                self.metrics.worker_healthy.with_label_values(&[url]).set(worker.is_healthy() as i64);
                self.metrics.circuit_state.with_label_values(&[url]).set(circuit);
            });
        }
    }

    /// Returns true when the worker's model was learned in this round.
    async fn check_worker(&self, worker: &Arc<Worker>) -> bool {
        let mut learned = false;
        if worker.model().is_none() {
            if let Ok(served) = self.check.discover_model(&worker.address).await {
                tracing::info!(worker = %worker.url, model = %served.id, "learned the worker's model");
                if let Some(len) = served.max_model_len {
                    worker.set_max_model_len(len);
                }
                learned = worker.set_model(served.id);
            }
        }
        if self.probes_disabled {
            return learned;
        }
        let passed = self.check.probe(&worker.address).await;
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
        if let Some(healthy) = worker.record_health(passed, self.failure_threshold, self.success_threshold) {
            if healthy {
                tracing::info!(worker = %worker.url, "worker is healthy again");
            } else {
                self.loads.forget(worker.id);
                tracing::warn!(worker = %worker.url, "worker marked unhealthy");
            }
        }
        learned
    }
}
