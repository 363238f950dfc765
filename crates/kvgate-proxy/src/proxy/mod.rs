//! The request path of a proxied endpoint: read the body, prepare the request (`prepare.rs`:
//! the model's pools and the plan's shape, the checks, the routing key; the same preparation as
//! the dry run's), then plan and execute: a route plan is one worker or a (prefill, decode) pair
//! (`plan.rs`: `kvgate_route`'s plan on the gateway's pools, `choose.rs`), executed by one exchange
//! (`attempt.rs`) or a disaggregated pair of them (`pd.rs`); retries, errors and metrics stay in
//! this one loop, and the answer streams back (`respond.rs`).

mod attempt;
mod choose;
mod migrate;
mod outcome;
mod pd;
mod plan;
mod prepare;
mod request_id;
mod respond;
pub mod route_only;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::state::AppState;
use attempt::{attempt, Attempt};
use kvgate_admission::Ticket;
use kvgate_gateway_core::backoff::Backoff;
use kvgate_gateway_core::error::ApiError;
use kvgate_gateway_core::otel::{RequestSpan, TRACEPARENT};
use kvgate_observe::accuracy::Probe;
use kvgate_protocol::edit::FieldEdit;
use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::headers;
use kvgate_protocol::request::RequestFields;
use kvgate_protocol::role::PdProtocol;
use outcome::{Failure, Outcome, Served};
use plan::RoutePlan;
use prepare::prepare;
use respond::{failure_response, respond, Expect};

/// Most gateways one request may pass through.
const MAX_HOPS: usize = 8;

/// A request this gateway already forwarded (its id in `x-kvgate-via`), or one that passed
/// through too many gateways, is a routing loop.
fn check_loop(state: &AppState, headers: &http::HeaderMap) -> Result<(), ApiError> {
    let mut hops = 0;
    for value in headers.get_all(&headers::VIA) {
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
    let mut request = request;
    let cors_origin = crate::cors::allow_origin(&state.config.cors_allowed_origins, request.headers());
    let request_id = match state.config.request_id_headers.is_empty() {
        true => None,
        false => {
            let names = request_id::header_names(&state.config.request_id_headers);
            request_id::take(&names, request.headers_mut())
        }
    };
    // Tracing: the request's span, its context to the engines in `traceparent`.
    let mut span = state.traces.as_ref().map(|traces| traces.start(endpoint, request.headers()));
    if let Some(span) = &span {
        request.headers_mut().insert(TRACEPARENT.clone(), span.traceparent().clone());
    }
    let mut response = match proxy(&state, endpoint, request, started, &mut span).await {
        Ok(response) => response,
        Err(error) => {
            let status = error.status();
            if let Some(span) = &mut span {
                span.status(status);
            }
            state.metrics.requests.with_label_values(&[endpoint.label(), status.as_str(), "none"]).inc();
            let id = request_id.as_ref().and_then(|id| id.to_str().ok()).unwrap_or("");
            tracing::debug!(endpoint = endpoint.label(), %status, %error, request_id = id, "request failed in the gateway");
            error.into_response()
        }
    };
    if let Some(span) = &mut span {
        span.status(response.status()); // an answer the gateway made (the others carry the span)
    }
    if let Some(id) = request_id {
        response.headers_mut().insert(request_id::REQUEST_ID_HEADER.clone(), id);
    }
    if let Some(origin) = cors_origin {
        crate::cors::decorate(&mut response, origin);
    }
    response
}

/// Reads a request body of at most `limit` bytes, each frame within `stall` of the one before.
async fn read_body<B>(body: B, limit: usize, stall: Option<Duration>) -> Result<Bytes, ApiError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut chunks: Vec<Bytes> = Vec::new();
    loop {
        let frame = match stall {
            Some(stall) => tokio::time::timeout(stall, body.frame()).await.map_err(|_| {
                ApiError::RequestTimeout(format!(
                    "the request body stalled: no byte for {:.1} s (--body-stall-timeout-secs)",
                    stall.as_secs_f64()
                ))
            })?,
            None => body.frame().await,
        };
        match frame {
            None => break,
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    chunks.push(data);
                }
            }
            Some(Err(error)) if error.downcast_ref::<LengthLimitError>().is_some() => {
                return Err(ApiError::PayloadTooLarge(limit))
            }
            Some(Err(error)) => {
                return Err(ApiError::BadRequest(format!("could not read the request body: {error}")))
            }
        }
    }
    Ok(match chunks.len() {
        1 => chunks.pop().unwrap_or_default(),
        _ => chunks.concat().into(),
    })
}

