//! A Hugging Face tokenizer with its chat templates: renders chats as transformers' `apply_chat_template` and encodes as `tokenizer(text, add_special_tokens=...)`.

use std::collections::BTreeMap;

use minijinja::Value;

use crate::cache::{encode_plain, SegmentCache};
use crate::chat::{cut_after_final_message, tag_final_message, ChatInput};
use crate::content_format::ContentFormat;
use crate::error::TokenizerError;
use crate::template::{context, ChatTemplates};
use crate::vllm_messages;
use crate::SegmentCacheStatus;

pub(crate) struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    templates: Option<ChatTemplates>,
    /// `bos_token`, `eos_token`, ... as template variables.
    special_tokens: BTreeMap<String, Value>,
    segments: Segments,
}

/// Whether texts are encoded through the segment cache.
pub(crate) enum Segments {
    /// Configured off (capacity 0).
    Off,
    /// Cutting at added tokens could change this tokenizer's ids: why.
    Unsupported(String),
    On(SegmentCache),
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.tokenizer.get_vocab_size(true))
            .field("templates", &self.templates)
            .field("special_tokens", &self.special_tokens)
            .field("segments", &self.segment_cache_status())
            .finish()
    }
}

impl HfTokenizer {
    pub(crate) fn new(
        tokenizer: tokenizers::Tokenizer,
        templates: Option<ChatTemplates>,
        special_tokens: BTreeMap<String, Value>,
        segments: Segments,
    ) -> HfTokenizer {
        HfTokenizer { tokenizer, templates, special_tokens, segments }
    }

    /// `tokenizer(text, add_special_tokens=...)`'s ids, through the segment cache when it is on.
    pub(crate) fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.segments {
            Segments::On(cache) => cache.encode(&self.tokenizer, text, add_special_tokens),
            Segments::Off | Segments::Unsupported(_) => {
                encode_plain(&self.tokenizer, text, add_special_tokens)
            }
        }
    }

    pub(crate) fn segment_cache_status(&self) -> SegmentCacheStatus {
        match &self.segments {
            Segments::Off => SegmentCacheStatus::Off,
            Segments::Unsupported(reason) => SegmentCacheStatus::Unsupported { reason: reason.clone() },
            Segments::On(cache) => {
                let (entries, weight, capacity) = cache.usage();
                SegmentCacheStatus::On { entries, weight, capacity }
            }
        }
    }

    pub(crate) fn clear_segment_cache(&self) {
        if let Segments::On(cache) = &self.segments {
            cache.clear();
        }
    }

    /// The content format of the template a request without tools gets.
    pub(crate) fn chat_content_format(&self) -> Option<ContentFormat> {
        let templates = self.templates.as_ref()?;
        templates.vllm_rendering(false).ok().flatten().map(|vllm| vllm.format)
    }

    /// `apply_chat_template(messages, tokenize=False, ...)`.
    pub(crate) fn render_chat(&self, input: ChatInput) -> Result<String, TokenizerError> {
        let Some(templates) = &self.templates else {
            return Err(TokenizerError::NoChatTemplate {
                message: "the tokenizer has no chat template (tokenizer_config.json `chat_template` or \
                          chat_template.jinja); pass one with --chat-template"
                    .to_string(),
            });
        };
        if input.messages.len() == Some(0) {
            return Err(TokenizerError::invalid_request("`messages` is empty"));
        }
        let has_tools = input.tools.is_some();
        // vLLM rebuilds the messages for the template before transformers renders them.
        let messages = match templates.vllm_rendering(has_tools)? {
            Some(vllm) => vllm_messages::rebuild(&input.messages, vllm.format, vllm.supports_developer)?,
            None => input.messages,
        };
        let (messages, final_text) = if input.continue_final_message {
            let (messages, final_text) = tag_final_message(&messages)?;
            (messages, Some(final_text))
        } else {
            (messages, None)
        };
        let named = [
            ("messages", messages),
            ("tools", input.tools.unwrap_or(Value::from(()))),
            ("documents", input.documents.unwrap_or(Value::from(()))),
            ("add_generation_prompt", Value::from(input.add_generation_prompt)),
        ];
        let rendered = templates.render(has_tools, context(&self.special_tokens, &input.kwargs, named))?;
        match final_text {
            Some(final_text) => cut_after_final_message(rendered, &final_text),
            None => Ok(rendered),
        }
    }
}
