//! The load monitor: polls every routable worker's engine load on an interval (spread over it,
//! less often while an engine's answers repeat and nothing is routed to it), only while some
//! policy consumes loads, and publishes an immutable snapshot (worker → sample) that
//! the request path reads without locks. Each worker's entry is published as soon as it arrives,
//! so a hung worker delays nobody else.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use kvgate_policy::{LoadSample, WorkerId};
use prometheus::IntCounterVec;
use tokio::sync::watch;

use crate::load_snapshot::LoadSnapshot;
use crate::poll_schedule::{Due, PollSchedule, Visits};
use crate::registry::{PoolSnapshot, Registry};
use crate::worker::Worker;
use kvgate_gateway_core::clock::Clock;
use kvgate_gateway_core::metrics::LoadMetrics;
use kvgate_gateway_core::upstream::{get, GetError, Keep, Upstream, Via};
use kvgate_protocol::loads::{parse_sglang, parse_vllm};

/// Where a worker's loads come from, learned on first contact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Sglang,
    Vllm,
}

/// What the load monitor is built from.
pub struct LoadMonitor {
    pub registry: Arc<Registry>,
    /// Where it publishes (and how often it polls: `poll_interval_ms`).
    pub loads: Arc<LoadSnapshot>,
    /// A worker is polled over its own connections (`Via::Worker`).
    pub upstream: Upstream,
    /// The workers' API key (`--api-key`).
    pub bearer: Option<String>,
    /// A poll never waits longer than a health check would.
    pub health_timeout: Duration,
    pub clock: Clock,
    pub metrics: LoadMetrics,
    /// Largest load answer read (`--max-probe-answer-bytes`); past it the poll fails.
    pub max_answer_bytes: usize,
    /// `kvgate_oversized_answers_total{source}`.
    pub oversized: IntCounterVec,
    /// Poll whatever the policies need (per-worker overload protection reads every pool's loads).
    pub always_poll: bool,
}

/// Ticks per interval: each polls the workers then due, so polls spread over the interval.
const TICKS_PER_INTERVAL: u32 = 10;
/// An engine whose answers repeat while nothing is routed to it is polled less often, at most
/// 2^4 = 16 intervals apart; its sample is carried forward meanwhile (nothing this gateway sent
/// can have changed it), and it is polled one interval after its last poll once a request goes
/// to it. An engine another client loads is seen up to 16 intervals late while this gateway
/// sends it nothing (8 before: at 10,000 idle workers, 1,250 polls a second against 625).
const MAX_BACKOFF: u32 = 4;

impl LoadMonitor {
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let interval = Duration::from_millis(self.loads.poll_interval_ms);
        let mut ticker =
            tokio::time::interval((interval / TICKS_PER_INTERVAL).max(Duration::from_millis(10)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let sources: Arc<Mutex<HashMap<WorkerId, Source>>> = Arc::default();
        let mut schedule = PollSchedule::new(interval, MAX_BACKOFF);
        let mut registered = Registered::default();
        let mut visits = Visits::default();
        for tick in 0u32.. {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = shutdown.changed() => return,
            }
            let full_round = tick.is_multiple_of(TICKS_PER_INTERVAL);
            let tick = Tick { interval, full_round };
            poll_due(&self, &sources, &mut schedule, &mut registered, &mut visits, tick).await;
        }
    }
}

/// The poll interval, and whether this tick is the interval's first (`full_round`).
#[derive(Clone, Copy)]
struct Tick {
    interval: Duration,
    full_round: bool,
}

