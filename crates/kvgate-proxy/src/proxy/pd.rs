//! Executing a disaggregated route plan: a prefill worker and a decode worker, told about each
//! other the SGLang way (the same request to both at once, with `bootstrap_host`,
//! `bootstrap_port` and a random `bootstrap_room`) or the vLLM way (the prefill worker first,
//! with `max_tokens: 1` and `kv_transfer_params.do_remote_decode`, then the decode worker with
//! the `kv_transfer_params` the prefill answer returned). The decode side's answer is the
//! client's. Whichever side fails before a byte reached the client, the other is cancelled
//! (its request dropped) and the outcome says which worker to avoid on the retry; a decode
//! engine answering a failed transfer is, with `--pd-fallback-in-place`, asked again in place
//! ([`transfer_failed`]).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::HeaderMap;
use kvgate_index::Namespace;
use kvgate_policy::RouteRequest;
use kvgate_protocol::edit::FieldEdit;
use kvgate_protocol::transfer;
use rand::Rng;

use super::attempt::{attempt, edited, Attempt, AttemptError, AttemptErrorKind};
use super::outcome::{Failure, Outcome, Served};
use super::plan::Pick;
use crate::body::InFlight;
use crate::state::AppState;
use kvgate_gateway_core::conn::UpstreamBody;
use kvgate_gateway_core::error::ApiError;
use kvgate_gateway_core::upstream::{drain_limited, read_limited, GetError};
use kvgate_protocol::role::WorkerRole;

/// What every exchange of one request shares.
pub(super) struct Exchange<'a> {
    pub state: &'a Arc<AppState>,
    pub path_and_query: &'a str,
    pub headers: &'a HeaderMap,
    pub body: &'a Bytes,
    pub request: &'a RouteRequest<'a>,
    pub namespace: Namespace<'a>,
    /// The request's tenant, as its series name it (`Admission::tenant_label`).
    pub tenant: &'a str,
    /// When the request arrived at the gateway.
    pub started: Instant,
}

/// The request body with `edits` applied (`kvgate_protocol::transfer`'s writers).
fn rewrite(body: &[u8], edits: &[FieldEdit<'_>]) -> Result<Bytes, ApiError> {
    edited(body, edits, "a disaggregated request")
}

/// The `status` label of one side's attempt.
fn status_label(attempt: &Attempt) -> String {
    match attempt {
        Attempt::Answered(response, _) => response.status().as_str().to_string(),
        Attempt::Failed(error) => error.label(),
    }
}

fn count(state: &AppState, role: WorkerRole, attempt: &Attempt) {
    state.metrics.pd_requests.with_label_values(&[role.as_str(), &status_label(attempt)]).inc();
}

/// How the prefill side went.
enum PrefillResult {
    Ok(http::Response<UpstreamBody>, InFlight),
    /// A 4xx: the request itself is wrong; the client gets this answer.
    Refused(Box<Served>),
    /// The prefill side failed (its server errors are no client's answer).
    Failed(AttemptError),
}

/// A prefill worker's answer as the client would get it (a refusal).
fn prefill_served(prefill: &Pick) -> impl FnOnce(http::Response<UpstreamBody>, InFlight) -> Box<Served> + '_ {
    |response, in_flight| {
        Box::new(Served {
            response,
            in_flight,
            worker: prefill.worker.clone(),
            decision: prefill.decision,
            prefill: None,
            probe: None,
            learn: None,
            pd: None,
        })
    }
}

fn classify_prefill(prefill: &Pick, result: Attempt) -> PrefillResult {
    match result {
        Attempt::Answered(response, in_flight) if response.status().is_success() => {
            PrefillResult::Ok(response, in_flight)
        }
        Attempt::Answered(response, in_flight) => {
            PrefillResult::Refused(prefill_served(prefill)(response, in_flight))
        }
        Attempt::Failed(error) => PrefillResult::Failed(error),
    }
}

/// The decode side's attempt as the plan's outcome.
fn decode_outcome(prefill: Pick, decode: Pick, result: Attempt) -> Outcome {
    let served = |response, in_flight| {
        Box::new(Served {
            response,
            in_flight,
            worker: decode.worker,
            decision: decode.decision,
            prefill: Some((prefill.worker, prefill.decision)),
            probe: None,
            learn: None,
            pd: None,
        })
    };
    match result {
        Attempt::Answered(response, in_flight) => Outcome::Done(served(response, in_flight)),
        Attempt::Failed(error) => error.into_outcome(served),
    }
}

/// Reads a finished prefill answer to its end without keeping it (so its connection is
/// reused), at most `--max-prefill-answer-bytes`, then ends it.
async fn drain(state: Arc<AppState>, response: http::Response<UpstreamBody>, in_flight: InFlight) {
    let limit = state.config.max_prefill_answer_bytes;
    let drained = tokio::time::timeout(state.request_timeout, drain_limited(response.into_body(), limit));
    if let Ok(Err(GetError::Oversized { .. })) = drained.await {
        state.metrics.count_oversized("prefill");
    }
    drop(in_flight);
}

/// A server error other than 503 (overloaded or unhealthy, which in place would not help):
/// what a decode engine answers when a pair's KV transfer failed or never came (the mock's 502
/// `kv_transfer_error`; SGLang 0.5's decode side aborts the request with a 500).
fn is_transfer_failure(status: http::StatusCode) -> bool {
    status.is_server_error() && status != http::StatusCode::SERVICE_UNAVAILABLE
}

fn attempt_failed_transfer(attempt: &Attempt) -> bool {
    match attempt {
        Attempt::Answered(response, _)
        | Attempt::Failed(AttemptError { kind: AttemptErrorKind::Status(response, _), .. }) => {
            is_transfer_failure(response.status())
        }
        Attempt::Failed(_) => false,
    }
}

