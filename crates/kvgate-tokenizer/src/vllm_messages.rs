//! A chat request's messages as vLLM's chat API hands them to the template: each message rebuilt
//! by `parse_chat_messages` (vLLM 0.32.0, `vllm/renderers/chat_utils.py`) for the template's
//! content format (`content_format.rs`), its tool calls' arguments parsed
//! (`_postprocess_messages`), and `developer` messages turned into one leading `system` message
//! when the template names no developer role (`safe_apply_chat_template`, `vllm/renderers/hf.py`).
//!
//! Text parts only: a part carrying media (an image, audio, video, embeddings) is refused, so
//! the request is routed on its text (the engine's multimodal processing is not mirrored).

use minijinja::value::ValueKind;
use minijinja::Value;

use crate::content_format::ContentFormat;
use crate::error::TokenizerError;

/// Part types whose content is text (`TEXT_PART_TYPES`) and the field each is read from.
const TEXT_PARTS: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];

/// The fields of vLLM's content part types (`_KNOWN_CONTENT_PART_FIELDS`): any other field of a
/// part is passed on to the template with it (`_collect_extra_fields`).
const KNOWN_PART_FIELDS: [&str; 18] = [
    "audio_embeds",
    "audio_url",
    "closed",
    "data",
    "file",
    "image_embeds",
    "image_pil",
    "image_url",
    "input_audio",
    "name",
    "prompt_cache_breakpoint",
    "refusal",
    "text",
    "thinking",
    "type",
    "uuid",
    "video_embeds",
    "video_url",
];

/// Claude Code's per-request attribution line, dropped from system text parts.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// `messages` as vLLM's template sees them, for a template rendered in `format` that does or
/// does not name the `developer` role.
pub(crate) fn rebuild(
    messages: &Value,
    format: ContentFormat,
    supports_developer: bool,
) -> Result<Value, TokenizerError> {
    let mut conversation = Vec::new();
    for message in iter(messages, "`messages` must be an array")? {
        let mut rebuilt = parse_message(&message, format)?;
        postprocess(&mut rebuilt)?;
        conversation.push(rebuilt);
    }
    let has_developer = conversation.iter().any(|message| role_of(message) == Some("developer"));
    if has_developer && !supports_developer {
        conversation = consolidate_system(conversation.into_iter().map(developer_to_system).collect());
    }
    Ok(Value::from(conversation.into_iter().map(Pairs::into_value).collect::<Vec<_>>()))
}

/// A message under construction: its fields in vLLM's insertion order.
struct Pairs(Vec<(String, Value)>);

impl Pairs {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.iter().find(|(name, _)| name == key).map(|(_, value)| value)
    }

    fn set(&mut self, key: &str, value: Value) {
        match self.0.iter_mut().find(|(name, _)| name == key) {
            Some(entry) => entry.1 = value,
            None => self.0.push((key.to_string(), value)),
        }
    }

    fn remove(&mut self, key: &str) {
        self.0.retain(|(name, _)| name != key);
    }

    fn into_value(self) -> Value {
        Value::from_pairs(self.0)
    }
}

fn role_of(message: &Pairs) -> Option<&str> {
    message.get("role").and_then(Value::as_str)
}

