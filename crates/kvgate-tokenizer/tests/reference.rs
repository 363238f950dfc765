//! Every case of testdata/reference.json (made by transformers, see make_reference.py) renders to the same text and the same token ids here, with the segment cache cold and warm.

use std::path::PathBuf;

use kvgate_tokenizer::{
    ChatOptions, ContentFormatOption, SegmentCacheStatus, Tokenizer, TokenizerError, TokenizerOptions,
};

/// The reference is transformers' `apply_chat_template` on the messages as sent.
fn as_sent() -> TokenizerOptions {
    TokenizerOptions { content_format: ContentFormatOption::AsSent, ..TokenizerOptions::default() }
}
use serde_json::Value;

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(testdata().join("reference.json")).expect("read reference.json");
    serde_json::from_str(&text).expect("parse reference.json")
}

fn cases(kind: &str) -> Vec<Value> {
    let reference = reference();
    let cases = reference["cases"].as_array().expect("cases").clone();
    cases.into_iter().filter(|case| case["kind"] == kind).collect()
}

fn tiny() -> Tokenizer {
    let tokenizer = Tokenizer::from_path_with_options(&testdata().join("tiny-chatml"), None, &as_sent())
        .expect("load tiny-chatml");
    assert_segment_cache_on(&tokenizer);
    tokenizer
}

fn assert_segment_cache_on(tokenizer: &Tokenizer) {
    let status = tokenizer.segment_cache_status();
    assert!(matches!(status, SegmentCacheStatus::On { .. }), "{status:?}");
}

/// `encode` run with the segment cache emptied (cold), then again (warm): both must agree.
fn cold_and_warm(
    tokenizer: &Tokenizer,
    encode: impl Fn(&Tokenizer) -> Result<Vec<u32>, TokenizerError>,
) -> Result<Vec<u32>, String> {
    tokenizer.clear_segment_cache();
    let cold = encode(tokenizer).map_err(|error| format!("encode error {error}"))?;
    let warm = encode(tokenizer).map_err(|error| format!("encode error (warm) {error}"))?;
    if cold != warm {
        return Err(format!("cold and warm differ\n  cold: {cold:?}\n  warm: {warm:?}"));
    }
    Ok(cold)
}

fn ids(value: &Value) -> Vec<u32> {
    value.as_array().expect("ids").iter().map(|id| id.as_u64().expect("id") as u32).collect()
}

/// The request's messages and options, read from the body as the gateway would.
fn messages_and_options(body: &Value) -> (Value, ChatOptions) {
    let options = ChatOptions {
        add_generation_prompt: body.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true),
        continue_final_message: body.get("continue_final_message").and_then(Value::as_bool).unwrap_or(false),
        tools: body.get("tools").cloned(),
        chat_template_kwargs: body.get("chat_template_kwargs").cloned(),
    };
    (body["messages"].clone(), options)
}