/// One tick. Once an interval (`full_round`): drop entries of workers that left or are not
/// routable (every entry while no policy reads loads; only when the registry, the fleet's
/// activity or the polling changed since), and carry forward the samples of quiet workers. Then poll the routable workers due, concurrently: found by visiting every worker
/// once an interval and whenever anything moved, else among those whose time came.
async fn poll_due(
    monitor: &LoadMonitor,
    sources: &Arc<Mutex<HashMap<WorkerId, Source>>>,
    schedule: &mut PollSchedule,
    registered: &mut Registered,
    visits: &mut Visits,
    Tick { interval, full_round }: Tick,
) {
    let polling = monitor.always_poll || monitor.registry.policies_need_loads();
    monitor.loads.set_active(polling);
    // Read before any worker's state: a change made after it is seen by the next tick.
    let activity = crate::worker::activity();
    let now = Instant::now();
    let snapshot = monitor.registry.snapshot();
    if full_round && registered.trim_due(&snapshot, activity, polling) {
        let routable: HashSet<WorkerId> = if polling {
            snapshot.workers.iter().filter(|w| w.is_routable(now)).map(|w| w.id).collect()
        } else {
            HashSet::new()
        };
        monitor.loads.retain(&routable);
        // Removed workers' remembered load formats go too (the map would otherwise grow with churn).
        let registered = registered.current(&monitor.registry);
        sources.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| registered.contains(id));
        schedule.retain(registered);
    }
    if full_round && polling {
        carry_forward(monitor, schedule, &snapshot.workers, registered.current(&monitor.registry));
    }
    if !polling {
        return;
    }
    // A poll never outlives the interval, and never waits longer than a health check would.
    let timeout = interval.min(monitor.health_timeout).max(Duration::from_millis(50));
    // A routable worker without a sample (just added, healthy again, its circuit closed again)
    // is polled within an interval whatever its back-off: a policy has no load to read for it.
    let published = monitor.loads.load();
    let every = visits.every_worker(&snapshot, activity, full_round);
    let visited: Vec<Arc<Worker>> = if every {
        snapshot.workers.clone()
    } else {
        schedule.due_by_time(now).iter().filter_map(|id| visits.by_id.get(id).cloned()).collect()
    };
    let mut attention = false;
    let mut pending: FuturesUnordered<_> = visited
        .iter()
        .filter_map(|worker| {
            if every {
                worker.settle();
            }
            let mark = worker.requests_begun();
            let routable = worker.is_routable(now);
            if routable && !published.contains_key(&worker.id) {
                schedule.hurry(worker.id);
                attention = true;
            }
            attention |= !routable;
            match schedule.due(worker.id, mark, now) {
                Due::NotYet => None,
                _ if !routable => None,
                due => Some(
                    poll_worker(monitor, sources, worker, timeout).map(move |answer| (answer, mark, due)),
                ),
            }
        })
        .collect();
    if every {
        visits.attention = attention;
    }
    drop(published);
    // Answers are published together once the tick's polls have all answered, or a tick after
    // the first unpublished one arrived: one copy of the snapshot per tick (a copy per burst of
    // answers, 10,000 entries at 10,000 workers, was most of an idle gateway's cost per poll),
    // and a hung worker delays the others' samples by a tick at most.
    let wait = (interval / TICKS_PER_INTERVAL).max(Duration::from_millis(10));
    let mut arrived = Vec::new();
    let mut publish_by: Option<tokio::time::Instant> = None;
    loop {
        let next = match publish_by {
            Some(deadline) => match tokio::time::timeout_at(deadline, pending.next()).await {
                Ok(next) => next,
                Err(_) => {
                    publish(monitor, registered, &mut arrived);
                    publish_by = None;
                    continue;
                }
            },
            None => pending.next().await,
        };
        let Some(((id, sample), mark, due)) = next else { break };
        let published = monitor.loads.load();
        let unchanged = due == Due::Quiet
            && sample.zip(published.get(&id)).is_some_and(|(new, old)| same_load(&new, old));
        drop(published);
        schedule.polled(id, mark, unchanged, Instant::now());
        if let Some(sample) = sample {
            arrived.push((id, sample));
            publish_by.get_or_insert_with(|| tokio::time::Instant::now() + wait);
        }
    }
    publish(monitor, registered, &mut arrived);
}

/// Whether two samples say the same but for when they were taken.
fn same_load(new: &LoadSample, old: &LoadSample) -> bool {
    LoadSample { fetched_at_ms: 0, ..*new } == LoadSample { fetched_at_ms: 0, ..*old }
}

