//! The request path of a proxied endpoint: read and check the body, find the model's pools, then
//! plan and execute: a route plan is one worker or a (prefill, decode) pair (`plan.rs`), executed
//! by one exchange (`attempt.rs`) or a disaggregated pair of them (`pd.rs`); retries, errors and
//! metrics stay in this one loop, and the answer streams back (`respond.rs`).

mod attempt;
mod pd;
mod plan;
mod respond;
pub(crate) mod route_only;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use kvgate_policy::{RouteRequest, RoutingKey};
use rand::Rng;

use crate::error::ApiError;
use crate::request::{OwnedKey, RequestFields};
use crate::role::PdProtocol;
use crate::state::AppState;
use attempt::{attempt, Attempt};
use plan::{RoutePlan, Shape};
use respond::{failure_response, respond, Failure, Outcome, Served};

/// The gateways a request passed through, by instance id (loop detection).
pub(crate) static VIA_HEADER: http::HeaderName = http::HeaderName::from_static("x-kvgate-via");
/// Most gateways one request may pass through.
const MAX_HOPS: usize = 8;

/// A request this gateway already forwarded (its id in `x-kvgate-via`), or one that passed
/// through too many gateways, is a routing loop.
fn check_loop(state: &AppState, headers: &http::HeaderMap) -> Result<(), ApiError> {
    let mut hops = 0;
    for value in headers.get_all(&VIA_HEADER) {
        for hop in value.as_bytes().split(|&b| b == b',') {
            hops += 1;
            if hop.trim_ascii() == state.instance.as_bytes() {
                return Err(ApiError::LoopDetected(
                    "routing loop: this request already passed through this gateway (a worker URL points back at a gateway)".into(),
                ));
            }
        }
    }
    if hops >= MAX_HOPS {
        return Err(ApiError::LoopDetected(format!(
            "routing loop: the request passed through {hops} gateways"
        )));
    }
    Ok(())
}

/// With `--client-api-keys`, the request must present one of them (compared in constant time).
fn check_client_key(state: &AppState, headers: &http::HeaderMap) -> Result<(), ApiError> {
    let keys = &state.config.client_api_keys;
    if keys.is_empty() {
        return Ok(());
    }
    let presented = crate::admin::bearer_token(headers);
    let mut valid = false;
    for key in keys {
        valid |= crate::admin::constant_time_eq(presented.as_bytes(), key.as_bytes());
    }
    if valid {
        Ok(())
    } else {
        Err(ApiError::InvalidApiKey)
    }
}