/// `_parse_chat_message_content`: one message rebuilt for the template.
fn parse_message(message: &Value, format: ContentFormat) -> Result<Pairs, TokenizerError> {
    if message.kind() != ValueKind::Map {
        return Err(invalid("each message must be an object"));
    }
    let role = field(message, "role");
    let Some(role_name) = role.as_str() else {
        return Err(invalid("each message needs a string `role`"));
    };
    let content = field(message, "content");
    let mut parts: Vec<Value> = match content.kind() {
        ValueKind::Undefined | ValueKind::None => Vec::new(),
        ValueKind::String => vec![content.clone()],
        ValueKind::Seq => {
            iter(&content, "a message's `content` must be a string or an array of parts")?.collect()
        }
        _ => return Err(invalid("a message's `content` must be a string or an array of parts")),
    };
    if role_name == "system" {
        parts = strip_billing_header(parts);
    }
    let mut texts: Vec<Value> = Vec::new();
    for part in &parts {
        if let Some(parsed) = parse_part(part, format)? {
            texts.push(parsed);
        }
    }
    let content = match format {
        ContentFormat::Openai => Value::from(texts),
        ContentFormat::String => {
            let strings: Vec<&str> = texts.iter().filter_map(Value::as_str).collect();
            Value::from(strings.join("\n"))
        }
    };
    let mut rebuilt = Pairs(vec![("role".to_string(), role.clone()), ("content".to_string(), content)]);
    match role_name {
        "assistant" => {
            let tool_calls = field(message, "tool_calls");
            if !is_none(&tool_calls) {
                rebuilt.set("tool_calls", tool_calls);
            }
            let reasoning = field(message, "reasoning");
            if !is_none(&reasoning) {
                rebuilt.set("reasoning", reasoning.clone());
                rebuilt.set("reasoning_content", reasoning);
            }
        }
        "tool" => {
            let call_id = field(message, "tool_call_id");
            if !call_id.is_undefined() {
                rebuilt.set("tool_call_id", call_id);
            }
            // A tool result's text parts are joined whatever the format (structured ones kept).
            let content = rebuilt.get("content").cloned().unwrap_or_default();
            if content.kind() == ValueKind::Seq {
                let items: Vec<Value> = content.try_iter().map(|items| items.collect()).unwrap_or_default();
                if items.iter().all(|item| field(item, "type").as_str() == Some("text")) {
                    let texts: Vec<String> = items
                        .iter()
                        .map(|item| field(item, "text").as_str().unwrap_or("").to_string())
                        .collect();
                    rebuilt.set("content", Value::from(texts.join("\n")));
                }
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        let value = field(message, key);
        if value.kind() == ValueKind::String {
            rebuilt.set(key, value);
        }
    }
    if role_name == "developer" {
        let tools = field(message, "tools");
        rebuilt.set("tools", if tools.is_undefined() { Value::from(()) } else { tools });
    }
    Ok(rebuilt)
}

/// `_parse_chat_message_content_part`: a text part as the format wants it (a string for
/// `string`, a `{"type": "text", "text": ...}` object with the part's extra fields for
/// `openai`), `None` for a text part without text.
fn parse_part(part: &Value, format: ContentFormat) -> Result<Option<Value>, TokenizerError> {
    if let Some(text) = part.as_str() {
        return Ok(Some(text_part(Value::from(text), &[], format)));
    }
    if part.kind() != ValueKind::Map {
        return Err(invalid("a content part must be a string or an object"));
    }
    let part_type = field(part, "type");
    let has_uuid = !is_none(&field(part, "uuid"));
    if let (Some(kind), false) = (part_type.as_str(), has_uuid) {
        if let Some((_, source)) = TEXT_PARTS.iter().find(|(name, _)| *name == kind) {
            let text = field(part, source);
            if is_none(&text) {
                // vLLM skips a text or refusal part with no text (and fails on the others).
                return match kind {
                    "text" | "refusal" => Ok(None),
                    _ => Err(invalid(format!("a `{kind}` part without `{source}`"))),
                };
            }
            if text.kind() != ValueKind::String {
                return Err(invalid(format!("a `{kind}` part's `{source}` must be a string")));
            }
            return Ok(Some(text_part(text, &extra_fields(part), format)));
        }
        if kind == "tool_reference" {
            let name = field(part, "name");
            return Ok(Some(match format {
                ContentFormat::String => name,
                ContentFormat::Openai => {
                    let mut pairs =
                        vec![("type".to_string(), Value::from("tool_reference")), ("name".to_string(), name)];
                    pairs.extend(extra_fields(part));
                    Value::from_pairs(pairs)
                }
            }));
        }
    }
    Err(invalid(
        "a content part other than text (media are not rendered by the gateway; the request is routed on its text)",
    ))
}

fn text_part(text: Value, extra: &[(String, Value)], format: ContentFormat) -> Value {
    match format {
        ContentFormat::String => text,
        ContentFormat::Openai => {
            let mut pairs = vec![("type".to_string(), Value::from("text")), ("text".to_string(), text)];
            pairs.extend(extra.iter().cloned());
            Value::from_pairs(pairs)
        }
    }
}

/// A part's fields that no vLLM part type declares, in their order.
fn extra_fields(part: &Value) -> Vec<(String, Value)> {
    part.try_iter()
        .into_iter()
        .flatten()
        .filter_map(|key| {
            let name = key.as_str()?.to_string();
            (!KNOWN_PART_FIELDS.contains(&name.as_str())).then(|| {
                let value = part.get_item(&key).unwrap_or_default();
                (name, value)
            })
        })
        .collect()
}

/// `_strip_claude_code_billing_header`: a system text part starting with the header loses its
/// first line (and is dropped when nothing follows).
fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
    let mut kept = Vec::with_capacity(parts.len());
    for part in parts {
        let text = match part.as_str() {
            Some(text) => Some(text.to_string()),
            None if field(&part, "type").as_str() == Some("text") => {
                field(&part, "text").as_str().map(str::to_string)
            }
            None => None,
        };
        let Some(text) = text.filter(|text| text.starts_with(BILLING_HEADER)) else {
            kept.push(part);
            continue;
        };
        let rest = text.split_once('\n').map_or("", |(_, rest)| rest);
        if rest.is_empty() {
            continue;
        }
        if part.as_str().is_some() {
            kept.push(Value::from(rest));
        } else {
            let mut pairs: Vec<(String, Value)> = part
                .try_iter()
                .into_iter()
                .flatten()
                .filter_map(|key| Some((key.as_str()?.to_string(), part.get_item(&key).unwrap_or_default())))
                .collect();
            if let Some(entry) = pairs.iter_mut().find(|(name, _)| name == "text") {
                entry.1 = Value::from(rest);
            }
            kept.push(Value::from_pairs(pairs));
        }
    }
    kept
}

/// `_postprocess_messages`: an assistant's tool calls get their `arguments` as an object
/// (parsed from JSON; `{}` when empty, invalid or not an object); an empty list is dropped.
fn postprocess(message: &mut Pairs) -> Result<(), TokenizerError> {
    if role_of(message) != Some("assistant") {
        return Ok(());
    }
    let Some(tool_calls) = message.get("tool_calls").cloned() else { return Ok(()) };
    if tool_calls.kind() != ValueKind::Seq {
        return Ok(());
    }
    let calls: Vec<Value> = tool_calls.try_iter().map(|items| items.collect()).unwrap_or_default();
    if calls.is_empty() {
        message.remove("tool_calls");
        return Ok(());
    }
    let mut rebuilt = Vec::with_capacity(calls.len());
    for call in calls {
        if call.kind() != ValueKind::Map {
            return Err(invalid("assistant tool_calls entries must be objects"));
        }
        let function = field(&call, "function");
        let call_type = field(&call, "type");
        let is_function = call_type.is_undefined() || call_type.as_str() == Some("function");
        if !is_function || function.kind() != ValueKind::Map {
            return Err(invalid("chat completions only support assistant tool_calls of type 'function'"));
        }
        let arguments = parsed_arguments(&field(&function, "arguments"));
        let function = with_field(&function, "arguments", arguments);
        rebuilt.push(with_field(&call, "function", function));
    }
    message.set("tool_calls", Value::from(rebuilt));
    Ok(())
}

/// A tool call's `arguments` as vLLM passes them on: an object, else `{}`.
fn parsed_arguments(arguments: &Value) -> Value {
    let empty = || Value::from_pairs(Vec::<(String, Value)>::new());
    if !arguments.is_true() {
        return empty();
    }
    match arguments.kind() {
        ValueKind::Map => arguments.clone(),
        ValueKind::String => match serde_json::from_str::<Value>(arguments.as_str().unwrap_or("")) {
            Ok(parsed) if parsed.kind() == ValueKind::Map => parsed,
            _ => empty(),
        },
        _ => empty(),
    }
}

/// `_convert_developer_to_system` for one message.
fn developer_to_system(mut message: Pairs) -> Pairs {
    if role_of(&message) == Some("developer") {
        message.set("role", Value::from("system"));
        message.remove("tools");
    }
    message
}

/// `_consolidate_system_messages`: several system messages, or one not first, become one
/// leading system message (their texts joined by blank lines).
fn consolidate_system(conversation: Vec<Pairs>) -> Vec<Pairs> {
    let mut contents = Vec::new();
    let mut others = Vec::new();
    let mut needed = false;
    for (position, message) in conversation.iter().enumerate() {
        if role_of(message) != Some("system") {
            continue;
        }
        if position > 0 || !contents.is_empty() {
            needed = true;
        }
        let content = message.get("content").cloned().unwrap_or_default();
        let text = match content.kind() {
            ValueKind::Seq => content
                .try_iter()
                .into_iter()
                .flatten()
                .filter_map(|part| match part.as_str() {
                    Some(text) => Some(text.to_string()),
                    None => field(&part, "text").as_str().map(str::to_string),
                })
                .collect::<Vec<_>>()
                .join("\n"),
            _ => content.as_str().unwrap_or("").to_string(),
        };
        if !text.is_empty() {
            contents.push(text);
        }
    }
    if !needed {
        return conversation;
    }
    for message in conversation {
        if role_of(&message) != Some("system") {
            others.push(message);
        }
    }
    let merged = Pairs(vec![
        ("role".to_string(), Value::from("system")),
        ("content".to_string(), Value::from(contents.join("\n\n"))),
    ]);
    std::iter::once(merged).chain(others).collect()
}

fn field(map: &Value, key: &str) -> Value {
    if map.kind() == ValueKind::Map {
        map.get_item(&Value::from(key)).unwrap_or_default()
    } else {
        Value::UNDEFINED
    }
}

/// Missing or null (Python's `None`).
fn is_none(value: &Value) -> bool {
    value.is_undefined() || value.is_none()
}

/// A copy of `map` with `key` set to `value`, in its place (or last).
fn with_field(map: &Value, key: &str, value: Value) -> Value {
    let mut pairs: Vec<(String, Value)> = map
        .try_iter()
        .into_iter()
        .flatten()
        .filter_map(|name| Some((name.as_str()?.to_string(), map.get_item(&name).unwrap_or_default())))
        .collect();
    match pairs.iter_mut().find(|(name, _)| name == key) {
        Some(entry) => entry.1 = value,
        None => pairs.push((key.to_string(), value)),
    }
    Value::from_pairs(pairs)
}

fn iter(value: &Value, message: &str) -> Result<impl Iterator<Item = Value>, TokenizerError> {
    if value.kind() != ValueKind::Seq {
        return Err(invalid(message));
    }
    value.try_iter().map_err(|_| invalid(message))
}

fn invalid(message: impl Into<String>) -> TokenizerError {
    TokenizerError::invalid_request(message)
}
