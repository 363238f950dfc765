//! What a migrating stream has said so far, read event by event as it passes: its response id,
//! the text and tokens generated, whether its role went out, whether it finished, and anything
//! that makes it impossible to continue. After a migration the continuation's events are
//! rewritten to read as the same answer: the first engine's id and creation time, no second
//! role, and the usage of the whole answer (the request's own prompt, every engine's output).

use bytes::Bytes;
use kvgate_protocol::sse::data_event_bytes;
use serde_json::{Map, Value};

/// What to do with one event of the answer.
#[derive(Debug, PartialEq)]
pub(super) enum Verdict {
    /// Pass it as it came.
    Pass,
    /// Pass this instead (a continuation's event, rewritten).
    Rewritten(Bytes),
    /// Leave it out (a continuation's usage chunk the client did not ask for).
    Drop,
}

/// The answer so far, across the engines that gave it.
#[derive(Debug, Default)]
pub(super) struct Transcript {
    /// The first engine's response id and creation time, kept by every continuation.
    id: Option<Value>,
    created: Option<Value>,
    /// The text generated so far (a chat's `delta.content`s, a completion's `text`s).
    pub(super) text: String,
    /// The tokens generated so far: one per event that carried text (engines stream one token
    /// per event unless told otherwise), or the engine's own count when its events carry usage.
    pub(super) tokens: u64,
    /// The tokens generated before the answer's current engine started.
    prior_tokens: u64,
    /// The current engine's own count of its output (`usage.completion_tokens`), when given.
    reported: Option<u64>,
    role_sent: bool,
    /// A finish reason went out: the answer is whole but for its end.
    pub(super) finished: bool,
    /// `[DONE]` went out.
    pub(super) done: bool,
    /// Why the answer cannot be continued, once something in it says so.
    pub(super) unresumable: Option<&'static str>,
    /// A continuation is answering.
    pub(super) migrated: bool,
    /// The client gets a usage chunk (it asked, or the gateway asked for it and leaves it out).
    emit_usage: bool,
}

impl Transcript {
    pub(super) fn new(emit_usage: bool) -> Self {
        Self { emit_usage, ..Self::default() }
    }

    /// The tokens of the answer so far (what a continuation's `max_tokens` is lowered by).
    pub(super) fn generated(&self) -> u64 {
        self.tokens.max(self.prior_tokens + self.reported.unwrap_or(0))
    }

    /// Another engine takes the answer over from here.
    pub(super) fn continue_on_another(&mut self) {
        self.tokens = self.generated();
        self.prior_tokens = self.tokens;
        self.reported = None;
        self.migrated = true;
        self.finished = false;
    }

    /// Reads one event's `data:` payload.
    pub(super) fn on_event(&mut self, data: &[u8]) -> Verdict {
        if data == b"[DONE]" {
            self.done = true;
            return Verdict::Pass;
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_slice::<Value>(data) else {
            return Verdict::Pass;
        };
        if chunk.contains_key("error") {
            return Verdict::Pass;
        }
        if self.id.is_none() {
            self.id = chunk.get("id").cloned();
            self.created = chunk.get("created").cloned();
        }
        let mut changed = self.read_choices(&mut chunk);
        let usage_only = chunk.get("choices").and_then(Value::as_array).is_some_and(Vec::is_empty);
        if let Some(Value::Object(usage)) = chunk.get_mut("usage") {
            let completion = usage.get("completion_tokens").and_then(Value::as_u64);
            if let Some(completion) = completion {
                self.reported = Some(completion);
            }
            if self.migrated {
                if usage_only && !self.emit_usage {
                    return Verdict::Drop;
                }
                self.merge_usage(usage, completion.unwrap_or(0));
                changed = true;
            }
        }
        if !self.migrated {
            return Verdict::Pass;
        }
        for (field, value) in [("id", &self.id), ("created", &self.created)] {
            if let Some(value) = value {
                if chunk.get(field) != Some(value) {
                    chunk.insert(field.into(), value.clone());
                    changed = true;
                }
            }
        }
        match changed {
            true => Verdict::Rewritten(data_event_bytes(&Value::Object(chunk))),
            false => Verdict::Pass,
        }
    }

    /// Reads the choices of a chunk (text, role, finish, what cannot be continued); drops a
    /// continuation's second role. Returns whether the chunk changed.
    fn read_choices(&mut self, chunk: &mut Map<String, Value>) -> bool {
        let Some(Value::Array(choices)) = chunk.get_mut("choices") else { return false };
        let mut changed = false;
        for choice in choices {
            if choice.get("index").and_then(Value::as_u64).is_some_and(|index| index != 0) {
                self.unresumable = Some("several choices");
            }
            if choice.get("finish_reason").is_some_and(|reason| !reason.is_null()) {
                self.finished = true;
            }
            if let Some(text) = choice.get("text").and_then(Value::as_str) {
                self.add_text(text);
            }
            let Some(Value::Object(delta)) = choice.get_mut("delta") else { continue };
            if delta.contains_key("role") {
                if self.role_sent && self.migrated {
                    delta.remove("role");
                    changed = true;
                }
                self.role_sent = true;
            }
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                let text = text.to_string();
                self.add_text(&text);
            }
            let present = |value: Option<&Value>| match value {
                None | Some(Value::Null) => false,
                Some(Value::String(text)) => !text.is_empty(),
                Some(Value::Array(items)) => !items.is_empty(),
                Some(_) => true,
            };
            if present(delta.get("tool_calls")) || present(delta.get("function_call")) {
                self.unresumable = Some("tool calls");
            }
            if present(delta.get("reasoning_content")) || present(delta.get("reasoning")) {
                self.unresumable = Some("reasoning");
            }
        }
        changed
    }

