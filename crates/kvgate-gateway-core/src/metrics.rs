//! Prometheus metrics of the gateway: requests, latencies, in-flight, retries, worker health,
//! circuit state and routing decisions, and each subsystem's own families (load monitor, KV
//! events, admission, replica sync, the OTLP exporter), rendered as text at GET /metrics.

use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

use kvgate_policy::{IndexKind, PdPath, Reason};
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

mod alignment;
mod otlp;
mod replica_sync;

pub use alignment::AlignmentMetrics;
pub use otlp::OtlpMetrics;
pub use replica_sync::ReplicaSyncMetrics;

use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::role::WorkerRole;

/// Removes every series of `family` whose `worker` label is `url`, whatever its other labels.
fn remove_labelled<T: prometheus::core::MetricVecBuilder>(
    family: &prometheus::core::MetricVec<T>,
    url: &str,
) {
    use prometheus::core::Collector;
    for gathered in family.collect() {
        for metric in gathered.get_metric() {
            let labels: HashMap<&str, &str> =
                metric.get_label().iter().map(|pair| (pair.name(), pair.value())).collect();
            if labels.get("worker") == Some(&url) {
                let _ = family.remove(&labels);
            }
        }
    }
}

/// Each series of a counter family by the value of its label `label`, summed over its other
/// labels.
pub fn counter_by_label(family: &IntCounterVec, label: &str) -> Vec<(String, u64)> {
    use prometheus::core::Collector;
    let mut sums: HashMap<String, u64> = HashMap::new();
    for gathered in family.collect() {
        for metric in gathered.get_metric() {
            let value =
                metric.get_label().iter().find(|pair| pair.name() == label).map_or("", |pair| pair.value());
            *sums.entry(value.to_string()).or_default() += metric.get_counter().get_value() as u64;
        }
    }
    sums.into_iter().collect()
}

/// Latency buckets in seconds, from sub-millisecond proxy overhead to long generations.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0,
];

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub ttfb: HistogramVec,
    pub duration: HistogramVec,
    pub in_flight: IntGaugeVec,
    pub client_connections: IntGauge,
    pub retries: IntCounterVec,
    /// Streams whose engine failed mid-answer, by endpoint and what became of them
    /// (`--migrate-streams`).
    pub stream_migrations: IntCounterVec,
    /// Workers left out of a decision by per-worker overload protection, by model.
    pub overload_left_out: IntCounterVec,
    pub upstream_failures: IntCounterVec,
    pub worker_healthy: IntGaugeVec,
    pub circuit_state: IntGaugeVec,
    pub decisions: IntCounterVec,
    pub pd_decisions: IntCounterVec,
    pub pd_requests: IntCounterVec,
    pub pd_transfer_fallbacks: IntCounterVec,
    pub match_rate: HistogramVec,
    pub predicted_ttft: HistogramVec,
    pub tokenize_failures: IntCounterVec,
    /// The closed loop (`accuracy.rs`): per model and worker.
    pub prefix_predicted_tokens: IntCounterVec,
    /// Prompt tokens of the answers the closed loop read (the hit rate's denominator).
    pub prefix_prompt_tokens: IntCounterVec,
    pub prefix_engine_cached_tokens: IntCounterVec,
    pub prefix_missed_cached_tokens: IntCounterVec,
    pub prefix_evicted_after_routing_tokens: IntCounterVec,
    pub prefix_evicted_after_routing_requests: IntCounterVec,
    pub prefix_cached_difference: HistogramVec,
    pub prefix_index_disagreement: IntGaugeVec,
    pub prefix_model_index_disagreement: IntGaugeVec,
    pub tokenize_limited: IntCounterVec,
    pub tokenizer_pending: IntGauge,
    /// Answers of workers and peers past their bound, by source.
    pub oversized_answers: IntCounterVec,
    /// The subsystems' own families, each handed to its subsystem when it is built.
    pub loads: LoadMetrics,
    pub kv_events: KvEventsMetrics,
    pub admission: AdmissionMetrics,
    pub replica_sync: ReplicaSyncMetrics,
    pub otlp: OtlpMetrics,
    /// The alignment probe and the index repairs.
    pub alignment: AlignmentMetrics,
    /// Kubernetes service discovery events: joined, left, relist, error.
    pub discovery_events: IntCounterVec,
    /// Per-endpoint latency series, resolved once (label hashing on every request showed in O1).
    ttfb_series: [OnceLock<Histogram>; Endpoint::ALL.len()],
    duration_series: [OnceLock<Histogram>; Endpoint::ALL.len()],
}

