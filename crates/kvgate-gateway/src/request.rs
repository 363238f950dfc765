//! What the gateway reads from a request body: the model, the stream flag and the routing key
//! (a chat conversation rendered in order, a completion prompt, or token ids). The body itself is
//! forwarded untouched.

use std::borrow::Cow;

use serde::Deserialize;

/// The fields the gateway looks at. Unknown fields are skipped (but the JSON must be valid);
/// known fields of the wrong type are a 400.
#[derive(Debug, Deserialize)]
pub struct RequestFields<'a> {
    #[serde(borrow, default)]
    pub model: Option<Cow<'a, str>>,
    /// Type-checked only: streamed and whole answers are both passed through as they arrive.
    #[serde(default)]
    #[allow(dead_code, reason = "validated for a clear 400; the proxy streams either way")]
    pub stream: Option<bool>,
    #[serde(borrow, default)]
    pub messages: Option<Vec<ChatMessage<'a>>>,
    /// `/v1/completions` prompt.
    #[serde(borrow, default)]
    pub prompt: Option<PromptInput<'a>>,
    /// `/generate` text.
    #[serde(borrow, default)]
    pub text: Option<PromptInput<'a>>,
    /// `/generate` token ids.
    #[serde(default)]
    pub input_ids: Option<TokenInput>,
    /// `/v1/embeddings` input.
    #[serde(borrow, default)]
    pub input: Option<PromptInput<'a>>,
    /// The end user (OpenAI's `user`): the session key when no routing-key header is given.
    #[serde(borrow, default)]
    pub user: Option<Cow<'a, str>>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage<'a> {
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    #[serde(borrow, default)]
    pub content: Option<MessageContent<'a>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(#[serde(borrow)] Vec<ContentPart<'a>>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart<'a> {
    #[serde(borrow, default)]
    pub text: Option<Cow<'a, str>>,
}

/// A prompt: one string, a batch of strings, token ids, or a batch of token-id lists.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum TokenInput {
    Single(Vec<u32>),
    Batch(Vec<Vec<u32>>),
}

/// The routing key a prefix-aware policy matches on.
#[derive(Debug, PartialEq, Eq)]
pub enum OwnedKey<'a> {
    None,
    Text(Cow<'a, str>),
    Tokens(Cow<'a, [u32]>),
}

impl<'a> RequestFields<'a> {
    /// Parse a body; the error text says what was wrong and where.
    pub fn parse(body: &'a [u8]) -> Result<Self, String> {
        let fields: RequestFields<'a> = serde_json::from_slice(body).map_err(|e| {
            if e.is_syntax() || e.is_eof() {
                format!("malformed JSON body: {e}")
            } else {
                format!("invalid request body: {e}")
            }
        })?;
        Ok(fields)
    }

    /// The prompt as a policy sees it. Chat conversations are rendered whole and in order, with
    /// role markers, so successive turns of one conversation share a prefix.
    pub fn routing_key(&self) -> OwnedKey<'_> {
        match &self.input_ids {
            Some(TokenInput::Single(ids)) => return OwnedKey::Tokens(Cow::Borrowed(ids)),
            Some(TokenInput::Batch(batches)) if !batches.is_empty() => {
                return OwnedKey::Tokens(Cow::Borrowed(&batches[0]))
            }
            _ => {}
        }
        if let Some(messages) = &self.messages {
            return OwnedKey::Text(Cow::Owned(render_chat(messages)));
        }
        for input in [&self.prompt, &self.text, &self.input].into_iter().flatten() {
            match input {
                PromptInput::Text(text) => return OwnedKey::Text(Cow::Borrowed(text)),
                PromptInput::Texts(texts) if !texts.is_empty() => {
                    return OwnedKey::Text(Cow::Borrowed(&texts[0]))
                }
                PromptInput::Tokens(ids) => return OwnedKey::Tokens(Cow::Borrowed(ids)),
                PromptInput::TokenBatches(batches) if !batches.is_empty() => {
                    return OwnedKey::Tokens(Cow::Borrowed(&batches[0]))
                }
                _ => {}
            }
        }
        OwnedKey::None
    }
}

