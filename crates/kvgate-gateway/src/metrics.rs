//! Prometheus metrics of the gateway: requests, latencies, in-flight, retries, worker health,
//! circuit state and routing decisions, rendered as text at GET /metrics.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

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
    pub retries: IntCounterVec,
    pub upstream_failures: IntCounterVec,
    pub worker_healthy: IntGaugeVec,
    pub circuit_state: IntGaugeVec,
    pub decisions: IntCounterVec,
    pub match_rate: HistogramVec,
    pub load_poll_duration: Histogram,
    pub load_poll_failures: IntCounterVec,
    pub load_snapshot_age: GaugeVec,
}

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
            retries: counter(
                "kvgate_retries_total",
                "Requests retried on another worker, by endpoint.",
                &["endpoint"],
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
                "Routing decisions by model and reason.",
                &["model", "reason"],
            ),
            match_rate: histogram(
                "kvgate_prefix_match_rate",
                "Prefix match rate per cache-aware decision: best available on any healthy worker (kind=best) vs on the chosen worker (kind=chosen).",
                &["model", "kind"],
                vec![0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0],
            ),
            load_poll_duration: register(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new("kvgate_load_poll_duration_seconds", "Duration of one engine load poll.")
                        .buckets(LATENCY_BUCKETS.to_vec()),
                )
                .expect("valid metric"),
            ),
            load_poll_failures: counter(
                "kvgate_load_poll_failures_total",
                "Failed engine load polls per worker.",
                &["worker"],
            ),
            load_snapshot_age: register(
                &registry,
                GaugeVec::new(
                    Opts::new("kvgate_load_snapshot_age_seconds", "Age of each worker's load sample."),
                    &["worker"],
                )
                .expect("valid metric"),
            ),
            registry,
        }
    }

    /// Forget a removed worker's series.
    pub fn remove_worker(&self, url: &str) {
        let _ = self.in_flight.remove_label_values(&[url]);
        let _ = self.worker_healthy.remove_label_values(&[url]);
        let _ = self.circuit_state.remove_label_values(&[url]);
        let _ = self.load_poll_failures.remove_label_values(&[url]);
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
