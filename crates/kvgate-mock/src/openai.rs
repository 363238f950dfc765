//! The OpenAI-compatible endpoints `/v1/chat/completions` and `/v1/completions`: request parsing and response shapes.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvgate_engine::tokenize;
use kvgate_protocol::request::{render_chat, ChatMessage, ChatTurn};
use kvgate_protocol::usage::usage_object;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api_error::{parse_json, ApiError};
use crate::driver::unix_now_secs;
use crate::generation::{respond, Continuation, GenerationParams, Outcome, ResponseFormat};
use crate::state::AppState;
use kvgate_protocol::sse::{data_event, DONE};

#[derive(Deserialize)]
pub(crate) struct ChatRequest<'a> {
    #[serde(default)]
    pub(crate) model: Option<String>,
    /// The data-parallel rank to run on (SGLang's OpenAI requests take `data_parallel_rank`).
    #[serde(default)]
    pub(crate) data_parallel_rank: Option<u32>,
    #[serde(borrow)]
    pub(crate) messages: Vec<ChatMessage<'a>>,
    #[serde(default)]
    pub(crate) stream: bool,
    #[serde(default)]
    pub(crate) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(crate) max_tokens: Option<u32>,
    #[serde(default)]
    pub(crate) max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub(crate) ignore_eos: bool,
    /// vLLM's `priority` (lower first, default 0), honoured with `--priority-scheduling`.
    #[serde(default)]
    pub(crate) priority: Option<i32>,
    /// vLLM's and SGLang's `continue_final_message`: the final (assistant) message is an answer
    /// begun, which the engine continues instead of starting a new one.
    #[serde(default)]
    pub(crate) continue_final_message: bool,
    /// vLLM's `add_generation_prompt` (default true), which must be false with
    /// `continue_final_message` (vLLM refuses both).
    #[serde(default)]
    pub(crate) add_generation_prompt: Option<bool>,
}

/// The prompt of a chat request: the messages rendered with the engines' chat template (the one
/// chat rendering, `kvgate_protocol::render_chat`).
pub(crate) fn chat_prompt(messages: &[ChatMessage<'_>]) -> String {
    render_chat(messages)
}

/// A message's text as the template writes it (content parts joined by single spaces).
fn message_text(message: &ChatMessage<'_>) -> String {
    let mut text = String::new();
    message.push_text(&mut text);
    text
}

#[derive(Deserialize)]
pub(crate) struct CompletionRequest {
    #[serde(default)]
    pub(crate) model: Option<String>,
    /// The data-parallel rank to run on (SGLang's OpenAI requests take `data_parallel_rank`).
    #[serde(default)]
    pub(crate) data_parallel_rank: Option<u32>,
    pub(crate) prompt: Prompt,
    #[serde(default)]
    pub(crate) stream: bool,
    #[serde(default)]
    pub(crate) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(crate) max_tokens: Option<u32>,
    #[serde(default)]
    pub(crate) ignore_eos: bool,
    /// vLLM's `priority` (lower first, default 0), honoured with `--priority-scheduling`.
    #[serde(default)]
    pub(crate) priority: Option<i32>,
}

/// `stream_options`: a stream ends with a usage chunk only when the client asks for it, as
/// vLLM's OpenAI server does (`should_include_usage` in vllm/entrypoints/openai: the chunk, with
/// `choices: []` and `usage`, right before `data: [DONE]`).
#[derive(Deserialize, Default)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

fn include_usage(options: &Option<StreamOptions>) -> bool {
    options.as_ref().is_some_and(|options| options.include_usage)
}

/// A completion prompt: text, token ids, or a batch of one text.
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

impl Prompt {
    fn into_tokens(self) -> Result<Vec<u32>, ApiError> {
        match self {
            Prompt::Text(text) => Ok(tokenize(&text)),
            Prompt::Tokens(tokens) => Ok(tokens),
            Prompt::Texts(texts) if texts.len() == 1 => Ok(tokenize(&texts[0])),
            Prompt::Texts(_) => {
                Err(ApiError::bad_request("batched prompts are not supported; send one prompt per request"))
            }
        }
    }
}

fn usage(outcome: &Outcome) -> Value {
    usage_object(outcome.written_usage())
}

/// The prompt of a chat request, and with `continue_final_message` where the answer picks up:
/// the final assistant message is the answer so far, appended to the rest rendered as usual
/// (as vLLM's `apply_hf_chat_template` with `continue_final_message` leaves the final message
/// open). vLLM's checks: the final message must be the assistant's, and `add_generation_prompt`
/// must be false.
fn chat_continuation(request: &ChatRequest<'_>) -> Result<(Vec<u32>, Option<Continuation>), ApiError> {
    if !request.continue_final_message {
        return Ok((tokenize(&chat_prompt(&request.messages)), None));
    }
    if request.add_generation_prompt != Some(false) {
        return Err(ApiError::bad_request(
            "Cannot set both `add_generation_prompt` and `continue_final_message` to True.",
        ));
    }
    let Some((last, earlier)) = request.messages.split_last().filter(|(last, _)| last.role == "assistant")
    else {
        return Err(ApiError::bad_request("continue_final_message needs a final assistant message"));
    };
    let mut prompt = tokenize(&chat_prompt(earlier));
    let seed_tokens = prompt.len();
    let answered = tokenize(&message_text(last));
    let first_index = answered.len() as u32;
    prompt.extend(answered);
    Ok((prompt, Some(Continuation { seed_tokens, first_index })))
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let (pd, cut) = match state.admit(&body).await {
        Ok(admitted) => admitted,
        Err(response) => return response,
    };
    let request: ChatRequest<'_> = match parse_json(&body) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    let (prompt, continuation) = match chat_continuation(&request) {
        Ok(continued) => continued,
        Err(error) => return error.into_response(),
    };
    let params = GenerationParams {
        prompt,
        continuation,
        max_tokens: request.max_completion_tokens.or(request.max_tokens),
        ignore_eos: request.ignore_eos,
        stream: request.stream,
        pd,
        lora: state.lora(request.model.as_deref()),
        dp_rank: request.data_parallel_rank,
        priority: request.priority.unwrap_or(0),
    };
    let format = OpenAiFormat::new(&state, OpenAiKind::Chat, include_usage(&request.stream_options));
    respond(&state, params, format, cut).await
}

