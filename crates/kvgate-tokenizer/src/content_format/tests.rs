//! vLLM's content-format detection, case by case: each expected format is what vLLM 0.32.0's
//! `vllm.renderers.hf._detect_content_format(template, default="string")` returned for the same
//! template.

use super::*;

fn check(template: &str, expected: ContentFormat) {
    assert_eq!(detect(template), expected, "{template}");
}

#[test]
fn loop_over_message_content() {
    check("{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn loop_over_message_content_attr() {
    check(
        "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
        ContentFormat::Openai,
    );
}

#[test]
fn string_only() {
    check(
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}{% endfor %}",
        ContentFormat::String,
    );
}

#[test]
fn loop_via_assigned_slice() {
    check("{% set loop_messages = messages[1:] %}{% for message in loop_messages %}{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}{% endfor %}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn loop_via_filtered_messages() {
    check("{% for message in messages | rejectattr('role', 'equalto', 'system') %}{% for c in message.content %}{{ c.text }}{% endfor %}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn content_is_string_test() {
    check("{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}{{ c.text }}{% endfor %}{% endif %}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn macro_param() {
    check("{% macro render(items) %}{% for item in items %}{{ item.text }}{% endfor %}{% endmacro %}{% for message in messages %}{{ render(message['content']) }}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn macro_kwarg() {
    check("{% macro render(x, items=none) %}{% for item in items %}{{ item.text }}{% endfor %}{% endmacro %}{% for message in messages %}{{ render(1, items=message.content) }}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn macro_unrelated() {
    check("{% macro render(items) %}{% for item in items %}{{ item }}{% endfor %}{% endmacro %}{% for message in messages %}{{ render(message['role']) }}{% endfor %}", ContentFormat::String);
}

#[test]
fn top_level_content_var() {
    check("{% for message in messages %}{% set content = message['content'] %}{% for item in content %}{{ item }}{% endfor %}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn content_var_in_macro() {
    check("{% macro m(content) %}{% for item in content %}{{ item }}{% endfor %}{% endmacro %}{% for message in messages %}{{ message['content'] }}{% endfor %}", ContentFormat::String);
}

#[test]
fn tuple_target_over_messages() {
    check("{% for i, message in messages %}{{ message }}{% endfor %}{% for message in messages %}{% for p in message['content'] %}{{ p }}{% endfor %}{% endfor %}", ContentFormat::String);
}

#[test]
fn namespace_assign_from_messages() {
    check("{% set ns = namespace(m=none) %}{% set ns.m = messages %}{% for message in messages %}{% for p in message['content'] %}{{ p }}{% endfor %}{% endfor %}", ContentFormat::String);
}

#[test]
fn tuple_target_over_content() {
    check(
        "{% for message in messages %}{% for k, v in message['content'] %}{{ k }}{% endfor %}{% endfor %}",
        ContentFormat::String,
    );
}

#[test]
fn syntax_error() {
    check("{% for message in messages %}{{ message['content'] }", ContentFormat::String);
}

#[test]
fn loop_in_callblock() {
    check("{% macro wrap() %}{{ caller() }}{% endmacro %}{% for message in messages %}{% call wrap() %}{% for p in message.content %}{{ p.text }}{% endfor %}{% endcall %}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn loop_over_messages_content_index() {
    check(
        "{% for message in messages %}{% for p in message['content'][1:] %}{{ p }}{% endfor %}{% endfor %}",
        ContentFormat::Openai,
    );
}

#[test]
fn chained_assignment() {
    check("{% set a = messages %}{% set b = a %}{% for message in b %}{% for p in message['content'] %}{{ p }}{% endfor %}{% endfor %}", ContentFormat::Openai);
}

#[test]
fn content_index_const() {
    check(
        "{% for message in messages %}{% for p in message[0] %}{{ p }}{% endfor %}{% endfor %}",
        ContentFormat::String,
    );
}

#[test]
fn the_test_tokenizers_chatml_template_loops_over_parts_and_the_plain_one_does_not() {
    let config = include_str!("../../testdata/tiny-chatml/tokenizer_config.json");
    let config: serde_json::Value = serde_json::from_str(config).unwrap();
    check(config["chat_template"].as_str().unwrap(), ContentFormat::Openai);
    check(include_str!("../../../../scripts/real-vllm/templates/plain.jinja"), ContentFormat::String);
}

#[test]
fn a_stated_format_is_used_as_stated() {
    let looping =
        "{% for message in messages %}{% for p in message.content %}{{ p }}{% endfor %}{% endfor %}";
    assert_eq!(ContentFormatOption::String.resolve(looping), Some(ContentFormat::String));
    assert_eq!(ContentFormatOption::Openai.resolve("{{ messages }}"), Some(ContentFormat::Openai));
    assert_eq!(ContentFormatOption::Auto.resolve(looping), Some(ContentFormat::Openai));
    assert_eq!(ContentFormatOption::AsSent.resolve(looping), None);
}
