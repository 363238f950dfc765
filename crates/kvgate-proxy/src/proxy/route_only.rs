//! `POST /v1/route`: the routing decision a request would get, without forwarding it. The body
//! is the request as a client would send it (the endpoint is `?endpoint=` or inferred from the
//! body); the answer names the worker (or the prefill and decode pair, or the decode worker
//! prefilling in place, with the conditional rule's verdict as `path` and `pd`), the reason and
//! the prefix index consulted. Nothing is recorded: no prefix index learns the choice, no policy
//! records it (its `on_routed` is never called: round_robin's turn stays, manual binds no
//! session), no metric or peer replica hears of it, and no request reaches a worker. Behind the
//! admin key.

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use kvgate_policy::PdChoice;
use serde::Deserialize;
use serde_json::{json, Value};

use super::plan::{Pick, RoutePlan};
use super::prepare::prepare;
use crate::state::SharedState;
use kvgate_gateway_core::error::ApiError;
use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::request::RequestFields;

#[derive(Debug, Deserialize)]
pub struct RouteQuery {
    /// `chat_completions`, `completions`, `generate` or `embeddings` (the metrics labels).
    endpoint: Option<String>,
}

pub async fn route(
    State(state): State<SharedState>,
    Query(query): Query<RouteQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match decide(&state, &query, &headers, &body).await {
        Ok(answer) => Json(answer).into_response(),
        Err(error) => error.into_response(),
    }
}

/// The endpoint named by the query, else the one the body's fields belong to.
fn endpoint(query: &RouteQuery, fields: &RequestFields<'_>) -> Result<Endpoint, ApiError> {
    if let Some(label) = &query.endpoint {
        return Endpoint::ALL.into_iter().find(|e| e.label() == label).ok_or_else(|| {
            ApiError::BadRequest(format!(
                "unknown endpoint {label:?}: chat_completions, completions, generate or embeddings"
            ))
        });
    }
    Ok(if fields.messages.is_some() {
        Endpoint::ChatCompletions
    } else if fields.prompt.is_some() {
        Endpoint::Completions
    } else if fields.input.is_some() {
        Endpoint::Embeddings
    } else {
        Endpoint::Generate
    })
}

async fn decide(
    state: &SharedState,
    query: &RouteQuery,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Value, ApiError> {
    kvgate_gateway_core::auth::check_admin_key(state.config.admin_api_key.as_deref(), headers)?;
    if body.len() > state.config.max_payload_size {
        return Err(ApiError::PayloadTooLarge(state.config.max_payload_size));
    }
    let fields = RequestFields::parse(body).map_err(ApiError::BadRequest)?;
    let endpoint = endpoint(query, &fields)?;
    let prepared = prepare(state, endpoint, &fields, headers, body).await?;
    let route_request = prepared.route_request();
    Ok(match prepared.shape.dry_run(state, &route_request, prepared.namespace)? {
        RoutePlan::Single(pick) => {
            let mut answer = describe(&pick, endpoint);
            // What the engine would serve from cache there, as the closed loop compares it.
            answer["prompt_tokens"] = json!(route_request.prompt_tokens);
            answer["predicted_cached_tokens"] =
                json!(kvgate_policy::cached_tokens(&pick.decision, route_request.prompt_tokens));
            answer
        }
        RoutePlan::Pair { prefill, decode, pd } => json!({
            "endpoint": endpoint.label(),
            "path": pd.path.as_str(),
            "pd": describe_pd(&pd),
            "prefill": describe(&prefill, endpoint),
            "decode": describe(&decode, endpoint),
        }),
        RoutePlan::InPlace { decode, pd } => json!({
            "endpoint": endpoint.label(),
            "path": pd.path.as_str(),
            "pd": describe_pd(&pd),
            "decode": describe(&decode, endpoint),
        }),
    })
}

/// The conditional rule's verdict and inputs.
fn describe_pd(pd: &PdChoice) -> Value {
    json!({
        "path": pd.path.as_str(),
        "why": pd.why.as_str(),
        "prompt_tokens": pd.inputs.prompt_tokens,
        "cached_tokens": pd.inputs.cached_tokens,
        "uncached_tokens": pd.inputs.uncached_tokens(),
        "uncached_fraction": pd.inputs.uncached_fraction(),
        "prefill_queue": pd.inputs.prefill_queue,
        // Both paths' predictions (kv_aware on both sides), in seconds.
        "predicted": pd.inputs.predicted.map(|p| json!({
            "in_place_s": p.in_place_s,
            "pair_s": p.pair_s(),
            "prefill_s": p.prefill_s,
            "transfer_s": p.transfer_s,
            "decode_wait_s": p.decode_wait_s,
            "in_place_cost_s": p.in_place_cost_s(),
            "pair_cost_s": p.pair_cost_s(),
        })),
    })
}

fn describe(pick: &Pick, endpoint: Endpoint) -> Value {
    let decision = &pick.decision;
    json!({
        "endpoint": endpoint.label(),
        "model": pick.pool.model,
        "worker": pick.worker.url,
        "reason": decision.reason.as_str(),
        "index": decision.index.map(|index| index.as_str()),
        "chosen_match_rate": decision.matches.map(|m| m.chosen_match_rate),
        "best_match_rate": decision.matches.map(|m| m.best_match_rate),
    })
}
