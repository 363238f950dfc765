//! The kvgate mock engines' tokenizer: chats rendered with `kvgate_words::render_chat` from messages read as crates/kvgate-mock/src/openai.rs reads them, one word one token.

use minijinja::value::ValueKind;
use minijinja::Value;
use serde::Deserialize;

use crate::error::TokenizerError;
use crate::template::{ChatTemplates, TemplateSource};

/// The body fields the mock engines read for a chat prompt.
#[derive(Deserialize)]
struct MessagesOnly {
    messages: Value,
}

/// Messages from a raw chat request body.
pub(crate) fn messages_from_body(body: &[u8]) -> Result<Value, TokenizerError> {
    let request: MessagesOnly = serde_json::from_slice(body).map_err(|error| {
        TokenizerError::invalid_request(format!("the body is not a chat request: {error}"))
    })?;
    Ok(request.messages)
}

/// The mock engines' chat prompt. Like the mock's request parsing: `role` must be a string;
/// `content` is a string, null/absent (empty), or a list of parts whose `text`s are joined with
/// single spaces (parts without text are skipped). The engines ignore the chat options. With
/// `template`, the messages are rendered by it instead (with `add_generation_prompt` true).
pub(crate) fn render_chat(
    messages: &Value,
    template: Option<&ChatTemplates>,
) -> Result<String, TokenizerError> {
    if let Some(template) = template {
        let context = Value::from_pairs(vec![
            ("messages".to_string(), messages.clone()),
            ("add_generation_prompt".to_string(), Value::from(true)),
        ]);
        return template.render(false, context);
    }
    if messages.kind() != ValueKind::Seq {
        return Err(TokenizerError::invalid_request(format!(
            "`messages` must be an array, not {}",
            messages.kind()
        )));
    }
    let mut pairs: Vec<(String, String)> = Vec::with_capacity(messages.len().unwrap_or(0));
    for (index, message) in messages.try_iter().into_iter().flatten().enumerate() {
        if message.kind() != ValueKind::Map {
            return Err(TokenizerError::invalid_request(format!("messages[{index}] must be an object")));
        }
        let role = field(&message, "role");
        let Some(role) = role.as_str() else {
            return Err(TokenizerError::invalid_request(format!("messages[{index}].role must be a string")));
        };
        pairs.push((role.to_string(), message_text(&field(&message, "content"), index)?));
    }
    Ok(kvgate_words::render_chat(&pairs))
}

fn message_text(content: &Value, index: usize) -> Result<String, TokenizerError> {
    match content.kind() {
        ValueKind::Undefined | ValueKind::None => Ok(String::new()),
        ValueKind::String => Ok(content.as_str().unwrap_or_default().to_string()),
        ValueKind::Seq => {
            let mut texts = Vec::new();
            for part in content.try_iter().into_iter().flatten() {
                if part.kind() != ValueKind::Map {
                    return Err(TokenizerError::invalid_request(format!(
                        "messages[{index}].content parts must be objects"
                    )));
                }
                let text = field(&part, "text");
                match text.kind() {
                    ValueKind::Undefined | ValueKind::None => {}
                    ValueKind::String => texts.push(text.as_str().unwrap_or_default().to_string()),
                    _ => {
                        return Err(TokenizerError::invalid_request(format!(
                            "messages[{index}].content part text must be a string"
                        )));
                    }
                }
            }
            Ok(texts.join(" "))
        }
        _ => Err(TokenizerError::invalid_request(format!(
            "messages[{index}].content must be a string or a list of parts"
        ))),
    }
}

fn field(map: &Value, key: &str) -> Value {
    map.get_item(&Value::from(key)).unwrap_or_default()
}

/// The chat template file at `path`, compiled as the Hugging Face tokenizers' templates are.
pub(crate) fn compile_template(path: &std::path::Path) -> Result<ChatTemplates, TokenizerError> {
    let source = std::fs::read_to_string(path)
        .map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
    let template = TemplateSource { name: "default".into(), origin: path.display().to_string(), source };
    ChatTemplates::compile(vec![template], true, crate::ContentFormatOption::AsSent)
}
