//! Turning an attempt's outcome into the client's response: routing headers, request metrics,
//! and the body wrapper that ends the request when the body ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderName, HeaderValue};
use kvgate_policy::{Decision, PdChoice};

use super::outcome::{Failure, Served};
use crate::body::{BodyWatch, MeteredBody, RequestTail, UsageBound, Watched};
use crate::state::AppState;
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::error::ApiError;
use kvgate_gateway_core::otel::RequestSpan;
use kvgate_gateway_core::upstream::is_hop_by_hop;
use kvgate_observe::accuracy::UsageTap;
use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::headers;

/// A model's context when its engine did not say (`max_model_len`): what an open-ended answer's
/// usage is bounded by.
const UNKNOWN_CONTEXT_TOKENS: u64 = 131_072;

/// What the request says of its answer.
#[derive(Clone, Default)]
pub(super) struct Expect {
    /// The gateway asked the stream for its usage chunk on the client's behalf: left out again.
    pub strip_usage: bool,
    /// The request body's length in bytes (no prompt has more tokens).
    pub body_bytes: u64,
    /// Its maximum output per choice (`max_tokens`, ...), when it names one.
    pub max_output: Option<u64>,
    /// The choices asked for (`n`).
    pub choices: u64,
    /// How to continue the stream on another engine (`--migrate-streams`).
    pub resume: Option<std::sync::Arc<super::migrate::Resume>>,
}

impl Expect {
    /// The most the answer of `worker` can have used.
    fn usage_bound(&self, worker: &Worker) -> UsageBound {
        let per_choice = self
            .max_output
            .unwrap_or_else(|| worker.max_model_len().map_or(UNKNOWN_CONTEXT_TOKENS, u64::from));
        UsageBound { prompt: self.body_bytes, completion: per_choice.saturating_mul(self.choices.max(1)) }
    }
}

pub(super) fn failure_response(
    state: &AppState,
    endpoint: Endpoint,
    started: Instant,
    failure: Failure,
    permit: kvgate_admission::Permit,
    expect: Expect,
    span: &mut Option<RequestSpan>,
) -> Response {
    let expect = Expect { strip_usage: false, resume: None, ..expect };
    let error = match failure {
        Failure::Response(served) => return respond(state, endpoint, started, *served, permit, expect, span),
        Failure::Unreachable(message) => ApiError::UpstreamUnreachable(message),
        Failure::TimedOut(secs) => ApiError::UpstreamTimeout(secs),
    };
    state.metrics.requests.with_label_values(&[endpoint.label(), error.status().as_str(), "none"]).inc();
    error.into_response()
}

fn set_header(headers: &mut http::HeaderMap, name: &HeaderName, value: &str) {
    if let Ok(value) = HeaderValue::from_str(value) {
        headers.insert(name.clone(), value);
    }
}

fn routing_headers(
    headers: &mut http::HeaderMap,
    worker: &Worker,
    decision: &Decision,
    prefill: Option<&(Arc<Worker>, Decision)>,
    pd: Option<&PdChoice>,
) {
    set_header(headers, &headers::WORKER, &worker.url);
    if let Some(pd) = pd {
        set_header(headers, &headers::PD_PATH, &pd.describe());
    }
    set_header(headers, &headers::ROUTE, decision.reason.as_str());
    if let Some(index) = decision.index {
        set_header(headers, &headers::PREFIX_INDEX, index.as_str());
    }
    if let Some((worker, decision)) = prefill {
        set_header(headers, &headers::PREFILL_WORKER, &worker.url);
        set_header(headers, &headers::PREFILL_ROUTE, decision.reason.as_str());
        if let Some(index) = decision.index {
            set_header(headers, &headers::PREFILL_PREFIX_INDEX, index.as_str());
        }
    }
    // The time to first token is decided where the prompt is prefilled.
    let predicted = prefill.map_or(decision.predicted, |(_, d)| d.predicted);
    if let Some(predicted) = predicted {
        let terms: Vec<String> = kvgate_policy::PredictedTtft::TERMS
            .iter()
            .zip(predicted.terms())
            .map(|(name, seconds)| format!("{name}={:.1}ms", seconds * 1e3))
            .collect();
        set_header(headers, &headers::PREDICTED_TTFT, &terms.join("; "));
    }
}

