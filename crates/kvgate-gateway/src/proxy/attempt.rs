//! One exchange with one worker: build the upstream request, send it under the request timeout,
//! and classify the answer (done, retryable, unreachable, fatal), recording failures on the
//! worker's circuit breaker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, StatusCode};
use http_body_util::Full;
use kvgate_config::error_chain;
use kvgate_index::InFlightPrompt;

use crate::body::InFlight;
use crate::conn::{self, SendError, UpstreamBody};
use crate::error::ApiError;
use crate::registry::ModelPrefix;
use crate::state::AppState;
use crate::upstream::is_hop_by_hop;
use crate::worker::Worker;

/// Outcome of one attempt on one worker.
pub(super) enum Attempt {
    Done(http::Response<UpstreamBody>, InFlight),
    /// 502/503/504 before any byte went to the client.
    RetryableStatus(http::Response<UpstreamBody>, InFlight),
    /// Connection could not be established.
    Unreachable(String),
    /// No response head within `--ttfb-timeout-secs`: the request was dropped there, nothing
    /// reached the client, another worker may take it.
    SlowHead(Duration),
    /// The exchange failed after the request may have reached the worker, or timed out.
    Fatal(ApiError),
}

pub(super) async fn attempt(
    state: &AppState,
    worker: &Arc<Worker>,
    path_and_query: &str,
    client_headers: &http::HeaderMap,
    body: Bytes,
    prompt: Option<(Arc<ModelPrefix>, InFlightPrompt)>,
) -> Attempt {
    let body = match worker.dp_rank {
        Some(rank) => match with_dp_rank(&body, rank) {
            Ok(body) => body,
            Err(error) => return Attempt::Fatal(error),
        },
        None => body,
    };
    let mut upstream = http::Request::new(Full::new(body));
    *upstream.method_mut() = http::Method::POST;
    *upstream.uri_mut() = match worker.conns.target(path_and_query) {
        Ok(uri) => uri,
        Err(e) => return Attempt::Fatal(ApiError::BadRequest(format!("invalid request path: {e}"))),
    };
    let headers = upstream.headers_mut();
    let forward_credentials = state.config.forward_client_auth
        && state.config.client_api_keys.is_empty()
        && state.config.client_api_keys_file.is_none();
    for (name, value) in client_headers {
        if forwarded(name, forward_credentials) {
            headers.append(name.clone(), value.clone());
        }
    }
    if let Some(token) = &state.api_key_header {
        headers.insert(header::AUTHORIZATION, token.clone());
    }
    // Every gateway a request passes adds its id: one that sees its own refuses it (a loop).
    let via = match client_headers.get(&super::VIA_HEADER) {
        None => state.instance.clone(),
        Some(hops) => {
            let mut chained = hops.as_bytes().to_vec();
            chained.extend_from_slice(b", ");
            chained.extend_from_slice(state.instance.as_bytes());
            http::HeaderValue::from_bytes(&chained).unwrap_or_else(|_| state.instance.clone())
        }
    };
    headers.insert(super::VIA_HEADER.clone(), via);

    let in_flight = InFlight::begin(worker.clone(), prompt);
    let head_timeout = state.ttfb_timeout.map_or(state.request_timeout, |t| t.min(state.request_timeout));
    let sent =
        tokio::time::timeout(head_timeout, conn::send(&worker.conns, upstream, &state.upstream_tls)).await;
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
                worker.series.write(|url| state.metrics.circuit_state.with_label_values(&[url]).set(0));
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
            if head_timeout < state.request_timeout {
                tracing::debug!(worker = %worker.url, "no response head in time, will try elsewhere");
                return Attempt::SlowHead(head_timeout);
            }
            Attempt::Fatal(ApiError::UpstreamTimeout(state.request_timeout.as_secs_f64()))
        }
    }
}

/// The client's credentials: forwarded to workers only with `--forward-client-auth` (and never
/// when the gateway checks them itself with `--client-api-keys`).
fn is_credential(name: &http::HeaderName) -> bool {
    matches!(name.as_str(), "authorization" | "cookie" | "x-api-key" | "api-key")
}