/// The samples of quiet workers (backed off, nothing routed to them since their last poll)
/// stamped now once they are 1.5 intervals old (stale past 3; the full rounds that carry them
/// come an interval apart): what they last answered still holds as far as this gateway knows,
/// and a sample read as fresh keeps them in the policies' load terms. Every other round, not
/// every round: each carried sample is published, moved in a large pool's order and told to
/// the policy.
fn carry_forward(
    monitor: &LoadMonitor,
    schedule: &PollSchedule,
    workers: &[Arc<Worker>],
    registered: &HashSet<WorkerId>,
) {
    let now_ms = monitor.clock.now_ms();
    let carry_after_ms = monitor.loads.poll_interval_ms * 3 / 2;
    let published = monitor.loads.load();
    let carried: Vec<(WorkerId, LoadSample)> = workers
        .iter()
        .filter(|worker| schedule.quiet_since_last_poll(worker.id, worker.requests_begun()))
        .filter_map(|worker| published.get(&worker.id).map(|sample| (worker.id, *sample)))
        .filter(|(_, sample)| now_ms.saturating_sub(sample.fetched_at_ms) >= carry_after_ms)
        .map(|(id, sample)| (id, LoadSample { fetched_at_ms: now_ms.max(sample.fetched_at_ms), ..sample }))
        .collect();
    drop(published);
    if !carried.is_empty() {
        monitor.loads.publish(&carried, registered);
        let poll_ms = monitor.loads.poll_interval_ms;
        monitor.registry.snapshot().tell_load_reports(&carried, now_ms, poll_ms);
    }
}

/// The registered workers' ids, built again only when the registry published a new snapshot
/// (at 10,000 workers, building the set for every burst of answers was most of the monitor's
/// idle CPU).
#[derive(Default)]
struct Registered {
    snapshot: Option<Arc<PoolSnapshot>>,
    ids: HashSet<WorkerId>,
    /// The registry's snapshot, the fleet's activity and the polling at the last trim.
    trimmed: Option<(Arc<PoolSnapshot>, u64, bool)>,
}

impl Registered {
    /// Whether a full round trims the snapshot and the maps (anything they keep may have gone
    /// since the last trim), noted as the last trim if so.
    fn trim_due(&mut self, snapshot: &Arc<PoolSnapshot>, activity: u64, polling: bool) -> bool {
        let same = self.trimmed.as_ref().is_some_and(|(known, at, was)| {
            Arc::ptr_eq(known, snapshot) && *at == activity && *was == polling
        });
        if !same {
            self.trimmed = Some((snapshot.clone(), activity, polling));
        }
        !same
    }

    fn current(&mut self, registry: &Registry) -> &HashSet<WorkerId> {
        let snapshot = registry.snapshot();
        if !self.snapshot.as_ref().is_some_and(|known| Arc::ptr_eq(known, &snapshot)) {
            self.ids = snapshot.workers.iter().map(|w| w.id).collect();
            self.snapshot = Some(snapshot);
        }
        &self.ids
    }
}

/// Publish the samples that arrived, except those of workers removed meanwhile.
fn publish(monitor: &LoadMonitor, registered: &mut Registered, arrived: &mut Vec<(WorkerId, LoadSample)>) {
    if arrived.is_empty() {
        return;
    }
    monitor.loads.publish(arrived, registered.current(&monitor.registry));
    let (now_ms, poll_ms) = (monitor.clock.now_ms(), monitor.loads.poll_interval_ms);
    monitor.registry.snapshot().tell_load_reports(arrived, now_ms, poll_ms);
    arrived.clear();
}

async fn poll_worker(
    monitor: &LoadMonitor,
    sources: &Arc<Mutex<HashMap<WorkerId, Source>>>,
    worker: &Arc<Worker>,
    timeout: Duration,
) -> (WorkerId, Option<LoadSample>) {
    let known = sources.lock().unwrap_or_else(|p| p.into_inner()).get(&worker.id).copied();
    let started = Instant::now();
    // Stamped when the poll is sent: requests routed while it is in flight may or may not be in
    // the engine's answer, and the in-flight correction counts everything routed from here on.
    let sent_at_ms = monitor.clock.now_ms();
    let result = match known {
        Some(source) => fetch(monitor, worker, source, timeout).await,
        None => match fetch(monitor, worker, Source::Sglang, timeout).await {
            Ok(sample) => {
                remember(sources, worker.id, Source::Sglang);
                Ok(sample)
            }
            Err(sglang_error) => match fetch(monitor, worker, Source::Vllm, timeout).await {
                Ok(sample) => {
                    remember(sources, worker.id, Source::Vllm);
                    Ok(sample)
                }
                Err(vllm_error) => Err(format!("{sglang_error}; {vllm_error}")),
            },
        },
    };
    monitor.metrics.poll_duration.observe(started.elapsed().as_secs_f64());
    match result {
        Ok(mut sample) => {
            sample.fetched_at_ms = sent_at_ms;
            (worker.id, Some(sample))
        }
        Err(error) => {
            worker.series.write(|url| monitor.metrics.poll_failures.with_label_values(&[url]).inc());
            tracing::debug!(worker = %worker.url, %error, "load poll failed");
            (worker.id, None)
        }
    }
}

