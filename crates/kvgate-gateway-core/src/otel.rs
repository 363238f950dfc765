//! OpenTelemetry traces (`--otlp-traces-endpoint`): one server span per proxied request, exported
//! over OTLP/HTTP (protobuf) in batches from a thread of the SDK's own, with the route plan of
//! every attempt as events, the final decision's reason, prefix index and predicted-TTFT terms,
//! the worker and the time to first byte as attributes. The span continues the client's W3C
//! `traceparent` and its own context goes to the engines in that header. Off by default: with
//! no endpoint nothing here is built and the request path only tests an `Option`.
//!
//! Nothing is lost silently: the export queue is bounded here (`ExportAccounting`: a span that
//! ends with `MAX_QUEUED_SPANS` waiting is dropped and counted), every export's outcome is
//! counted (`kvgate_otlp_*`), and failures warn in the log at most once per `WARN_INTERVAL`,
//! naming the endpoint.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue};
use kvgate_policy::{Decision, PredictedTtft};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, Span, SpanData, SpanExporter,
    SpanProcessor,
};
use opentelemetry_sdk::Resource;

use crate::metrics::OtlpMetrics;
use kvgate_protocol::endpoint::Endpoint;

/// The W3C trace context header.
pub static TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");

/// How often finished spans are sent.
const EXPORT_INTERVAL: Duration = Duration::from_secs(1);
/// Finished spans that may wait for export; a span ending past this is dropped (and counted).
const MAX_QUEUED_SPANS: usize = 2048;
/// Spans per export request.
const MAX_EXPORT_BATCH: usize = 512;
/// Export failures warn at most this often (the counters count every one).
const WARN_INTERVAL: Duration = Duration::from_secs(60);

/// The tracer of a gateway with `--otlp-traces-endpoint`.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Traces {
    /// An exporter to `endpoint` (the collector's OTLP/HTTP traces URL, e.g.
    /// `http://127.0.0.1:4318/v1/traces`).
    pub fn new(endpoint: &str, metrics: OtlpMetrics) -> Result<Self, String> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| format!("the OTLP traces exporter for {endpoint}: {e}"))?;
        let accounting = Arc::new(ExportAccounting::new(endpoint, MAX_QUEUED_SPANS, metrics));
        let exporter = CountedExporter { inner: exporter, accounting: accounting.clone() };
        // The processor's own queue is as long as ours, so it never drops a span uncounted.
        let batches = BatchConfigBuilder::default()
            .with_scheduled_delay(EXPORT_INTERVAL)
            .with_max_queue_size(MAX_QUEUED_SPANS)
            .with_max_export_batch_size(MAX_EXPORT_BATCH)
            .build();
        let inner = BatchSpanProcessor::builder(exporter).with_batch_config(batches).build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BoundedProcessor { inner, accounting })
            .with_resource(Resource::builder().with_service_name("kvgate").build())
            .build();
        let tracer = provider.tracer("kvgate");
        Ok(Self { provider, tracer })
    }

    /// The span of one proxied request, a child of the client's `traceparent` if it sent one.
    pub fn start(&self, endpoint: Endpoint, headers: &HeaderMap) -> RequestSpan {
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        let span = self
            .tracer
            .span_builder(format!("POST {}", endpoint.path()))
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("url.path", endpoint.path()),
                KeyValue::new("kvgate.endpoint", endpoint.label()),
            ])
            .start_with_context(&self.tracer, &parent);
        let context = span.span_context();
        let traceparent =
            format!("00-{}-{}-{:02x}", context.trace_id(), context.span_id(), context.trace_flags().to_u8());
        let traceparent = HeaderValue::from_str(&traceparent).expect("hex digits and dashes");
        RequestSpan {
            span,
            traceparent,
            attempts: 0,
            retries: 0,
            route: Vec::new(),
            prefill_route: Vec::new(),
            status: None,
        }
    }

    /// Sends what is buffered and stops the exporter (at the gateway's shutdown).
    pub fn shutdown(&self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::warn!(%error, "stopping the OTLP traces exporter");
        }
    }
}

/// The export path's books: the spans waiting for export (ended, not yet handed to the exporter),
/// the counters, and when the last warning was logged.
struct ExportAccounting {
    endpoint: String,
    max_queued: usize,
    queued: AtomicUsize,
    metrics: OtlpMetrics,
    warnings: Mutex<Warnings>,
}

impl std::fmt::Debug for ExportAccounting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportAccounting")
            .field("endpoint", &self.endpoint)
            .field("queued", &self.queued)
            .finish_non_exhaustive()
    }
}

impl ExportAccounting {
    fn new(endpoint: &str, max_queued: usize, metrics: OtlpMetrics) -> Self {
        let warnings = Mutex::new(Warnings::new(metrics.spans_dropped_queue_full.get()));
        Self { endpoint: endpoint.to_string(), max_queued, queued: AtomicUsize::new(0), metrics, warnings }
    }

