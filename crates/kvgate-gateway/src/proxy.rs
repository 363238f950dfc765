//! The request path of a proxied endpoint: read and check the body, pick the model's pool, ask the
//! policy for a worker, forward, retry on another worker when allowed, and stream the answer back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, StatusCode};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use kvgate_index::{ExactRecordingTree, InFlightPrompt};
use kvgate_policy::{
    Candidate, Decision, IndexKind, PrefixIndex, PrefixIndexMode, RouteRequest, RoutingKey, SelectContext,
};
use rand::Rng;

use crate::body::{InFlight, MeteredBody, RequestTail};
use crate::conn::{self, SendError, UpstreamBody};
use crate::error::ApiError;
use crate::registry::{ModelPool, ModelPrefix};
use crate::request::{estimate_tokens, OwnedKey, RequestFields};
use crate::state::AppState;
use crate::upstream::is_hop_by_hop;
use crate::worker::Worker;

/// The proxied endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
    Generate,
    Embeddings,
}

impl Endpoint {
    pub const ALL: [Endpoint; 4] =
        [Endpoint::ChatCompletions, Endpoint::Completions, Endpoint::Generate, Endpoint::Embeddings];

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Generate => "/generate",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }

    /// The endpoint served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        Endpoint::ALL.into_iter().find(|endpoint| endpoint.path() == path)
    }

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Generate => "generate",
            Endpoint::Embeddings => "embeddings",
        }
    }
}

static WORKER_HEADER: HeaderName = HeaderName::from_static("x-kvgate-worker");
static ROUTE_HEADER: HeaderName = HeaderName::from_static("x-kvgate-route");
static INDEX_HEADER: HeaderName = HeaderName::from_static("x-kvgate-prefix-index");
static PREDICTED_HEADER: HeaderName = HeaderName::from_static("x-kvgate-predicted-ttft");

/// What the last failed attempt left, returned to the client when no retry is possible.
enum Failure {
    /// A 502/503/504 answer, not yet read: passed through as is.
    Response {
        response: http::Response<UpstreamBody>,
        worker: Arc<Worker>,
        decision: Box<Decision>,
        in_flight: InFlight,
    },
    /// The worker could not be reached.
    Unreachable(String),
}

/// Outcome of one attempt on one worker.
enum Attempt {
    Done(http::Response<UpstreamBody>, InFlight),
    /// 502/503/504 before any byte went to the client.
    RetryableStatus(http::Response<UpstreamBody>, InFlight),
    /// Connection could not be established.
    Unreachable(String),
    Fatal(ApiError),
}

/// The axum handler of a proxied endpoint.
pub async fn handle(State(state): State<Arc<AppState>>, endpoint: Endpoint, request: Request) -> Response {
    serve(state, endpoint, request).await
}

/// Proxy one request, whatever its body type (the accept loop hands hyper's body over unboxed).
pub async fn serve<B>(state: Arc<AppState>, endpoint: Endpoint, request: http::Request<B>) -> Response
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let started = Instant::now();
    match proxy(&state, endpoint, request, started).await {
        Ok(response) => response,
        Err(error) => {
            let status = error.status();
            state.metrics.requests.with_label_values(&[endpoint.label(), status.as_str(), "none"]).inc();
            tracing::debug!(endpoint = endpoint.label(), %status, %error, "request failed in the gateway");
            error.into_response()
        }
    }
}

async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, ApiError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::PayloadTooLarge(limit))
        }
        Err(error) => Err(ApiError::BadRequest(format!("could not read the request body: {error}"))),
    }
}

