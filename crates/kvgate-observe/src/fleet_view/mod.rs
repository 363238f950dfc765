//! The fleet at a glance: `GET /v1/fleet` (JSON) and `GET /dashboard` (one HTML page polling it),
//! served where the admin API is and behind its key. Built from a narrow read-only handle
//! (`FleetView`: the registry, the load snapshot, the metrics, the decision log, the clock),
//! never the whole state. At 1,000 workers the answer stays small: per pool aggregates and a
//! KV-usage histogram, the top workers (troubled ones first, then the busiest), the last
//! decisions.

mod rates;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvgate_policy::{LoadSample, PolicyConfig, Reason};
use prometheus::core::Collector;
use prometheus::IntCounterVec;
use serde::{Deserialize, Serialize};

use crate::kv_map::{KvMap, KvMapView};
use kvgate_fleet::load_snapshot::LoadSnapshot;
use kvgate_fleet::registry::{ModelPool, Registry};
use kvgate_fleet::worker::{CircuitState, Worker};
use kvgate_gateway_core::auth::check_admin_browser;
use kvgate_gateway_core::clock::Clock;
use kvgate_gateway_core::decisions::{DecisionLog, TallyView};
use kvgate_gateway_core::metrics::Metrics;
use rates::{RateHistory, Totals};

/// The page: inline CSS and JS, no external asset, no build step.
const DASHBOARD_HTML: &str = include_str!("dashboard.html");

/// Workers listed by default, and at most (`?workers=N`).
const DEFAULT_WORKERS: usize = 20;
const MAX_WORKERS: usize = 10_000;
/// Buckets of the per-pool KV usage histogram (0-10%, ..., 90-100%).
const KV_BUCKETS: usize = 10;

/// What the fleet page reads, each part shared with the gateway (read only here).
pub struct FleetView {
    pub registry: Arc<Registry>,
    pub loads: Arc<LoadSnapshot>,
    pub metrics: Arc<Metrics>,
    pub decisions: Arc<DecisionLog>,
    /// The fleet's KV, hot prefixes, tenants' shares and the plots' history (computed in the
    /// background).
    pub kv_map: Arc<KvMap>,
    pub clock: Clock,
    /// `--admin-api-key`: required as on `/workers` (Bearer, or Basic with the key as password).
    pub admin_api_key: Option<String>,
    rates: Mutex<RateHistory>,
}

impl FleetView {
    pub fn new(
        registry: Arc<Registry>,
        loads: Arc<LoadSnapshot>,
        metrics: Arc<Metrics>,
        decisions: Arc<DecisionLog>,
        kv_map: Arc<KvMap>,
        clock: Clock,
        admin_api_key: Option<String>,
    ) -> Self {
        let rates = Mutex::new(RateHistory::new(Instant::now()));
        Self { registry, loads, metrics, decisions, kv_map, clock, admin_api_key, rates }
    }
}

#[derive(Deserialize)]
pub struct FleetQuery {
    /// How many workers to list (default 20).
    workers: Option<usize>,
}

/// `GET /dashboard`.
pub async fn dashboard(State(view): State<Arc<FleetView>>, headers: HeaderMap) -> Response {
    if let Some(refused) = refusal(&view, &headers) {
        return refused;
    }
    let mut response = DASHBOARD_HTML.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    // The page loads nothing from anywhere: its own inline script and style, fetches to itself.
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
        ),
    );
    response
}

/// `GET /v1/fleet`.
pub async fn fleet(
    State(view): State<Arc<FleetView>>,
    Query(query): Query<FleetQuery>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = refusal(&view, &headers) {
        return refused;
    }
    let shown = query.workers.unwrap_or(DEFAULT_WORKERS).min(MAX_WORKERS);
    let mut response = Json(snapshot(&view, shown)).into_response();
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The answer to a request without the admin key (as `/workers` requires it), if it has none; a
/// browser is asked for it (Basic, the key as the password) so the page opens where a key is set.
fn refusal(view: &FleetView, headers: &HeaderMap) -> Option<Response> {
    let error = check_admin_browser(view.admin_api_key.as_deref(), headers).err()?;
    let mut response = error.into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic realm=\"kvgate admin\""));
    Some(response)
}