/// Compares every case and reports all differences at once.
fn check_all(failures: Vec<String>) {
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn reference_covers_the_planned_cases() {
    let reference = reference();
    assert!(reference["versions"]["transformers"].is_string());
    assert!(cases("chat").len() >= 12);
    assert!(cases("completion").len() >= 3);
}

#[test]
fn chat_request_bodies_render_and_encode_as_transformers() {
    let tokenizer = tiny();
    let mut failures = Vec::new();
    for case in cases("chat") {
        let name = case["name"].as_str().unwrap_or_default();
        let body = case["request"].as_str().expect("request").as_bytes();
        match tokenizer.render_chat_request(body) {
            Ok(text) if text == case["text"] => {}
            Ok(text) => failures.push(format!("{name}: text\n  got:  {text:?}\n  want: {:?}", case["text"])),
            Err(error) => failures.push(format!("{name}: render error {error}")),
        }
        match cold_and_warm(&tokenizer, |tokenizer| tokenizer.encode_chat_request(body)) {
            Ok(got) if got == ids(&case["ids"]) => {}
            Ok(got) => {
                failures.push(format!("{name}: ids\n  got:  {got:?}\n  want: {:?}", ids(&case["ids"])))
            }
            Err(error) => failures.push(format!("{name}: {error}")),
        }
    }
    check_all(failures);
}

/// The serde_json API gives the same results where the key order of objects does not show in
/// the prompt (serde_json's maps are sorted; the tools cases print objects with `tojson`).
#[test]
fn chat_json_values_render_and_encode_as_transformers() {
    let tokenizer = tiny();
    let mut failures = Vec::new();
    let mut compared = 0;
    for case in cases("chat") {
        let name = case["name"].as_str().unwrap_or_default();
        let body: Value = serde_json::from_str(case["request"].as_str().expect("request")).expect("body");
        let (messages, options) = messages_and_options(&body);
        let text = tokenizer.render_chat(&messages, &options);
        let encoded = cold_and_warm(&tokenizer, |tokenizer| tokenizer.encode_chat(&messages, &options));
        if case["sorted_keys_same"] != true {
            assert!(text.is_ok() && encoded.is_ok(), "{name}: {text:?}");
            continue;
        }
        compared += 1;
        match text {
            Ok(text) if text == case["text"] => {}
            other => failures.push(format!("{name}: text {other:?}\n  want: {:?}", case["text"])),
        }
        match encoded {
            Ok(got) if got == ids(&case["ids"]) => {}
            other => failures.push(format!("{name}: ids {other:?}")),
        }
    }
    check_all(failures);
    assert!(compared >= 10);
}

#[test]
fn completion_prompts_encode_as_transformers() {
    let tokenizer = tiny();
    let mut failures = Vec::new();
    for case in cases("completion") {
        let name = case["name"].as_str().unwrap_or_default();
        let prompt = case["prompt"].as_str().expect("prompt");
        match cold_and_warm(&tokenizer, |tokenizer| tokenizer.encode_prompt(prompt)) {
            Ok(got) if got == ids(&case["ids"]) => {}
            other => failures.push(format!("{name}: {other:?}\n  want: {:?}", ids(&case["ids"]))),
        }
    }
    check_all(failures);
}

#[test]
fn raised_template_errors_carry_the_template_message() {
    let tokenizer = tiny();
    let error_cases = cases("chat_error");
    assert!(!error_cases.is_empty());
    for case in error_cases {
        let body = case["request"].as_str().expect("request").as_bytes();
        match tokenizer.render_chat_request(body) {
            Err(TokenizerError::TemplateRaised { message }) => assert_eq!(message, case["error"]),
            other => panic!("{}: expected TemplateRaised, got {other:?}", case["name"]),
        }
    }
}

/// A fresh directory under the system temp dir for one test.
fn scratch_dir(name: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("kvgate-tokenizer-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).expect("create scratch dir");
    directory
}

/// Templates given as an override exercise the Jinja2 features real templates use (tojson
/// options, Python printing and methods, loops, filters, whitespace control, macros).
#[test]
fn override_templates_render_as_transformers() {
    let directory = scratch_dir("template-cases");
    let mut failures = Vec::new();
    let template_cases = cases("template");
    assert!(template_cases.len() >= 5);
    for case in template_cases {
        let name = case["name"].as_str().unwrap_or_default();
        let template_path = directory.join(format!("{name}.jinja"));
        std::fs::write(&template_path, case["template"].as_str().expect("template")).expect("write template");
        let tokenizer = match Tokenizer::from_path_with_options(
            &testdata().join("tiny-chatml"),
            Some(&template_path),
            &as_sent(),
        ) {
            Ok(tokenizer) => tokenizer,
            Err(error) => {
                failures.push(format!("{name}: load error {error}"));
                continue;
            }
        };
        let body = case["request"].as_str().expect("request").as_bytes();
        match tokenizer.render_chat_request(body) {
            Ok(text) if text == case["text"] => {}
            Ok(text) => failures.push(format!("{name}: text\n  got:  {text:?}\n  want: {:?}", case["text"])),
            Err(error) => failures.push(format!("{name}: render error {error}")),
        }
        assert_segment_cache_on(&tokenizer);
        match cold_and_warm(&tokenizer, |tokenizer| tokenizer.encode_chat_request(body)) {
            Ok(got) if got == ids(&case["ids"]) => {}
            other => failures.push(format!("{name}: ids {other:?}")),
        }
    }
    let _ = std::fs::remove_dir_all(&directory);
    check_all(failures);
}