/// The load monitor's families.
#[derive(Clone)]
pub struct LoadMetrics {
    pub poll_duration: Histogram,
    pub poll_failures: IntCounterVec,
    pub snapshot_age: GaugeVec,
}

/// The KV-event subscriptions' families, and the size of the exact index they feed.
#[derive(Clone)]
pub struct KvEventsMetrics {
    pub batches: IntCounterVec,
    pub malformed: IntCounterVec,
    pub refused: IntCounterVec,
    pub gaps: IntCounterVec,
    pub restarts: IntCounterVec,
    pub live_ranks: IntGaugeVec,
    pub index_blocks: IntGaugeVec,
}

/// The admission queue's families.
#[derive(Clone)]
pub struct AdmissionMetrics {
    pub queue_depth: IntGauge,
    pub rejected: IntCounterVec,
    /// Per tenant (named ones; the rest as `other`) and class.
    pub tenant_requests: IntCounterVec,
    pub tenant_tokens: IntCounterVec,
    /// Engine-reported cached tokens of each tenant's requests (those the closed loop reads).
    pub tenant_cached_tokens: IntCounterVec,
    pub tenant_rejected: IntCounterVec,
    pub tenant_queue_wait: HistogramVec,
    pub client_keys_reloads: IntCounterVec,
}

/// One tenant label's series for one class, resolved once (`kvgate_admission` keeps them per
/// label): what every admitted request touches, without hashing labels or allocating.
#[derive(Clone, Debug)]
pub struct TenantClassSeries {
    pub queue_wait: Histogram,
    pub requests: IntCounter,
    pub tokens: IntCounter,
}

impl AdmissionMetrics {
    /// The series of tenant label `tenant` and class `class`.
    pub fn tenant_class_series(&self, tenant: &str, class: &str) -> TenantClassSeries {
        TenantClassSeries {
            queue_wait: self.tenant_queue_wait.with_label_values(&[tenant, class]),
            requests: self.tenant_requests.with_label_values(&[tenant, class]),
            tokens: self.tenant_tokens.with_label_values(&[tenant, class]),
        }
    }
}

/// One worker's series: those its requests touch, resolved when it is registered, and every
/// other one labelled by its URL, made only through [`WorkerSeries::write`]. Once the worker is
/// removed ([`Metrics::remove_worker`]) nothing writes its series again, whatever loop still
/// holds it (a health round, a load poll, a KV-event subscription, a request finishing), so a
/// removed worker's series go with it.
#[derive(Debug)]
pub struct WorkerSeries {
    url: String,
    pub in_flight: IntGauge,
    /// `kvgate_requests_total{status="200"}` per endpoint; other statuses take the slow path.
    ok_requests: [OnceLock<IntCounter>; Endpoint::ALL.len()],
    /// False once the worker is removed: writers hold it shared, removal exclusively.
    live: RwLock<bool>,
    /// The closed loop's series of the worker, each made on its first use.
    pub closed_loop: ClosedLoopSeries,
}

/// One worker's `kvgate_prefix_*{model, worker}` series the closed loop writes on every answer it
/// reads, each resolved once ([`WorkerSeries::resolved`]) instead of by label per answer.
#[derive(Debug, Default)]
pub struct ClosedLoopSeries {
    pub predicted_tokens: OnceLock<IntCounter>,
    pub evicted_after_routing_tokens: OnceLock<IntCounter>,
    pub evicted_after_routing_requests: OnceLock<IntCounter>,
    pub prompt_tokens: OnceLock<IntCounter>,
    pub engine_cached_tokens: OnceLock<IntCounter>,
    pub missed_cached_tokens: OnceLock<IntCounter>,
    pub cached_difference: OnceLock<Histogram>,
}

