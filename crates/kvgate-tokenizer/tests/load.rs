//! Loading from local files: a directory or a tokenizer.json, the template override, chat_template.jinja and named templates, and errors that name the file or line.

use std::path::{Path, PathBuf};

use kvgate_tokenizer::{ChatOptions, ErrorSide, Tokenizer, TokenizerError};
use serde_json::json;

fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join("tiny-chatml")
}

/// A fresh directory under the system temp dir for one test, removed when dropped.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch_dir(name: &str) -> Scratch {
    let directory = std::env::temp_dir().join(format!("kvgate-tokenizer-load-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).expect("create scratch dir");
    Scratch(directory)
}

/// A model directory with the tiny tokenizer.json and the given extra files.
fn model_dir(name: &str, files: &[(&str, &str)]) -> Scratch {
    let directory = scratch_dir(name);
    std::fs::copy(tiny_dir().join("tokenizer.json"), directory.join("tokenizer.json")).expect("copy");
    for (file, contents) in files {
        let path = directory.join(file);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(path, contents).expect("write");
    }
    directory
}

fn user(text: &str) -> serde_json::Value {
    json!([{"role": "user", "content": text}])
}

fn render(tokenizer: &Tokenizer, options: &ChatOptions) -> String {
    tokenizer.render_chat(&user("hi"), options).expect("render")
}

#[test]
fn a_directory_and_its_tokenizer_json_load_the_same_tokenizer() {
    let from_dir = Tokenizer::from_path(&tiny_dir(), None).expect("dir");
    let from_file = Tokenizer::from_path(&tiny_dir().join("tokenizer.json"), None).expect("file");
    let options = ChatOptions::default();
    assert_eq!(render(&from_dir, &options), render(&from_file, &options));
    assert_eq!(
        from_dir.encode_prompt("hello world").unwrap(),
        from_file.encode_prompt("hello world").unwrap()
    );
    assert!(!from_dir.is_mock());
}

#[test]
fn a_missing_path_is_named_in_the_error() {
    let missing = Path::new("/nonexistent/kvgate/model");
    let error = Tokenizer::from_path(missing, None).unwrap_err();
    assert!(matches!(error, TokenizerError::Io { .. }));
    assert!(error.to_string().contains("/nonexistent/kvgate/model"), "{error}");
    assert_eq!(error.side(), ErrorSide::Config);

    let empty = scratch_dir("empty");
    let error = Tokenizer::from_path(&empty, None).unwrap_err();
    assert!(error.to_string().contains(&empty.join("tokenizer.json").display().to_string()), "{error}");

    let missing_template = Path::new("/nonexistent/template.jinja");
    let error = Tokenizer::from_path(&tiny_dir(), Some(missing_template)).unwrap_err();
    assert!(error.to_string().contains("/nonexistent/template.jinja"), "{error}");
}

#[test]
fn invalid_files_are_named_in_the_error() {
    let directory = scratch_dir("invalid-tokenizer");
    std::fs::write(directory.join("tokenizer.json"), "{\"model\": 42}").unwrap();
    let error = Tokenizer::from_path(&directory, None).unwrap_err();
    assert!(matches!(error, TokenizerError::InvalidTokenizer { .. }), "{error:?}");
    assert!(error.to_string().contains("tokenizer.json"), "{error}");

    let directory = model_dir("invalid-config", &[("tokenizer_config.json", "{not json")]);
    let error = Tokenizer::from_path(&directory, None).unwrap_err();
    assert!(matches!(error, TokenizerError::InvalidConfig { .. }), "{error:?}");
    assert!(error.to_string().contains("tokenizer_config.json"), "{error}");

    let directory = model_dir("bad-bos", &[("tokenizer_config.json", r#"{"bos_token": 7}"#)]);
    let error = Tokenizer::from_path(&directory, None).unwrap_err();
    assert!(error.to_string().contains("bos_token"), "{error}");
}

#[test]
fn the_chat_template_override_replaces_the_models_template() {
    let directory = scratch_dir("override");
    let template = directory.join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ eos_token }}",
    )
    .unwrap();
    let tokenizer = Tokenizer::from_path(&tiny_dir(), Some(&template)).expect("load");
    assert_eq!(render(&tokenizer, &ChatOptions::default()), "user: hi\n<|im_end|>");
    // Completions are unaffected by the template.
    let model = Tokenizer::from_path(&tiny_dir(), None).unwrap();
    assert_eq!(tokenizer.encode_prompt("a b").unwrap(), model.encode_prompt("a b").unwrap());
}

#[test]
fn chat_template_jinja_takes_precedence_over_the_config() {
    let config = r#"{"chat_template": "config", "eos_token": "<|im_end|>"}"#;
    let directory = model_dir(
        "jinja-file",
        &[("tokenizer_config.json", config), ("chat_template.jinja", "file {{ eos_token }}")],
    );
    let tokenizer = Tokenizer::from_path(&directory, None).expect("load");
    assert_eq!(render(&tokenizer, &ChatOptions::default()), "file <|im_end|>");

    let directory = model_dir("config-string", &[("tokenizer_config.json", config)]);
    let tokenizer = Tokenizer::from_path(&directory.join("tokenizer.json"), None).expect("load");
    assert_eq!(render(&tokenizer, &ChatOptions::default()), "config");
}

#[test]
fn named_templates_pick_default_or_tool_use() {
    let config = json!({"chat_template": [
        {"name": "default", "template": "default"},
        {"name": "tool_use", "template": "tools: {{ tools | length }}"},
    ]})
    .to_string();
    let directory = model_dir("named", &[("tokenizer_config.json", &config)]);
    let tokenizer = Tokenizer::from_path(&directory, None).expect("load");
    assert_eq!(render(&tokenizer, &ChatOptions::default()), "default");
    let with_tools = ChatOptions { tools: Some(json!([{"type": "function"}])), ..ChatOptions::default() };
    assert_eq!(render(&tokenizer, &with_tools), "tools: 1");

    // The same from files: chat_template.jinja is "default", additional_chat_templates/ the rest.
    let directory = model_dir(
        "named-files",
        &[("chat_template.jinja", "default file"), ("additional_chat_templates/tool_use.jinja", "tool file")],
    );
    let tokenizer = Tokenizer::from_path(&directory, None).expect("load");
    assert_eq!(render(&tokenizer, &ChatOptions::default()), "default file");
    assert_eq!(render(&tokenizer, &with_tools), "tool file");

    // Without a "default" there is nothing to use for requests without tools.
    let config = json!({"chat_template": [{"name": "rag", "template": "rag"}]}).to_string();
    let directory = model_dir("no-default", &[("tokenizer_config.json", &config)]);
    let tokenizer = Tokenizer::from_path(&directory, None).expect("load");
    let error = tokenizer.render_chat(&user("hi"), &ChatOptions::default()).unwrap_err();
    assert!(matches!(error, TokenizerError::NoChatTemplate { .. }), "{error:?}");
    assert!(error.to_string().contains("rag"), "{error}");
}

#[test]
fn a_tokenizer_without_a_template_encodes_prompts_but_refuses_chats() {
    let tokenizer = Tokenizer::from_path(&model_dir("bare", &[]), None).expect("load");
    assert!(!tokenizer.encode_prompt("hello").unwrap().is_empty());
    let error = tokenizer.encode_chat(&user("hi"), &ChatOptions::default()).unwrap_err();
    assert!(matches!(error, TokenizerError::NoChatTemplate { .. }), "{error:?}");
    assert!(error.to_string().contains("--chat-template"), "{error}");
}

#[test]
fn legacy_special_tokens_map_supplies_the_special_tokens() {
    let directory = model_dir(
        "legacy",
        &[
            ("tokenizer_config.json", r#"{"chat_template": "{{ bos_token }}|{{ eos_token }}"}"#),
            ("special_tokens_map.json", r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>"}"#),
        ],
    );
    let tokenizer = Tokenizer::from_path(&directory, None).expect("load");
    assert_eq!(render(&tokenizer, &ChatOptions::default()), "<s>|</s>");
}

#[test]
fn template_syntax_errors_name_the_template_and_line() {
    let directory = scratch_dir("syntax");
    let template = directory.join("broken.jinja");
    std::fs::write(&template, "line one\n{% for m in messages %}\n{{ m.role }\n{% endfor %}").unwrap();
    let error = Tokenizer::from_path(&tiny_dir(), Some(&template)).unwrap_err();
    match &error {
        TokenizerError::TemplateSyntax { template: origin, line, source_line, .. } => {
            assert!(origin.contains("broken.jinja"), "{error}");
            assert_eq!(*line, 3, "{error}");
            assert_eq!(source_line, "{{ m.role }");
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    assert!(error.to_string().contains("line 3"), "{error}");

    let config = json!({"chat_template": "ok\n{% if %}"}).to_string();
    let directory = model_dir("syntax-config", &[("tokenizer_config.json", &config)]);
    let error = Tokenizer::from_path(&directory, None).unwrap_err();
    assert!(
        error.to_string().contains("tokenizer_config.json") && error.to_string().contains("line 2"),
        "{error}"
    );
}

#[test]
fn truncation_and_padding_in_tokenizer_json_are_ignored_as_transformers_does() {
    let text = std::fs::read_to_string(tiny_dir().join("tokenizer.json")).unwrap();
    let mut tokenizer_json: serde_json::Value = serde_json::from_str(&text).unwrap();
    tokenizer_json["truncation"] =
        json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0});
    tokenizer_json["padding"] = json!({"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    let directory = scratch_dir("truncating");
    std::fs::write(directory.join("tokenizer.json"), tokenizer_json.to_string()).unwrap();
    let tokenizer = Tokenizer::from_path(&directory, None).expect("load");
    // transformers 4.57.6 on this file: tokenizer("the gateway routes requests to engines").
    let expected = vec![0, 641, 609, 2117, 652, 423, 588];
    assert_eq!(tokenizer.encode_prompt("the gateway routes requests to engines").unwrap(), expected);
    let model = Tokenizer::from_path(&tiny_dir(), None).unwrap();
    assert_eq!(model.encode_prompt("the gateway routes requests to engines").unwrap(), expected);
}
