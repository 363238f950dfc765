//! The request a migrating stream is continued with, and whether a request can be continued at
//! all. A chat continues its answer as its final assistant message with vLLM's
//! `continue_final_message: true` and `add_generation_prompt: false` (`vllm/entrypoints/openai/
//! protocol.py`; SGLang's chat requests take `continue_final_message` too,
//! `python/sglang/srt/entrypoints/openai/protocol.py`); a completion continues with its prompt
//! plus the text. `max_tokens` (`max_completion_tokens`, vLLM's `min_tokens`) are lowered by the
//! tokens generated, and the usage chunk is always asked for (the gateway reports the whole
//! answer's usage). The rest of the client's request (sampling options included) is kept: the
//! continuation is the same request with a longer prompt. It is exact for a greedy answer; a
//! sampled one goes on as a new sample of the rest (an engine's sampling state does not move).

use bytes::Bytes;
use serde_json::{json, Map, Value};

use kvgate_protocol::endpoint::Endpoint;

/// Why a request cannot be continued by another engine, read from the request itself (`None`:
/// it can, as far as its request says).
pub(super) fn unresumable(endpoint: Endpoint, request: &Map<String, Value>) -> Option<&'static str> {
    let number = |field: &str| request.get(field).and_then(Value::as_u64);
    if number("n").is_some_and(|n| n > 1) || number("best_of").is_some_and(|n| n > 1) {
        return Some("several choices");
    }
    if request.get("echo").and_then(Value::as_bool) == Some(true) {
        return Some("echo");
    }
    let structured = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "regex",
        "ebnf",
        "json_schema",
    ]
    .iter()
    .any(|field| request.get(*field).is_some_and(|value| !value.is_null()))
        || request.get("response_format").is_some_and(|format| !format.is_null() && format["type"] != "text");
    if structured {
        return Some("structured output");
    }
    match endpoint {
        Endpoint::ChatCompletions => match request.get("messages") {
            Some(Value::Array(messages)) if !messages.is_empty() => None,
            _ => Some("no messages"),
        },
        Endpoint::Completions => {
            if request.get("suffix").is_some_and(|suffix| !suffix.is_null()) {
                return Some("suffix");
            }
            match request.get("prompt") {
                Some(Value::String(_)) => None,
                Some(Value::Array(prompts)) if prompts.len() == 1 && prompts[0].is_string() => None,
                _ => Some("a token-id or batched prompt"),
            }
        }
        _ => Some("not a chat or completions stream"),
    }
}

/// The continuation of `request` after `text` (`tokens` tokens) was streamed, or why there is
/// none (`Err`: the request is already answered to its `max_tokens`).
pub(super) fn continuation(
    endpoint: Endpoint,
    mut request: Map<String, Value>,
    text: &str,
    tokens: u64,
) -> Result<Bytes, &'static str> {
    if !text.is_empty() {
        match endpoint {
            Endpoint::ChatCompletions => continue_chat(&mut request, text),
            Endpoint::Completions => match request.get_mut("prompt") {
                Some(Value::String(prompt)) => prompt.push_str(text),
                Some(Value::Array(prompts)) => match prompts.first_mut() {
                    Some(Value::String(prompt)) => prompt.push_str(text),
                    _ => return Err("a token-id or batched prompt"),
                },
                _ => return Err("a token-id or batched prompt"),
            },
            _ => return Err("not a chat or completions stream"),
        }
    }
    for field in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = request.get(field).and_then(Value::as_u64) {
            if max <= tokens {
                return Err("answered to its max_tokens");
            }
            request.insert(field.into(), (max - tokens).into());
        }
    }
    if let Some(min) = request.get("min_tokens").and_then(Value::as_u64) {
        request.insert("min_tokens".into(), min.saturating_sub(tokens).into());
    }
    let options = request.entry("stream_options").or_insert_with(|| json!({}));
    if !options.is_object() {
        *options = json!({});
    }
    if let Some(options) = options.as_object_mut() {
        options.insert("include_usage".into(), Value::Bool(true));
    }
    serde_json::to_vec(&request).map(Bytes::from).map_err(|_| "could not re-encode the request")
}