/// Whether a client's header goes to the worker: not the connection's own (hop-by-hop, `host`,
/// `content-length`: the body is re-framed, `expect`: the body was read already), and the
/// client's credentials only when told to.
fn forwarded(name: &http::HeaderName, forward_credentials: bool) -> bool {
    !is_hop_by_hop(name)
        && name != header::HOST
        && name != header::CONTENT_LENGTH
        && name != header::EXPECT
        && (forward_credentials || !is_credential(name))
}

pub(super) fn record_failure(state: &AppState, worker: &Worker, kind: &str, now: Instant) {
    worker.series.write(|url| state.metrics.upstream_failures.with_label_values(&[url, kind]).inc());
    if worker.circuit.record_failure(now) {
        tracing::warn!(worker = %worker.url, "circuit opened after consecutive failures");
        worker.series.write(|url| state.metrics.circuit_state.with_label_values(&[url]).set(1));
    }
}

/// The body for one data-parallel rank of an engine (`--dp-aware`): `"data_parallel_rank": R`
/// put first in the JSON object, the rest byte for byte (SGLang's `GenerateReqInput` and its
/// OpenAI requests take the field: `python/sglang/srt/managers/io_struct.py`, "For data
/// parallel rank routing"; SMG 1.13 sends the same, `worker.rs` `prepare_request`). A rank the
/// client gave is replaced: the gateway's choice is the rank its state accounts for.
pub(super) fn with_dp_rank(body: &[u8], rank: u32) -> Result<Bytes, ApiError> {
    with_first_field(
        body,
        "data_parallel_rank",
        i64::from(rank),
        "a request to a data-parallel rank (--dp-aware)",
    )
}

/// `body` (a JSON object) with `"FIELD": VALUE` put first and the rest byte for byte; a value
/// the client gave for `field` is replaced (the object then re-serialized). `what` names the
/// request in the error when the body is no JSON object.
pub(super) fn with_first_field(body: &[u8], field: &str, value: i64, what: &str) -> Result<Bytes, ApiError> {
    let not_an_object = || ApiError::BadRequest(format!("{what} needs a JSON object body"));
    let quoted = format!("\"{field}\"");
    if body.windows(quoted.len()).any(|window| window == quoted.as_bytes()) {
        let mut object: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(body).map_err(|_| not_an_object())?;
        object.insert(field.into(), value.into());
        return serde_json::to_vec(&object).map(Bytes::from).map_err(|_| not_an_object());
    }
    let start = body.iter().position(|b| !b.is_ascii_whitespace()).ok_or_else(not_an_object)?;
    if body[start] != b'{' {
        return Err(not_an_object());
    }
    let rest = &body[start + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + 32);
    out.extend_from_slice(format!("{{{quoted}:{value}").as_bytes());
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::{with_dp_rank, with_first_field};

    #[test]
    fn the_rank_goes_first_and_the_rest_is_kept_byte_for_byte() {
        let body = br#"  {"model": "m", "messages": [], "z": 1, "a": 2}"#;
        let ranked = with_dp_rank(body, 3).unwrap();
        assert_eq!(&ranked[..], br#"{"data_parallel_rank":3,"model": "m", "messages": [], "z": 1, "a": 2}"#);
        assert_eq!(&with_dp_rank(b"{ }", 0).unwrap()[..], br#"{"data_parallel_rank":0 }"#);
        // The client's rank is replaced by the gateway's.
        let replaced = with_dp_rank(br#"{"data_parallel_rank": 7, "model": "m"}"#, 1).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&replaced).unwrap();
        assert_eq!((value["data_parallel_rank"].as_u64(), value["model"].as_str()), (Some(1), Some("m")));
        assert!(with_dp_rank(b"[1]", 0).is_err());
        assert!(with_dp_rank(b"", 0).is_err());
    }

    #[test]
    fn a_negative_priority_goes_first_and_a_client_priority_is_replaced() {
        let forwarded = with_first_field(br#"{"model": "m"}"#, "priority", -1, "x").unwrap();
        assert_eq!(&forwarded[..], br#"{"priority":-1,"model": "m"}"#);
        let replaced = with_first_field(br#"{"priority": 5, "model": "m"}"#, "priority", 1, "x").unwrap();
        let value: serde_json::Value = serde_json::from_slice(&replaced).unwrap();
        assert_eq!(value["priority"].as_i64(), Some(1));
    }
}