    /// A span ended: true if it may wait for export, false (counted) if the queue is full.
    /// On the request path: one atomic add, no lock, no log.
    fn admit(&self) -> bool {
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.metrics.spans_dropped_queue_full.inc();
            return false;
        }
        true
    }

    /// `spans` left the queue for the exporter.
    fn handed_over(&self, spans: usize) {
        self.queued.fetch_sub(spans, Ordering::AcqRel);
    }

    /// The outcome of one export request of `spans` spans (on the exporter's thread).
    fn exported(&self, spans: usize, result: &OTelSdkResult, now: Instant) {
        let error = match result {
            Ok(()) => {
                self.metrics.spans_exported.inc_by(spans as u64);
                None
            }
            Err(error) => {
                self.metrics.export_failures.inc();
                self.metrics.spans_dropped_export_failed.inc_by(spans as u64);
                Some(error.to_string())
            }
        };
        let dropped_total = self.metrics.spans_dropped_queue_full.get();
        let mut warnings = self.warnings.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(lost) = warnings.note(now, error.is_some().then_some(spans), dropped_total) else { return };
        tracing::warn!(
            endpoint = %self.endpoint,
            error = error.as_deref().unwrap_or("none"),
            failed_exports = lost.failed_exports,
            spans_lost_in_failed_exports = lost.failed_spans,
            spans_dropped_queue_full = lost.dropped_queue_full,
            "OTLP traces are being lost (counted in kvgate_otlp_export_failures_total and \
             kvgate_otlp_spans_dropped_total; this warning repeats at most once a minute)"
        );
    }
}

/// What was lost since the last warning, and when that was.
#[derive(Debug, Default, PartialEq)]
struct Lost {
    failed_exports: u64,
    failed_spans: u64,
    dropped_queue_full: u64,
}

/// The rate limit of the export path's warning.
#[derive(Debug)]
struct Warnings {
    last: Option<Instant>,
    since: Lost,
    /// `kvgate_otlp_spans_dropped_total{reason="queue_full"}` when last looked at.
    dropped_seen: u64,
}

impl Warnings {
    fn new(dropped_total: u64) -> Self {
        Self { last: None, since: Lost::default(), dropped_seen: dropped_total }
    }

    /// After an export (`failed`: the spans of a failed one) with `dropped_total` spans dropped
    /// at the queue so far: what to warn about now, if anything was lost and the last warning
    /// is `WARN_INTERVAL` old (or there was none).
    fn note(&mut self, now: Instant, failed: Option<usize>, dropped_total: u64) -> Option<Lost> {
        if let Some(spans) = failed {
            self.since.failed_exports += 1;
            self.since.failed_spans += spans as u64;
        }
        self.since.dropped_queue_full += dropped_total.saturating_sub(self.dropped_seen);
        self.dropped_seen = dropped_total;
        if self.since == Lost::default() || self.last.is_some_and(|last| now - last < WARN_INTERVAL) {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since))
    }
}

/// The batch processor behind the bound of `ExportAccounting`.
#[derive(Debug)]
struct BoundedProcessor {
    inner: BatchSpanProcessor,
    accounting: Arc<ExportAccounting>,
}