async fn proxy<B>(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    request: http::Request<B>,
    started: Instant,
) -> Result<Response, ApiError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let permit = match &state.concurrency {
        Some(semaphore) => Some(
            semaphore
                .clone()
                .try_acquire_owned()
                .map_err(|_| ApiError::TooManyRequests(state.config.max_concurrent_requests.unwrap_or(0)))?,
        ),
        None => None,
    };
    let (parts, body) = request.into_parts();
    let limit = state.config.max_payload_size;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    let bytes = read_body(body, limit).await?;
    let fields = RequestFields::parse(&bytes).map_err(ApiError::BadRequest)?;

    let snapshot = state.registry.snapshot();
    let pool = match snapshot.pool_for(fields.model.as_deref()) {
        Some(pool) => pool.clone(),
        None => return Err(no_pool_error(snapshot.models.len(), fields.model.as_deref())),
    };
    let key = if pool.policy.needs_routing_key() {
        crate::tokenize::routing_key(state, &pool, endpoint, &fields, &bytes)
    } else {
        OwnedKey::None
    };
    let route_request = RouteRequest {
        key: match &key {
            OwnedKey::None => RoutingKey::None,
            OwnedKey::Text(text) => RoutingKey::Text(text),
            OwnedKey::Tokens(ids) => RoutingKey::Tokens(ids),
        },
        prompt_tokens: estimate_tokens(&key),
    };
    let path_and_query = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or(endpoint.path());

    let retries_allowed = if state.config.disable_retries { 0 } else { state.config.retry_max_retries };
    let mut tried: Vec<u32> = Vec::with_capacity(2);
    let mut last_failure: Option<Failure> = None;
    let mut retries = 0;
    loop {
        let Some((worker, decision)) = choose(state, &pool, &route_request, &tried) else {
            return match last_failure {
                Some(failure) => Ok(failure_response(state, endpoint, started, failure, permit)),
                None => Err(ApiError::NoHealthyWorker(format!(" for model `{}`", pool.model))),
            };
        };
        tried.push(worker.id);
        let prompt = in_flight_prompt(&pool, &decision, &route_request);
        match attempt(state, &worker, path_and_query, &parts.headers, bytes.clone(), prompt).await {
            Attempt::Done(response, in_flight) => {
                return Ok(respond(
                    state, endpoint, started, &worker, &decision, response, in_flight, permit,
                ));
            }
            Attempt::Fatal(error) => return Err(error),
            Attempt::RetryableStatus(response, in_flight) => {
                last_failure =
                    Some(Failure::Response { response, worker, decision: Box::new(decision), in_flight });
            }
            Attempt::Unreachable(message) => last_failure = Some(Failure::Unreachable(message)),
        }
        let untried_left = {
            let now = Instant::now();
            pool.workers.iter().any(|w| !tried.contains(&w.id) && w.is_routable(now))
        };
        if retries >= retries_allowed || !untried_left {
            let failure = last_failure.expect("a retryable failure was just recorded");
            return Ok(failure_response(state, endpoint, started, failure, permit));
        }
        retries += 1;
        state.metrics.retries.with_label_values(&[endpoint.label()]).inc();
        tokio::time::sleep(backoff(state, retries)).await;
    }
}

fn no_pool_error(model_count: usize, model: Option<&str>) -> ApiError {
    match (model_count, model) {
        (0, _) => ApiError::NoHealthyWorker(String::new()),
        (_, Some(model)) => ApiError::ModelNotFound(model.to_string()),
        (_, None) => ApiError::BadRequest(
            "the `model` field is required: several models are served (see GET /v1/models)".into(),
        ),
    }
}