impl WorkerSeries {
    /// The series in `slot`, made by `make` with the worker's URL on first use; `None` when it
    /// was not made before the worker was removed (a series resolved earlier is detached by the
    /// removal: nobody exports it).
    pub fn resolved<'s, T>(&self, slot: &'s OnceLock<T>, make: impl FnOnce(&str) -> T) -> Option<&'s T> {
        if let Some(series) = slot.get() {
            return Some(series);
        }
        let live = self.live.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        (*live).then(|| slot.get_or_init(|| make(&self.url)))
    }

    /// Runs `write` with the worker's URL (the `worker` label), unless the worker was removed.
    pub fn write(&self, write: impl FnOnce(&str)) {
        let live = self.live.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        if *live {
            write(&self.url);
        }
    }
}

/// The `index` label of a decision: none, approximate, exact.
const INDEX_LABELS: [&str; 3] = ["none", "approximate", "exact"];

fn index_slot(index: Option<IndexKind>) -> usize {
    match index {
        None => 0,
        Some(IndexKind::Approximate) => 1,
        Some(IndexKind::Exact) => 2,
    }
}

/// The series of one model's routing decisions, resolved on first use.
#[derive(Default)]
pub struct PoolSeries {
    /// By reason, index and path (a regular pool's use the first path slot only).
    decisions: [[[OnceLock<IntCounter>; PdPath::ALL.len()]; INDEX_LABELS.len()]; Reason::ALL.len()],
    match_best: OnceLock<Histogram>,
    match_chosen: OnceLock<Histogram>,
    predicted: [OnceLock<Histogram>; PREDICTED_TERMS.len()],
}

