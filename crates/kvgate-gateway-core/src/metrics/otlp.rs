//! The OTLP traces exporter's metric families (`--otlp-traces-endpoint`), registered with the
//! gateway's other metrics whether tracing is on or not (all zero when off).

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

#[derive(Clone, Debug)]
pub struct OtlpMetrics {
    /// Export requests the collector did not take (after the exporter's own retries).
    pub export_failures: IntCounter,
    /// Spans the collector took.
    pub spans_exported: IntCounter,
    /// Spans lost because the export queue was full.
    pub spans_dropped_queue_full: IntCounter,
    /// Spans lost with a failed export.
    pub spans_dropped_export_failed: IntCounter,
}

impl OtlpMetrics {
    pub fn register(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| {
            let counter = IntCounter::new(name, help).expect("valid metric");
            registry.register(Box::new(counter.clone())).expect("unique metric");
            counter
        };
        let dropped = IntCounterVec::new(
            Opts::new(
                "kvgate_otlp_spans_dropped_total",
                "Request spans never delivered to the OTLP collector, by reason: queue_full (the \
                 export queue, 2048 spans, was full when the request ended), export_failed (their \
                 export request failed).",
            ),
            &["reason"],
        )
        .expect("valid metric");
        registry.register(Box::new(dropped.clone())).expect("unique metric");
        Self {
            export_failures: counter(
                "kvgate_otlp_export_failures_total",
                "OTLP trace export requests that failed (an error status, no connection, a timeout), \
                 after the exporter's own retries; each also warns in the log, at most once a minute, \
                 naming the endpoint.",
            ),
            spans_exported: counter(
                "kvgate_otlp_spans_exported_total",
                "Request spans the OTLP collector accepted.",
            ),
            spans_dropped_queue_full: dropped.with_label_values(&["queue_full"]),
            spans_dropped_export_failed: dropped.with_label_values(&["export_failed"]),
        }
    }
}
