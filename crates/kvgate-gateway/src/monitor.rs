//! The load monitor: polls every routable worker's engine load concurrently on an interval, only
//! while some policy consumes loads, and publishes an immutable snapshot (worker → sample) that
//! the request path reads without locks. Each worker's entry is published as soon as it arrives,
//! so a hung worker delays nobody else.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use kvgate_policy::{LoadSample, WorkerId};
use tokio::sync::watch;

use crate::loads::{parse_sglang, parse_vllm};
use crate::state::SharedState;
use crate::upstream::{get, GetError, Keep};
use crate::worker::Worker;

/// Where a worker's loads come from, learned on first contact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Sglang,
    Vllm,
}

pub async fn run(state: SharedState, mut shutdown: watch::Receiver<bool>) {
    let interval = Duration::from_millis(state.load_poll_interval_ms);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sources: Arc<Mutex<HashMap<WorkerId, Source>>> = Arc::default();
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        poll_once(&state, &sources, interval).await;
    }
}

/// One round: drop entries of workers that left, then poll every routable worker concurrently.
async fn poll_once(state: &SharedState, sources: &Arc<Mutex<HashMap<WorkerId, Source>>>, interval: Duration) {
    let polling = state.registry.policies_need_loads();
    state.monitor_active.store(polling, std::sync::atomic::Ordering::Relaxed);
    let now = Instant::now();
    let snapshot = state.registry.snapshot();
    let routable: Vec<Arc<Worker>> = if polling {
        snapshot.workers.iter().filter(|w| w.is_routable(now)).cloned().collect()
    } else {
        Vec::new()
    };
    let routable_ids: HashSet<WorkerId> = routable.iter().map(|w| w.id).collect();
    state.loads.rcu(|loads| {
        let mut kept = (**loads).clone();
        kept.retain(|id, _| routable_ids.contains(id));
        kept
    });
    // Removed workers' remembered load formats go too (the map would otherwise grow with churn).
    let registered: HashSet<WorkerId> = snapshot.workers.iter().map(|w| w.id).collect();
    sources.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| registered.contains(id));
    if routable.is_empty() {
        return;
    }
    // A poll never outlives the interval, and never waits longer than a health check would.
    let timeout = interval.min(state.health_timeout()).max(Duration::from_millis(50));
    let mut pending: FuturesUnordered<_> =
        routable.iter().map(|worker| poll_worker(state, sources, worker, timeout)).collect();
    // Answers are published as they arrive, a burst at a time: one copy of the snapshot per
    // burst (not per worker, which made a round quadratic in the fleet size), and a hung worker
    // still delays nobody.
    let mut arrived = Vec::new();
    while let Some(answer) = pending.next().await {
        arrived.extend(answer);
        while let Some(Some(answer)) = pending.next().now_or_never() {
            arrived.extend(answer);
        }
        publish(state, &mut arrived);
    }
}

/// Publish the samples that arrived, except those of workers removed meanwhile.
fn publish(state: &SharedState, arrived: &mut Vec<(WorkerId, LoadSample)>) {
    if arrived.is_empty() {
        return;
    }
    let registered: HashSet<WorkerId> = state.registry.snapshot().workers.iter().map(|w| w.id).collect();
    state.loads.rcu(|loads| {
        let mut next = (**loads).clone();
        for (id, sample) in arrived.iter() {
            if registered.contains(id) {
                next.insert(*id, *sample);
            }
        }
        next
    });
    arrived.clear();
}

