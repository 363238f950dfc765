//! A generation request as the engines take it and the gateway reads it: the model, the stream
//! flag, the messages or prompt, the generation options, and the routing key (a chat
//! conversation rendered in order by the one chat rendering, [`render_chat`], a completion
//! prompt, or token ids). The gateway forwards the body itself untouched.

use std::borrow::Cow;

use serde::Deserialize;

/// The fields the gateway looks at. Unknown fields are skipped (but the JSON must be valid);
/// known fields of the wrong type are a 400.
#[derive(Debug, Deserialize)]
#[serde(expecting = "a JSON object")]
pub struct RequestFields<'a> {
    #[serde(borrow, default)]
    pub model: Option<Cow<'a, str>>,
    /// Streamed and whole answers are both passed through as they arrive; a stream is asked for
    /// its usage chunk when the client did not ask (the closed loop reads it, `accuracy.rs`).
    #[serde(default)]
    pub stream: Option<bool>,
    /// The client's `stream_options` (read leniently: a value of another shape is the
    /// engine's to refuse). Unless it asks for the usage chunk, the gateway asks for it when it
    /// needs the usage and leaves the chunk out of the answer (`accuracy.rs`).
    #[serde(default)]
    pub stream_options: Option<serde_json::Value>,
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
    /// vLLM's and SGLang's `cache_salt`: the request's blocks are shared only with requests
    /// carrying the same salt.
    #[serde(borrow, default)]
    pub cache_salt: Option<Cow<'a, str>>,
    /// The end user (OpenAI's `user`): the session key when no routing-key header is given.
    #[serde(borrow, default)]
    pub user: Option<Cow<'a, str>>,
    /// The most output tokens asked for (OpenAI's `max_tokens`, `max_completion_tokens`), what a
    /// tenant's tokens-per-minute quota charges beside the prompt. Read leniently: a value that
    /// is no token count is the engine's to refuse.
    #[serde(default)]
    pub max_tokens: Option<serde_json::Value>,
    #[serde(default)]
    pub max_completion_tokens: Option<serde_json::Value>,
    /// SGLang's `/generate`: `sampling_params.max_new_tokens`.
    #[serde(default)]
    pub sampling_params: Option<serde_json::Value>,
    /// The choices asked for (OpenAI's `n`; SGLang's `sampling_params.n`).
    #[serde(default)]
    n: Option<serde_json::Value>,
    /// The KV-transfer fields (`transfer/`), only noticed: a client's are taken out.
    #[serde(default)]
    bootstrap_host: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    bootstrap_port: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    bootstrap_room: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    bootstrap_pair_key: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    decode_tp_size: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    disagg_prefill_dp_rank: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    kv_transfer_params: Option<serde::de::IgnoredAny>,
}

