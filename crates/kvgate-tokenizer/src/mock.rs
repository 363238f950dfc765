//! The kvgate mock engines' tokenizer: chats read and rendered as the mock engines read and render them (`kvgate_protocol::request`: its `ChatMessage` and the one chat rendering, `render_chat`), one word one token.

use kvgate_protocol::request::ChatMessage;
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

/// The mock engines' chat prompt: the messages read as the engines read them (`role` a string;
/// `content` a string, null/absent, or a list of parts whose `text`s are joined with single
/// spaces) and rendered by the one chat rendering. The engines ignore the chat options. With
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
    let json = serde_json::to_value(messages)
        .map_err(|error| TokenizerError::invalid_request(format!("`messages`: {error}")))?;
    let messages: Vec<ChatMessage<'_>> = Vec::deserialize(&json)
        .map_err(|error| TokenizerError::invalid_request(format!("`messages`: {error}")))?;
    Ok(kvgate_protocol::render_chat(&messages))
}

/// The chat template file at `path`, compiled as the Hugging Face tokenizers' templates are.
pub(crate) fn compile_template(path: &std::path::Path) -> Result<ChatTemplates, TokenizerError> {
    let source = std::fs::read_to_string(path)
        .map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
    let template = TemplateSource { name: "default".into(), origin: path.display().to_string(), source };
    ChatTemplates::compile(vec![template], true, crate::ContentFormatOption::AsSent)
}