/// The answer to the client (with `expect.strip_usage`, the usage chunk the gateway asked a
/// stream for on the client's behalf is left out again).
pub(super) fn respond(
    state: &AppState,
    endpoint: Endpoint,
    started: Instant,
    served: Served,
    permit: kvgate_admission::Permit,
    expect: Expect,
    span: &mut Option<RequestSpan>,
) -> Response {
    let strip_usage = expect.strip_usage;
    let Served { response, in_flight, worker, decision, prefill, probe, learn, pd } = served;
    let (mut parts, body) = response.into_parts();
    // Hop-by-hop headers, and the gateway's own namespace: a worker's `x-kvgate-*` never
    // reaches a client (the routing headers below are the gateway's).
    let dropped: Vec<HeaderName> =
        parts.headers.keys().filter(|n| is_hop_by_hop(n) || headers::is_gateway_header(n)).cloned().collect();
    for name in dropped {
        parts.headers.remove(name);
    }
    if state.config.expose_routing_headers {
        routing_headers(&mut parts.headers, &worker, &decision, prefill.as_ref(), pd.as_ref());
    }
    state.metrics.count_request(endpoint, parts.status, &worker.series);
    tracing::debug!(endpoint = endpoint.label(), worker = %worker.url, reason = decision.reason.as_str(), status = %parts.status, "proxied");
    let event_stream = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    // The closed loop reads successful answers only; a stream asked for its usage chunk is
    // always read, so that the chunk is left out.
    let probe = probe.filter(|_| parts.status.is_success()).map(|probe| (probe, worker.clone()));
    let permit = permit.into_hold();
    // A tenant's token charge is corrected from the answer's usage (successful answers only).
    let settles = parts.status.is_success() && permit.as_ref().is_some_and(|hold| hold.wants_usage());
    // Only a stream's first byte is its time to first token.
    let learn = learn.filter(|_| parts.status.is_success() && event_stream);
    let usage = (probe.is_some() || learn.is_some() || (strip_usage && event_stream) || settles)
        .then(|| UsageTap::new(probe, event_stream, strip_usage && event_stream).learning(learn));
    if strip_usage && event_stream {
        // The body the client gets is shorter than the worker's: its length is not known.
        parts.headers.remove(header::CONTENT_LENGTH);
    }
    let config = &state.config;
    let watch = BodyWatch {
        stall: (config.body_stall_timeout_secs > 0.0)
            .then(|| Duration::from_secs_f64(config.body_stall_timeout_secs)),
        deadline: config.stream_deadline_secs.filter(|_| event_stream).map(|secs| {
            let bound = Duration::from_secs_f64(secs);
            (tokio::time::Instant::from_std(started) + bound, bound)
        }),
    };
    let tail = RequestTail {
        endpoint,
        started,
        metrics: state.metrics.clone(),
        permit,
        event_stream,
        usage,
        span: span.take().map(|mut span| {
            span.status(parts.status);
            span
        }),
        usage_bound: expect.usage_bound(&worker),
    };
    let answer = Watched::new(body, in_flight, worker.clone(), watch);
    // A stream that may move to another engine when this one fails (`migrate.rs`).
    let body = match expect.resume.filter(|_| event_stream && parts.status.is_success()) {
        Some(resume) => {
            let relay = super::migrate::Relay::new(answer, worker.id, resume, watch, strip_usage);
            Body::new(MeteredBody::new(relay, tail))
        }
        None => Body::new(MeteredBody::new(answer, tail)),
    };
    Response::from_parts(parts, body)
}