#[derive(Serialize)]
pub struct Fleet {
    /// The gateway's clock (milliseconds since it started).
    pub now_ms: u64,
    /// The window the decision rates are over, in seconds.
    pub rate_window_secs: f64,
    pub totals: FleetTotals,
    pub pools: Vec<PoolView>,
    pub workers: WorkerList,
    /// The last routing decisions, newest first.
    pub recent_decisions: Vec<DecisionView>,
    /// The fleet's KV (each pool's engines, copies, tiers and hottest prefixes), the tenants'
    /// use of it, and the plots' points; computed every few seconds off the request path.
    pub kv: KvMapView,
}

#[derive(Serialize, Default)]
pub struct FleetTotals {
    pub workers: usize,
    pub healthy: usize,
    pub routable: usize,
    pub open_circuits: usize,
    pub in_flight: u64,
    pub decisions_per_sec: f64,
}

#[derive(Serialize)]
pub struct PoolView {
    pub model: String,
    pub role: &'static str,
    pub policy: &'static str,
    pub workers: usize,
    pub healthy: usize,
    pub routable: usize,
    pub in_flight: Spread<u64>,
    /// Engine-reported KV usage of the workers with a load sample.
    pub kv_usage: KvUsage,
    /// Prefill tokens queued on the engines (their `num_waiting_uncached_tokens`).
    pub queued_prefill_tokens: QueuedPrefill,
    pub decisions_per_sec: BTreeMap<String, f64>,
    pub decisions_total: BTreeMap<String, u64>,
    /// Mean prefix match rate of the chosen worker and the best available, over the pool's
    /// prefix-aware decisions since the workers joined.
    pub hit_rate: Option<HitRate>,
    pub imbalance: ImbalanceView,
    /// The closed loop: tokens the index predicted cached vs what the engines reported.
    pub closed_loop: Option<ClosedLoop>,
}

#[derive(Serialize, Default, Clone, Copy)]
pub struct Spread<T> {
    pub sum: T,
    pub min: T,
    pub max: T,
}

#[derive(Serialize)]
pub struct KvUsage {
    pub sampled: usize,
    pub min: Option<f64>,
    pub mean: Option<f64>,
    pub max: Option<f64>,
    /// Workers per tenth of KV usage.
    pub histogram: [usize; KV_BUCKETS],
}

#[derive(Serialize, Default)]
pub struct QueuedPrefill {
    pub sum: u64,
    pub max: u64,
}

#[derive(Serialize, Clone, Copy)]
pub struct HitRate {
    pub decisions: u64,
    pub chosen: f64,
    pub best: f64,
}

/// The three imbalance terms on the pool's current state, beside their thresholds, and which
/// imbalance reasons the policy gave over the rate window (the term that fired).
#[derive(Serialize)]
pub struct ImbalanceView {
    /// The highest KV usage vs `--overload-token-usage-threshold` (None without a fresh
    /// sample of every routable worker: a partial snapshot never drives the KV terms).
    pub overload: Term,
    /// Highest minus lowest KV usage vs `--balance-token-usage-threshold`.
    pub kv_spread: Term,
    /// Most minus fewest in flight vs `--balance-abs-threshold` (and the ratio vs `--balance-rel-threshold`).
    pub count: CountTerm,
    /// The imbalance reasons decided per second over the window (empty: none fired).
    pub firing: BTreeMap<String, f64>,
}

#[derive(Serialize)]
pub struct Term {
    pub value: Option<f64>,
    pub threshold: f64,
}

#[derive(Serialize)]
pub struct CountTerm {
    pub value: u64,
    pub threshold: f64,
    pub ratio: Option<f64>,
    pub rel_threshold: f64,
}

#[derive(Serialize, Default, Clone, Copy)]
pub struct ClosedLoop {
    pub predicted_tokens: u64,
    pub engine_cached_tokens: u64,
}