    fn add_text(&mut self, text: &str) {
        if !text.is_empty() {
            self.text.push_str(text);
            self.tokens += 1;
        }
    }

    /// A continuation's usage as the whole answer's: its prompt was the request's plus the
    /// answer so far, its output comes after the earlier engines'.
    fn merge_usage(&self, usage: &mut Map<String, Value>, completion: u64) {
        let prompt = usage.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
        let prompt = prompt.saturating_sub(self.prior_tokens);
        let completion = self.prior_tokens + completion;
        usage.insert("prompt_tokens".into(), prompt.into());
        usage.insert("completion_tokens".into(), completion.into());
        usage.insert("total_tokens".into(), (prompt + completion).into());
        if let Some(Value::Object(details)) = usage.get_mut("prompt_tokens_details") {
            if let Some(cached) = details.get("cached_tokens").and_then(Value::as_u64) {
                details.insert("cached_tokens".into(), cached.min(prompt).into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvgate_protocol::sse::event_data;

    use super::*;
    use serde_json::json;

    fn event(value: Value) -> Vec<u8> {
        serde_json::to_vec(&value).unwrap()
    }

    fn chunk(id: &str, delta: Value, finish: Value) -> Vec<u8> {
        event(
            json!({"id": id, "created": 1, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        )
    }

    fn rewritten(verdict: Verdict) -> Value {
        match verdict {
            Verdict::Rewritten(bytes) => serde_json::from_slice(event_data(&bytes).unwrap()).unwrap(),
            other => panic!("not rewritten: {other:?}"),
        }
    }

    #[test]
    fn a_continuation_reads_as_the_same_answer() {
        let mut transcript = Transcript::new(true);
        let first = chunk("a", json!({"role": "assistant", "content": ""}), Value::Null);
        assert_eq!(transcript.on_event(&first), Verdict::Pass);
        for word in ["one", " two", " three"] {
            assert_eq!(
                transcript.on_event(&chunk("a", json!({"content": word}), Value::Null)),
                Verdict::Pass
            );
        }
        assert_eq!((transcript.text.as_str(), transcript.generated()), ("one two three", 3));
        transcript.continue_on_another();
        // The continuation's first chunk: the first id, no second role.
        let next = rewritten(transcript.on_event(&chunk(
            "b",
            json!({"role": "assistant", "content": " four"}),
            Value::Null,
        )));
        assert_eq!(next["id"], "a");
        assert_eq!(next["choices"][0]["delta"], json!({"content": " four"}));
        // Its usage counts the whole answer: the request's prompt (20), 3 + 2 tokens.
        let usage =
            event(json!({"id": "b", "choices": [], "usage": {"prompt_tokens": 23, "completion_tokens": 2,
            "total_tokens": 25, "prompt_tokens_details": {"cached_tokens": 22}}}));
        let merged = rewritten(transcript.on_event(&usage));
        assert_eq!(
            merged["usage"],
            json!({"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
            "prompt_tokens_details": {"cached_tokens": 20}})
        );
        assert_eq!(merged["id"], "a");
        assert_eq!(transcript.on_event(b"[DONE]"), Verdict::Pass);
        assert!(transcript.done);
        // Not asked for: the continuation's usage chunk is left out.
        let mut quiet = Transcript::new(false);
        quiet.on_event(&chunk("a", json!({"content": "x"}), Value::Null));
        quiet.continue_on_another();
        assert_eq!(quiet.on_event(&usage), Verdict::Drop);
    }

    #[test]
    fn what_cannot_be_continued_is_noticed() {
        let mut tools = Transcript::new(false);
        tools.on_event(&chunk(
            "a",
            json!({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}),
            Value::Null,
        ));
        assert_eq!(tools.unresumable, Some("tool calls"));
        let mut reasoning = Transcript::new(false);
        reasoning.on_event(&chunk("a", json!({"reasoning_content": "hmm"}), Value::Null));
        assert_eq!(reasoning.unresumable, Some("reasoning"));
        let mut two = Transcript::new(false);
        two.on_event(&event(json!({"id": "a", "choices": [{"index": 1, "text": "x"}]})));
        assert_eq!(two.unresumable, Some("several choices"));
        let mut finished = Transcript::new(false);
        finished.on_event(&chunk("a", json!({"content": "x"}), json!("stop")));
        assert!(finished.finished && finished.unresumable.is_none());
        // An engine's own count wins over the events it sent.
        let mut counted = Transcript::new(false);
        counted.on_event(&event(
            json!({"id": "a", "choices": [{"index": 0, "text": "xy"}], "usage": {"completion_tokens": 2}}),
        ));
        assert_eq!(counted.generated(), 2);
    }
}
