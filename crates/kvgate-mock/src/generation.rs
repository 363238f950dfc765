//! One generation request end to end, shared by every endpoint: output length, deterministic text, and the streaming or whole response built by an endpoint's `ResponseFormat`.

use std::io;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use kvgate_engine::{splitmix64, EngineOutput, RequestStats};
use kvgate_protocol::sse::{data_event, DONE};
use kvgate_protocol::usage::WrittenUsage;

use crate::api_error::ApiError;
use crate::driver::{RequestStream, Submission};
use crate::pd::PdPlan;
use crate::state::AppState;

/// Words of the generated text, picked deterministically from the prompt.
const VOCAB: [&str; 32] = [
    "the", "engine", "token", "cache", "block", "prefix", "route", "model", "batch", "queue", "decode",
    "prefill", "page", "hash", "gate", "load", "reply", "answer", "simple", "quick", "steady", "light",
    "river", "stone", "cloud", "paper", "signal", "window", "garden", "orbit", "echo", "amber",
];

/// What an endpoint asks the engine for.
pub(crate) struct GenerationParams {
    pub(crate) prompt: Vec<u32>,
    /// Requested cap on generated tokens (`max_tokens`, `max_new_tokens`, ...), if any.
    pub(crate) max_tokens: Option<u32>,
    /// Generate exactly the cap.
    pub(crate) ignore_eos: bool,
    pub(crate) stream: bool,
    /// What the request is under prefill/decode disaggregation.
    pub(crate) pd: PdPlan,
    /// The LoRA adapter the request names.
    pub(crate) lora: Option<kvgate_engine::LoraAdapter>,
    /// The data-parallel rank the request names (`data_parallel_rank`).
    pub(crate) dp_rank: Option<u32>,
    /// Its priority in the engine model's convention (lower first).
    pub(crate) priority: i32,
    /// A continuation of an answer already partly given (a chat's final assistant message with
    /// `continue_final_message`): the text goes on where that answer stopped.
    pub(crate) continuation: Option<Continuation>,
}

/// Where a continued answer picks up: its text is the original answer's from token
/// `first_index` on, the original prompt being the first `seed_tokens` tokens of the prompt (the
/// rest is the answer so far), as a deterministic model continues its own greedy output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Continuation {
    pub(crate) seed_tokens: usize,
    pub(crate) first_index: u32,
}

/// Token counts and finish reason of a completed generation.
pub(crate) struct Outcome {
    pub(crate) prompt_tokens: u32,
    pub(crate) completion_tokens: u32,
    pub(crate) cached_tokens: u32,
    /// "length" when the cap was reached, else "stop".
    pub(crate) finish_reason: &'static str,
    pub(crate) stats: RequestStats,
    /// vLLM prefill engines: the top-level `kv_transfer_params` of the answer.
    pub(crate) kv_transfer_params: Option<serde_json::Value>,
}

impl Outcome {
    /// The counts the answer's usage reports.
    pub(crate) fn written_usage(&self) -> WrittenUsage {
        WrittenUsage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: self.cached_tokens,
        }
    }
}

/// How one endpoint shapes its streamed chunks and whole bodies.
pub(crate) trait ResponseFormat: Send + 'static {
    /// Appends the SSE event(s) for the answer's `index`-th token (0: its first), whose text is
    /// `piece`.
    fn token_chunk(&mut self, index: u32, piece: &str, out: &mut Vec<u8>);
    /// Appends the closing SSE events (finish reason, usage, `[DONE]`).
    fn final_chunks(&mut self, outcome: &Outcome, out: &mut Vec<u8>);
    /// The whole (non-streaming) JSON body.
    fn full_body(&mut self, text: &str, outcome: &Outcome) -> Vec<u8>;
}

