//! What an engine's answer says about its prompt (tokens, and how many were served from its
//! cache), read from a whole JSON body or from a stream as it passes, and the usage chunk the
//! gateway asked for on the client's behalf taken out of the stream again; and the usage object
//! as the engines write it ([`usage_object`], [`meta_info_usage`], the simulated engines' writer).
//!
//! Where the engines say it (read from their source, not from a description):
//! - vLLM's OpenAI server (`vllm/entrypoints/openai/chat_completion/serving.py` and
//!   `completion/serving.py`, main in 2026): `usage.prompt_tokens` and, with
//!   `--enable-prompt-tokens-details`, `usage.prompt_tokens_details.cached_tokens` (local prefix
//!   cache and KV-connector hits together). A whole answer carries `usage`; a stream carries it
//!   only when `stream_options.include_usage` is set, in one last chunk with `"choices": []`
//!   right before `data: [DONE]`.
//! - SGLang (`sglang/srt/managers/tokenizer_manager.py`): `meta_info.prompt_tokens` and
//!   `meta_info.cached_tokens` in every answer of `/generate`, each streamed chunk included (the
//!   last one has the final counts); its OpenAI server reports like vLLM's with
//!   `--enable-cache-report`.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;

use crate::sse::{event_data, last_boundary, split_events};

/// The prompt and cached token counts of one answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineUsage {
    pub prompt_tokens: Option<u32>,
    /// `None` when the answer did not say (vLLM without `--enable-prompt-tokens-details`).
    pub cached_tokens: Option<u32>,
    /// The output tokens (`usage.completion_tokens`, SGLang's `meta_info.completion_tokens`):
    /// what a tenant's tokens-per-minute charge is corrected to, with the prompt's.
    pub completion_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    meta_info: Option<MetaInfo>,
    #[serde(default)]
    choices: Option<Vec<serde::de::IgnoredAny>>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct MetaInfo {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    cached_tokens: Option<u32>,
}

impl Answer {
    fn usage(&self) -> Option<EngineUsage> {
        if let Some(usage) = &self.usage {
            let cached_tokens =
                usage.prompt_tokens_details.as_ref().and_then(|details| details.cached_tokens);
            let completion_tokens = usage.completion_tokens;
            return Some(EngineUsage {
                prompt_tokens: usage.prompt_tokens,
                cached_tokens,
                completion_tokens,
            });
        }
        self.meta_info.as_ref().map(|meta| EngineUsage {
            prompt_tokens: meta.prompt_tokens,
            cached_tokens: meta.cached_tokens,
            completion_tokens: meta.completion_tokens,
        })
    }

    /// vLLM's usage-only chunk: `"choices": []` and a usage object.
    fn is_usage_chunk(&self) -> bool {
        self.usage.is_some() && self.choices.as_ref().is_some_and(Vec::is_empty)
    }
}

/// The usage of a whole (non-streamed) JSON answer.
pub fn usage_of_body(body: &[u8]) -> Option<EngineUsage> {
    serde_json::from_slice::<Answer>(body).ok()?.usage()
}

/// Whether `needle` occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

/// Reads a server-sent-events stream frame by frame: the last usage it carries, and (when the
/// gateway asked for it on the client's behalf) the usage-only chunk left out. Events are only
/// parsed when they mention `usage` or `meta_info`; token chunks pass untouched.
#[derive(Debug, Default)]
pub struct StreamUsage {
    /// Drop vLLM's usage-only chunk (the client did not ask for it).
    strip: bool,
    /// The start of an event not complete yet.
    pending: BytesMut,
    usage: Option<EngineUsage>,
}

impl StreamUsage {
    pub fn new(strip: bool) -> Self {
        StreamUsage { strip, ..StreamUsage::default() }
    }

    /// Whether the usage-only chunk is left out of what passes.
    pub fn strips(&self) -> bool {
        self.strip
    }

    /// The last usage seen so far.
    pub fn usage(&self) -> Option<EngineUsage> {
        self.usage
    }

    /// One frame of the stream; returns what to pass on. Without stripping, that is the frame
    /// itself; with it, the complete events of it (the tail of an incomplete one is held until
    /// the frame that completes it).
    pub fn on_frame(&mut self, frame: Bytes) -> Bytes {
        if self.pending.is_empty() && frame.ends_with(b"\n\n") {
            // The common case (one or more whole events per frame): nothing held, nothing copied
            // unless an event is left out.
            if self.strip {
                return self.filter(&frame);
            }
            self.scan(&frame);
            return frame;
        }
        self.pending.extend_from_slice(&frame);
        let Some(end) = last_boundary(&self.pending) else {
            return if self.strip { Bytes::new() } else { frame };
        };
        let complete = self.pending.split_to(end).freeze();
        let passed = self.filter(&complete);
        if self.strip {
            passed
        } else {
            frame
        }
    }

    /// The stream ended: whatever was held.
    pub fn finish(&mut self) -> Bytes {
        let rest = std::mem::take(&mut self.pending).freeze();
        if rest.is_empty() {
            return rest;
        }
        let passed = self.filter(&rest);
        if self.strip {
            passed
        } else {
            Bytes::new()
        }
    }

    fn scan(&mut self, events: &[u8]) {
        for event in split_events(events) {
            self.read(event);
        }
    }

    /// Reads every event of `events`; returns them without the usage-only chunk when stripping.
    fn filter(&mut self, events: &Bytes) -> Bytes {
        let mut kept: Option<BytesMut> = None;
        let mut offset = 0;
        for event in split_events(events) {
            let start = offset;
            offset += event.len();
            let drop = self.read(event) && self.strip;
            match (&mut kept, drop) {
                (None, false) => {}
                (None, true) => kept = Some(BytesMut::from(&events[..start])),
                (Some(kept), false) => kept.extend_from_slice(event),
                (Some(_), true) => {}
            }
        }
        kept.map_or_else(|| events.clone(), BytesMut::freeze)
    }

