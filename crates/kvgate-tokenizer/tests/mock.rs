//! The mock tokenizer equals what the mock engines compute: `kvgate_words::tokenize(kvgate_protocol::render_chat(..))` for chats (content parts joined as crates/kvgate-mock joins them) and `tokenize` for prompts.

use kvgate_protocol::render_chat;
use kvgate_tokenizer::{ChatOptions, ErrorSide, Tokenizer};
use kvgate_words::tokenize;
use serde_json::json;

/// Checks one chat against the engine's own rendering, through both APIs.
fn check(messages: serde_json::Value, expected_pairs: &[(&str, &str)]) {
    let tokenizer = Tokenizer::mock();
    let expected_text = render_chat(expected_pairs);
    let options = ChatOptions::default();
    assert_eq!(tokenizer.render_chat(&messages, &options).unwrap(), expected_text);
    assert_eq!(tokenizer.encode_chat(&messages, &options).unwrap(), tokenize(&expected_text));
    let body = json!({"model": "mock", "messages": messages, "stream": true}).to_string();
    assert_eq!(tokenizer.render_chat_request(body.as_bytes()).unwrap(), expected_text);
    assert_eq!(tokenizer.encode_chat_request(body.as_bytes()).unwrap(), tokenize(&expected_text));
}

#[test]
fn chats_match_the_engine_rendering() {
    check(json!([{"role": "user", "content": "hi there"}]), &[("user", "hi there")]);
    check(
        json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is  a\tKV cache?"},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "user"},
        ]),
        &[("system", "be brief"), ("user", "what is  a\tKV cache?"), ("assistant", ""), ("user", "")],
    );
    check(json!([]), &[]);
}

#[test]
fn content_parts_are_joined_with_spaces_and_parts_without_text_skipped() {
    check(
        json!([{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "there"},
            {"type": "text", "text": null},
        ]}]),
        &[("user", "hi there")],
    );
    check(json!([{"role": "user", "content": []}]), &[("user", "")]);
}

#[test]
fn the_mock_ignores_the_chat_options_as_the_engines_do() {
    let tokenizer = Tokenizer::mock();
    let messages = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]);
    let options = ChatOptions {
        add_generation_prompt: true,
        continue_final_message: true,
        tools: Some(json!([{"type": "function"}])),
        chat_template_kwargs: Some(json!({"enable_thinking": false})),
    };
    assert_eq!(
        tokenizer.render_chat(&messages, &options).unwrap(),
        render_chat(&[("user", "hi"), ("assistant", "hel")])
    );
}

#[test]
fn prompts_are_words() {
    let tokenizer = Tokenizer::mock();
    assert!(tokenizer.is_mock());
    for prompt in ["", "one", "  several   words\tand\nlines ", "ünïcödé 🚀 words"] {
        assert_eq!(tokenizer.encode_prompt(prompt).unwrap(), tokenize(prompt));
    }
}

#[test]
fn messages_the_mock_engine_refuses_are_client_errors() {
    let tokenizer = Tokenizer::mock();
    let options = ChatOptions::default();
    for messages in [
        json!({"role": "user"}),
        json!(["hello"]),
        json!([{"content": "no role"}]),
        json!([{"role": 7, "content": "x"}]),
        json!([{"role": "user", "content": 42}]),
        json!([{"role": "user", "content": [{"text": 1}]}]),
        json!([{"role": "user", "content": ["bare string part"]}]),
    ] {
        let error = tokenizer.encode_chat(&messages, &options).unwrap_err();
        assert_eq!(error.side(), ErrorSide::Client, "{messages}: {error}");
    }
    assert!(tokenizer.encode_chat_request(b"{\"messages\": ").is_err());
    assert!(tokenizer.encode_chat_request(b"{}").is_err());
}