/// A stable seed for a prompt's generated text and natural length.
fn prompt_seed(prompt: &[u32]) -> u64 {
    prompt.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, &token| {
        (hash ^ u64::from(token)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Tokens to generate: the cap when `ignore_eos` (or `--force-max-tokens`), else the smaller of
/// the cap and a natural length of 8..=64 derived from the prompt.
pub(crate) fn planned_output_tokens(seed: u64, cap: u32, exact: bool) -> u32 {
    let cap = cap.max(1);
    if exact {
        cap
    } else {
        cap.min(8 + (splitmix64(seed) % 57) as u32)
    }
}

/// The text of generated token `index`: a word, with a leading space after the first.
pub(crate) fn token_piece(seed: u64, index: u32) -> String {
    let word = VOCAB[(splitmix64(seed ^ u64::from(index).wrapping_mul(0x9e37)) % 32) as usize];
    if index == 0 {
        word.to_string()
    } else {
        format!(" {word}")
    }
}

fn full_text(seed: u64, first_index: u32, n_tokens: u32) -> String {
    (first_index..first_index + n_tokens).map(|index| token_piece(seed, index)).collect()
}

/// The first `n_tokens` tokens of the answer a mock engine gives to the chat `messages` (roles
/// and contents): what a client that received the whole answer, across engines, must see.
pub fn chat_answer_text<R: AsRef<str>, C: AsRef<str>>(messages: &[(R, C)], n_tokens: u32) -> String {
    let prompt = kvgate_engine::tokenize(&kvgate_protocol::render_chat(messages));
    full_text(prompt_seed(&prompt), 0, n_tokens)
}

/// The whole answer a mock engine (without `--force-max-tokens`) gives to the chat `messages`
/// asked with `max_tokens` and `ignore_eos`.
pub fn chat_answer<R: AsRef<str>, C: AsRef<str>>(
    messages: &[(R, C)],
    max_tokens: u32,
    ignore_eos: bool,
) -> String {
    let prompt = kvgate_engine::tokenize(&kvgate_protocol::render_chat(messages));
    let seed = prompt_seed(&prompt);
    full_text(seed, 0, planned_output_tokens(seed, max_tokens, ignore_eos))
}

/// The answer's counts; `transferred_cached_tokens` (a decode of a transferred prompt: what the
/// prefill engine found cached) replaces the engine's own match as the cached count.
fn outcome(
    stats: RequestStats,
    cap: u32,
    kv_transfer_params: Option<&serde_json::Value>,
    transferred_cached_tokens: Option<u32>,
) -> Outcome {
    let stats = RequestStats {
        cached_tokens: transferred_cached_tokens.unwrap_or(stats.cached_tokens),
        offloaded_tokens: if transferred_cached_tokens.is_some() { 0 } else { stats.offloaded_tokens },
        ..stats
    };
    Outcome {
        prompt_tokens: stats.prompt_tokens,
        completion_tokens: stats.completion_tokens,
        cached_tokens: stats.cached_tokens,
        finish_reason: if stats.completion_tokens >= cap { "length" } else { "stop" },
        stats,
        kv_transfer_params: kv_transfer_params.cloned(),
    }
}

/// How long a cut response waits after its last bytes before dropping the connection, so
/// that the status line and those bytes reach the client first.
const CUT_DELAY: Duration = Duration::from_millis(5);

/// The error ending a cut response's body, after `CUT_DELAY`.
async fn cut_error() -> io::Error {
    tokio::time::sleep(CUT_DELAY).await;
    io::Error::new(io::ErrorKind::ConnectionAborted, "injected connection cut")
}

/// A body that sends `head` and then drops the connection.
pub(crate) fn cut_body(head: Bytes) -> Body {
    let head = futures_util::stream::iter([Ok(head)]);
    let cut = futures_util::stream::once(async { Err::<Bytes, io::Error>(cut_error().await) });
    Body::from_stream(head.chain(cut))
}

/// Runs one generation on the worker's engine and answers in `format`; `cut` ends the
/// connection halfway through the body. A PD request first goes through its plan: a decode
/// engine pulls its KV (502 before any byte on failure), a prefill engine generates one token.
pub(crate) async fn respond<F: ResponseFormat>(
    state: &AppState,
    params: GenerationParams,
    mut format: F,
    cut: bool,
) -> Response {
    let GenerationParams {
        prompt,
        max_tokens,
        ignore_eos,
        stream: streamed,
        pd,
        lora,
        dp_rank,
        priority,
        continuation,
    } = params;
    let engine = match state.rank_engine(dp_rank) {
        Ok(engine) => engine,
        Err(error) => return error.into_response(),
    };
    let start = match state.pd.start(pd, engine, prompt.len()).await {
        Ok(start) => start,
        Err(error) => return error.into_response(),
    };
    // A continuation goes on with the original answer: same seed, from where it stopped.
    let (seed, first_index) = match continuation {
        Some(c) => (prompt_seed(&prompt[..c.seed_tokens.min(prompt.len())]), c.first_index),
        None => (prompt_seed(&prompt), 0),
    };
    let cap = start.max_tokens.or(max_tokens).unwrap_or(state.options.default_max_tokens).max(1);
    let exact = ignore_eos || state.options.force_max_tokens;
    let n_tokens = planned_output_tokens(seed, first_index.saturating_add(cap), exact)
        .saturating_sub(first_index)
        .max(1);
    let mut stream = engine.submit(Submission {
        prompt,
        output_tokens: n_tokens,
        wants_tokens: streamed,
        stage: start.stage,
        lora,
        priority,
        on_end: start.on_end,
    });
    let first = stream.try_next();
    if let Some(EngineOutput::Rejected { reason, .. }) = &first {
        return ApiError::bad_request(format!("request rejected by the engine: {reason}")).into_response();
    }
    let (kv_transfer_params, transferred_cached_tokens) =
        (start.kv_transfer_params, start.transferred_cached_tokens);
    if streamed {
        let cut_at = match state.options.cut_after_tokens {
            Some(tokens) => Some(tokens),
            None => cut.then_some((cap / 2).max(1)),
        };
        let ending = Ending { seed, first_index, cap, cut_at, kv_transfer_params, transferred_cached_tokens };
        stream_response(stream, first, format, ending)
    } else {
        let mut pending = first;
        loop {
            let output = match pending.take() {
                Some(output) => Some(output),
                None => stream.next().await,
            };
            match output {
                Some(EngineOutput::Finished { stats, .. }) => {
                    let outcome = outcome(stats, cap, kv_transfer_params.as_ref(), transferred_cached_tokens);
                    let text = full_text(seed, first_index, stats.completion_tokens);
                    let body = format.full_body(&text, &outcome);
                    return whole_response(Bytes::from(body), cut);
                }
                Some(EngineOutput::Rejected { reason, .. }) => {
                    return ApiError::bad_request(format!("request rejected: {reason}")).into_response();
                }
                Some(_) => {}
                None => return ApiError::unavailable("the engine shut down").into_response(),
            }
        }
    }
}

/// A JSON body; when `cut`, only its first half is sent before the connection is dropped.
pub(crate) fn whole_response(body: Bytes, cut: bool) -> Response {
    let content_type = HeaderValue::from_static("application/json");
    if !cut {
        return ([(header::CONTENT_TYPE, content_type)], body).into_response();
    }
    let half_len = body.len() / 2;
    ([(header::CONTENT_TYPE, content_type)], cut_body(body.slice(..half_len))).into_response()
}

/// What a streamed response needs besides its outputs.
struct Ending {
    seed: u64,
    /// The index of its first token in the answer (a continuation's is past 0).
    first_index: u32,
    cap: u32,
    /// Tokens sent before the connection is cut (`--cut-stream-rate`, `--cut-after-tokens`).
    cut_at: Option<u32>,
    kv_transfer_params: Option<serde_json::Value>,
    transferred_cached_tokens: Option<u32>,
}

struct StreamState<F> {
    stream: RequestStream,
    pending: Option<EngineOutput>,
    format: F,
    seed: u64,
    first_index: u32,
    cap: u32,
    next_index: u32,
    cut_at: Option<u32>,
    finished: bool,
    kv_transfer_params: Option<serde_json::Value>,
    transferred_cached_tokens: Option<u32>,
}

fn stream_response<F: ResponseFormat>(
    stream: RequestStream,
    first: Option<EngineOutput>,
    format: F,
    ending: Ending,
) -> Response {
    let Ending { seed, first_index, cap, cut_at, kv_transfer_params, transferred_cached_tokens } = ending;
    let state = StreamState {
        stream,
        pending: first,
        format,
        seed,
        first_index,
        cap,
        next_index: 0,
        cut_at,
        finished: false,
        kv_transfer_params,
        transferred_cached_tokens,
    };
    let body = futures_util::stream::unfold(state, |mut state| async move {
        if state.finished {
            return None;
        }
        let output = match state.pending.take() {
            Some(output) => Some(output),
            None => state.stream.next().await,
        };
        let mut chunk = Vec::new();
        match output {
            Some(EngineOutput::FirstToken { .. } | EngineOutput::Token { .. }) => {
                let index = state.next_index;
                if state.cut_at.is_some_and(|cut_at| index >= cut_at) {
                    state.finished = true;
                    return Some((Err(cut_error().await), state));
                }
                state.next_index += 1;
                let piece = token_piece(state.seed, state.first_index + index);
                state.format.token_chunk(index, &piece, &mut chunk);
            }
            Some(EngineOutput::Finished { stats, .. }) => {
                state.finished = true;
                if state.cut_at.is_some() {
                    return Some((Err(cut_error().await), state));
                }
                let outcome = outcome(
                    stats,
                    state.cap,
                    state.kv_transfer_params.as_ref(),
                    state.transferred_cached_tokens,
                );
                state.format.final_chunks(&outcome, &mut chunk);
            }
            Some(EngineOutput::Rejected { reason, .. }) => {
                state.finished = true;
                let error = serde_json::json!({"error": {
                    "message": reason.to_string(), "type": "invalid_request_error", "code": 400}});
                data_event(&error, &mut chunk);
                chunk.extend_from_slice(DONE);
            }
            None => {
                state.finished = true;
                return Some((Err(io::Error::other("the engine shut down mid-stream")), state));
            }
        }
        Some((Ok(Bytes::from(chunk)), state))
    });
    sse_response(Body::from_stream(body))
}

/// A `text/event-stream` response around `body`.
pub(crate) fn sse_response(body: Body) -> Response {
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream")),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_length_is_capped_and_exact_on_request() {
        for seed in 0..200 {
            let natural = planned_output_tokens(seed, 1000, false);
            assert!((8..=64).contains(&natural));
            assert_eq!(planned_output_tokens(seed, 5, false), 5);
            assert_eq!(planned_output_tokens(seed, 100, true), 100);
        }
        assert_eq!(planned_output_tokens(3, 0, true), 1);
    }

    #[test]
    fn text_is_deterministic_words() {
        let text = full_text(42, 0, 5);
        assert_eq!(text, full_text(42, 0, 5));
        // A continuation's text goes on where the answer stopped.
        assert_eq!(format!("{}{}", full_text(42, 0, 2), full_text(42, 2, 3)), text);
        assert_eq!(text.split(' ').count(), 5);
        assert!(text.split(' ').all(|word| VOCAB.contains(&word)));
    }
}