fn remember(sources: &Arc<Mutex<HashMap<WorkerId, Source>>>, id: WorkerId, source: Source) {
    sources.lock().unwrap_or_else(|p| p.into_inner()).insert(id, source);
}

async fn fetch(
    monitor: &LoadMonitor,
    worker: &Worker,
    source: Source,
    timeout: Duration,
) -> Result<LoadSample, String> {
    let path = match source {
        Source::Sglang => "/v1/loads",
        Source::Vllm => "/metrics",
    };
    let bearer = monitor.bearer.as_deref();
    let (limit, via) = (monitor.max_answer_bytes, Via::Worker(&worker.conns));
    let (status, body) = match get(&monitor.upstream, via, path, bearer, timeout, limit, Keep::Body).await {
        Ok(answer) => answer,
        Err(error @ GetError::Oversized { .. }) => {
            monitor.oversized.with_label_values(&["loads"]).inc();
            return Err(error.to_string());
        }
        Err(GetError::Failed(error)) => return Err(error),
    };
    if !status.is_success() {
        return Err(format!("GET {path} answered {status}"));
    }
    match source {
        Source::Sglang => parse_sglang(&body, worker.dp_rank),
        Source::Vllm => parse_vllm(&String::from_utf8_lossy(&body)),
    }
}

/// The snapshot as served at `GET /get_loads`.
pub fn snapshot_json(registry: &Registry, loads: &LoadSnapshot, clock: Clock) -> serde_json::Value {
    let now_ms = clock.now_ms();
    let polling = loads.is_active();
    let interval_ms = loads.poll_interval_ms;
    let loads = loads.load();
    let registry = registry.snapshot();
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
        "polling": polling,
        "interval_ms": interval_ms,
        "loads": entries,
    })
}

/// Refresh the per-worker snapshot-age gauges (called when /metrics is scraped).
pub fn update_age_gauges(registry: &Registry, loads: &LoadSnapshot, clock: Clock, metrics: &LoadMetrics) {
    let now_ms = clock.now_ms();
    let loads = loads.load();
    metrics.snapshot_age.reset();
    for worker in &registry.snapshot().workers {
        if let Some(load) = loads.get(&worker.id) {
            let age = now_ms.saturating_sub(load.fetched_at_ms) as f64 / 1000.0;
            worker.series.write(|url| metrics.snapshot_age.with_label_values(&[url]).set(age));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kvgate_policy::PolicyConfig;

    use super::*;
    use crate::registry::NewWorker;
    use crate::worker::CircuitSettings;
    use kvgate_gateway_core::metrics::Metrics;

    /// The snapshot is built from its parts alone: a registry, the load snapshot and a clock.
    #[test]
    fn get_loads_lists_registered_workers_and_forgets_removed_ones() {
        let circuit = CircuitSettings { enabled: false, failure_threshold: 1, open_duration: Duration::ZERO };
        let registry = Registry::new(
            PolicyConfig::default(),
            BTreeMap::new(),
            [None, None],
            circuit,
            Arc::new(Metrics::new()),
            16,
            100,
        );
        let new = |url: &str| NewWorker { url: url.into(), model: Some("m".into()), ..NewWorker::default() };
        let a = registry.add(new("http://127.0.0.1:1"), true).unwrap();
        let b = registry.add(new("http://127.0.0.1:2"), true).unwrap();
        let loads = LoadSnapshot::new(1000);
        let sample = LoadSample { token_usage: 0.5, ..LoadSample::default() };
        let registered: HashSet<WorkerId> = [a.id, b.id].into();
        loads.publish(&[(a.id, sample), (b.id, sample), (99, sample)], &registered);
        let listed = |loads: &LoadSnapshot| {
            let json = snapshot_json(&registry, loads, Clock::start());
            json["loads"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l["worker"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(listed(&loads), ["http://127.0.0.1:1", "http://127.0.0.1:2"], "99 was never registered");
        loads.forget(a.id);
        assert_eq!(listed(&loads), ["http://127.0.0.1:2"]);
        let json = snapshot_json(&registry, &loads, Clock::start());
        assert_eq!((json["polling"].as_bool(), json["interval_ms"].as_u64()), (Some(false), Some(1000)));
    }
}
