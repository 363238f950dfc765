//! Turns requests into the token ids an engine computes: Hugging Face tokenizers with chat templates rendered as transformers renders them, or the mock engines' word tokenizer.
//!
//! Chat requests are rendered the way vLLM and SGLang render them, with transformers'
//! `apply_chat_template` (Jinja2, `trim_blocks` and `lstrip_blocks`, `raise_exception`,
//! `strftime_now`, a `tojson` without HTML escaping, the special tokens as variables), then
//! tokenized without adding special tokens; completion prompts are tokenized with them.
//! Everything is read from local files; nothing is downloaded.
//!
//! Encoding goes through a segment cache (cache.rs, split.rs): the text is cut at the added
//! tokens the Hugging Face tokenizer itself cuts at, and each section's ids are cached, so a
//! conversation's history is tokenized once, not every turn. It is on only for tokenizers where
//! that gives exactly the same ids ([`SegmentCacheStatus`] says why not otherwise).

mod cache;
mod chat;
mod content_format;
mod error;
mod hf;
mod load;
mod mock;
mod pyfmt;
mod split;
mod strftime;
mod template;
mod vllm_messages;

use std::path::Path;

pub use content_format::{ContentFormat, ContentFormatOption};
pub use error::{ErrorSide, TokenizerError};

use chat::ChatInput;
use hf::HfTokenizer;

/// How the gateway turns requests into the token ids an engine computes. Cheap to share
/// between threads (`Send + Sync`); templates are compiled once, at load.
#[derive(Debug)]
pub struct Tokenizer {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Hf(Box<HfTokenizer>),
    /// The mock engines' words, chats rendered as they render them, or with a template given in
    /// their place (`--chat-template` with `--mock-tokenizer`).
    Mock(Option<Box<template::ChatTemplates>>),
}

/// The chat options of vLLM's chat API that change the prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatOptions {
    /// Append the template's assistant header (default true, as in vLLM's API).
    pub add_generation_prompt: bool,
    /// Render the final message open-ended so the model continues it (needs `add_generation_prompt: false`).
    pub continue_final_message: bool,
    /// The request's `tools` (an array of objects), given to the template as `tools`.
    pub tools: Option<serde_json::Value>,
    /// Extra template variables (an object). As in vLLM, its `add_generation_prompt`,
    /// `continue_final_message` and `tools` override the fields above.
    pub chat_template_kwargs: Option<serde_json::Value>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            continue_final_message: false,
            tools: None,
            chat_template_kwargs: None,
        }
    }
}

/// How a Hugging Face tokenizer is set up, beyond its files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizerOptions {
    /// Capacity of the segment cache in token-sized units (4 bytes): a cached section counts its
    /// token ids, its text (4 bytes a unit) and 16 units of bookkeeping, so the cache takes about
    /// 4 bytes × this much memory and holds about half as many ids of typical text. 0 turns it off.
    pub segment_cache_tokens: u64,
    /// How a chat request's messages reach the template: as vLLM's chat API passes them, for the
    /// template's content format (`Auto`, the default, detects it as vLLM does), or as sent.
    pub content_format: ContentFormatOption,
}

impl TokenizerOptions {
    /// The default segment cache capacity: 8 Mi units, about 32 MiB and 4 M tokens of text.
    pub const DEFAULT_SEGMENT_CACHE_TOKENS: u64 = 8 << 20;
}

impl Default for TokenizerOptions {
    fn default() -> Self {
        TokenizerOptions {
            segment_cache_tokens: TokenizerOptions::DEFAULT_SEGMENT_CACHE_TOKENS,
            content_format: ContentFormatOption::default(),
        }
    }
}

/// The state of a tokenizer's segment cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SegmentCacheStatus {
    /// The mock tokenizer, or a capacity of 0.
    Off,
    /// Cutting texts at added tokens could give other ids than the tokenizer does (an added token
    /// with `lstrip`, `rstrip` or `single_word`, a position-dependent pre-tokenizer, ...):
    /// every text is tokenized whole. `reason` says which.
    Unsupported { reason: String },
    /// In use: cached sections, their weight and the capacity (token-sized units).
    On { entries: usize, weight: u64, capacity: u64 },
}