#[derive(Serialize)]
pub struct WorkerList {
    pub total: usize,
    /// Troubled workers first (unhealthy, circuit not closed, events not flowing), then by
    /// in-flight and KV usage, highest first.
    pub order: &'static str,
    pub rows: Vec<WorkerRow>,
}

#[derive(Serialize)]
pub struct WorkerRow {
    pub id: u32,
    pub url: String,
    pub model: Option<String>,
    pub role: &'static str,
    pub healthy: bool,
    pub circuit: CircuitState,
    pub in_flight: u64,
    pub kv_usage: Option<f64>,
    pub queued_prefill_tokens: Option<u64>,
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    /// Age of the worker's load sample.
    pub load_age_ms: Option<u64>,
    pub events: Option<EventsView>,
    pub hit_rate: Option<HitRate>,
    pub closed_loop: Option<ClosedLoop>,
    /// The alignment probe's last verdict and the quarantine (absent until probed).
    pub alignment: Option<AlignmentRow>,
}

#[derive(Serialize)]
pub struct AlignmentRow {
    /// `passed`, `failed` or `inconclusive`.
    pub outcome: &'static str,
    pub cause: Option<&'static str>,
    pub age_ms: Option<u64>,
    pub quarantined: bool,
}

#[derive(Serialize)]
pub struct EventsView {
    pub flowing: bool,
    pub live_ranks: usize,
    pub ranks: usize,
    pub batches: u64,
}

#[derive(Serialize)]
pub struct DecisionView {
    pub age_ms: u64,
    pub model: Option<String>,
    pub role: &'static str,
    pub worker: String,
    pub reason: &'static str,
    pub index: Option<&'static str>,
    pub chosen_match: Option<f64>,
    pub best_match: Option<f64>,
    /// kv_aware's predicted time to first token, term by term, in milliseconds.
    pub predicted_ms: Option<BTreeMap<&'static str, f64>>,
    /// kv_aware: the predicted time to first token on the runner-up (the candidate of lowest
    /// cost after the chosen one), in milliseconds.
    pub runner_up_ms: Option<f64>,
}

/// A counter family's values by their labels (one pass over its series).
fn counter_values(family: &IntCounterVec) -> Vec<(HashMap<String, String>, u64)> {
    family
        .collect()
        .iter()
        .flat_map(|gathered| gathered.get_metric().iter())
        .map(|metric| {
            let labels =
                metric.get_label().iter().map(|pair| (pair.name().to_string(), pair.value().to_string()));
            (labels.collect(), metric.get_counter().get_value() as u64)
        })
        .collect()
}

fn label<'a>(labels: &'a HashMap<String, String>, name: &str) -> &'a str {
    labels.get(name).map_or("", String::as_str)
}

/// Decisions so far by (model, role, reason), from the decision counters.
fn decision_totals(metrics: &Metrics) -> Totals {
    let mut totals = Totals::new();
    for (labels, count) in counter_values(&metrics.decisions) {
        let key = (label(&labels, "model").to_string(), "regular", label(&labels, "reason").to_string());
        *totals.entry(key).or_default() += count;
    }
    for (labels, count) in counter_values(&metrics.pd_decisions) {
        let role = match label(&labels, "role") {
            "prefill" => "prefill",
            _ => "decode",
        };
        let key = (label(&labels, "model").to_string(), role, label(&labels, "reason").to_string());
        *totals.entry(key).or_default() += count;
    }
    totals
}

/// Per worker URL: the closed loop's counters summed over models.
fn closed_loop_by_worker(metrics: &Metrics) -> HashMap<String, ClosedLoop> {
    let mut by_worker: HashMap<String, ClosedLoop> = HashMap::new();
    for (labels, count) in counter_values(&metrics.prefix_predicted_tokens) {
        by_worker.entry(label(&labels, "worker").to_string()).or_default().predicted_tokens += count;
    }
    for (labels, count) in counter_values(&metrics.prefix_engine_cached_tokens) {
        by_worker.entry(label(&labels, "worker").to_string()).or_default().engine_cached_tokens += count;
    }
    by_worker
}