    /// Reads one event; true when it is vLLM's usage-only chunk.
    fn read(&mut self, event: &[u8]) -> bool {
        if !contains(event, b"\"usage\"") && !contains(event, b"\"meta_info\"") {
            return false;
        }
        let Some(data) = event_data(event) else { return false };
        let Ok(answer) = serde_json::from_slice::<Answer>(data) else { return false };
        if let Some(usage) = answer.usage() {
            self.usage = Some(usage);
        }
        answer.is_usage_chunk()
    }
}

/// OpenAI's `usage` object as vLLM writes it (with `--enable-prompt-tokens-details`): what
/// [`usage_of_body`] reads back.
pub fn usage_object(usage: WrittenUsage) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    })
}

/// The usage fields of SGLang's `meta_info` (`prompt_tokens`, `completion_tokens`,
/// `cached_tokens`), written into `meta_info`: what [`usage_of_body`] reads back.
pub fn meta_info_usage(usage: WrittenUsage, meta_info: &mut serde_json::Map<String, serde_json::Value>) {
    meta_info.insert("prompt_tokens".into(), usage.prompt_tokens.into());
    meta_info.insert("completion_tokens".into(), usage.completion_tokens.into());
    meta_info.insert("cached_tokens".into(), usage.cached_tokens.into());
}

/// The counts an engine writes of one answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WrittenUsage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n";
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\
        \"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn run(strip: bool, frames: &[&str]) -> (String, Option<EngineUsage>) {
        let mut reader = StreamUsage::new(strip);
        let mut out = Vec::new();
        for frame in frames {
            out.extend_from_slice(&reader.on_frame(Bytes::copy_from_slice(frame.as_bytes())));
        }
        out.extend_from_slice(&reader.finish());
        (String::from_utf8(out).unwrap(), reader.usage())
    }

    #[test]
    fn what_the_engines_write_reads_back() {
        let written = WrittenUsage { prompt_tokens: 12, completion_tokens: 3, cached_tokens: 8 };
        let read =
            EngineUsage { prompt_tokens: Some(12), cached_tokens: Some(8), completion_tokens: Some(3) };
        let openai = serde_json::json!({"choices": [], "usage": usage_object(written)});
        assert_eq!(usage_of_body(openai.to_string().as_bytes()), Some(read));
        let mut meta = serde_json::Map::new();
        meta_info_usage(written, &mut meta);
        let sglang = serde_json::json!({"text": "x", "meta_info": meta});
        assert_eq!(usage_of_body(sglang.to_string().as_bytes()), Some(read));
    }

    #[test]
    fn whole_answers_of_both_engines() {
        let vllm = br#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        assert_eq!(
            usage_of_body(vllm),
            Some(EngineUsage { prompt_tokens: Some(10), cached_tokens: Some(4), completion_tokens: None })
        );
        let no_details = br#"{"choices":[],"usage":{"prompt_tokens":10,"prompt_tokens_details":null}}"#;
        assert_eq!(
            usage_of_body(no_details),
            Some(EngineUsage { prompt_tokens: Some(10), cached_tokens: None, completion_tokens: None })
        );
        let sglang = br#"{"text":"x","meta_info":{"id":"1","prompt_tokens":7,"cached_tokens":3}}"#;
        assert_eq!(
            usage_of_body(sglang),
            Some(EngineUsage { prompt_tokens: Some(7), cached_tokens: Some(3), completion_tokens: None })
        );
        assert_eq!(usage_of_body(b"not json"), None);
    }

    #[test]
    fn a_stream_passes_untouched_unless_the_gateway_asked_for_the_usage() {
        let usage = Some(EngineUsage {
            prompt_tokens: Some(40),
            cached_tokens: Some(32),
            completion_tokens: Some(2),
        });
        let all = [TOKEN, TOKEN, USAGE, DONE];
        assert_eq!(run(false, &all), (all.concat(), usage));
        assert_eq!(run(true, &all), ([TOKEN, TOKEN, DONE].concat(), usage), "the usage chunk is left out");
        // Events split across frames, and frames holding several events.
        let joined = all.concat();
        let cuts: Vec<&str> = vec![&joined[..5], &joined[5..90], &joined[90..200], &joined[200..]];
        assert_eq!(run(true, &cuts), ([TOKEN, TOKEN, DONE].concat(), usage));
        assert_eq!(run(false, &cuts), (joined.clone(), usage));
        // A stream cut short: the partial event is passed on at the end.
        assert_eq!(run(true, &[TOKEN, "data: {\"cho"]).0, format!("{TOKEN}data: {{\"cho"));
    }

    #[test]
    fn sglang_streams_carry_meta_info_in_every_chunk() {
        let chunk = |cached: u32| {
            format!("data: {{\"text\":\"a\",\"meta_info\":{{\"prompt_tokens\":9,\"cached_tokens\":{cached}}}}}\n\n")
        };
        let frames = [chunk(0), chunk(4), DONE.to_string()];
        let frames: Vec<&str> = frames.iter().map(String::as_str).collect();
        let (out, usage) = run(true, &frames);
        assert_eq!(out, frames.concat(), "no usage-only chunk to leave out");
        assert_eq!(
            usage,
            Some(EngineUsage { prompt_tokens: Some(9), cached_tokens: Some(4), completion_tokens: None })
        );
    }
}
