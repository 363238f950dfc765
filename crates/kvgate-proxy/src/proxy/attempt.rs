//! One exchange with one worker: build the upstream request, send it under the request timeout,
//! and classify how it went, once for every path (a single worker, either side of a pair, the
//! in-place fallback): an answer the client may get, or an [`AttemptError`] saying what failed,
//! on which side, and whether another worker may take the request. Failures are recorded on the
//! worker's circuit breaker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, StatusCode};
use http_body_util::Full;
use kvgate_config::error_chain;
use kvgate_index::InFlightPrompt;

use super::outcome::{Failure, Outcome, Served};
use crate::body::InFlight;
use crate::state::AppState;
use kvgate_fleet::registry::ModelPrefix;
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::conn::{self, SendError, UpstreamBody};
use kvgate_gateway_core::error::ApiError;
use kvgate_gateway_core::upstream::is_hop_by_hop;
use kvgate_protocol::edit::{edit_body, EditError, FieldEdit};
use kvgate_protocol::role::WorkerRole;

/// How one attempt on one worker went.
pub(super) enum Attempt {
    /// A response head the client may get: a success, a client error, or a server error other
    /// than 502/503/504 (from a prefill worker, a success or a client error only: its other
    /// answers are no client's).
    Answered(http::Response<UpstreamBody>, InFlight),
    /// The attempt failed before anything reached the client.
    Failed(AttemptError),
}

/// Why one attempt failed (pingora-error's `ErrorType`), on which side (the worker and its role
/// in the plan; the upstream or the request itself: `ErrorSource`), and whether another worker
/// may take the request (`RetryType`). One classification for every path.
pub(super) struct AttemptError {
    /// The worker that failed.
    pub worker: u32,
    /// Its side of the plan (a regular worker, or a pair's prefill or decode side).
    pub role: WorkerRole,
    pub kind: AttemptErrorKind,
}

/// What failed.
pub(super) enum AttemptErrorKind {
    /// An error answer no client gets: 502, 503 or 504 (overloaded, unhealthy, or a proxy in
    /// front of the engine failing), or any server error from a prefill worker.
    Status(http::Response<UpstreamBody>, InFlight),
    /// No connection could be made: the request was not sent.
    Connect(String),
    /// The connection broke before a response head: the request may have reached the worker,
    /// nothing reached the client.
    Exchange(String),
    /// The worker's answer broke the protocol (a vLLM prefill answer without its
    /// `kv_transfer_params`).
    Protocol(String),
    /// No response head within `--ttfb-timeout-secs`.
    SlowHead(Duration),
    /// No response head within `--request-timeout-secs`: the request's own time is spent.
    Timeout(Duration),
    /// The request cannot be made to the worker (its path, or a body the edit needs): the
    /// client's fault.
    Request(ApiError),
}

/// Which side of the exchange caused a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ErrorSource {
    /// The worker (or the way to it).
    Upstream,
    /// The client's request.
    Client,
}

/// Whether another worker may take the request after a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RetryType {
    /// Within the retry budget (`--retry-max-retries`), on a worker not tried yet.
    Allowed,
    /// The failure is the client's, or the request's time is spent: answer now.
    Never,
}

impl AttemptError {
    pub(super) fn source(&self) -> ErrorSource {
        match self.kind {
            AttemptErrorKind::Request(_) => ErrorSource::Client,
            _ => ErrorSource::Upstream,
        }
    }

    /// Every upstream failure before anything reached the client may go to another worker
    /// (an exchange that broke included, on a single worker as on either side of a pair), except
    /// a request whose time is spent.
    pub(super) fn retry(&self) -> RetryType {
        match (&self.kind, self.source()) {
            (AttemptErrorKind::Timeout(_), _) | (_, ErrorSource::Client) => RetryType::Never,
            _ => RetryType::Allowed,
        }
    }

    /// The `status` label of `kvgate_pd_requests_total`.
    pub(super) fn label(&self) -> String {
        match &self.kind {
            AttemptErrorKind::Status(response, _) => response.status().as_str().to_string(),
            AttemptErrorKind::Connect(_) => "unreachable".into(),
            AttemptErrorKind::SlowHead(_) | AttemptErrorKind::Timeout(_) => "timeout".into(),
            AttemptErrorKind::Exchange(_) | AttemptErrorKind::Protocol(_) | AttemptErrorKind::Request(_) => {
                "error".into()
            }
        }
    }

