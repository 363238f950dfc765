//! OpenTelemetry traces (`--otlp-traces-endpoint`): one server span per proxied request, exported
//! over OTLP/HTTP (protobuf) in batches from a thread of the SDK's own, with the route plan of
//! every attempt as events, the final decision's reason, prefix index and predicted-TTFT terms,
//! the worker and the time to first byte as attributes. The span continues the client's W3C
//! `traceparent` and its own context goes to the engines in that header. Off by default: with
//! no endpoint nothing here is built and the request path only tests an `Option`.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use kvgate_policy::{Decision, PredictedTtft};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, Span};
use opentelemetry_sdk::Resource;

use crate::endpoint::Endpoint;

/// The W3C trace context header.
pub static TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");

/// How often finished spans are sent.
const EXPORT_INTERVAL: Duration = Duration::from_secs(1);

/// The tracer of a gateway with `--otlp-traces-endpoint`.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Traces {
    /// An exporter to `endpoint` (the collector's OTLP/HTTP traces URL, e.g.
    /// `http://127.0.0.1:4318/v1/traces`).
    pub fn new(endpoint: &str) -> Result<Self, String> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| format!("the OTLP traces exporter for {endpoint}: {e}"))?;
        let batches = BatchConfigBuilder::default().with_scheduled_delay(EXPORT_INTERVAL).build();
        let processor = BatchSpanProcessor::builder(exporter).with_batch_config(batches).build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
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