async fn proxy<B>(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    request: http::Request<B>,
    started: Instant,
    span: &mut Option<RequestSpan>,
) -> Result<Response, ApiError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (parts, body) = request.into_parts();
    check_loop(state, &parts.headers)?;
    let caller = state.clients.authenticate(&parts.headers)?;
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
    let stall = state.config.body_stall_timeout_secs;
    let stall = (stall > 0.0).then(|| Duration::from_secs_f64(stall));
    let bytes = tokio::time::timeout(read_timeout, read_body(body, limit, stall)).await.map_err(|_| {
        ApiError::RequestTimeout(format!(
            "the request body did not arrive within {:.1} s (--body-read-timeout-secs)",
            read_timeout.as_secs_f64()
        ))
    })??;
    let fields = RequestFields::parse(&bytes).map_err(ApiError::BadRequest)?;
    // A client's KV-transfer fields never reach an engine, on any path (`kvgate_protocol::transfer`).
    let forwarded = match fields.carries_transfer_fields() {
        true => attempt::edited(
            &bytes,
            &kvgate_protocol::transfer::TRANSFER_FIELDS.map(FieldEdit::Remove),
            "a request",
        )?,
        false => bytes.clone(),
    };
    let prepared = prepare(state, endpoint, &fields, &parts.headers, &bytes).await?;
    // Admission once the request is known: its tenant, class and size.
    let identity = state
        .clients
        .identify(&caller, &parts.headers, fields.user.as_deref(), |t| state.admission.class_of(t))?;
    let tokens = match state.admission.counts_tokens() {
        true => {
            let prompt = match prepared.prompt_tokens {
                0 => kvgate_protocol::request::estimate_tokens(&fields.routing_key()),
                known => known,
            };
            prompt.saturating_add(fields.max_output_tokens())
        }
        false => 0,
    };
    let open_ended = endpoint != Endpoint::Embeddings && fields.max_output_tokens() == 0;
    let ticket = Ticket { tenant: &identity.tenant, class: identity.class, tokens, open_ended };
    let shape = &prepared.shape;
    let route_request = prepared.route_request();
    // A waiter's locality score: the prompt tokens the policy predicts cached where it would
    // route the request now (a dry run: nothing recorded).
    let locality = || {
        shape
            .dry_run(state, &route_request, prepared.namespace)
            .map_or(0, |plan| plan.predicted_cached_tokens(route_request.prompt_tokens))
    };
    let permit = state.admission.admit_scored(ticket, locality).await?;
    let target = match parts.headers.get(&headers::TARGET_WORKER) {
        Some(value) if state.config.routing_key_override => Some(shape.target(value)?),
        _ => None,
    };
    let path_and_query = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or(endpoint.path());
    // The gateway learns the usage of every stream it needs it of (the closed loop: one routed on
    // token ids; a tenant's tokens-per-minute charge): a client that did not ask for the usage
    // chunk gets it asked for on its behalf, and left out of its answer again.
    // kv_aware learns its engines' speed from the streams' times to first token and usage.
    let closed_loop = match (shape, &route_request.key) {
        (plan::Shape::Single(_), kvgate_policy::RoutingKey::Tokens(_)) => true,
        (plan::Shape::Single(pool), _) => pool.policy.predicts(),
        _ => false,
    };
    let asked = match matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Completions)
        && fields.stream == Some(true)
        && !fields.asks_usage()
        && (closed_loop || permit.wants_usage())
    {
        true => kvgate_observe::accuracy::ask_for_usage(&forwarded),
        false => None,
    };
    // What goes to the engines of the client's headers: not the gateway's own (`x-kvgate-*`,
    // the tenant and priority headers); the hop header is chained by each attempt.
    let upstream_headers = upstream_headers(state, &parts.headers);
    let max_output = fields.max_output_tokens();
    let tenant_label = state.admission.tenant_label(&identity.tenant);
    let tenant: &str = &tenant_label;
    let expect = Expect {
        strip_usage: asked.is_some(),
        body_bytes: bytes.len() as u64,
        max_output: (max_output > 0).then_some(max_output),
        choices: fields.choices(),
        resume: migrate::Resume::of(
            state,
            endpoint,
            path_and_query,
            (&upstream_headers, &parts.headers),
            &fields,
            &forwarded,
            (state.config.forward_priority.value(identity.class), tenant),
        ),
    };
    let body = asked.unwrap_or(forwarded);
    // The class as the engine's `priority` (`--forward-priority`), on generation requests.
    let body = match state.config.forward_priority.value(identity.class) {
        Some(priority) if !matches!(endpoint, Endpoint::Embeddings) => attempt::edited(
            &body,
            &[FieldEdit::Set("priority", priority.into())],
            "a request with --forward-priority",
        )?,
        _ => body,
    };
    let exchange = pd::Exchange {
        state,
        path_and_query,
        headers: &upstream_headers,
        body: &body,
        request: &route_request,
        namespace: prepared.namespace,
        tenant,
        started,
    };

    let retries_allowed = if state.config.disable_retries { 0 } else { state.config.retry_max_retries };
    let mut tried: Vec<u32> = Vec::with_capacity(2);
    let mut last_failure: Option<Failure> = None;
    let mut retries = 0;
    // Made at the first retry.
    let mut backoff: Option<Backoff> = None;
    // A pair whose decode engine answered a failed transfer: the next attempt goes in place on a
    // decode engine (once per request; no backoff, no retry counted).
    let mut fallback: Option<kvgate_policy::PdChoice> = None;
    let mut fell_back = false;
    loop {
        let in_place = fallback
            .take()
            .and_then(|pair| shape.plan_in_place(state, &route_request, prepared.namespace, &tried, &pair));
        let planned = match in_place {
            Some(plan) => Ok(plan),
            None => shape.plan(state, &route_request, prepared.namespace, &tried, target),
        };
        let plan = match planned {
            Ok(plan) => plan,
            Err(error) => {
                return match last_failure {
                    Some(failure) => {
                        Ok(failure_response(state, endpoint, started, failure, permit, expect, span))
                    }
                    None => Err(error),
                }
            }
        };
        if let Some(span) = span.as_mut() {
            trace_plan(span, &plan);
        }
        let (outcome, pd) = match plan {
            RoutePlan::Single(pick) => (single(&exchange, pick).await, None),
            RoutePlan::Pair { prefill, decode, pd } => {
                let may_fall_back =
                    !fell_back && state.config.pd_fallback_in_place && prefill.pool.config.pd_conditional;
                let (decode_id, decode_pool) = (decode.worker.id, decode.pool.clone());
                let outcome = match state.config.pd_protocol {
                    PdProtocol::Sglang => pd::sglang(&exchange, prefill, decode, may_fall_back).await,
                    PdProtocol::Vllm => pd::vllm(&exchange, prefill, decode).await,
                };
                if may_fall_back && pd::transfer_failed(&outcome, decode_id) {
                    // The failed answer is dropped (its body and in-flight count): the in-place
                    // attempt's own outcome is what the client gets.
                    drop(outcome);
                    if let Some(span) = span.as_mut() {
                        span.failed("status");
                    }
                    state.metrics.pd_transfer_fallbacks.with_label_values(&[&decode_pool.model]).inc();
                    fallback = Some(pd);
                    fell_back = true;
                    continue;
                }
                (outcome, Some(pd))
            }
            // The plain request: the decode engine prefills it itself.
            RoutePlan::InPlace { decode, pd } => (single(&exchange, decode).await, Some(pd)),
        };
        match outcome {
            Outcome::Done(mut served) => {
                served.pd = pd;
                return Ok(respond(state, endpoint, started, *served, permit, expect, span));
            }
            Outcome::Fatal(error) => return Err(error),
            Outcome::Retry { failure, failed } => {
                if let Some(span) = span.as_mut() {
                    span.failed(failure.kind());
                }
                tried.push(failed);
                last_failure = Some(failure);
            }
        }
        if retries >= retries_allowed || !shape.untried_left(state, &tried) {
            let failure = last_failure.expect("a retryable failure was just recorded");
            return Ok(failure_response(state, endpoint, started, failure, permit, expect, span));
        }
        retries += 1;
        if let Some(span) = span.as_mut() {
            span.retries(retries);
        }
        state.metrics.retries.with_label_values(&[endpoint.label()]).inc();
        let backoff = backoff.get_or_insert_with(|| {
            let millis = |ms: u64| Duration::from_millis(ms);
            Backoff::new(
                millis(state.config.retry_initial_backoff_ms),
                millis(state.config.retry_max_backoff_ms),
            )
        });
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// The client's headers an engine may see: the gateway's own (`Clients::is_gateway_header`)
/// are left out, but for the hop header (`x-kvgate-via`), which each attempt extends; so are
/// the connection's own and the client's credentials (`attempt::forwarded`).
fn upstream_headers(state: &AppState, headers: &http::HeaderMap) -> http::HeaderMap {
    let forward_credentials = attempt::forwards_credentials(state);
    let mut kept = http::HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let ours = *name != headers::VIA && state.clients.is_gateway_header(name);
        if !ours && attempt::forwarded(name, forward_credentials) {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// The attempt's plan on the request's span: each side's worker and decision.
fn trace_plan(span: &mut RequestSpan, plan: &RoutePlan) {
    match plan {
        RoutePlan::Single(pick) => span.route("regular", &pick.worker.url, &pick.decision),
        RoutePlan::Pair { prefill, decode, .. } => {
            span.route("prefill", &prefill.worker.url, &prefill.decision);
            span.route("decode", &decode.worker.url, &decode.decision);
        }
        RoutePlan::InPlace { decode, .. } => span.route("in_place", &decode.worker.url, &decode.decision),
    }
}

/// Executes a one-worker plan.
async fn single(ex: &pd::Exchange<'_>, pick: plan::Pick) -> Outcome {
    // Taken before the prompt counts as in flight on the worker: what its engine should hold.
    let probe = pick.probe(ex.request, ex.namespace).map(|probe| {
        // The fleet's KV map learns what was served from where, and for whom (a short record).
        if let Some(hashes) = &pick.hashes {
            let index = &pick.pool.prefix.exact;
            if let Some(layout) = index.layouts().first() {
                ex.state.kv_map.record(
                    (&pick.pool.model, pick.pool.role.as_str()),
                    ex.tenant,
                    hashes.hashes(*layout),
                    layout.block_size as usize,
                    u64::from(probe.predicted),
                    ex.state.clock.now_ms(),
                );
            }
        }
        Probe { tenant: Some(ex.tenant.to_string()), ..probe }
    });
    let learn = pick.learn(ex.request, ex.started.elapsed().as_secs_f64());
    let prompt = pick.in_flight_prompt(ex.request, ex.namespace);
    let result =
        attempt(ex.state, &pick.worker, ex.path_and_query, ex.headers, ex.body.clone(), prompt).await;
    let served = |response, in_flight| {
        Box::new(Served {
            response,
            in_flight,
            worker: pick.worker,
            decision: pick.decision,
            prefill: None,
            probe,
            learn,
            pd: None,
        })
    };
    match result {
        Attempt::Answered(response, in_flight) => Outcome::Done(served(response, in_flight)),
        Attempt::Failed(error) => error.into_outcome(served),
    }
}