    /// The retry loop's outcome of the failure: when a retry is allowed, a retry without the
    /// failed worker (with what the client gets if none is left: the error answer as `served`
    /// wraps it, or the gateway's 502 or 504); else that answer now.
    pub(super) fn into_outcome(
        self,
        served: impl FnOnce(http::Response<UpstreamBody>, InFlight) -> Box<Served>,
    ) -> Outcome {
        let (failed, retry) = (self.worker, self.retry());
        tracing::debug!(
            worker = failed,
            side = self.role.as_str(),
            source = ?self.source(),
            ?retry,
            status = self.label(),
            "attempt failed"
        );
        let failure = match self.kind {
            AttemptErrorKind::Status(response, in_flight) => Failure::Response(served(response, in_flight)),
            AttemptErrorKind::Connect(message)
            | AttemptErrorKind::Exchange(message)
            | AttemptErrorKind::Protocol(message) => Failure::Unreachable(message),
            AttemptErrorKind::SlowHead(timeout) | AttemptErrorKind::Timeout(timeout) => {
                Failure::TimedOut(timeout.as_secs_f64())
            }
            AttemptErrorKind::Request(error) => return Outcome::Fatal(error),
        };
        match retry {
            RetryType::Allowed => Outcome::Retry { failure, failed },
            RetryType::Never => match failure {
                Failure::Response(served) => Outcome::Done(served),
                Failure::Unreachable(message) => Outcome::Fatal(ApiError::UpstreamUnreachable(message)),
                Failure::TimedOut(secs) => Outcome::Fatal(ApiError::UpstreamTimeout(secs)),
            },
        }
    }
}

pub(super) async fn attempt(
    state: &AppState,
    worker: &Arc<Worker>,
    path_and_query: &str,
    client_headers: &http::HeaderMap,
    body: Bytes,
    prompt: Option<(Arc<ModelPrefix>, InFlightPrompt)>,
) -> Attempt {
    let failed = |kind| Attempt::Failed(AttemptError { worker: worker.id, role: worker.role, kind });
    let body = match worker.dp_rank {
        Some(rank) => match with_dp_rank(&body, rank) {
            Ok(body) => body,
            Err(error) => return failed(AttemptErrorKind::Request(error)),
        },
        None => body,
    };
    let mut upstream = http::Request::new(Full::new(body));
    *upstream.method_mut() = http::Method::POST;
    *upstream.uri_mut() = match worker.conns.target(path_and_query) {
        Ok(uri) => uri,
        Err(e) => {
            let error = ApiError::BadRequest(format!("invalid request path: {e}"));
            return failed(AttemptErrorKind::Request(error));
        }
    };
    // Filtered once per request (`proxy::upstream_headers`): each attempt copies them whole.
    *upstream.headers_mut() = client_headers.clone();
    let headers = upstream.headers_mut();
    if let Some(token) = &state.api_key_header {
        headers.insert(header::AUTHORIZATION, token.clone());
    }
    // Every gateway a request passes adds its id: one that sees its own refuses it (a loop).
    let via = match client_headers.get(&kvgate_protocol::headers::VIA) {
        None => state.instance.clone(),
        Some(hops) => {
            let mut chained = hops.as_bytes().to_vec();
            chained.extend_from_slice(b", ");
            chained.extend_from_slice(state.instance.as_bytes());
            http::HeaderValue::from_bytes(&chained).unwrap_or_else(|_| state.instance.clone())
        }
    };
    headers.insert(kvgate_protocol::headers::VIA.clone(), via);

    let in_flight = InFlight::begin(worker.clone(), prompt);
    let head_timeout = state.ttfb_timeout.map_or(state.request_timeout, |t| t.min(state.request_timeout));
    let sent =
        tokio::time::timeout(head_timeout, conn::send(&worker.conns, upstream, &state.upstream_tls)).await;
    match sent {
        Ok(Ok(response)) => {
            let status = response.status();
            let no_clients = matches!(
                status,
                StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT
            ) || (worker.role == WorkerRole::Prefill && status.is_server_error());
            if status.is_server_error() {
                record_failure(state, worker, "status");
            } else {
                worker.record_answer();
                if worker.circuit.record_success() {
                    worker.series.write(|url| state.metrics.circuit_state.with_label_values(&[url]).set(0));
                }
            }
            if no_clients {
                return failed(AttemptErrorKind::Status(response, in_flight));
            }
            Attempt::Answered(response, in_flight)
        }
        Ok(Err(SendError::Connect(message))) => {
            record_failure(state, worker, "connect");
            let message = format!("{}: {message}", worker.url);
            tracing::debug!(worker = %worker.url, %message, "connect failed, will retry elsewhere");
            failed(AttemptErrorKind::Connect(message))
        }
        Ok(Err(SendError::Exchange(error))) => {
            record_failure(state, worker, "connect");
            let message = format!("{}: {}", worker.url, error_chain(&error));
            tracing::debug!(worker = %worker.url, %message, "the exchange broke before an answer, will retry elsewhere");
            failed(AttemptErrorKind::Exchange(message))
        }
        Err(_) => {
            record_failure(state, worker, "timeout");
            if head_timeout < state.request_timeout {
                tracing::debug!(worker = %worker.url, "no response head in time, will try elsewhere");
                return failed(AttemptErrorKind::SlowHead(head_timeout));
            }
            failed(AttemptErrorKind::Timeout(state.request_timeout))
        }
    }
}

