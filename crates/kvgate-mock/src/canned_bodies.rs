//! The canned engine's prebuilt answers: one worker's fixed small bodies (whole, and a stream's first chunk and rest) for each generation endpoint, built once from the model name.

use bytes::Bytes;
use serde_json::json;

use kvgate_protocol::sse::{data_event, DONE};

/// Prompt and completion token counts reported by every canned answer.
const CANNED_PROMPT_TOKENS: u32 = 8;
const CANNED_COMPLETION_TOKENS: u32 = 2;

/// The prebuilt answers of one worker: (whole body, stream first chunk, stream rest) per endpoint.
pub(crate) struct CannedBodies {
    pub(crate) chat: CannedEndpoint,
    pub(crate) completion: CannedEndpoint,
    pub(crate) generate: CannedEndpoint,
}

pub(crate) struct CannedEndpoint {
    pub(crate) whole: Bytes,
    pub(crate) stream_head: Bytes,
    pub(crate) stream_tail: Bytes,
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