/// Names the worker a request must go to (with `--routing-key-override`).
static TARGET_HEADER: http::HeaderName = http::HeaderName::from_static("x-kvgate-target-worker");

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
    let (parts, body) = request.into_parts();
    check_loop(state, &parts.headers)?;
    check_client_key(state, &parts.headers)?;
    let permit = state.admission.admit().await?;
    let limit = state.config.max_payload_size;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    let read_timeout = Duration::from_secs_f64(state.config.body_read_timeout_secs);
    let bytes = tokio::time::timeout(read_timeout, read_body(body, limit)).await.map_err(|_| {
        ApiError::RequestTimeout(format!(
            "the request body did not arrive within {:.1} s (--body-read-timeout-secs)",
            read_timeout.as_secs_f64()
        ))
    })??;
    let fields = RequestFields::parse(&bytes).map_err(ApiError::BadRequest)?;

    let pools = model_pools(state, fields.model.as_deref())?;
    let shape = Shape::of(state, &pools, endpoint)?;
    fields.check(endpoint).map_err(ApiError::BadRequest)?;
    let (key, prompt_tokens) = if shape.needs_routing_key() {
        crate::tokenize::routing_key(state, shape.key_pool(), endpoint, &fields, &bytes).await
    } else {
        (OwnedKey::None, 0)
    };
    let session = parts
        .headers
        .get(&state.routing_key_header)
        .and_then(|value| value.to_str().ok())
        .or(fields.user.as_deref());
    let target = match parts.headers.get(&TARGET_HEADER) {
        Some(value) if state.config.routing_key_override => Some(shape.target(value)?),
        _ => None,
    };
    let route_request = RouteRequest {
        key: match &key {
            OwnedKey::None => RoutingKey::None,
            OwnedKey::Text(text) => RoutingKey::Text(text),
            OwnedKey::Tokens(ids) => RoutingKey::Tokens(ids),
        },
        prompt_tokens,
        session,
    };
    let path_and_query = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or(endpoint.path());
    let exchange = pd::Exchange {
        state,
        path_and_query,
        headers: &parts.headers,
        body: &bytes,
        request: &route_request,
    };

    let retries_allowed = if state.config.disable_retries { 0 } else { state.config.retry_max_retries };
    let mut tried: Vec<u32> = Vec::with_capacity(2);
    let mut last_failure: Option<Failure> = None;
    let mut retries = 0;
    loop {
        let plan = match shape.plan(state, &route_request, &tried, target) {
            Ok(plan) => plan,
            Err(error) => {
                return match last_failure {
                    Some(failure) => Ok(failure_response(state, endpoint, started, failure, permit)),
                    None => Err(error),
                }
            }
        };
        let outcome = match plan {
            RoutePlan::Single(pick) => single(&exchange, pick).await,
            RoutePlan::Pair { prefill, decode } => match state.config.pd_protocol {
                PdProtocol::Sglang => pd::sglang(&exchange, prefill, decode).await,
                PdProtocol::Vllm => pd::vllm(&exchange, prefill, decode).await,
            },
        };
        match outcome {
            Outcome::Done(served) => return Ok(respond(state, endpoint, started, *served, permit)),
            Outcome::Fatal(error) => return Err(error),
            Outcome::Retry { failure, failed } => {
                tried.push(failed);
                last_failure = Some(failure);
            }
        }
        if retries >= retries_allowed || !shape.untried_left(&tried) {
            let failure = last_failure.expect("a retryable failure was just recorded");
            return Ok(failure_response(state, endpoint, started, failure, permit));
        }
        retries += 1;
        state.metrics.retries.with_label_values(&[endpoint.label()]).inc();
        tokio::time::sleep(backoff(state, retries)).await;
    }
}

/// Executes a one-worker plan.
async fn single(ex: &pd::Exchange<'_>, pick: plan::Pick) -> Outcome {
    let prompt = pick.in_flight_prompt(ex.request);
    let result =
        attempt(ex.state, &pick.worker, ex.path_and_query, ex.headers, ex.body.clone(), prompt).await;
    let failed = pick.worker.id;
    let served = |response, in_flight| {
        Box::new(Served { response, in_flight, worker: pick.worker, decision: pick.decision, prefill: None })
    };
    match result {
        Attempt::Done(response, in_flight) => Outcome::Done(served(response, in_flight)),
        Attempt::RetryableStatus(response, in_flight) => {
            Outcome::Retry { failure: Failure::Response(served(response, in_flight)), failed }
        }
        Attempt::Unreachable(message) => Outcome::Retry { failure: Failure::Unreachable(message), failed },
        Attempt::SlowHead(timeout) => {
            Outcome::Retry { failure: Failure::TimedOut(timeout.as_secs_f64()), failed }
        }
        Attempt::Fatal(error) => Outcome::Fatal(error),
    }
}

/// The pools of the request's model (a copy of the registry's handles, so no snapshot is held
/// while the request runs), or the 404/400 a client gets when there is none.
pub(super) fn model_pools(
    state: &AppState,
    model: Option<&str>,
) -> Result<crate::registry::ModelPools, ApiError> {
    let snapshot = state.registry.snapshot();
    match snapshot.pool_for(model) {
        Some(pools) => Ok(pools.clone()),
        None => Err(no_pool_error(snapshot.models.len(), model)),
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

fn backoff(state: &AppState, retry: u32) -> Duration {
    let initial = state.config.retry_initial_backoff_ms as f64;
    let capped =
        (initial * 2f64.powi(retry.saturating_sub(1) as i32)).min(state.config.retry_max_backoff_ms as f64);
    // Jitter in [50%, 100%] so that retries from many requests do not line up.
    let jittered = capped * rand::rng().random_range(0.5..=1.0);
    Duration::from_micros((jittered * 1000.0) as u64)
}
