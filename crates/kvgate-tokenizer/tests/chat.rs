//! Chat options and bad input on the Hugging Face path: continue_final_message, chat_template_kwargs, raised and failed templates, malformed requests (errors, never panics).

use std::path::PathBuf;

use kvgate_tokenizer::{
    ChatOptions, ContentFormatOption, ErrorSide, Tokenizer, TokenizerError, TokenizerOptions,
};
use serde_json::json;

fn tiny() -> Tokenizer {
    let directory = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join("tiny-chatml");
    Tokenizer::from_path_with_options(&directory, None, &as_sent()).expect("load tiny-chatml")
}

/// transformers' `apply_chat_template` on the messages as sent (this file checks its semantics;
/// vLLM's rebuilding of messages is checked in vllm_messages.rs).
fn as_sent() -> TokenizerOptions {
    TokenizerOptions { content_format: ContentFormatOption::AsSent, ..TokenizerOptions::default() }
}

/// The tiny model with `template` as its chat template.
fn with_template(name: &str, template: &str) -> Tokenizer {
    let directory = std::env::temp_dir().join(format!("kvgate-tokenizer-chat-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("mkdir");
    let path = directory.join(format!("{name}.jinja"));
    std::fs::write(&path, template).expect("write");
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join("tiny-chatml");
    let tokenizer = Tokenizer::from_path_with_options(&model, Some(&path), &as_sent()).expect("load");
    let _ = std::fs::remove_dir_all(&directory);
    tokenizer
}

fn continue_options() -> ChatOptions {
    ChatOptions { add_generation_prompt: false, continue_final_message: true, ..ChatOptions::default() }
}

#[test]
fn continue_final_message_ends_the_prompt_inside_the_final_message() {
    let tokenizer = tiny();
    let messages = json!([{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]);
    let text = tokenizer.render_chat(&messages, &continue_options()).unwrap();
    assert!(text.ends_with("<|im_start|>assistant\n1, 2,"), "{text:?}");
    // The continued prompt is a prefix of the closed conversation's.
    let closed = tokenizer
        .render_chat(&messages, &ChatOptions { add_generation_prompt: false, ..ChatOptions::default() });
    assert!(closed.unwrap().starts_with(&text));
}

#[test]
fn continue_final_message_needs_text_to_continue() {
    let tokenizer = tiny();
    for messages in [
        json!([{"role": "assistant", "content": null}]),
        json!([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        json!([{"role": "assistant"}]),
    ] {
        let error = tokenizer.render_chat(&messages, &continue_options()).unwrap_err();
        assert_eq!(error.side(), ErrorSide::Client, "{error}");
    }
    // A template that drops the final message's text cannot be continued.
    let dropping = with_template("dropping", "{% for m in messages %}{{ m.role }}{% endfor %}");
    let error =
        dropping.render_chat(&json!([{"role": "user", "content": "x"}]), &continue_options()).unwrap_err();
    assert!(error.to_string().contains("final message does not appear"), "{error}");
}

#[test]
fn continue_final_message_with_the_default_generation_prompt_is_refused() {
    let tokenizer = tiny();
    let options = ChatOptions { continue_final_message: true, ..ChatOptions::default() };
    let error = tokenizer.render_chat(&json!([{"role": "user", "content": "x"}]), &options).unwrap_err();
    assert!(matches!(error, TokenizerError::InvalidRequest { .. }), "{error:?}");
    assert!(error.to_string().contains("add_generation_prompt"), "{error}");
}

#[test]
fn chat_template_kwargs_become_variables_and_override_options_as_in_vllm() {
    let tokenizer =
        with_template("kwargs", "{{ add_generation_prompt }} {{ tools }} {{ flavour }} {{ bos_token }}");
    let messages = json!([{"role": "user", "content": "x"}]);
    let options = ChatOptions {
        chat_template_kwargs: Some(
            json!({"flavour": "mint", "add_generation_prompt": false, "bos_token": "<s>"}),
        ),
        ..ChatOptions::default()
    };
    assert_eq!(tokenizer.render_chat(&messages, &options).unwrap(), "False None mint <s>");
    let body = br#"{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": [{"b": 1, "a": 2}]}}"#;
    assert_eq!(tokenizer.render_chat_request(body).unwrap(), "True [{'b': 1, 'a': 2}]  <|endoftext|>");

    let documents = with_template("documents", "{{ documents | tojson }}");
    let body =
        br#"{"messages": [{"role": "user", "content": "x"}], "documents": [{"title": "t", "text": "d"}]}"#;
    assert_eq!(documents.render_chat_request(body).unwrap(), r#"[{"title": "t", "text": "d"}]"#);
    let options = ChatOptions {
        chat_template_kwargs: Some(json!({"documents": [{"z": 1}]})),
        ..ChatOptions::default()
    };
    assert_eq!(documents.render_chat(&messages, &options).unwrap(), r#"[{"z": 1}]"#);
    assert_eq!(documents.render_chat(&messages, &ChatOptions::default()).unwrap(), "null");

    for kwargs in [json!("not an object"), json!({"messages": []}), json!({"add_generation_prompt": "yes"})] {
        let options = ChatOptions { chat_template_kwargs: Some(kwargs), ..ChatOptions::default() };
        let error = tokenizer.render_chat(&messages, &options).unwrap_err();
        assert!(matches!(error, TokenizerError::InvalidRequest { .. }), "{error:?}");
    }
}

#[test]
fn raise_exception_gives_the_templates_message_as_a_client_error() {
    let tokenizer = tiny();
    let error = tokenizer
        .render_chat(&json!([{"role": "critic", "content": "x"}]), &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(error, TokenizerError::TemplateRaised { .. }), "{error:?}");
    assert_eq!(error.side(), ErrorSide::Client);
    assert!(error.to_string().contains("Unsupported role \"critic\""), "{error}");

    let raising = with_template(
        "raising",
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}ok",
    );
    assert_eq!(raising.render_chat(&json!([{"role": "user"}]), &ChatOptions::default()).unwrap(), "ok");
    let error = raising
        .render_chat(&json!([{"role": "user"}, {"role": "user"}]), &ChatOptions::default())
        .unwrap_err();
    assert_eq!(error.to_string(), "the chat template rejected the request: one message only");
}

#[test]
fn runtime_template_failures_name_the_line() {
    let failing = with_template("failing", "first\n{{ messages[0].content.missing.deeper }}");
    let error =
        failing.render_chat(&json!([{"role": "user", "content": {}}]), &ChatOptions::default()).unwrap_err();
    assert!(matches!(error, TokenizerError::Render { line: Some(2), .. }), "{error:?}");
    assert!(error.to_string().contains("line 2"), "{error}");
}

#[test]
fn malformed_requests_are_errors_not_panics() {
    let tokenizer = tiny();
    let options = ChatOptions::default();
    let bad_messages = [
        json!(null),
        json!("hello"),
        json!({"role": "user"}),
        json!([]),
        json!([null]),
        json!([42, "x"]),
        json!([{"role": null, "content": null}]),
        json!([{"role": "user", "content": [null, 3, {"type": "text"}]}]),
        json!([{"role": "assistant", "content": "x", "tool_calls": "not a list"}]),
        json!([{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {"x": [1, {"y": null}]}}}]}]),
    ];
    for messages in bad_messages {
        // Rendering may succeed (templates are lenient) or fail; it must not panic.
        let _ = tokenizer.encode_chat(&messages, &options);
    }
    for tools in [json!("x"), json!([1, 2]), json!({"type": "function"})] {
        let options = ChatOptions { tools: Some(tools), ..ChatOptions::default() };
        let error = tokenizer.encode_chat(&json!([{"role": "user", "content": "x"}]), &options).unwrap_err();
        assert!(matches!(error, TokenizerError::InvalidRequest { .. }), "{error:?}");
    }
    for body in [&b""[..], b"[]", b"{\"messages\": 3", b"{\"model\": \"m\"}", b"\xff\xfe"] {
        let error = tokenizer.encode_chat_request(body).unwrap_err();
        assert_eq!(error.side(), ErrorSide::Client, "{error}");
    }
    let error = tokenizer.encode_chat(&json!([]), &options).unwrap_err();
    assert!(error.to_string().contains("empty"), "{error}");
}

#[test]
fn the_tokenizer_is_shared_between_threads() {
    let tokenizer = std::sync::Arc::new(tiny());
    let expected = tokenizer
        .encode_chat(&json!([{"role": "user", "content": "same"}]), &ChatOptions::default())
        .unwrap();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let tokenizer = std::sync::Arc::clone(&tokenizer);
            std::thread::spawn(move || {
                (0..20)
                    .map(|_| {
                        tokenizer.encode_chat(
                            &json!([{"role": "user", "content": "same"}]),
                            &ChatOptions::default(),
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for handle in handles {
        for result in handle.join().expect("thread") {
            assert_eq!(result.unwrap(), expected);
        }
    }
}

/// A conversation too long to tokenize whole: the prefix ids of its first N characters are the
/// whole conversation's ids up to the cut (bar the token the cut splits), whatever its length,
/// for the Hugging Face path and the mock engines' tokenizer alike.
#[test]
fn the_prefix_of_a_long_chat_is_the_prefix_of_its_ids() {
    let messages: Vec<_> = (0..3_000)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("turn {i} says hello world")}))
        .collect();
    let body = serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap();
    for tokenizer in [tiny(), Tokenizer::mock()] {
        let whole = tokenizer.encode_chat_request(&body).unwrap();
        let prefix = tokenizer.encode_chat_request_prefix(&body, 2000).unwrap();
        assert!(prefix.len() > 20 && prefix.len() < whole.len() / 20, "{} of {}", prefix.len(), whole.len());
        let agreed = prefix.iter().zip(&whole).take_while(|(a, b)| a == b).count();
        assert!(agreed + 1 >= prefix.len(), "{agreed} of {} prefix ids agree", prefix.len());
        // A short request is tokenized whole, its generation prompt excepted.
        let short = serde_json::to_vec(&json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap();
        let ids = tokenizer.encode_chat_request_prefix(&short, 2000).unwrap();
        assert!(tokenizer.encode_chat_request(&short).unwrap().starts_with(&ids));
    }
}
