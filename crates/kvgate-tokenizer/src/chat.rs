//! A chat request as the template sees it (messages, tools, flags, extra variables), read from JSON values or a raw request body, and transformers' `continue_final_message` cut.

use minijinja::value::ValueKind;
use minijinja::Value;
use serde::Deserialize;

use crate::error::TokenizerError;
use crate::ChatOptions;

/// A chat request, normalised for rendering.
pub(crate) struct ChatInput {
    /// The `messages` array, passed to the template as sent.
    pub(crate) messages: Value,
    pub(crate) tools: Option<Value>,
    /// vLLM's `documents` (RAG templates), none unless given.
    pub(crate) documents: Option<Value>,
    pub(crate) add_generation_prompt: bool,
    pub(crate) continue_final_message: bool,
    /// `chat_template_kwargs` without the names that set the fields above.
    pub(crate) kwargs: Vec<(String, Value)>,
}

/// The fields of an OpenAI chat request body that decide its prompt. minijinja values keep
/// the client's key order (JSON objects are ordered maps there), which `tojson` reproduces.
#[derive(Deserialize)]
struct ChatRequestBody {
    messages: Value,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
}

impl ChatInput {
    /// From the `messages` JSON and the options.
    pub(crate) fn from_json(
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<ChatInput, TokenizerError> {
        let messages = json_value(messages);
        let tools = options.tools.as_ref().filter(|tools| !tools.is_null()).map(json_value);
        let kwargs = options.chat_template_kwargs.as_ref().map(json_value);
        let flags = (options.add_generation_prompt, options.continue_final_message);
        ChatInput::build(messages, tools, None, flags, kwargs)
    }

    /// From a whole `/v1/chat/completions` request body (other fields are ignored).
    pub(crate) fn from_body(body: &[u8]) -> Result<ChatInput, TokenizerError> {
        let request: ChatRequestBody = serde_json::from_slice(body).map_err(|error| {
            TokenizerError::invalid_request(format!("the body is not a chat request: {error}"))
        })?;
        let tools = request.tools.filter(|tools| !tools.is_none());
        let documents = request.documents.filter(|documents| !documents.is_none());
        let defaults = ChatOptions::default();
        let flags = (
            request.add_generation_prompt.unwrap_or(defaults.add_generation_prompt),
            request.continue_final_message.unwrap_or(defaults.continue_final_message),
        );
        let kwargs = request.chat_template_kwargs.filter(|kwargs| !kwargs.is_none());
        ChatInput::build(request.messages, tools, documents, flags, kwargs)
    }

    /// Checks the shapes and applies `chat_template_kwargs` as vLLM does: its keys override the
    /// request's `add_generation_prompt`, `continue_final_message`, `tools` and `documents`.
    /// `flags` are (add_generation_prompt, continue_final_message).
    fn build(
        messages: Value,
        mut tools: Option<Value>,
        mut documents: Option<Value>,
        flags: (bool, bool),
        kwargs: Option<Value>,
    ) -> Result<ChatInput, TokenizerError> {
        let (mut add_generation_prompt, mut continue_final_message) = flags;
        if messages.kind() != ValueKind::Seq {
            return Err(TokenizerError::invalid_request(format!(
                "`messages` must be an array, not {}",
                messages.kind()
            )));
        }
        let mut extra = Vec::new();
        if let Some(kwargs) = kwargs {
            if kwargs.kind() != ValueKind::Map {
                return Err(TokenizerError::invalid_request("`chat_template_kwargs` must be an object"));
            }
            for key in
                kwargs.try_iter().map_err(|error| TokenizerError::invalid_request(error.to_string()))?
            {
                let value = kwargs.get_item(&key).unwrap_or_default();
                let name = key.as_str().unwrap_or_default().to_string();
                match name.as_str() {
                    "add_generation_prompt" => add_generation_prompt = flag(&name, &value)?,
                    "continue_final_message" => continue_final_message = flag(&name, &value)?,
                    "tools" => tools = Some(value).filter(|tools| !tools.is_none()),
                    "documents" => documents = Some(value).filter(|documents| !documents.is_none()),
                    // vLLM drops these; they are not template variables.
                    "chat_template" | "tokenize" => {}
                    "messages" => {
                        return Err(TokenizerError::invalid_request(
                            "`chat_template_kwargs` cannot set `messages`; send them as the request's messages",
                        ));
                    }
                    _ => extra.push((name, value)),
                }
            }
        }
        if let Some(tools) = &tools {
            let all_objects =
                tools.try_iter().is_ok_and(|mut items| items.all(|tool| tool.kind() == ValueKind::Map));
            if tools.kind() != ValueKind::Seq || !all_objects {
                return Err(TokenizerError::invalid_request("`tools` must be an array of objects"));
            }
        }
        if continue_final_message && add_generation_prompt {
            return Err(TokenizerError::invalid_request(
                "continue_final_message and add_generation_prompt cannot both be true (add_generation_prompt \
                 defaults to true: set it to false to continue the final message)",
            ));
        }
        Ok(ChatInput {
            messages,
            tools,
            documents,
            add_generation_prompt,
            continue_final_message,
            kwargs: extra,
        })
    }
}

impl ChatInput {
    /// The conversation's leading messages, enough to render its first `max_chars` characters:
    /// messages are kept until their contents pass `max_chars` bytes (the one that passes it
    /// included), rendered as history (no generation prompt, no final message continued).
    pub(crate) fn leading(mut self, max_chars: usize) -> ChatInput {
        self.messages = leading_messages(&self.messages, max_chars);
        self.add_generation_prompt = false;
        self.continue_final_message = false;
        self
    }
}

/// The leading messages whose contents reach past `max_chars` bytes (all when they do not).
pub(crate) fn leading_messages(messages: &Value, max_chars: usize) -> Value {
    if messages.kind() != ValueKind::Seq {
        return messages.clone(); // refused by the renderer as usual
    }
    let mut kept = Vec::new();
    let mut size = 0usize;
    for message in messages.try_iter().into_iter().flatten() {
        size = size.saturating_add(content_bytes(&get(&message, "content")));
        kept.push(message);
        if size > max_chars {
            break;
        }
    }
    Value::from(kept)
}

/// The bytes of a message's text: a string, or the `text`s of its parts.
fn content_bytes(content: &Value) -> usize {
    match content.kind() {
        ValueKind::String => content.as_str().map_or(0, str::len),
        ValueKind::Seq => content
            .try_iter()
            .into_iter()
            .flatten()
            .map(|part| get(&part, "text").as_str().map_or(0, str::len))
            .sum(),
        _ => 0,
    }
}

/// `text` cut to its first `max_chars` characters.
pub(crate) fn first_chars(text: &str, max_chars: usize) -> &str {
    match text.char_indices().nth(max_chars) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

/// A JSON value as a template value (objects keep serde_json's key order).
pub(crate) fn json_value(value: &serde_json::Value) -> Value {
    Value::from(minijinja::value::Serde(value))
}

fn flag(name: &str, value: &Value) -> Result<bool, TokenizerError> {
    match value.kind() {
        ValueKind::Bool => Ok(value.is_true()),
        _ => Err(TokenizerError::invalid_request(format!(
            "`chat_template_kwargs.{name}` must be true or false"
        ))),
    }
}

/// What transformers appends to the final message's text to find where it ends after rendering.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// transformers' `continue_final_message`: the final message's (last text part's) text gets
/// [`CONTINUE_TAG`] appended. Returns the new messages and the original text.
pub(crate) fn tag_final_message(messages: &Value) -> Result<(Value, String), TokenizerError> {
    let mut items: Vec<Value> = messages.try_iter().map(|items| items.collect()).unwrap_or_default();
    let Some(last) = items.pop() else {
        return Err(TokenizerError::invalid_request("continue_final_message needs at least one message"));
    };
    let content = get(&last, "content");
    let (content, final_text) = match content.kind() {
        ValueKind::String => {
            let text = content.as_str().unwrap_or_default().to_string();
            (Value::from(format!("{text}{CONTINUE_TAG}")), text)
        }
        ValueKind::Seq => {
            let mut parts: Vec<Value> = content.try_iter().map(|parts| parts.collect()).unwrap_or_default();
            let position = parts
                .iter()
                .rposition(|part| part.kind() == ValueKind::Map && !get(part, "text").is_undefined());
            let Some(position) = position else {
                return Err(TokenizerError::invalid_request(
                    "continue_final_message is set but the final message has no text part to continue",
                ));
            };
            let text = text_of(&get(&parts[position], "text"))?;
            parts[position] =
                with_key(&parts[position], "text", Value::from(format!("{text}{CONTINUE_TAG}")));
            (Value::from(parts), text)
        }
        _ => {
            return Err(TokenizerError::invalid_request(
                "continue_final_message is set but the final message's content is not text",
            ));
        }
    };
    items.push(with_key(&last, "content", content));
    Ok((Value::from(items), final_text))
}

/// Cuts the rendering after the final message's text, as transformers does.
pub(crate) fn cut_after_final_message(rendered: String, final_text: &str) -> Result<String, TokenizerError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(python_strip(final_text)) || !rendered.contains(tag) {
        return Err(TokenizerError::Render {
            message: "continue_final_message is set but the final message does not appear in the chat after \
                      applying the chat template (the template changes the final message)"
                .to_string(),
            line: None,
        });
    }
    let position = rendered.rfind(tag).unwrap_or(rendered.len());
    let mut rendered = rendered;
    if rendered[position..].starts_with(CONTINUE_TAG) {
        rendered.truncate(position);
    } else {
        let kept = rendered[..position].trim_end_matches(is_python_space).len();
        rendered.truncate(kept);
    }
    Ok(rendered)
}

fn text_of(value: &Value) -> Result<String, TokenizerError> {
    value.as_str().map(str::to_string).ok_or_else(|| {
        TokenizerError::invalid_request("continue_final_message: the final text part's text is not a string")
    })
}

fn get(map: &Value, key: &str) -> Value {
    if map.kind() == ValueKind::Map {
        map.get_item(&Value::from(key)).unwrap_or_default()
    } else {
        Value::UNDEFINED
    }
}

/// A copy of `map` with `key` set to `value`, keys kept in their order.
fn with_key(map: &Value, key: &str, value: Value) -> Value {
    let mut replaced = false;
    let mut pairs: Vec<(Value, Value)> = Vec::new();
    for existing in map.try_iter().into_iter().flatten() {
        if existing.as_str() == Some(key) {
            pairs.push((existing, value.clone()));
            replaced = true;
        } else {
            let item = map.get_item(&existing).unwrap_or_default();
            pairs.push((existing, item));
        }
    }
    if !replaced {
        pairs.push((Value::from(key), value));
    }
    Value::from_pairs(pairs)
}

/// `str.isspace()` for the characters Python strips (Unicode whitespace plus the ASCII separators 0x1c-0x1f).
fn is_python_space(ch: char) -> bool {
    ch.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&ch)
}

fn python_strip(text: &str) -> &str {
    text.trim_matches(is_python_space)
}