/// The `term` label of `kvgate_predicted_ttft_seconds`.
const PREDICTED_TERMS: [&str; kvgate_policy::PredictedTtft::TERMS.len()] =
    kvgate_policy::PredictedTtft::TERMS;

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: T) -> T {
    registry.register(Box::new(metric.clone())).expect("metric names are unique and valid");
    metric
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            register(&registry, IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            register(&registry, IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
        };
        let histogram = |name: &str, help: &str, labels: &[&str], buckets: Vec<f64>| {
            register(
                &registry,
                HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
                    .expect("valid metric"),
            )
        };
        Self {
            requests: counter(
                "kvgate_requests_total",
                "Proxied requests by endpoint, final status and worker (worker=\"none\" when none was chosen).",
                &["endpoint", "status", "worker"],
            ),
            ttfb: histogram(
                "kvgate_request_ttfb_seconds",
                "Time from request arrival to the first response body byte from the worker.",
                &["endpoint"],
                LATENCY_BUCKETS.to_vec(),
            ),
            duration: histogram(
                "kvgate_request_duration_seconds",
                "Time from request arrival to the end of the response body.",
                &["endpoint"],
                LATENCY_BUCKETS.to_vec(),
            ),
            in_flight: gauge("kvgate_worker_in_flight", "Requests in flight per worker.", &["worker"]),
            client_connections: register(
                &registry,
                IntGauge::new(
                    "kvgate_client_connections",
                    "Client connections open on the gateway's listener (at most --max-connections).",
                )
                .expect("valid metric"),
            ),
            retries: counter(
                "kvgate_retries_total",
                "Requests retried on another worker, by endpoint.",
                &["endpoint"],
            ),
            stream_migrations: counter(
                "kvgate_stream_migrations_total",
                "Streams whose engine failed mid-answer (--migrate-streams), by endpoint and result: \
                 `resumed` (another engine took the continuation and the stream went on), `failed` \
                 (no engine took it), `exhausted` (past --max-stream-migrations), `not_resumable` (the \
                 request cannot be continued: several choices, echo, token-id prompts, tool calls, \
                 reasoning, structured output), `off` (--migrate-streams false).",
                &["endpoint", "result"],
            ),
            overload_left_out: counter(
                "kvgate_worker_overload_left_out_total",
                "Workers left out of a routing decision for their waiting requests or KV usage \
                 (--worker-overload-waiting-requests, --worker-overload-token-usage), by model.",
                &["model"],
            ),
            upstream_failures: counter(
                "kvgate_upstream_failures_total",
                "Failed attempts per worker: connect (connection error), status (502/503/504/5xx), timeout.",
                &["worker", "kind"],
            ),
            worker_healthy: gauge("kvgate_worker_healthy", "1 when the worker passes health checks.", &["worker"]),
            circuit_state: gauge(
                "kvgate_worker_circuit_state",
                "Circuit breaker state per worker: 0 closed, 1 open, 2 half-open.",
                &["worker"],
            ),
            decisions: counter(
                "kvgate_routing_decisions_total",
                "Routing decisions by model, reason and the prefix index consulted (index=exact: the engines' KV events; approximate: the tree of what was routed where; none).",
                &["model", "reason", "index"],
            ),
            pd_decisions: counter(
                "kvgate_pd_decisions_total",
                "Routing decisions of the prefill and decode sides of a disaggregated fleet, by model, role, reason, prefix index and path (`pair`: prefilled on a prefill engine; `in_place`: on the decode engine, --pd-conditional).",
                &["model", "role", "reason", "index", "path"],
            ),
            pd_requests: counter(
                "kvgate_pd_requests_total",
                "Requests sent to each side of a disaggregated pair, by role and outcome (HTTP status, unreachable, timeout, error).",
                &["role", "status"],
            ),
            pd_transfer_fallbacks: counter(
                "kvgate_pd_transfer_fallbacks_total",
                "Pairs whose decode engine answered a failed KV transfer (a server error other than 503) and whose request was sent again, plain, in place on the decode engine the decode side's policy picks (--pd-fallback-in-place), by model.",
                &["model"],
            ),
            match_rate: histogram(
                "kvgate_prefix_match_rate",
                "Prefix match rate per cache-aware decision: best available on any healthy worker (kind=best) vs on the chosen worker (kind=chosen).",
                &["model", "kind"],
                vec![0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0],
            ),
            predicted_ttft: histogram(
                "kvgate_predicted_ttft_seconds",
                "kv_aware's predicted time to first token on the chosen worker, by term: queue (prefill work ahead), prefill (the request's uncached tokens), decode (running requests), kv (KV pressure), total; and the costs it adds to choose: recompute (its prefill's cost to the requests behind it), stall (to the requests decoding there), cost (the sum minimised).",
                &["model", "term"],
                LATENCY_BUCKETS.to_vec(),
            ),
            tokenize_failures: counter(
                "kvgate_tokenize_failures_total",
                "Requests the gateway could not tokenize (routed on their text instead), by endpoint.",
                &["endpoint"],
            ),
            prefix_predicted_tokens: counter(
                "kvgate_prefix_predicted_tokens_total",
                "Prompt tokens the prefix index predicted cached on the worker each answered request went to (requests routed on token ids), by model and worker.",
                &["model", "worker"],
            ),
            prefix_engine_cached_tokens: counter(
                "kvgate_prefix_engine_cached_tokens_total",
                "Prompt tokens the engine reported served from its cache (usage.prompt_tokens_details.cached_tokens, SGLang's meta_info.cached_tokens) on the same requests, by model and worker.",
                &["model", "worker"],
            ),
            prefix_missed_cached_tokens: counter(
                "kvgate_prefix_missed_cached_tokens_total",
                "Of the engine-reported cached tokens, those beyond what the index predicted on the same request (the engine's hits the index did not see), by model and worker; over kvgate_prefix_engine_cached_tokens_total: the missed share.",
                &["model", "worker"],
            ),
            prefix_evicted_after_routing_tokens: counter(
                "kvgate_prefix_evicted_after_routing_tokens_total",
                "Predicted cached tokens the engine did not serve because its caches lost blocks between the routing decision and the answer (KV pressure), by model and worker: counted apart from a disagreement.",
                &["model", "worker"],
            ),
            prefix_evicted_after_routing_requests: counter(
                "kvgate_prefix_evicted_after_routing_requests_total",
                "Answered requests that lost predicted cached tokens to eviction after routing, by model and worker.",
                &["model", "worker"],
            ),
            prefix_cached_difference: histogram(
                "kvgate_prefix_cached_tokens_difference_ratio",
                "Per answered request: (engine-reported cached tokens - predicted) / prompt tokens, by model and worker. Near 0: the index agrees with the engine; negative: it overclaims; positive: it misses what the engine holds.",
                &["model", "worker"],
                vec![-1.0, -0.5, -0.2, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0],
            ),
            prefix_prompt_tokens: counter(
                "kvgate_prefix_prompt_tokens_total",
                "Prompt tokens of the answers the closed loop compared (the engine's usage.prompt_tokens where \
                 it says): kvgate_prefix_engine_cached_tokens_total over it is the engines' hit rate.",
                &["model", "worker"],
            ),
            prefix_index_disagreement: gauge(
                "kvgate_prefix_index_disagreement",
                "1 while the index and the engine disagree persistently on a worker (more than 10% of prompt tokens, a quarter of at least 10 claimed requests wrong, or 10% of the engine's cached tokens missed over at least 5 requests, over its last 100 answered requests; the cause is in the log and in /workers), else 0.",
                &["model", "worker"],
            ),
            prefix_model_index_disagreement: gauge(
                "kvgate_prefix_model_index_disagreement",
                "1 while the index and the engines disagree persistently over the model's last 500 answered requests (every worker's; the same bounds, the missed one at 5% of the engines' cached tokens over at least 15 requests; the cause is in the log and in /workers' models), else 0.",
                &["model"],
            ),
            tokenize_limited: counter(
                "kvgate_tokenize_limited_total",
                "Requests not tokenized whole, by endpoint and reason: prefix (longer than --max-tokenize-chars: routed on the ids of its first characters), queue_full (the tokenizer threads' queue was full: routed on its text), queue_timeout (its tokens were not ready within --tokenizer-queue-timeout-secs: routed on its text).",
                &["endpoint", "reason"],
            ),
            tokenizer_pending: register(
                &registry,
                IntGauge::new(
                    "kvgate_tokenizer_pending",
                    "Inputs handed to the tokenizer threads and not finished (running or queued).",
                )
                .expect("valid metric"),
            ),
            oversized_answers: counter(
                "kvgate_oversized_answers_total",
                "Answers of workers or peers larger than their bound, not read past it, by source: health, models, loads (--max-probe-answer-bytes), prefill (--max-prefill-answer-bytes), kv_events, kv_replay (--kv-events-max-message-bytes), replica_sync (--replica-sync-max-message-bytes).",
                &["source"],
            ),
            loads: LoadMetrics {
            poll_duration: register(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new("kvgate_load_poll_duration_seconds", "Duration of one engine load poll.")
                        .buckets(LATENCY_BUCKETS.to_vec()),
                )
                .expect("valid metric"),
            ),
            poll_failures: counter(
                "kvgate_load_poll_failures_total",
                "Failed engine load polls per worker.",
                &["worker"],
            ),
            snapshot_age: register(
                &registry,
                GaugeVec::new(
                    Opts::new("kvgate_load_snapshot_age_seconds", "Age of each worker's load sample."),
                    &["worker"],
                )
                .expect("valid metric"),
            ),
            },
            kv_events: KvEventsMetrics {
            batches: counter(
                "kvgate_kv_events_batches_total",
                "KV event batches applied to the exact index, per worker.",
                &["worker"],
            ),
            malformed: counter(
                "kvgate_kv_events_malformed_total",
                "KV event messages that could not be decoded (the worker's index entries are cleared).",
                &["worker"],
            ),
            refused: counter(
                "kvgate_kv_events_refused_total",
                "KV events of well-formed batches not applied, by reason (unknown_parent, inconsistent, lora, other_group, unknown_event).",
                &["worker", "reason"],
            ),
            gaps: counter(
                "kvgate_kv_events_gaps_total",
                "Sequence gaps in a worker's KV events, by recovery: replay (filled from the engine's buffer) or cleared.",
                &["worker", "recovery"],
            ),
            restarts: counter(
                "kvgate_kv_events_restarts_total",
                "Engine restarts seen in a worker's KV events (the sequence went back; its entries were cleared).",
                &["worker"],
            ),
            live_ranks: gauge(
                "kvgate_kv_events_live_ranks",
                "Data-parallel ranks of a worker whose KV event subscription is connected and in sync.",
                &["worker"],
            ),
            index_blocks: gauge(
                "kvgate_kv_index_blocks",
                "Distinct KV blocks in a model's exact index.",
                &["model"],
            ),
            },
            admission: AdmissionMetrics {
            queue_depth: register(
                &registry,
                IntGauge::new("kvgate_queue_depth", "Requests waiting in the admission queue.").expect("valid metric"),
            ),
            rejected: counter(
                "kvgate_admission_rejected_total",
                "Requests refused at admission, by reason: concurrency (limit reached, no queue), queue_full, queue_timeout, rate_limited.",
                &["reason"],
            ),
            tenant_requests: counter(
                "kvgate_tenant_requests_total",
                "Requests admitted, by tenant (tenants named in `tenants:` or by a client key, and default; every other one as other) and priority class.",
                &["tenant", "class"],
            ),
            tenant_tokens: counter(
                "kvgate_tenant_tokens_total",
                "Tokens charged at admission (prompt plus maximum output), by tenant and priority class.",
                &["tenant", "class"],
            ),
            tenant_cached_tokens: counter(
                "kvgate_tenant_cached_tokens_total",
                "Prompt tokens the engines served from cache to each tenant's requests (as they reported \
                 them, on the answers the closed loop reads: models routed on KV events with a tokenizer).",
                &["tenant"],
            ),
            tenant_rejected: counter(
                "kvgate_tenant_rejected_total",
                "Requests refused at admission, by tenant, priority class and reason: requests_per_minute, tokens_per_minute, max_concurrent (the tenant's quotas) or the gateway-wide reasons of kvgate_admission_rejected_total.",
                &["tenant", "class", "reason"],
            ),
            tenant_queue_wait: histogram(
                "kvgate_tenant_queue_wait_seconds",
                "Time from a request's admission check to its concurrency slot (the admission queue), by tenant and priority class.",
                &["tenant", "class"],
                vec![0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0],
            ),
            client_keys_reloads: counter(
                "kvgate_client_keys_reloads_total",
                "Reloads of --client-api-keys-file (SIGHUP), by result: ok, error (the keys in use stay).",
                &["result"],
            ),
            },
            replica_sync: ReplicaSyncMetrics::register(&registry),
            otlp: OtlpMetrics::register(&registry),
            alignment: AlignmentMetrics::register(&registry),
            discovery_events: counter(
                "kvgate_discovery_events_total",
                "Kubernetes service discovery events: joined, left, relist, error.",
                &["event"],
            ),
            registry,
            ttfb_series: Default::default(),
            duration_series: Default::default(),
        }
    }

    pub fn ttfb(&self, endpoint: Endpoint) -> &Histogram {
        self.ttfb_series[endpoint as usize].get_or_init(|| self.ttfb.with_label_values(&[endpoint.label()]))
    }

    pub fn duration(&self, endpoint: Endpoint) -> &Histogram {
        self.duration_series[endpoint as usize]
            .get_or_init(|| self.duration.with_label_values(&[endpoint.label()]))
    }

    pub fn worker_series(&self, url: &str) -> WorkerSeries {
        WorkerSeries {
            url: url.to_string(),
            in_flight: self.in_flight.with_label_values(&[url]),
            ok_requests: Default::default(),
            live: RwLock::new(true),
            closed_loop: ClosedLoopSeries::default(),
        }
    }

    /// Count a finished request to a worker by endpoint and status.
    pub fn count_request(&self, endpoint: Endpoint, status: http::StatusCode, series: &WorkerSeries) {
        let slot = &series.ok_requests[endpoint as usize];
        if status == http::StatusCode::OK {
            if let Some(counter) = slot.get() {
                counter.inc(); // removed: a detached series nobody exports
                return;
            }
            series.write(|url| {
                slot.get_or_init(|| self.requests.with_label_values(&[endpoint.label(), "200", url])).inc()
            });
        } else {
            series.write(|url| {
                self.requests.with_label_values(&[endpoint.label(), status.as_str(), url]).inc()
            });
        }
    }

    /// Count one routing decision of a pool's policy (`model`'s regular pool, or one side of its
    /// disaggregated pair, on `path`), with its prefix-match rates and prediction if any (not
    /// for the decode side of a pair: the prompt's prefix and first token are the prefill
    /// side's; a decode engine prefilling in place counts them).
    pub fn count_decision(
        &self,
        model: &str,
        role: WorkerRole,
        series: &PoolSeries,
        decision: &kvgate_policy::Decision,
        path: PdPath,
    ) {
        let reason = decision.reason;
        let slot = index_slot(decision.index);
        let path_slot = PdPath::ALL.iter().position(|&p| p == path).unwrap_or(0);
        series.decisions[reason as usize][slot][path_slot]
            .get_or_init(|| match role {
                WorkerRole::Regular => {
                    self.decisions.with_label_values(&[model, reason.as_str(), INDEX_LABELS[slot]])
                }
                _ => self.pd_decisions.with_label_values(&[
                    model,
                    role.as_str(),
                    reason.as_str(),
                    INDEX_LABELS[slot],
                    path.as_str(),
                ]),
            })
            .inc();
        if role == WorkerRole::Decode && path == PdPath::Pair {
            return;
        }
        if let Some(matches) = decision.matches {
            series
                .match_best
                .get_or_init(|| self.match_rate.with_label_values(&[model, "best"]))
                .observe(matches.best_match_rate);
            series
                .match_chosen
                .get_or_init(|| self.match_rate.with_label_values(&[model, "chosen"]))
                .observe(matches.chosen_match_rate);
        }
        if let Some(predicted) = decision.predicted {
            for ((slot, term), value) in series.predicted.iter().zip(PREDICTED_TERMS).zip(predicted.terms()) {
                slot.get_or_init(|| self.predicted_ttft.with_label_values(&[model, term])).observe(value);
            }
        }
    }

    /// Count an answer that went past its bound (`source`: health, models, loads, prefill,
    /// kv_events, kv_replay, replica_sync).
    pub fn count_oversized(&self, source: &str) {
        self.oversized_answers.with_label_values(&[source]).inc();
    }

    /// The count of `count_oversized(source)` (the subsystems' tests read it).
    pub fn count_oversized_value(&self, source: &str) -> u64 {
        self.oversized_answers.with_label_values(&[source]).get()
    }

    /// Forget a removed worker's series: every series labelled by it goes, in every family, and
    /// none is made again (`WorkerSeries::write` runs nothing once this has begun).
    pub fn remove_worker(&self, series: &WorkerSeries) {
        let mut live = series.live.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        *live = false;
        let url = series.url.as_str();
        for family in [&self.requests, &self.upstream_failures] {
            remove_labelled(family, url);
        }
        for family in [&self.in_flight, &self.worker_healthy, &self.circuit_state, &self.kv_events.live_ranks]
        {
            remove_labelled(family, url);
        }
        remove_labelled(&self.loads.snapshot_age, url);
        for family in [
            &self.prefix_predicted_tokens,
            &self.prefix_prompt_tokens,
            &self.prefix_engine_cached_tokens,
            &self.prefix_missed_cached_tokens,
            &self.prefix_evicted_after_routing_tokens,
            &self.prefix_evicted_after_routing_requests,
        ] {
            remove_labelled(family, url);
        }
        remove_labelled(&self.prefix_index_disagreement, url);
        remove_labelled(&self.prefix_cached_difference, url);
        let alignment = &self.alignment;
        for family in [&alignment.probes, &alignment.failures] {
            remove_labelled(family, url);
        }
        for family in [&alignment.aligned, &alignment.quarantined] {
            remove_labelled(family, url);
        }
        let kv = &self.kv_events;
        for family in
            [&self.loads.poll_failures, &kv.batches, &kv.malformed, &kv.refused, &kv.gaps, &kv.restarts]
        {
            remove_labelled(family, url);
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buffer = Vec::with_capacity(16 * 1024);
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("text encoding into a Vec cannot fail");
        String::from_utf8(buffer).expect("the text encoder writes UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_series_are_the_labelled_ones() {
        // The caches index by discriminant: it must be the position in ALL.
        for (i, reason) in Reason::ALL.iter().enumerate() {
            assert_eq!(*reason as usize, i);
        }
        for (i, endpoint) in Endpoint::ALL.iter().enumerate() {
            assert_eq!(*endpoint as usize, i);
        }
        let metrics = Metrics::new();
        let series = metrics.worker_series("http://w");
        metrics.count_request(Endpoint::Generate, http::StatusCode::OK, &series);
        metrics.count_request(Endpoint::Generate, http::StatusCode::OK, &series);
        metrics.count_request(Endpoint::Generate, http::StatusCode::NOT_FOUND, &series);
        series.in_flight.inc();
        metrics.ttfb(Endpoint::Embeddings).observe(0.1);
        let text = metrics.render();
        assert!(
            text.contains(r#"kvgate_requests_total{endpoint="generate",status="200",worker="http://w"} 2"#)
        );
        assert!(
            text.contains(r#"kvgate_requests_total{endpoint="generate",status="404",worker="http://w"} 1"#)
        );
        assert!(text.contains(r#"kvgate_worker_in_flight{worker="http://w"} 1"#));
        assert!(text.contains(r#"kvgate_request_ttfb_seconds_count{endpoint="embeddings"} 1"#));
    }
}
