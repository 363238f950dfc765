//! Chat messages rebuilt as vLLM's chat API (0.32.0) rebuilds them before its template, for each
//! content format: `openai` wraps a plain string in a list of one text part (a template that
//! prints the content as is then prints that list), `string` joins text parts with newlines,
//! tool-call arguments are parsed, and `developer` becomes a leading `system` message for a
//! template that does not name it. The real engines check the same token for token
//! (tests/real_vllm).

use std::path::PathBuf;

use kvgate_tokenizer::{ChatOptions, ContentFormat, ContentFormatOption, Tokenizer, TokenizerOptions};
use serde_json::json;

fn tokenizer(template: &str, format: ContentFormatOption) -> Tokenizer {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let directory = std::env::temp_dir().join(format!("kvgate-vllm-messages-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("mkdir");
    let path = directory.join(format!("{}.jinja", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    std::fs::write(&path, template).expect("write");
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join("tiny-chatml");
    let options = TokenizerOptions { content_format: format, ..TokenizerOptions::default() };
    let tokenizer = Tokenizer::from_path_with_options(&model, Some(&path), &options).expect("load");
    let _ = std::fs::remove_file(&path);
    tokenizer
}

/// Prints each message's fields as the template receives them.
const SHOW: &str = "{% for m in messages %}{{ m.role }}={{ m.content }}{% if m.tool_calls %} calls={{ m.tool_calls | tojson }}{% endif %};{% endfor %}";
/// The same, but looping over content parts (so vLLM's `auto` picks `openai`).
const LOOPING: &str = "{% for m in messages %}{{ m.role }}={% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %};{% endfor %}";

fn render(tokenizer: &Tokenizer, messages: serde_json::Value) -> String {
    tokenizer.render_chat(&messages, &ChatOptions::default()).expect("render")
}

#[test]
fn auto_detects_the_format_as_vllm_does() {
    assert_eq!(tokenizer(SHOW, ContentFormatOption::Auto).chat_content_format(), Some(ContentFormat::String));
    assert_eq!(
        tokenizer(LOOPING, ContentFormatOption::Auto).chat_content_format(),
        Some(ContentFormat::Openai)
    );
}

#[test]
fn string_format_joins_text_parts_with_newlines() {
    let tokenizer = tokenizer(SHOW, ContentFormatOption::Auto);
    let messages = json!([{"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"}]}]);
    assert_eq!(render(&tokenizer, messages), "user=a\nb\nc;");
    assert_eq!(render(&tokenizer, json!([{"role": "user", "content": null}])), "user=;");
}

#[test]
fn openai_format_makes_a_string_a_list_of_one_text_part() {
    let tokenizer = tokenizer(LOOPING, ContentFormatOption::Auto);
    assert_eq!(render(&tokenizer, json!([{"role": "user", "content": "hello"}])), "user=[hello];");
    // A template that prints the content as is prints the list, as vLLM's does.
    let printing = self::tokenizer(SHOW, ContentFormatOption::Openai);
    assert_eq!(
        render(&printing, json!([{"role": "system", "content": "Be brief."}])),
        "system=[{'type': 'text', 'text': 'Be brief.'}];"
    );
}

#[test]
fn a_tool_result_is_one_string_in_either_format() {
    let tokenizer = tokenizer(LOOPING, ContentFormatOption::Auto);
    let messages = json!([{"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]);
    assert_eq!(render(&tokenizer, messages), "tool=x\ny;");
}

#[test]
fn tool_call_arguments_become_objects() {
    let tokenizer = tokenizer(SHOW, ContentFormatOption::Auto);
    // As a raw body: the calls' keys keep the client's order.
    let render = |_: &Tokenizer, arguments: serde_json::Value| {
        let body = format!(
            r#"{{"messages": [{{"role": "assistant", "content": null, "tool_calls": [{{"id": "c1", "type": "function", "function": {{"name": "f", "arguments": {arguments}}}}}]}}]}}"#
        );
        tokenizer.render_chat_request(body.as_bytes()).expect("render")
    };
    let call = |arguments: serde_json::Value| arguments;
    let expected = |arguments: &str| {
        format!("assistant= calls=[{{\"id\": \"c1\", \"type\": \"function\", \"function\": {{\"name\": \"f\", \"arguments\": {arguments}}}}}];")
    };
    assert_eq!(render(&tokenizer, call(json!("{\"b\": 1, \"a\": [2]}"))), expected("{\"b\": 1, \"a\": [2]}"));
    assert_eq!(render(&tokenizer, call(json!("not json"))), expected("{}"));
    assert_eq!(render(&tokenizer, call(json!(""))), expected("{}"));
    assert_eq!(render(&tokenizer, call(json!("[1]"))), expected("{}"));
    // An empty list of calls is dropped.
    let none = json!([{"role": "assistant", "content": "ok", "tool_calls": []}]);
    assert_eq!(self::render(&tokenizer, none), "assistant=ok;");
}

#[test]
fn developer_messages_become_one_leading_system_message_unless_the_template_names_them() {
    let tokenizer = tokenizer(SHOW, ContentFormatOption::Auto);
    let messages = json!([
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": [{"type": "text", "text": "D"}]},
    ]);
    assert_eq!(render(&tokenizer, messages.clone()), "system=S\n\nD;user=u;");
    let naming = self::tokenizer(&format!("{{# 'developer' #}}{SHOW}"), ContentFormatOption::Auto);
    assert_eq!(render(&naming, messages), "system=S;user=u;developer=D;");
}

#[test]
fn fields_vllm_drops_are_not_seen_by_the_template() {
    let tokenizer =
        tokenizer("{% for m in messages %}{{ m | tojson }}{% endfor %}", ContentFormatOption::Auto);
    let messages = json!([{"role": "user", "content": "hi", "name": "ann", "extra": 1}]);
    assert_eq!(render(&tokenizer, messages), "{\"role\": \"user\", \"content\": \"hi\", \"name\": \"ann\"}");
}

#[test]
fn media_parts_are_refused_so_the_request_routes_on_its_text() {
    let tokenizer = tokenizer(LOOPING, ContentFormatOption::Auto);
    let messages =
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]);
    assert!(tokenizer.render_chat(&messages, &ChatOptions::default()).is_err());
}
