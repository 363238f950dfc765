//! The canned engine: fixed small answers (prebuilt bytes) after `--gen-ms`, no model, for measuring gateway overhead.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;

use crate::generation::{cut_body, sse_response, whole_response};
use crate::server::{parse_json, AppState};
use kvgate_protocol::sse::{data_event, DONE};

/// Prompt and completion token counts reported by every canned answer.
const CANNED_PROMPT_TOKENS: u32 = 8;
const CANNED_COMPLETION_TOKENS: u32 = 2;

/// The prebuilt answers of one worker: (whole body, stream first chunk, stream rest) per endpoint.
pub(crate) struct CannedBodies {
    chat: CannedEndpoint,
    completion: CannedEndpoint,
    generate: CannedEndpoint,
}

struct CannedEndpoint {
    whole: Bytes,
    stream_head: Bytes,
    stream_tail: Bytes,
}

fn usage() -> serde_json::Value {
    json!({
        "prompt_tokens": CANNED_PROMPT_TOKENS,
        "completion_tokens": CANNED_COMPLETION_TOKENS,
        "total_tokens": CANNED_PROMPT_TOKENS + CANNED_COMPLETION_TOKENS,
        "prompt_tokens_details": {"cached_tokens": 0},
    })
}

fn sse(values: &[serde_json::Value], done: bool) -> Bytes {
    let mut out = Vec::new();
    for value in values {
        data_event(value, &mut out);
    }
    if done {
        out.extend_from_slice(DONE);
    }
    Bytes::from(out)
}

impl CannedBodies {
    pub(crate) fn new(model: &str) -> Self {
        let envelope = |object: &str, choices: serde_json::Value| {
            json!({"id": "canned", "object": object, "created": 0, "model": model,
                "choices": choices})
        };
        let with_usage = |mut value: serde_json::Value| {
            value["usage"] = usage();
            value
        };
        let chat = CannedEndpoint {
            whole: Bytes::from(
                with_usage(envelope(
                    "chat.completion",
                    json!([{"index": 0, "message": {"role": "assistant", "content": "ok ok"},
                        "logprobs": null, "finish_reason": "length"}]),
                ))
                .to_string(),
            ),
            stream_head: sse(
                &[envelope(
                    "chat.completion.chunk",
                    json!([{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                        "logprobs": null, "finish_reason": null}]),
                )],
                false,
            ),
            stream_tail: sse(
                &[
                    envelope(
                        "chat.completion.chunk",
                        json!([{"index": 0, "delta": {"content": " ok"},
                            "logprobs": null, "finish_reason": "length"}]),
                    ),
                    with_usage(envelope("chat.completion.chunk", json!([]))),
                ],
                true,
            ),
        };
        let completion = CannedEndpoint {
            whole: Bytes::from(
                with_usage(envelope(
                    "text_completion",
                    json!([{"index": 0, "text": "ok ok", "logprobs": null,
                        "finish_reason": "length"}]),
                ))
                .to_string(),
            ),
            stream_head: sse(
                &[envelope(
                    "text_completion",
                    json!([{"index": 0, "text": "ok", "logprobs": null, "finish_reason": null}]),
                )],
                false,
            ),
            stream_tail: sse(
                &[
                    envelope(
                        "text_completion",
                        json!([{"index": 0, "text": " ok", "logprobs": null,
                            "finish_reason": "length"}]),
                    ),
                    with_usage(envelope("text_completion", json!([]))),
                ],
                true,
            ),
        };
        let meta = json!({"id": "canned", "prompt_tokens": CANNED_PROMPT_TOKENS,
            "completion_tokens": CANNED_COMPLETION_TOKENS, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": CANNED_COMPLETION_TOKENS}});
        let generate = CannedEndpoint {
            whole: Bytes::from(json!({"text": "ok ok", "meta_info": meta}).to_string()),
            stream_head: sse(
                &[json!({"text": "ok", "meta_info": {"id": "canned",
                    "prompt_tokens": CANNED_PROMPT_TOKENS, "completion_tokens": 1,
                    "finish_reason": null}})],
                false,
            ),
            stream_tail: sse(&[json!({"text": "ok ok", "meta_info": meta})], true),
        };
        Self { chat, completion, generate }
    }
}

/// Only `stream` matters; the rest of the body is checked to be JSON and ignored.
#[derive(Deserialize)]
struct CannedRequest {
    #[serde(default)]
    stream: bool,
}

async fn answer(state: &AppState, body: &[u8], pick: fn(&CannedBodies) -> &CannedEndpoint) -> Response {
    let cut = match state.inject_faults().await {
        Ok(cut) => cut,
        Err(response) => return response,
    };
    let request: CannedRequest = match parse_json(body) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    if state.options.gen_ms > 0 {
        tokio::time::sleep(Duration::from_millis(state.options.gen_ms)).await;
    }
    let endpoint = pick(&state.canned);
    if !request.stream {
        return whole_response(endpoint.whole.clone(), cut);
    }
    if cut {
        return sse_response(cut_body(endpoint.stream_head.clone()));
    }
    let chunks = [Ok::<_, Infallible>(endpoint.stream_head.clone()), Ok(endpoint.stream_tail.clone())];
    sse_response(Body::from_stream(futures_util::stream::iter(chunks)))
}

pub(crate) async fn chat(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    answer(&state, &body, |bodies| &bodies.chat).await
}

pub(crate) async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    answer(&state, &body, |bodies| &bodies.completion).await
}

pub(crate) async fn generate(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    answer(&state, &body, |bodies| &bodies.generate).await
}