fn batches_by_worker(metrics: &Metrics) -> HashMap<String, u64> {
    let mut batches = HashMap::new();
    for (labels, count) in counter_values(&metrics.kv_events.batches) {
        *batches.entry(label(&labels, "worker").to_string()).or_default() += count;
    }
    batches
}

fn hit_rate(tally: TallyView) -> Option<HitRate> {
    tally.means().map(|(chosen, best)| HitRate { decisions: tally.matched, chosen, best })
}

/// The sample when it is fresh enough to drive the KV terms (three poll intervals, as the policies).
fn fresh(load: Option<&LoadSample>, now_ms: u64, poll_interval_ms: u64) -> Option<LoadSample> {
    load.copied().filter(|load| {
        now_ms.saturating_sub(load.fetched_at_ms) <= poll_interval_ms.saturating_mul(3)
            && load.token_usage.is_finite()
    })
}

/// The whole answer of `GET /v1/fleet`, listing `shown` workers.
pub fn snapshot(view: &FleetView, shown: usize) -> Fleet {
    let now = Instant::now();
    let now_ms = view.clock.now_ms();
    let registry = view.registry.snapshot();
    let loads = view.loads.load();
    let totals = decision_totals(&view.metrics);
    let (window, rates) = view.rates.lock().unwrap_or_else(|p| p.into_inner()).rates(now, &totals);
    let closed_loop = closed_loop_by_worker(&view.metrics);
    let batches = batches_by_worker(&view.metrics);

    let mut fleet_totals = FleetTotals { workers: registry.workers.len(), ..FleetTotals::default() };
    fleet_totals.decisions_per_sec = rates.values().sum();
    for worker in &registry.workers {
        fleet_totals.healthy += usize::from(worker.is_healthy());
        fleet_totals.routable += usize::from(worker.is_routable(now));
        fleet_totals.open_circuits += usize::from(worker.circuit.state(now) != CircuitState::Closed);
        fleet_totals.in_flight += worker.in_flight();
    }
    let pools = registry
        .pools()
        .map(|pool| {
            pool_view(
                pool,
                PoolInputs {
                    now,
                    now_ms,
                    loads: &loads,
                    poll: view.loads.poll_interval_ms,
                    rates: &rates,
                    totals: &totals,
                    closed_loop: &closed_loop,
                },
            )
        })
        .collect();

    let mut ranked: Vec<&Arc<Worker>> = registry.workers.iter().collect();
    let kv_of = |worker: &Worker| loads.get(&worker.id).map_or(0.0, |load| load.token_usage);
    let troubled = |worker: &Worker| {
        !worker.is_healthy()
            || worker.circuit.state(now) != CircuitState::Closed
            || (worker.kv_events.is_some() && !worker.kv_events_flowing())
            || worker.index_health.quarantined()
            || worker.index_health.report().is_some_and(|report| report.cause().is_some())
    };
    ranked.sort_by(|a, b| {
        troubled(b)
            .cmp(&troubled(a))
            .then(b.in_flight().cmp(&a.in_flight()))
            .then(kv_of(b).total_cmp(&kv_of(a)))
            .then(a.url.cmp(&b.url))
    });
    let rows = ranked
        .into_iter()
        .take(shown)
        .map(|worker| {
            let load = loads.get(&worker.id);
            WorkerRow {
                id: worker.id,
                url: worker.url.clone(),
                model: worker.model().map(str::to_string),
                role: worker.role.as_str(),
                healthy: worker.is_healthy(),
                circuit: worker.circuit.state(now),
                in_flight: worker.in_flight(),
                kv_usage: load.map(|l| l.token_usage),
                queued_prefill_tokens: load.map(|l| l.num_waiting_uncached_tokens),
                running: load.map(|l| l.num_running_reqs),
                waiting: load.map(|l| l.num_waiting_reqs),
                load_age_ms: load.map(|l| now_ms.saturating_sub(l.fetched_at_ms)),
                events: worker.kv_events.as_ref().map(|source| EventsView {
                    flowing: worker.kv_events_flowing(),
                    live_ranks: worker.kv_live_ranks(),
                    ranks: source.ranks.len(),
                    batches: batches.get(&worker.url).copied().unwrap_or(0),
                }),
                hit_rate: hit_rate(worker.routed.view()),
                closed_loop: closed_loop.get(&worker.url).copied(),
                alignment: alignment_row(worker, now_ms),
            }
        })
        .collect();

    let by_id: HashMap<u32, &Arc<Worker>> = registry.workers.iter().map(|w| (w.id, w)).collect();
    let recent_decisions = view
        .decisions
        .recent()
        .into_iter()
        .map(|record| {
            let worker = by_id.get(&record.decision.worker);
            let decision = record.decision;
            DecisionView {
                age_ms: now_ms.saturating_sub(record.at_ms),
                model: worker.and_then(|w| w.model()).map(str::to_string),
                role: record.role.as_str(),
                worker: worker.map_or_else(|| format!("(removed #{})", decision.worker), |w| w.url.clone()),
                reason: decision.reason.as_str(),
                index: decision.index.map(|index| index.as_str()),
                chosen_match: decision.matches.map(|m| m.chosen_match_rate),
                best_match: decision.matches.map(|m| m.best_match_rate),
                predicted_ms: decision.predicted.map(|predicted| {
                    kvgate_policy::PredictedTtft::TERMS
                        .into_iter()
                        .zip(predicted.terms())
                        .map(|(term, seconds)| (term, seconds * 1e3))
                        .collect()
                }),
                runner_up_ms: decision.predicted.and_then(|predicted| predicted.runner_up_s).map(|s| s * 1e3),
            }
        })
        .collect();

    Fleet {
        now_ms,
        rate_window_secs: window.as_secs_f64(),
        totals: fleet_totals,
        pools,
        workers: WorkerList {
            total: registry.workers.len(),
            order: "troubled first, then in_flight and kv_usage, highest first",
            rows,
        },
        recent_decisions,
        kv: KvMapView::clone(&view.kv_map.view()),
    }
}