/// Whether a pair's outcome is its decode engine (`decode`) answering a failed transfer: the
/// retry loop then sends the plain request there, in place (`--pd-fallback-in-place`).
pub(super) fn transfer_failed(outcome: &Outcome, decode: u32) -> bool {
    match outcome {
        Outcome::Retry { failure: Failure::Response(served), failed } => {
            *failed == decode && is_transfer_failure(served.response.status())
        }
        Outcome::Done(served) => {
            served.prefill.is_some()
                && served.worker.id == decode
                && is_transfer_failure(served.response.status())
        }
        _ => false,
    }
}

/// SGLang: the same request, with the bootstrap fields, to both workers at once. With
/// `fallback`, a decode answer of a failed transfer ends the pair at once (the prefill request,
/// if still running, is dropped: cancelled), for the retry loop to send it in place.
pub(super) async fn sglang(ex: &Exchange<'_>, prefill: Pick, decode: Pick, fallback: bool) -> Outcome {
    let room = rand::rng().random_range(0..=i64::MAX as u64);
    let bootstrap = transfer::sglang_bootstrap(prefill.worker.host(), prefill.worker.bootstrap_port, room);
    let body = match rewrite(ex.body, &bootstrap) {
        Ok(body) => body,
        Err(error) => return Outcome::Fatal(error),
    };
    let send = |pick: &Pick| {
        let (state, worker) = (ex.state.clone(), pick.worker.clone());
        let (path, headers, body) = (ex.path_and_query.to_string(), ex.headers.clone(), body.clone());
        let prompt = pick.in_flight_prompt(ex.request, ex.namespace);
        async move {
            let result = attempt(&state, &worker, &path, &headers, body, prompt).await;
            count(&state, worker.role, &result);
            result
        }
    };
    let mut prefill_side = Box::pin(send(&prefill));
    let mut decode_side = Box::pin(send(&decode));
    // The decode side's answer, held until the prefill side has answered too: a decode answer
    // whose prefill failed would break once its KV does not arrive, and a decode error answer
    // that comes first may be the prefill side's fault (its KV never came), so the side to
    // blame for the retry is only known once the prefill side answered.
    let mut decoded: Option<Attempt> = None;
    let mut prefill_done = false;
    loop {
        tokio::select! {
            result = &mut prefill_side, if !prefill_done => match classify_prefill(&prefill, result) {
                PrefillResult::Ok(response, in_flight) => {
                    tokio::spawn(drain(ex.state.clone(), response, in_flight));
                    if let Some(result) = decoded.take() {
                        return decode_outcome(prefill, decode, result);
                    }
                    prefill_done = true;
                }
                // Returning drops the decode side's request: the decode worker stops waiting.
                PrefillResult::Refused(served) => return Outcome::Done(served),
                PrefillResult::Failed(error) => return error.into_outcome(prefill_served(&prefill)),
            },
            result = &mut decode_side, if decoded.is_none() => {
                // Held: a success, or an error answer (maybe the prefill side's fault); the
                // rest (unreachable, no head in time, fatal) is the decode side's own.
                let held = matches!(
                    result,
                    Attempt::Answered(..) | Attempt::Failed(AttemptError { kind: AttemptErrorKind::Status(..), .. })
                );
                if prefill_done || !held || (fallback && attempt_failed_transfer(&result)) {
                    return decode_outcome(prefill, decode, result);
                }
                decoded = Some(result);
            }
        }
    }
}

/// vLLM: the prefill worker computes the KV (one token), then the decode worker pulls it.
pub(super) async fn vllm(ex: &Exchange<'_>, prefill: Pick, decode: Pick) -> Outcome {
    let first = match rewrite(ex.body, &transfer::vllm_prefill()) {
        Ok(body) => body,
        Err(error) => return Outcome::Fatal(error),
    };
    let state = ex.state;
    let prompt = prefill.in_flight_prompt(ex.request, ex.namespace);
    let result = attempt(state, &prefill.worker, ex.path_and_query, ex.headers, first, prompt).await;
    count(state, WorkerRole::Prefill, &result);
    let params = match classify_prefill(&prefill, result) {
        PrefillResult::Ok(response, in_flight) => {
            let limit = state.config.max_prefill_answer_bytes;
            let read = tokio::time::timeout(state.request_timeout, read_limited(response.into_body(), limit));
            let read = read.await;
            drop(in_flight);
            let params = match read {
                Ok(Ok(body)) => transfer::params_of_prefill_answer(&body),
                Ok(Err(GetError::Oversized { .. })) => {
                    state.metrics.count_oversized("prefill");
                    None
                }
                _ => None,
            };
            match params {
                Some(params) => params,
                None => {
                    let message = format!(
                        "{}: the prefill answer carries no kv_transfer_params (is the engine's KV connector configured?)",
                        prefill.worker.url
                    );
                    let kind = AttemptErrorKind::Protocol(message);
                    let error = AttemptError { worker: prefill.worker.id, role: prefill.worker.role, kind };
                    return error.into_outcome(prefill_served(&prefill));
                }
            }
        }
        PrefillResult::Refused(served) => return Outcome::Done(served),
        PrefillResult::Failed(error) => return error.into_outcome(prefill_served(&prefill)),
    };
    let second = match rewrite(ex.body, &transfer::vllm_decode(params)) {
        Ok(body) => body,
        Err(error) => return Outcome::Fatal(error),
    };
    let prompt = decode.in_flight_prompt(ex.request, ex.namespace);
    let result = attempt(state, &decode.worker, ex.path_and_query, ex.headers, second, prompt).await;
    count(state, WorkerRole::Decode, &result);
    decode_outcome(prefill, decode, result)
}