/// Render a conversation as routing text: `<|role|>\ncontent\n` per message, in order.
pub fn render_chat(messages: &[ChatMessage<'_>]) -> String {
    let capacity = messages
        .iter()
        .map(|m| {
            m.role.len()
                + 6
                + match &m.content {
                    Some(MessageContent::Text(text)) => text.len(),
                    Some(MessageContent::Parts(parts)) => {
                        parts.iter().filter_map(|p| p.text.as_ref()).map(|t| t.len() + 1).sum()
                    }
                    None => 0,
                }
        })
        .sum();
    let mut out = String::with_capacity(capacity);
    for message in messages {
        out.push_str("<|");
        out.push_str(&message.role);
        out.push_str("|>\n");
        match &message.content {
            Some(MessageContent::Text(text)) => out.push_str(text),
            Some(MessageContent::Parts(parts)) => {
                for text in parts.iter().filter_map(|p| p.text.as_ref()) {
                    out.push_str(text);
                    out.push('\n');
                }
            }
            None => {}
        }
        out.push('\n');
    }
    out
}

/// A rough prompt-token estimate for a routing key (4 characters per token for text).
pub fn estimate_tokens(key: &OwnedKey<'_>) -> u64 {
    match key {
        OwnedKey::None => 0,
        OwnedKey::Text(text) => (text.len() as u64).div_ceil(4),
        OwnedKey::Tokens(ids) => ids.len() as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(body: &str) -> String {
        let fields = RequestFields::parse(body.as_bytes()).unwrap();
        match fields.routing_key() {
            OwnedKey::Text(text) => text.into_owned(),
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn chat_turns_share_a_prefix() {
        let turn1 = key(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"}]}"#);
        let turn2 = key(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"},
                {"role":"assistant","content":"hello"},{"role":"user","content":"more"}]}"#);
        assert!(turn2.starts_with(&turn1), "{turn2:?} should extend {turn1:?}");
        let other = key(r#"{"messages":[{"role":"system","content":"T"},{"role":"user","content":"hi"}]}"#);
        assert_ne!(other.as_bytes()[..12], turn1.as_bytes()[..12]);
    }

    #[test]
    fn content_parts_and_tool_messages_render() {
        let text = key(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}}]},
                {"role":"tool","content":"r"}]}"#,
        );
        assert_eq!(text, "<|user|>\na\n\n<|tool|>\nr\n");
    }

    #[test]
    fn prompt_forms() {
        assert_eq!(key(r#"{"prompt":"abc"}"#), "abc");
        assert_eq!(key(r#"{"prompt":["x","y"]}"#), "x");
        assert_eq!(key(r#"{"text":"gen"}"#), "gen");
        assert_eq!(key(r#"{"input_ids":[1,2,3]}"#), "Tokens([1, 2, 3])");
        assert_eq!(key(r#"{"input_ids":[[4,5],[6]]}"#), "Tokens([4, 5])");
        assert_eq!(key(r#"{"prompt":[7,8]}"#), "Tokens([7, 8])");
        assert_eq!(key(r#"{"model":"m"}"#), "None");
    }

    #[test]
    fn bad_bodies_are_errors() {
        let syntax = RequestFields::parse(b"{not json").unwrap_err();
        assert!(syntax.starts_with("malformed JSON"), "{syntax}");
        let types = RequestFields::parse(br#"{"model": 3}"#).unwrap_err();
        assert!(types.starts_with("invalid request body"), "{types}");
        assert!(RequestFields::parse(br#"{"stream": "yes"}"#).is_err());
        assert!(RequestFields::parse(br#"{"messages": "hi"}"#).is_err());
        assert!(RequestFields::parse(br#"[1,2]"#).is_err());
        let escaped = RequestFields::parse(br#"{"model":"a\"b","extra":{"x":[1,2]}}"#).unwrap();
        assert_eq!(escaped.model.as_deref(), Some("a\"b"));
    }
}