/// A worker's alignment, as its row shows it.
fn alignment_row(worker: &Worker, now_ms: u64) -> Option<AlignmentRow> {
    let report = worker.index_health.report();
    let quarantined = worker.index_health.quarantined();
    if report.is_none() && !quarantined {
        return None;
    }
    let outcome = match report.as_ref().map(|report| report.verdict) {
        Some(kvgate_index::Verdict::Passed) => "passed",
        Some(kvgate_index::Verdict::Failed(_)) => "failed",
        Some(kvgate_index::Verdict::Inconclusive) | None => "inconclusive",
    };
    Some(AlignmentRow {
        outcome,
        cause: report.as_ref().and_then(|report| report.cause()).map(|cause| cause.as_str()),
        age_ms: report.map(|report| now_ms.saturating_sub(report.at_ms)),
        quarantined,
    })
}

struct PoolInputs<'a> {
    now: Instant,
    now_ms: u64,
    loads: &'a HashMap<u32, LoadSample>,
    poll: u64,
    rates: &'a BTreeMap<(String, &'static str, String), f64>,
    totals: &'a Totals,
    closed_loop: &'a HashMap<String, ClosedLoop>,
}

const IMBALANCE_REASONS: [Reason; 3] =
    [Reason::ImbalanceOverload, Reason::ImbalanceKvSpread, Reason::ImbalanceCount];