async fn poll_worker(
    state: &SharedState,
    sources: &Arc<Mutex<HashMap<WorkerId, Source>>>,
    worker: &Arc<Worker>,
    timeout: Duration,
) -> Option<(WorkerId, LoadSample)> {
    let known = sources.lock().unwrap_or_else(|p| p.into_inner()).get(&worker.id).copied();
    let started = Instant::now();
    // Stamped when the poll is sent: requests routed while it is in flight may or may not be in
    // the engine's answer, and the in-flight correction counts everything routed from here on.
    let sent_at_ms = state.now_ms();
    let result = match known {
        Some(source) => fetch(state, worker, source, timeout).await,
        None => match fetch(state, worker, Source::Sglang, timeout).await {
            Ok(sample) => {
                remember(sources, worker.id, Source::Sglang);
                Ok(sample)
            }
            Err(sglang_error) => match fetch(state, worker, Source::Vllm, timeout).await {
                Ok(sample) => {
                    remember(sources, worker.id, Source::Vllm);
                    Ok(sample)
                }
                Err(vllm_error) => Err(format!("{sglang_error}; {vllm_error}")),
            },
        },
    };
    state.metrics.load_poll_duration.observe(started.elapsed().as_secs_f64());
    match result {
        Ok(mut sample) => {
            sample.fetched_at_ms = sent_at_ms;
            Some((worker.id, sample))
        }
        Err(error) => {
            state.metrics.load_poll_failures.with_label_values(&[&worker.url]).inc();
            tracing::debug!(worker = %worker.url, %error, "load poll failed");
            None
        }
    }
}

fn remember(sources: &Arc<Mutex<HashMap<WorkerId, Source>>>, id: WorkerId, source: Source) {
    sources.lock().unwrap_or_else(|p| p.into_inner()).insert(id, source);
}

async fn fetch(
    state: &SharedState,
    worker: &Worker,
    source: Source,
    timeout: Duration,
) -> Result<LoadSample, String> {
    let path = match source {
        Source::Sglang => "/v1/loads",
        Source::Vllm => "/metrics",
    };
    let bearer = state.config.api_key.as_deref();
    let url = format!("{}{path}", worker.url);
    let limit = state.config.max_probe_answer_bytes;
    let (status, body) = match get(&state.client, &url, bearer, timeout, limit, Keep::Body).await {
        Ok(answer) => answer,
        Err(error @ GetError::Oversized { .. }) => {
            state.metrics.count_oversized("loads");
            return Err(error.to_string());
        }
        Err(GetError::Failed(error)) => return Err(error),
    };
    if !status.is_success() {
        return Err(format!("GET {path} answered {status}"));
    }
    match source {
        Source::Sglang => parse_sglang(&body),
        Source::Vllm => parse_vllm(&String::from_utf8_lossy(&body)),
    }
}

/// Forget a worker's entry at once (it was removed).
pub fn forget(state: &SharedState, worker: WorkerId) {
    state.loads.rcu(|loads| {
        let mut next = (**loads).clone();
        next.remove(&worker);
        next
    });
}

/// The snapshot as served at `GET /get_loads`.
pub fn snapshot_json(state: &SharedState) -> serde_json::Value {
    let now_ms = state.now_ms();
    let loads = state.loads.load();
    let registry = state.registry.snapshot();
    let mut entries: Vec<serde_json::Value> = registry
        .workers
        .iter()
        .filter_map(|w| loads.get(&w.id).map(|l| (w, l)))
        .map(|(worker, load)| {
            serde_json::json!({
                "worker": worker.url,
                "model_id": worker.model(),
                "age_ms": now_ms.saturating_sub(load.fetched_at_ms),
                "token_usage": load.token_usage,
                "num_running_reqs": load.num_running_reqs,
                "num_waiting_reqs": load.num_waiting_reqs,
                "num_waiting_uncached_tokens": load.num_waiting_uncached_tokens,
                "max_total_num_tokens": load.max_total_num_tokens,
                "gen_throughput": load.gen_throughput,
            })
        })
        .collect();
    entries.sort_by(|a, b| a["worker"].as_str().cmp(&b["worker"].as_str()));
    serde_json::json!({
        "polling": state.monitor_active.load(std::sync::atomic::Ordering::Relaxed),
        "interval_ms": state.load_poll_interval_ms,
        "loads": entries,
    })
}

/// Refresh the per-worker snapshot-age gauges (called when /metrics is scraped).
pub fn update_age_gauges(state: &SharedState) {
    let now_ms = state.now_ms();
    let loads = state.loads.load();
    state.metrics.load_snapshot_age.reset();
    for worker in &state.registry.snapshot().workers {
        if let Some(load) = loads.get(&worker.id) {
            let age = now_ms.saturating_sub(load.fetched_at_ms) as f64 / 1000.0;
            state.metrics.load_snapshot_age.with_label_values(&[&worker.url]).set(age);
        }
    }
}