/// Whether the client's credentials go to workers: with `--forward-client-auth`, and never
/// when the gateway checks them itself with `--client-api-keys`.
pub(super) fn forwards_credentials(state: &AppState) -> bool {
    state.config.forward_client_auth
        && state.config.client_api_keys.is_empty()
        && state.config.client_api_keys_file.is_none()
}

/// The client's credentials: forwarded to workers only with `--forward-client-auth` (and never
/// when the gateway checks them itself with `--client-api-keys`).
fn is_credential(name: &http::HeaderName) -> bool {
    matches!(name.as_str(), "authorization" | "cookie" | "x-api-key" | "api-key")
}

/// Whether a client's header goes to the worker: not the connection's own (hop-by-hop, `host`,
/// `content-length`: the body is re-framed, `expect`: the body was read already), and the
/// client's credentials only when told to.
pub(super) fn forwarded(name: &http::HeaderName, forward_credentials: bool) -> bool {
    !is_hop_by_hop(name)
        && name != header::HOST
        && name != header::CONTENT_LENGTH
        && name != header::EXPECT
        && (forward_credentials || !is_credential(name))
}

/// A failed attempt on the worker's series and circuit breaker (the clock read here: the
/// successful exchange reads none).
pub(super) fn record_failure(state: &AppState, worker: &Worker, kind: &str) {
    let now = Instant::now();
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
    edited(
        body,
        &[FieldEdit::Set("data_parallel_rank", rank.into())],
        "a request to a data-parallel rank (--dp-aware)",
    )
}

/// `body` with `edits` applied by the one body editor (`kvgate_protocol::edit`); `what` names
/// the request in the error when the body is no JSON object.
pub(super) fn edited(body: &[u8], edits: &[FieldEdit<'_>], what: &str) -> Result<Bytes, ApiError> {
    edit_body(body, edits).map_err(|error| match error {
        EditError::NotAnObject => ApiError::BadRequest(format!("{what} needs a JSON object body")),
        EditError::Encode(error) => ApiError::BadRequest(format!("could not re-encode the request: {error}")),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{edited, with_dp_rank, AttemptError, AttemptErrorKind, ErrorSource, RetryType};
    use crate::proxy::outcome::{Failure, Outcome};
    use kvgate_gateway_core::error::ApiError;
    use kvgate_protocol::role::WorkerRole;

    /// `check(kind, source, retry, label, outcome)`: one row of the classification every path uses.
    fn check(kind: AttemptErrorKind, expected: (ErrorSource, RetryType, &str, &str)) {
        let error = AttemptError { worker: 7, role: WorkerRole::Prefill, kind };
        let classified = (error.source(), error.retry(), error.label());
        let outcome = match error.into_outcome(|_, _| panic!("no error answer to wrap")) {
            Outcome::Retry { failure: Failure::Unreachable(_), failed: 7 } => "retry, 502 if none is left",
            Outcome::Retry { failure: Failure::TimedOut(_), failed: 7 } => "retry, 504 if none is left",
            Outcome::Fatal(ApiError::UpstreamTimeout(_)) => "504 now",
            Outcome::Fatal(ApiError::BadRequest(_)) => "400 now",
            _ => "something else",
        };
        assert_eq!((classified.0, classified.1, classified.2.as_str(), outcome), expected);
    }

    #[test]
    fn every_upstream_failure_may_go_to_another_worker_unless_the_time_is_spent() {
        use ErrorSource::{Client, Upstream};
        use RetryType::{Allowed, Never};
        let message = || "http://127.0.0.1:1: closed".to_string();
        check(
            AttemptErrorKind::Connect(message()),
            (Upstream, Allowed, "unreachable", "retry, 502 if none is left"),
        );
        // The exchange broke before an answer: nothing reached the client, so another worker may
        // take it, on a single worker as on either side of a pair.
        check(
            AttemptErrorKind::Exchange(message()),
            (Upstream, Allowed, "error", "retry, 502 if none is left"),
        );
        check(
            AttemptErrorKind::Protocol(message()),
            (Upstream, Allowed, "error", "retry, 502 if none is left"),
        );
        let second = Duration::from_secs(1);
        check(
            AttemptErrorKind::SlowHead(second),
            (Upstream, Allowed, "timeout", "retry, 504 if none is left"),
        );
        check(AttemptErrorKind::Timeout(second), (Upstream, Never, "timeout", "504 now"));
        let refused = ApiError::BadRequest("invalid request path".into());
        check(AttemptErrorKind::Request(refused), (Client, Never, "error", "400 now"));
    }

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
        let priority = |body: &[u8], value: i64| {
            edited(body, &[kvgate_protocol::FieldEdit::Set("priority", value.into())], "x")
        };
        let forwarded = priority(br#"{"model": "m"}"#, -1).unwrap();
        assert_eq!(&forwarded[..], br#"{"priority":-1,"model": "m"}"#);
        let replaced = priority(br#"{"priority": 5, "model": "m"}"#, 1).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&replaced).unwrap();
        assert_eq!(value["priority"].as_i64(), Some(1));
    }
}