impl Tokenizer {
    /// A Hugging Face tokenizer: `path` is a directory holding tokenizer.json (and
    /// tokenizer_config.json with `chat_template`, bos/eos tokens, ...) or a tokenizer.json file
    /// (then tokenizer_config.json is looked for beside it). `chat_template` (a file with the
    /// Jinja template) overrides the model's. The model's template is, as transformers finds it,
    /// `chat_template.jinja` (plus `additional_chat_templates/*.jinja`) if present, else
    /// tokenizer_config.json's `chat_template` (a string, or a list of {name, template}: "default"
    /// is used, "tool_use" when tools are given). No download ever. With the default options
    /// (the segment cache on).
    pub fn from_path(path: &Path, chat_template: Option<&Path>) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_path_with_options(path, chat_template, &TokenizerOptions::default())
    }

    /// [`Tokenizer::from_path`] with explicit options.
    pub fn from_path_with_options(
        path: &Path,
        chat_template: Option<&Path>,
        options: &TokenizerOptions,
    ) -> Result<Tokenizer, TokenizerError> {
        let hf = load::load(path, chat_template, options)?;
        Ok(Tokenizer { kind: Kind::Hf(Box::new(hf)) })
    }

    /// The kvgate mock engines' own tokenizer (crates/kvgate-words: one whitespace word = one
    /// token; chats rendered with `kvgate_protocol::render_chat` as crates/kvgate-mock does).
    pub fn mock() -> Tokenizer {
        Tokenizer { kind: Kind::Mock(None) }
    }

    /// The mock engines' word tokenizer, with chats rendered by the Jinja template at `path`
    /// instead of the engines' own rendering: what a gateway configured with another chat
    /// template than its engines' computes (the closed loop's wrong-template case).
    pub fn mock_with_chat_template(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let templates = mock::compile_template(path)?;
        Ok(Tokenizer { kind: Kind::Mock(Some(Box::new(templates))) })
    }

    /// Token ids of a completion prompt as the engine computes them (add_special_tokens = true).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.kind {
            Kind::Hf(hf) => hf.encode(text, true),
            Kind::Mock(_) => Ok(kvgate_words::tokenize(text)),
        }
    }

    /// Token ids of a chat request's prompt. `messages` is the request's `messages` array as sent
    /// (content as a string or a list of parts is passed to the template as is).
    ///
    /// Objects in a `serde_json::Value` have sorted keys unless serde_json's `preserve_order`
    /// feature is on; where a template prints objects (`tools | tojson`) the engine keeps the
    /// client's order, so prefer [`Tokenizer::encode_chat_request`] with the raw body.
    pub fn encode_chat(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<Vec<u32>, TokenizerError> {
        match &self.kind {
            Kind::Hf(hf) => hf.encode(&hf.render_chat(ChatInput::from_json(messages, options)?)?, false),
            Kind::Mock(_) => Ok(kvgate_words::tokenize(&self.render_chat(messages, options)?)),
        }
    }

    /// The rendered chat prompt text (before tokenization), for tests and debugging.
    pub fn render_chat(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<String, TokenizerError> {
        match &self.kind {
            Kind::Hf(hf) => hf.render_chat(ChatInput::from_json(messages, options)?),
            Kind::Mock(template) => mock::render_chat(&chat::json_value(messages), template.as_deref()),
        }
    }

    /// Token ids of a `/v1/chat/completions` request given as its raw JSON body: `messages`,
    /// `tools`, `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` are
    /// read from it (other fields are ignored), keeping the client's key order.
    pub fn encode_chat_request(&self, body: &[u8]) -> Result<Vec<u32>, TokenizerError> {
        match &self.kind {
            Kind::Hf(hf) => hf.encode(&hf.render_chat(ChatInput::from_body(body)?)?, false),
            Kind::Mock(_) => Ok(kvgate_words::tokenize(&self.render_chat_request(body)?)),
        }
    }

    /// The rendered prompt of a raw chat request body (see [`Tokenizer::encode_chat_request`]).
    pub fn render_chat_request(&self, body: &[u8]) -> Result<String, TokenizerError> {
        match &self.kind {
            Kind::Hf(hf) => hf.render_chat(ChatInput::from_body(body)?),
            Kind::Mock(template) => mock::render_chat(&mock::messages_from_body(body)?, template.as_deref()),
        }
    }

    /// Token ids of the first `max_chars` characters of a raw chat request's rendered prompt:
    /// only the leading messages needed for them are rendered (as history: no generation
    /// prompt), so the work is bounded by `max_chars`, not by the conversation. For templates
    /// that render each message in turn, a prefix of [`Tokenizer::encode_chat_request`]'s ids
    /// up to its last token or so.
    pub fn encode_chat_request_prefix(
        &self,
        body: &[u8],
        max_chars: usize,
    ) -> Result<Vec<u32>, TokenizerError> {
        match &self.kind {
            Kind::Hf(hf) => {
                let rendered = hf.render_chat(ChatInput::from_body(body)?.leading(max_chars))?;
                hf.encode(chat::first_chars(&rendered, max_chars), false)
            }
            Kind::Mock(template) => {
                let messages = chat::leading_messages(&mock::messages_from_body(body)?, max_chars);
                let rendered = mock::render_chat(&messages, template.as_deref())?;
                Ok(kvgate_words::tokenize(chat::first_chars(&rendered, max_chars)))
            }
        }
    }

    /// The content format the chat template used without tools renders with (`None`: the mock
    /// tokenizer, no chat template, or messages passed as sent).
    pub fn chat_content_format(&self) -> Option<ContentFormat> {
        match &self.kind {
            Kind::Hf(hf) => hf.chat_content_format(),
            Kind::Mock(_) => None,
        }
    }

    /// Whether the segment cache is in use, and how full it is.
    pub fn segment_cache_status(&self) -> SegmentCacheStatus {
        match &self.kind {
            Kind::Hf(hf) => hf.segment_cache_status(),
            Kind::Mock(_) => SegmentCacheStatus::Off,
        }
    }

    /// Empties the segment cache (for measurements; results never depend on it).
    pub fn clear_segment_cache(&self) {
        if let Kind::Hf(hf) = &self.kind {
            hf.clear_segment_cache();
        }
    }

    /// True for the mock engines' tokenizer.
    pub fn is_mock(&self) -> bool {
        matches!(self.kind, Kind::Mock(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_shareable() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert!(ChatOptions::default().add_generation_prompt);
    }
}