impl SpanProcessor for BoundedProcessor {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.accounting.admit() {
            self.inner.on_end(span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, its every export counted.
#[derive(Debug)]
struct CountedExporter<E> {
    inner: E,
    accounting: Arc<ExportAccounting>,
}

impl<E: SpanExporter> SpanExporter for CountedExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        self.accounting.handed_over(spans);
        let result = self.inner.export(batch).await;
        self.accounting.exported(spans, &result, Instant::now());
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn shutdown(&self) -> OTelSdkResult {
        self.inner.shutdown()
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// A request's headers as the propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// One request's span; ended when dropped (with the answer's body, or the error). The SDK
/// appends every attribute set, so the final ones (the last attempt's route, the status, the
/// retries) are kept here and set once, at the end.
pub struct RequestSpan {
    span: Span,
    /// This span's context as the engines get it.
    traceparent: HeaderValue,
    attempts: u32,
    retries: u32,
    /// The last attempt's route attributes (the regular or decode side, and the prefill side).
    route: Vec<KeyValue>,
    prefill_route: Vec<KeyValue>,
    status: Option<http::StatusCode>,
}

impl RequestSpan {
    pub fn traceparent(&self) -> &HeaderValue {
        &self.traceparent
    }

    /// The plan of an attempt: one decision (`role` regular), or each side of a pair. Every
    /// attempt is an event; the span's attributes are the last attempt's.
    pub fn route(&mut self, role: &'static str, worker: &str, decision: &Decision) {
        if role != "decode" {
            self.attempts += 1;
        }
        let mut attributes = vec![
            KeyValue::new("kvgate.attempt", i64::from(self.attempts)),
            KeyValue::new("kvgate.role", role),
            KeyValue::new("kvgate.worker", worker.to_string()),
            KeyValue::new("kvgate.route.reason", decision.reason.as_str()),
        ];
        if let Some(index) = decision.index {
            attributes.push(KeyValue::new("kvgate.route.prefix_index", index.as_str()));
        }
        if let Some(matches) = decision.matches {
            attributes.push(KeyValue::new("kvgate.route.match_chosen", matches.chosen_match_rate));
            attributes.push(KeyValue::new("kvgate.route.match_best", matches.best_match_rate));
        }
        if let Some(predicted) = decision.predicted {
            for (term, seconds) in PredictedTtft::TERMS.iter().zip(predicted.terms()) {
                attributes.push(KeyValue::new(format!("kvgate.predicted_ttft_ms.{term}"), seconds * 1e3));
            }
        }
        self.span.add_event("route", attributes.clone());
        if role == "prefill" {
            self.prefill_route = attributes
                .into_iter()
                .map(|kv| {
                    let key = kv.key.as_str().strip_prefix("kvgate.").unwrap_or(kv.key.as_str());
                    KeyValue::new(format!("kvgate.prefill.{key}"), kv.value)
                })
                .collect();
        } else {
            self.route = attributes;
        }
    }

    /// An attempt that failed before a byte reached the client (it is retried or answered).
    pub fn failed(&mut self, kind: &'static str) {
        let attempt = KeyValue::new("kvgate.attempt", i64::from(self.attempts));
        self.span.add_event("attempt_failed", vec![attempt, KeyValue::new("kvgate.failure", kind)]);
    }

    /// The retries the request took.
    pub fn retries(&mut self, retries: u32) {
        self.retries = retries;
    }

    /// The answer's status (the client's).
    pub fn status(&mut self, status: http::StatusCode) {
        self.status = Some(status);
    }

    /// The first byte of the answer's body reached the client, `secs` after the request arrived.
    pub fn first_byte(&mut self, secs: f64) {
        self.span.set_attribute(KeyValue::new("kvgate.ttfb_ms", secs * 1e3));
    }
}

impl Drop for RequestSpan {
    fn drop(&mut self) {
        let mut last = std::mem::take(&mut self.route);
        last.append(&mut self.prefill_route);
        last.push(KeyValue::new("kvgate.retries", i64::from(self.retries)));
        if let Some(status) = self.status {
            last.push(KeyValue::new("http.response.status_code", i64::from(status.as_u16())));
            if status.is_server_error() {
                self.span.set_status(Status::error(status.to_string()));
            }
        }
        self.span.set_attributes(last);
        // The span itself ends as it is dropped, right after.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accounting(max_queued: usize) -> ExportAccounting {
        let metrics = OtlpMetrics::register(&prometheus::Registry::new());
        ExportAccounting::new("http://127.0.0.1:1/v1/traces", max_queued, metrics)
    }

    #[test]
    fn a_span_ending_on_a_full_queue_is_dropped_and_counted() {
        let books = accounting(2);
        assert!(books.admit());
        assert!(books.admit());
        assert!(!books.admit(), "a third span waits behind two: the queue is full");
        assert_eq!(books.metrics.spans_dropped_queue_full.get(), 1);
        books.handed_over(2);
        assert!(books.admit(), "the exporter took the two: room again");
        assert_eq!(books.metrics.spans_dropped_queue_full.get(), 1);
    }

    #[test]
    fn every_export_is_counted_by_outcome() {
        let books = accounting(8);
        let now = Instant::now();
        books.exported(3, &Ok(()), now);
        books.exported(2, &Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure("500".into())), now);
        books.exported(
            4,
            &Err(opentelemetry_sdk::error::OTelSdkError::Timeout(Duration::from_secs(10))),
            now,
        );
        assert_eq!(books.metrics.spans_exported.get(), 3);
        assert_eq!(books.metrics.export_failures.get(), 2);
        assert_eq!(books.metrics.spans_dropped_export_failed.get(), 6);
    }

    #[test]
    fn losses_warn_at_once_then_at_most_once_per_interval_with_what_was_lost_between() {
        let start = Instant::now();
        let mut warnings = Warnings::new(0);
        assert_eq!(warnings.note(start, None, 0), None, "nothing lost: no warning");
        let first = Lost { failed_exports: 1, failed_spans: 5, dropped_queue_full: 0 };
        assert_eq!(warnings.note(start, Some(5), 0), Some(first), "the first loss warns at once");
        assert_eq!(warnings.note(start + Duration::from_secs(1), Some(3), 2), None);
        assert_eq!(warnings.note(start + Duration::from_secs(30), None, 7), None);
        let between = Lost { failed_exports: 1, failed_spans: 3, dropped_queue_full: 7 };
        assert_eq!(warnings.note(start + WARN_INTERVAL, None, 7), Some(between), "what was lost since");
        assert_eq!(warnings.note(start + 3 * WARN_INTERVAL, None, 7), None, "nothing new lost");
        let later = Lost { failed_exports: 0, failed_spans: 0, dropped_queue_full: 1 };
        assert_eq!(warnings.note(start + 3 * WARN_INTERVAL, None, 8), Some(later));
    }
}