/// The answer so far as the final assistant message, to be continued: appended to a final
/// assistant message the client itself asked to continue, else a message of its own.
fn continue_chat(request: &mut Map<String, Value>, text: &str) {
    let client_continues = request.get("continue_final_message").and_then(Value::as_bool) == Some(true);
    if let Some(Value::Array(messages)) = request.get_mut("messages") {
        let extend = client_continues
            && messages.last().is_some_and(|last| last["role"] == "assistant" && last["content"].is_string());
        match messages.last_mut() {
            Some(Value::Object(last)) if extend => {
                let begun = last.get("content").and_then(Value::as_str).unwrap_or_default();
                last.insert("content".into(), format!("{begun}{text}").into());
            }
            _ => messages.push(json!({"role": "assistant", "content": text})),
        }
    }
    request.insert("continue_final_message".into(), Value::Bool(true));
    request.insert("add_generation_prompt".into(), Value::Bool(false));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => unreachable!(),
        }
    }

    fn continued(endpoint: Endpoint, request: Value, text: &str, tokens: u64) -> Value {
        serde_json::from_slice(&continuation(endpoint, object(request), text, tokens).unwrap()).unwrap()
    }

    #[test]
    fn a_chat_goes_on_from_its_final_assistant_message() {
        let request = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
            "temperature": 0.5, "stream": true, "stream_options": {"continuous_usage_stats": true}});
        let body = continued(Endpoint::ChatCompletions, request, "Hello there", 2);
        assert_eq!(body["messages"][1], json!({"role": "assistant", "content": "Hello there"}));
        assert_eq!(
            (body["continue_final_message"].as_bool(), body["add_generation_prompt"].as_bool()),
            (Some(true), Some(false))
        );
        assert_eq!(body["max_tokens"], 8);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["stream_options"], json!({"continuous_usage_stats": true, "include_usage": true}));
        // A client continuing its own assistant message: the answer extends that message.
        let own = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}],
            "continue_final_message": true, "add_generation_prompt": false});
        let body = continued(Endpoint::ChatCompletions, own, " upon", 1);
        assert_eq!(body["messages"].as_array().unwrap().len(), 2);
        assert_eq!(body["messages"][1]["content"], "Once upon");
        // Nothing streamed yet: the request itself (with the usage asked for).
        let plain = continued(
            Endpoint::ChatCompletions,
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            "",
            0,
        );
        assert!(plain.get("continue_final_message").is_none());
    }

    #[test]
    fn a_completion_goes_on_from_its_prompt_plus_the_text() {
        let body = continued(
            Endpoint::Completions,
            json!({"prompt": "Once", "max_tokens": 5, "min_tokens": 3}),
            " upon",
            1,
        );
        assert_eq!(
            (body["prompt"].as_str(), body["max_tokens"].as_u64(), body["min_tokens"].as_u64()),
            (Some("Once upon"), Some(4), Some(2))
        );
        let batch = continued(Endpoint::Completions, json!({"prompt": ["Once"]}), " upon", 1);
        assert_eq!(batch["prompt"], json!(["Once upon"]));
        let done =
            continuation(Endpoint::Completions, object(json!({"prompt": "a", "max_tokens": 2})), " b c", 2);
        assert_eq!(done.unwrap_err(), "answered to its max_tokens");
    }

    #[test]
    fn requests_that_cannot_be_continued_say_why() {
        let check = |endpoint, request: Value| unresumable(endpoint, &object(request));
        let chat = Endpoint::ChatCompletions;
        let messages = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(check(chat, json!({"messages": messages})), None);
        assert_eq!(check(chat, json!({"messages": messages, "n": 2})), Some("several choices"));
        assert_eq!(
            check(chat, json!({"messages": messages, "response_format": {"type": "json_object"}})),
            Some("structured output")
        );
        assert_eq!(check(chat, json!({"messages": messages, "response_format": {"type": "text"}})), None);
        assert_eq!(check(chat, json!({"messages": messages, "echo": true})), Some("echo"));
        let completions = Endpoint::Completions;
        assert_eq!(check(completions, json!({"prompt": [1, 2, 3]})), Some("a token-id or batched prompt"));
        assert_eq!(check(completions, json!({"prompt": ["a", "b"]})), Some("a token-id or batched prompt"));
        assert_eq!(check(completions, json!({"prompt": "a", "suffix": "z"})), Some("suffix"));
        assert_eq!(check(Endpoint::Generate, json!({"text": "a"})), Some("not a chat or completions stream"));
    }
}