impl RequestFields<'_> {
    /// The choices the request asks for (`n`, at least 1): its output can be that many times its
    /// maximum.
    pub fn choices(&self) -> u64 {
        let given = self.sampling_params.as_ref().and_then(|params| params.get("n"));
        [self.n.as_ref(), given].into_iter().flatten().find_map(serde_json::Value::as_u64).unwrap_or(1).max(1)
    }

    /// Whether the client asked a stream for its usage chunk (`stream_options.include_usage`).
    pub fn asks_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|options| options["include_usage"] == true)
    }

    /// Whether the client set one of the fields that steer an engine's KV transfer (not null).
    pub fn carries_transfer_fields(&self) -> bool {
        [
            &self.bootstrap_host,
            &self.bootstrap_port,
            &self.bootstrap_room,
            &self.bootstrap_pair_key,
            &self.decode_tp_size,
            &self.disagg_prefill_dp_rank,
            &self.kv_transfer_params,
        ]
        .iter()
        .any(|field| field.is_some())
    }

    /// The most output tokens the request asks for (0 when it does not say).
    pub fn max_output_tokens(&self) -> u64 {
        let given = self.sampling_params.as_ref().and_then(|params| params.get("max_new_tokens"));
        [self.max_completion_tokens.as_ref(), self.max_tokens.as_ref(), given]
            .into_iter()
            .flatten()
            .find_map(serde_json::Value::as_u64)
            .unwrap_or(0)
    }
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage<'a> {
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    #[serde(borrow, default)]
    pub content: Option<MessageContent<'a>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of content parts")]
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
#[serde(untagged, expecting = "a string, a list of strings, a list of token ids or a list of token-id lists")]
pub enum PromptInput<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a list of token ids or a list of token-id lists")]
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
        // serde would also take a JSON array as the struct's fields in order.
        if body.trim_ascii_start().first().is_some_and(|&b| b != b'{') {
            return Err(match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                Ok(_) => "invalid request body: expected a JSON object".to_string(),
                Err(e) => format!("malformed JSON body: {e}"),
            });
        }
        let fields: RequestFields<'a> = serde_json::from_slice(body).map_err(|e| {
            if e.is_syntax() || e.is_eof() {
                format!("malformed JSON body: {e}")
            } else {
                // Parse again, only on this error path, to name the field that is wrong.
                let mut de = serde_json::Deserializer::from_slice(body);
                match serde_path_to_error::deserialize::<_, RequestFields<'_>>(&mut de) {
                    Err(error) if error.path().iter().next().is_some() => {
                        format!("invalid request body: `{}`: {}", error.path(), error.inner())
                    }
                    _ => format!("invalid request body: {e}"),
                }
            }
        })?;
        Ok(fields)
    }

    /// Refuses a request that gives the endpoint nothing to generate from (or embed).
    pub fn check(&self, endpoint: crate::endpoint::Endpoint) -> Result<(), String> {
        use crate::endpoint::Endpoint;
        let empty_prompt = |input: &Option<PromptInput<'_>>| match input {
            None => true,
            Some(PromptInput::Texts(items)) => items.is_empty(),
            Some(PromptInput::Tokens(items)) => items.is_empty(),
            Some(PromptInput::TokenBatches(items)) => items.is_empty(),
            Some(PromptInput::Text(_)) => false,
        };
        let missing = match endpoint {
            Endpoint::ChatCompletions => self
                .messages
                .as_ref()
                .is_none_or(Vec::is_empty)
                .then_some("`messages` must be a non-empty list"),
            Endpoint::Completions => empty_prompt(&self.prompt).then_some("`prompt` is required"),
            Endpoint::Generate => (empty_prompt(&self.text) && self.input_ids.is_none())
                .then_some("`text` or `input_ids` is required"),
            Endpoint::Embeddings => empty_prompt(&self.input).then_some("`input` is required"),
        };
        missing.map_or(Ok(()), |message| Err(message.to_string()))
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

/// One message of a conversation as [`render_chat`] reads it: its role, and its text pieces
/// (a string content is one piece; a list of content parts gives each part's `text`).
pub trait ChatTurn {
    fn role(&self) -> &str;
    /// Appends the message's text: its pieces joined by single spaces.
    fn push_text(&self, out: &mut String);
    /// The length of [`ChatTurn::push_text`]'s text, or a bound of it.
    fn text_len(&self) -> usize;
}

impl ChatTurn for ChatMessage<'_> {
    fn role(&self) -> &str {
        &self.role
    }

    fn push_text(&self, out: &mut String) {
        match &self.content {
            None => {}
            Some(MessageContent::Text(text)) => out.push_str(text),
            Some(MessageContent::Parts(parts)) => {
                for (index, text) in parts.iter().filter_map(|part| part.text.as_deref()).enumerate() {
                    if index > 0 {
                        out.push(' ');
                    }
                    out.push_str(text);
                }
            }
        }
    }

    fn text_len(&self) -> usize {
        match &self.content {
            None => 0,
            Some(MessageContent::Text(text)) => text.len(),
            Some(MessageContent::Parts(parts)) => {
                parts.iter().filter_map(|part| part.text.as_ref()).map(|text| text.len() + 1).sum()
            }
        }
    }
}

impl<R: AsRef<str>, C: AsRef<str>> ChatTurn for (R, C) {
    fn role(&self) -> &str {
        self.0.as_ref()
    }

    fn push_text(&self, out: &mut String) {
        out.push_str(self.1.as_ref());
    }

    fn text_len(&self) -> usize {
        self.1.as_ref().len()
    }
}

