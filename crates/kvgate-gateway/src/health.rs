//! The background health loop: probes every worker on an interval, applies the failure/success
//! thresholds, closes half-open circuits whose worker passes a probe, learns models that were not
//! known yet, and refreshes the health and circuit gauges.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::sync::watch;

use crate::admin::{learn_model, probe};
use crate::state::SharedState;
use crate::worker::Worker;

pub async fn run(state: SharedState, mut shutdown: watch::Receiver<bool>) {
    let mut interval =
        tokio::time::interval(Duration::from_secs_f64(state.config.health_check_interval_secs));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await; // workers were probed when they were added
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shutdown.changed() => return,
        }
        check_all(&state).await;
    }
}

/// One round over every registered worker, concurrently.
pub async fn check_all(state: &SharedState) {
    let snapshot = state.registry.snapshot();
    let learned = join_all(snapshot.workers.iter().map(|w| check_worker(state, w))).await;
    if learned.into_iter().any(|model_learned| model_learned) {
        state.registry.refresh();
    }
    let now = Instant::now();
    for worker in &snapshot.workers {
        state.metrics.worker_healthy.with_label_values(&[&worker.url]).set(worker.is_healthy() as i64);
        state
            .metrics
            .circuit_state
            .with_label_values(&[&worker.url])
            .set(worker.circuit.state(now).as_metric());
    }
}

/// Returns true when the worker's model was learned in this round.
async fn check_worker(state: &SharedState, worker: &Arc<Worker>) -> bool {
    let mut learned = false;
    if worker.model().is_none() {
        if let Ok(model) = learn_model(state, &worker.url).await {
            tracing::info!(worker = %worker.url, %model, "learned the worker's model");
            learned = worker.set_model(model);
        }
    }
    if state.config.disable_health_check {
        return learned;
    }
    let passed = probe(state, &worker.url).await;
    // Active half-open probing: a worker whose circuit waits half-open may get no request for a
    // long time (e.g. its prefixes are cached elsewhere); a passed probe closes it.
    // An open one turns half-open at the first passing probe (a restarted engine need not wait
    // out --cb-timeout-duration-secs), and closes at the next.
    if passed {
        match worker.circuit.state(Instant::now()) {
            crate::worker::CircuitState::HalfOpen if worker.circuit.record_success() => {
                tracing::info!(worker = %worker.url, "circuit closed: the half-open worker passed a health probe");
                state.metrics.circuit_state.with_label_values(&[&worker.url]).set(0);
            }
            crate::worker::CircuitState::Open if worker.circuit.probe_passed() => {
                tracing::info!(worker = %worker.url, "circuit half-open: the worker passed a health probe");
                state.metrics.circuit_state.with_label_values(&[&worker.url]).set(2);
            }
            _ => {}
        }
    }
    let config = &state.config;
    if let Some(healthy) =
        worker.record_health(passed, config.health_failure_threshold, config.health_success_threshold)
    {
        if healthy {
            tracing::info!(worker = %worker.url, "worker is healthy again");
        } else {
            crate::monitor::forget(state, worker.id);
            tracing::warn!(worker = %worker.url, "worker marked unhealthy");
        }
    }
    learned
}