/// `POST /v1/completions`.
pub(crate) async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let (pd, cut) = match state.admit(&body).await {
        Ok(admitted) => admitted,
        Err(response) => return response,
    };
    let request: CompletionRequest = match parse_json(&body) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    let usage_chunk = include_usage(&request.stream_options);
    let lora = state.lora(request.model.as_deref());
    let prompt = match request.prompt.into_tokens() {
        Ok(prompt) => prompt,
        Err(error) => return error.into_response(),
    };
    let params = GenerationParams {
        prompt,
        max_tokens: request.max_tokens,
        ignore_eos: request.ignore_eos,
        stream: request.stream,
        pd,
        lora,
        dp_rank: request.data_parallel_rank,
        priority: request.priority.unwrap_or(0),
        continuation: None,
    };
    let format = OpenAiFormat::new(&state, OpenAiKind::Completion, usage_chunk);
    respond(&state, params, format, cut).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum OpenAiKind {
    Chat,
    Completion,
}

/// Chat or text completion bodies and chunks.
struct OpenAiFormat {
    kind: OpenAiKind,
    id: String,
    created: u64,
    model: String,
    /// Streams end with a usage chunk (`stream_options.include_usage`).
    include_usage: bool,
}

impl OpenAiFormat {
    fn new(state: &AppState, kind: OpenAiKind, include_usage: bool) -> Self {
        let prefix = match kind {
            OpenAiKind::Chat => "chatcmpl",
            OpenAiKind::Completion => "cmpl",
        };
        Self {
            kind,
            id: state.response_id(prefix),
            created: unix_now_secs() as u64,
            model: state.model.clone(),
            include_usage,
        }
    }

    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            OpenAiKind::Chat => "chat.completion.chunk",
            OpenAiKind::Completion => "text_completion",
        }
    }
}

impl ResponseFormat for OpenAiFormat {
    fn token_chunk(&mut self, index: u32, piece: &str, out: &mut Vec<u8>) {
        let choice = match self.kind {
            OpenAiKind::Chat if index == 0 => json!({"index": 0,
                "delta": {"role": "assistant", "content": piece},
                "logprobs": null, "finish_reason": null}),
            OpenAiKind::Chat => json!({"index": 0, "delta": {"content": piece},
                "logprobs": null, "finish_reason": null}),
            OpenAiKind::Completion => json!({"index": 0, "text": piece,
                "logprobs": null, "finish_reason": null}),
        };
        data_event(&self.envelope(self.chunk_object(), json!([choice])), out);
    }

    fn final_chunks(&mut self, outcome: &Outcome, out: &mut Vec<u8>) {
        let choice = match self.kind {
            OpenAiKind::Chat => json!({"index": 0, "delta": {},
                "logprobs": null, "finish_reason": outcome.finish_reason}),
            OpenAiKind::Completion => json!({"index": 0, "text": "",
                "logprobs": null, "finish_reason": outcome.finish_reason}),
        };
        data_event(&self.envelope(self.chunk_object(), json!([choice])), out);
        if self.include_usage || outcome.kv_transfer_params.is_some() {
            let mut last_chunk = self.envelope(self.chunk_object(), json!([]));
            if self.include_usage {
                last_chunk["usage"] = usage(outcome);
            }
            if let Some(params) = &outcome.kv_transfer_params {
                last_chunk["kv_transfer_params"] = params.clone();
            }
            data_event(&last_chunk, out);
        }
        out.extend_from_slice(DONE);
    }

    fn full_body(&mut self, text: &str, outcome: &Outcome) -> Vec<u8> {
        let (object, choice) = match self.kind {
            OpenAiKind::Chat => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text},
                    "logprobs": null, "finish_reason": outcome.finish_reason}),
            ),
            OpenAiKind::Completion => (
                "text_completion",
                json!({"index": 0, "text": text,
                    "logprobs": null, "finish_reason": outcome.finish_reason}),
            ),
        };
        let mut body = self.envelope(object, json!([choice]));
        body["usage"] = usage(outcome);
        if let Some(params) = &outcome.kv_transfer_params {
            body["kv_transfer_params"] = params.clone();
        }
        serde_json::to_vec(&body).expect("a JSON value always serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_messages_render_with_the_template() {
        let request: ChatRequest<'_> = serde_json::from_str(
            r#"{"messages": [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]}"#,
        )
        .unwrap();
        assert_eq!(chat_prompt(&request.messages), "<|system|> be brief <|user|> hi there <|assistant|>");
    }

    #[test]
    fn completion_prompts_accept_text_and_token_ids() {
        let tokens = |body: &str| {
            serde_json::from_str::<CompletionRequest>(body)
                .unwrap()
                .prompt
                .into_tokens()
                .map_err(|e| format!("{e:?}"))
        };
        assert_eq!(tokens(r#"{"prompt": "a b c"}"#).unwrap().len(), 3);
        assert_eq!(tokens(r#"{"prompt": [1, 2]}"#).unwrap(), [1, 2]);
        assert_eq!(tokens(r#"{"prompt": ["a b"]}"#).unwrap().len(), 2);
        assert!(tokens(r#"{"prompt": ["a", "b"]}"#).is_err());
    }
}