/// The one chat rendering: every message as `<|role|> text ` in order, then `<|assistant|>`
/// (the simulated engines' chat template, and the text the gateway routes a conversation on),
/// so successive turns of one conversation share their whole earlier rendering as a prefix.
pub fn render_chat<T: ChatTurn>(messages: &[T]) -> String {
    let capacity =
        messages.iter().map(|message| message.role().len() + message.text_len() + 6).sum::<usize>() + 13;
    let mut out = String::with_capacity(capacity);
    for message in messages {
        out.push_str("<|");
        out.push_str(message.role());
        out.push_str("|> ");
        message.push_text(&mut out);
        out.push(' ');
    }
    out.push_str("<|assistant|>");
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
    fn one_rendering_for_pairs_and_parsed_messages() {
        let first = render_chat(&[("system", "be brief"), ("user", "hi there")]);
        assert_eq!(first, "<|system|> be brief <|user|> hi there <|assistant|>");
        let second = render_chat(&[
            ("system", "be brief"),
            ("user", "hi there"),
            ("assistant", "hello"),
            ("user", "more"),
        ]);
        assert!(second.starts_with(&first), "{second:?} should extend {first:?}");
        let parsed = key(
            r#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"text","text":"there"}]}]}"#,
        );
        assert_eq!(parsed, first);
    }

    #[test]
    fn content_parts_and_tool_messages_render() {
        let text = key(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}}]},
                {"role":"tool","content":"r"}]}"#,
        );
        assert_eq!(text, "<|user|> a <|tool|> r <|assistant|>");
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

    #[test]
    fn errors_name_the_field_not_the_rust_type() {
        for (body, field, expected) in [
            (r#"{"prompt": {"a": 1}}"#, "`prompt`", "a string, a list of strings"),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                "`messages[0].content`",
                "a string or a list",
            ),
            (r#"{"input_ids": "x"}"#, "`input_ids`", "token ids"),
            (r#"{"model": 3}"#, "`model`", "expected a string"),
            (r#"{"messages": [{"content": "no role"}]}"#, "`messages[0]`", "role"),
        ] {
            let error = RequestFields::parse(body.as_bytes()).unwrap_err();
            assert!(error.contains(field) && error.contains(expected), "{body}: {error}");
            for rust in ["RequestFields", "PromptInput", "MessageContent", "TokenInput", "untagged"] {
                assert!(!error.contains(rust), "{body}: {error}");
            }
        }
        let not_object = RequestFields::parse(b"[1,2]").unwrap_err();
        assert!(
            not_object.contains("a JSON object") && !not_object.contains("RequestFields"),
            "{not_object}"
        );
    }

    /// JSON-shaped bodies around the fields the gateway reads, with values of every type.
    fn body_strategy() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(serde_json::Value::from),
            ".{0,20}".prop_map(serde_json::Value::from),
        ];
        let value = leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("role".to_string()),
                        Just("content".to_string()),
                        Just("text".to_string()),
                        ".{0,6}"
                    ],
                    inner,
                    0..4
                )
                .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
            ]
        });
        let field = prop_oneof![
            Just("model"),
            Just("stream"),
            Just("messages"),
            Just("prompt"),
            Just("text"),
            Just("input_ids"),
            Just("input"),
            Just("user"),
            Just("other")
        ];
        proptest::collection::btree_map(field, value, 0..6).prop_map(|fields| {
            let object: serde_json::Map<String, serde_json::Value> =
                fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            serde_json::to_vec(&object).unwrap_or_default()
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]

        /// Bounded fuzzing of the request path's parsing: any bytes, and JSON bodies with any
        /// types in the known fields, give a value or an error, never a panic; whatever parses
        /// yields a routing key and a verdict for every endpoint.
        #[test]
        fn parsing_and_key_extraction_never_panic(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            body in body_strategy(),
        ) {
            use crate::endpoint::Endpoint;
            for bytes in [&raw, &body] {
                if let Ok(fields) = RequestFields::parse(bytes) {
                    let _ = fields.routing_key();
                    for endpoint in Endpoint::ALL {
                        let _ = fields.check(endpoint);
                    }
                }
            }
        }
    }

    #[test]
    fn a_request_with_nothing_to_generate_from_is_refused() {
        use crate::endpoint::Endpoint;
        let check = |body: &str, endpoint| RequestFields::parse(body.as_bytes()).unwrap().check(endpoint);
        assert!(check(r#"{"messages": []}"#, Endpoint::ChatCompletions).unwrap_err().contains("messages"));
        assert!(check(r#"{"model": "m"}"#, Endpoint::ChatCompletions).is_err());
        assert!(check(r#"{"model": "m"}"#, Endpoint::Completions).unwrap_err().contains("prompt"));
        assert!(check(r#"{"prompt": []}"#, Endpoint::Completions).is_err());
        assert!(check(r#"{"model": "m"}"#, Endpoint::Generate).is_err());
        assert!(check(r#"{"model": "m"}"#, Endpoint::Embeddings).is_err());
        check(r#"{"messages": [{"role": "user", "content": ""}]}"#, Endpoint::ChatCompletions).unwrap();
        check(r#"{"prompt": ""}"#, Endpoint::Completions).unwrap();
        check(r#"{"input_ids": [1]}"#, Endpoint::Generate).unwrap();
        check(r#"{"input": "x"}"#, Endpoint::Embeddings).unwrap();
    }
}