fn pool_view(pool: &ModelPool, inputs: PoolInputs<'_>) -> PoolView {
    let PoolInputs { now, now_ms, loads, poll, rates, totals, closed_loop } = inputs;
    let role = pool.role.as_str();
    let mine = |key: &(String, &'static str, String)| key.0 == pool.model && key.1 == role;
    let decisions_per_sec: BTreeMap<String, f64> =
        rates.iter().filter(|(key, _)| mine(key)).map(|(key, rate)| (key.2.clone(), *rate)).collect();
    let decisions_total =
        totals.iter().filter(|(key, _)| mine(key)).map(|(key, count)| (key.2.clone(), *count)).collect();

    let routable: Vec<&Arc<Worker>> = pool.workers.iter().filter(|w| w.is_routable(now)).collect();
    let in_flight: Vec<u64> = routable.iter().map(|w| w.in_flight()).collect();
    let mut in_flight_spread = Spread::<u64>::default();
    if let (Some(lo), Some(hi)) = (in_flight.iter().min(), in_flight.iter().max()) {
        in_flight_spread = Spread { sum: in_flight.iter().sum(), min: *lo, max: *hi };
    }

    let mut histogram = [0usize; KV_BUCKETS];
    let mut usages = Vec::new();
    let mut queued = QueuedPrefill::default();
    let mut tally = TallyView::default();
    let mut loop_sum: Option<ClosedLoop> = None;
    for worker in &pool.workers {
        tally.add(worker.routed.view());
        if let Some(counts) = closed_loop.get(&worker.url) {
            let sum = loop_sum.get_or_insert_with(ClosedLoop::default);
            sum.predicted_tokens += counts.predicted_tokens;
            sum.engine_cached_tokens += counts.engine_cached_tokens;
        }
        let Some(load) = loads.get(&worker.id) else { continue };
        if load.token_usage.is_finite() {
            let usage = load.token_usage.clamp(0.0, 1.0);
            histogram[((usage * KV_BUCKETS as f64) as usize).min(KV_BUCKETS - 1)] += 1;
            usages.push(usage);
        }
        queued.sum += load.num_waiting_uncached_tokens;
        queued.max = queued.max.max(load.num_waiting_uncached_tokens);
    }
    let kv_min = usages.iter().copied().reduce(f64::min);
    let kv_max = usages.iter().copied().reduce(f64::max);
    let kv_mean = (!usages.is_empty()).then(|| usages.iter().sum::<f64>() / usages.len() as f64);

    // The KV terms on a fresh sample of every routable worker only, as the policies see them.
    let fresh_usage: Option<Vec<f64>> = match routable.is_empty() {
        true => None,
        false => {
            routable.iter().map(|w| fresh(loads.get(&w.id), now_ms, poll).map(|l| l.token_usage)).collect()
        }
    };
    let (fresh_min, fresh_max) = match &fresh_usage {
        Some(kv) => (kv.iter().copied().reduce(f64::min), kv.iter().copied().reduce(f64::max)),
        None => (None, None),
    };
    let config: &PolicyConfig = &pool.config;
    let firing = IMBALANCE_REASONS
        .iter()
        .filter_map(|reason| {
            let rate = decisions_per_sec.get(reason.as_str()).copied().unwrap_or(0.0);
            (rate > 0.0).then(|| (reason.as_str().to_string(), rate))
        })
        .collect();
    let imbalance = ImbalanceView {
        overload: Term { value: fresh_max, threshold: config.overload_token_usage_threshold },
        kv_spread: Term {
            value: fresh_min.zip(fresh_max).map(|(lo, hi)| hi - lo),
            threshold: config.balance_token_usage_threshold,
        },
        count: CountTerm {
            value: in_flight_spread.max - in_flight_spread.min,
            threshold: config.balance_abs_threshold,
            ratio: (in_flight_spread.min > 0)
                .then(|| in_flight_spread.max as f64 / in_flight_spread.min as f64),
            rel_threshold: config.balance_rel_threshold,
        },
        firing,
    };

    PoolView {
        model: pool.model.clone(),
        role,
        policy: pool.policy.name(),
        workers: pool.workers.len(),
        healthy: pool.workers.iter().filter(|w| w.is_healthy()).count(),
        routable: routable.len(),
        in_flight: in_flight_spread,
        kv_usage: KvUsage { sampled: usages.len(), min: kv_min, mean: kv_mean, max: kv_max, histogram },
        queued_prefill_tokens: queued,
        decisions_per_sec,
        decisions_total,
        hit_rate: hit_rate(tally),
        imbalance,
        closed_loop: loop_sum,
    }
}