/// Ask the model's policy for a routable worker that has not been tried yet.
fn choose(
    state: &AppState,
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    tried: &[u32],
) -> Option<(Arc<Worker>, Decision)> {
    let now = Instant::now();
    let loads = state.loads.load();
    let mut events_flowing = true;
    let candidates: Vec<Candidate> = pool
        .workers
        .iter()
        .filter(|w| !tried.contains(&w.id) && w.is_routable(now))
        .map(|w| {
            events_flowing &= w.kv_events_flowing();
            Candidate { id: w.id, in_flight: w.in_flight(), load: loads.get(&w.id).copied() }
        })
        .collect();
    if candidates.is_empty() {
        return None;
    }
    let exact = ExactRecordingTree { exact: &pool.prefix.exact, tree: &pool.prefix.tree };
    let prefix_index: &dyn PrefixIndex =
        if use_exact_index(state, pool, request, events_flowing) { &exact } else { &pool.prefix.tree };
    let mut rng = rand::rng();
    let mut ctx = SelectContext {
        now_ms: state.now_ms(),
        load_poll_interval_ms: state.load_poll_interval_ms,
        rng: &mut rng,
        prefix_index: Some(prefix_index),
    };
    let decision = pool.policy.select(request, &candidates, &mut ctx).ok()?;
    state.metrics.count_decision(&pool.model, &pool.series, &decision);
    let worker = pool.workers.iter().find(|w| w.id == decision.worker)?.clone();
    Some((worker, decision))
}

/// A request routed on the exact index: its prompt's blocks count as held by the chosen worker
/// until the request ends.
fn in_flight_prompt(
    pool: &ModelPool,
    decision: &Decision,
    request: &RouteRequest<'_>,
) -> Option<(Arc<ModelPrefix>, InFlightPrompt)> {
    match (decision.index, request.key) {
        (Some(IndexKind::Exact), RoutingKey::Tokens(tokens)) => {
            Some((pool.prefix.clone(), pool.prefix.in_flight.add(decision.worker, tokens)))
        }
        _ => None,
    }
}

/// Whether to match against the exact index: the model's workers publish KV events, the request
/// has token ids, and the mode allows it (`auto`: every candidate's events flow).
fn use_exact_index(
    state: &AppState,
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    events_flowing: bool,
) -> bool {
    if !pool.has_kv_events || !matches!(request.key, RoutingKey::Tokens(_)) {
        return false;
    }
    match state.config.routing.prefix_index {
        PrefixIndexMode::Auto => events_flowing,
        PrefixIndexMode::Exact => true,
        PrefixIndexMode::Approximate => false,
    }
}

fn backoff(state: &AppState, retry: u32) -> Duration {
    let initial = state.config.retry_initial_backoff_ms as f64;
    let capped =
        (initial * 2f64.powi(retry.saturating_sub(1) as i32)).min(state.config.retry_max_backoff_ms as f64);
    // Jitter in [50%, 100%] so that retries from many requests do not line up.
    let jittered = capped * rand::rng().random_range(0.5..=1.0);
    Duration::from_micros((jittered * 1000.0) as u64)
}

async fn attempt(
    state: &AppState,
    worker: &Arc<Worker>,
    path_and_query: &str,
    client_headers: &http::HeaderMap,
    body: Bytes,
    prompt: Option<(Arc<ModelPrefix>, InFlightPrompt)>,
) -> Attempt {
    let mut upstream = http::Request::new(Full::new(body));
    *upstream.method_mut() = http::Method::POST;
    *upstream.uri_mut() = match worker.conns.target(path_and_query) {
        Ok(uri) => uri,
        Err(e) => return Attempt::Fatal(ApiError::BadRequest(format!("invalid request path: {e}"))),
    };
    let headers = upstream.headers_mut();
    for (name, value) in client_headers {
        if !is_hop_by_hop(name) && name != header::HOST && name != header::CONTENT_LENGTH {
            headers.append(name.clone(), value.clone());
        }
    }
    if let Some(token) = &state.api_key_header {
        headers.insert(header::AUTHORIZATION, token.clone());
    }

    let in_flight = InFlight::begin(worker.clone(), prompt);
    let sent = tokio::time::timeout(state.request_timeout, conn::send(worker, upstream)).await;
    let now = Instant::now();
    match sent {
        Ok(Ok(response)) => {
            let status = response.status();
            if matches!(
                status,
                StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT
            ) {
                record_failure(state, worker, "status", now);
                return Attempt::RetryableStatus(response, in_flight);
            }
            if status.is_server_error() {
                record_failure(state, worker, "status", now);
            } else if worker.circuit.record_success() {
                state.metrics.circuit_state.with_label_values(&[&worker.url]).set(0);
            }
            Attempt::Done(response, in_flight)
        }
        Ok(Err(SendError::Connect(message))) => {
            record_failure(state, worker, "connect", now);
            let message = format!("{}: {message}", worker.url);
            tracing::debug!(worker = %worker.url, %message, "connect failed, will retry elsewhere");
            Attempt::Unreachable(message)
        }
        Ok(Err(SendError::Exchange(error))) => {
            record_failure(state, worker, "connect", now);
            Attempt::Fatal(ApiError::UpstreamUnreachable(format!("{}: {}", worker.url, error_chain(&error))))
        }
        Err(_) => {
            record_failure(state, worker, "timeout", now);
            Attempt::Fatal(ApiError::UpstreamTimeout(state.request_timeout.as_secs_f64()))
        }
    }
}

fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn record_failure(state: &AppState, worker: &Worker, kind: &str, now: Instant) {
    state.metrics.upstream_failures.with_label_values(&[&worker.url, kind]).inc();
    if worker.circuit.record_failure(now) {
        tracing::warn!(worker = %worker.url, "circuit opened after consecutive failures");
        state.metrics.circuit_state.with_label_values(&[&worker.url]).set(1);
    }
}

fn failure_response(
    state: &AppState,
    endpoint: Endpoint,
    started: Instant,
    failure: Failure,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
) -> Response {
    match failure {
        Failure::Response { response, worker, decision, in_flight } => {
            respond(state, endpoint, started, &worker, &decision, response, in_flight, permit)
        }
        Failure::Unreachable(message) => {
            let error = ApiError::UpstreamUnreachable(message);
            state
                .metrics
                .requests
                .with_label_values(&[endpoint.label(), error.status().as_str(), "none"])
                .inc();
            error.into_response()
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn respond(
    state: &AppState,
    endpoint: Endpoint,
    started: Instant,
    worker: &Worker,
    decision: &Decision,
    response: http::Response<UpstreamBody>,
    in_flight: InFlight,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
) -> Response {
    let (mut parts, body) = response.into_parts();
    let hop_by_hop: Vec<HeaderName> = parts.headers.keys().filter(|n| is_hop_by_hop(n)).cloned().collect();
    for name in hop_by_hop {
        parts.headers.remove(name);
    }
    if state.config.expose_routing_headers {
        if let Ok(value) = HeaderValue::from_str(&worker.url) {
            parts.headers.insert(WORKER_HEADER.clone(), value);
        }
        parts.headers.insert(ROUTE_HEADER.clone(), HeaderValue::from_static(decision.reason.as_str()));
        if let Some(index) = decision.index {
            parts.headers.insert(INDEX_HEADER.clone(), HeaderValue::from_static(index.as_str()));
        }
        if let Some(predicted) = decision.predicted {
            let terms = format!(
                "total={:.1}ms; queue={:.1}ms; prefill={:.1}ms; decode={:.1}ms; kv={:.1}ms",
                predicted.total() * 1e3,
                predicted.queue_s * 1e3,
                predicted.prefill_s * 1e3,
                predicted.decode_s * 1e3,
                predicted.kv_s * 1e3
            );
            if let Ok(value) = HeaderValue::from_str(&terms) {
                parts.headers.insert(PREDICTED_HEADER.clone(), value);
            }
        }
    }
    state.metrics.count_request(endpoint, parts.status, &worker.url, &worker.series);
    tracing::debug!(endpoint = endpoint.label(), worker = %worker.url, reason = decision.reason.as_str(), status = %parts.status, "proxied");
    let tail = RequestTail { endpoint, started, metrics: state.metrics.clone(), in_flight, permit };
    Response::from_parts(parts, Body::new(MeteredBody::new(body, tail)))
}
