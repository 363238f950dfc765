//! The segment cache gives exactly the ids of tokenizing the whole text: random texts of ChatML-like pieces through variants of the tiny tokenizer (extra and overlapping added tokens, normalized ones, Metaspace, other normalizers, a tiny cache), cold, warm and from several threads; and the tokenizers it must not cut (lstrip, Metaspace `first`) run uncached.

use std::path::Path;
use std::sync::OnceLock;

use kvgate_tokenizer::{ContentFormatOption, SegmentCacheStatus, Tokenizer, TokenizerOptions};
use proptest::prelude::*;
use serde_json::{json, Value};

/// A template that renders the first message's content as is, so a chat request encodes that
/// text with add_special_tokens = false.
const VERBATIM_TEMPLATE: &str = "{{ messages[0]['content'] }}";

struct Variant {
    name: &'static str,
    cached: Tokenizer,
    plain: Tokenizer,
}

fn added(id: u64, content: &str, special: bool, normalized: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": normalized, "special": special})
}

/// Added tokens that overlap ChatML's and each other (a shorter one listed before a longer one
/// with the same start, so only leftmost-longest matching gets them right), special and not,
/// normalized ones (one with lstrip).
fn extra_added_tokens() -> Vec<Value> {
    let mut think = added(3005, "<think>", false, true);
    think["lstrip"] = json!(true);
    vec![
        added(3000, "<too", true, false),
        added(3001, "<tool_call>", true, false),
        added(3002, "</tool_call>", false, false),
        added(3003, "<|im", false, false),
        added(3004, "_start|>\n", false, false),
        think,
        added(3006, "cache", false, true),
    ]
}

/// The tiny tokenizer.json with `edit` applied.
fn tiny_json_with(edit: impl FnOnce(&mut Value)) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tiny-chatml/tokenizer.json");
    let mut file: Value = serde_json::from_slice(&std::fs::read(path).expect("read")).expect("parse");
    edit(&mut file);
    file
}

/// `pre_tokenizer` followed by the byte-level mapping, so that every character it leaves (`▁`
/// included) reaches the byte-level BPE as known symbols instead of being dropped.
fn then_bytes(pre_tokenizer: Value) -> Value {
    let bytes =
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    json!({"type": "Sequence", "pretokenizers": [pre_tokenizer, bytes]})
}

fn variant_files() -> Vec<(&'static str, Value)> {
    vec![
        ("tiny", tiny_json_with(|_| {})),
        (
            "extra_added_tokens",
            tiny_json_with(|file| {
                file["added_tokens"].as_array_mut().expect("list").extend(extra_added_tokens())
            }),
        ),
        (
            "metaspace_always_and_prepend",
            tiny_json_with(|file| {
                file["normalizer"] = json!({"type": "Sequence", "normalizers": [
                    {"type": "NFC"}, {"type": "Prepend", "prepend": "▁"}]});
                file["pre_tokenizer"] = then_bytes(
                    json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}),
                );
            }),
        ),
        (
            "lowercase_strip_whitespace",
            tiny_json_with(|file| {
                file["normalizer"] = json!({"type": "Sequence", "normalizers": [
                    {"type": "Lowercase"}, {"type": "Strip", "strip_left": true, "strip_right": true}]});
                file["pre_tokenizer"] = then_bytes(json!({"type": "Whitespace"}));
            }),
        ),
        (
            "lstrip_token",
            tiny_json_with(|file| {
                let mut token = added(3000, "<tool>", false, false);
                token["lstrip"] = json!(true);
                file["added_tokens"].as_array_mut().expect("list").push(token);
            }),
        ),
        (
            "metaspace_first",
            tiny_json_with(|file| {
                file["pre_tokenizer"] = then_bytes(
                    json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false}),
                );
            }),
        ),
    ]
}

fn load(directory: &Path, segment_cache_tokens: u64) -> Tokenizer {
    let options = TokenizerOptions { segment_cache_tokens, content_format: ContentFormatOption::AsSent };
    Tokenizer::from_path_with_options(directory, Some(&directory.join("verbatim.jinja")), &options)
        .expect("load variant")
}

/// Every variant, loaded once: with the default cache, and plain (cache off). The tiny tokenizer
/// also with a cache so small that it evicts all the time.
fn variants() -> &'static [Variant] {
    static VARIANTS: OnceLock<Vec<Variant>> = OnceLock::new();
    VARIANTS.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("kvgate-tokenizer-segments-{}", std::process::id()));
        let mut variants = Vec::new();
        for (name, file) in variant_files() {
            let directory = root.join(name);
            std::fs::create_dir_all(&directory).expect("mkdir");
            std::fs::write(directory.join("tokenizer.json"), serde_json::to_vec(&file).expect("json"))
                .expect("write");
            std::fs::write(directory.join("verbatim.jinja"), VERBATIM_TEMPLATE).expect("write");
            variants.push(Variant {
                name,
                cached: load(&directory, TokenizerOptions::DEFAULT_SEGMENT_CACHE_TOKENS),
                plain: load(&directory, 0),
            });
            if name == "tiny" {
                variants.push(Variant {
                    name: "tiny_small_cache",
                    cached: load(&directory, 64),
                    plain: load(&directory, 0),
                });
            }
        }
        let _ = std::fs::remove_dir_all(&root);
        variants
    })
}

fn variant(name: &str) -> &'static Variant {
    variants().iter().find(|variant| variant.name == name).expect("variant")
}

/// A piece of ChatML-like text: special tokens whole and broken, roles, whitespace runs,
/// combining marks (NFC joins them across nothing but a section), scripts, emoji, code.
fn piece() -> impl Strategy<Value = String> {
    let fixed = prop::sample::select(vec![
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_",
        "|>",
        "<|",
        "_start|>\n",
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "<tool>",
        "cache",
        "CACHE",
        "user\n",
        "assistant\n",
        "system\n",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        " \n ",
        "\r\n",
        "   \n",
        "e\u{301}",
        "\u{301}",
        "\u{308}",
        "é",
        "Ünïcödé",
        "网关",
        "ゲートウェイ",
        "🚀",
        "👩\u{200d}💻",
        "ｆｕｌｌ",
        "'s",
        "'ll",
        "123",
        "3.14",
        "!?",
        "fn main() {}",
        "▁",
    ]);
    prop_oneof![
        6 => fixed.prop_map(String::from),
        2 => "[a-zA-Z]{1,8}",
        1 => "[ \t\r\n]{1,5}",
        1 => "\\PC{1,6}",
        1 => ".{0,12}",
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(piece(), 0..40).prop_map(|pieces| pieces.concat())
}

fn chat_body(text: &str) -> Vec<u8> {
    json!({"model": "m", "messages": [{"role": "user", "content": text}]}).to_string().into_bytes()
}

/// Chat (no special tokens added) and completion (added) ids, twice, through the cache, and
/// once without it; errors compared by their presence only.
fn check_text(variant: &Variant, text: &str) -> Result<(), TestCaseError> {
    let body = chat_body(text);
    let rendered = variant.plain.render_chat_request(&body).ok();
    prop_assert_eq!(rendered.as_deref(), Some(text));
    let plain_chat = variant.plain.encode_chat_request(&body).ok();
    let plain_prompt = variant.plain.encode_prompt(text).ok();
    for round in ["first", "again"] {
        prop_assert_eq!(
            &variant.cached.encode_chat_request(&body).ok(),
            &plain_chat,
            "{} chat, {}",
            variant.name,
            round
        );
        prop_assert_eq!(
            &variant.cached.encode_prompt(text).ok(),
            &plain_prompt,
            "{} prompt, {}",
            variant.name,
            round
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn cached_encoding_equals_encoding_the_whole_text(text in text()) {
        for variant in variants() {
            check_text(variant, &text)?;
        }
    }

    /// The same texts again after clearing, so each is seen cold.
    #[test]
    fn cold_cached_encoding_equals_encoding_the_whole_text(text in text()) {
        let tiny = variant("tiny");
        tiny.cached.clear_segment_cache();
        check_text(tiny, &text)?;
    }
}

#[test]
fn the_cache_is_on_where_exact_and_off_with_a_reason_elsewhere() {
    for name in [
        "tiny",
        "tiny_small_cache",
        "extra_added_tokens",
        "metaspace_always_and_prepend",
        "lowercase_strip_whitespace",
    ] {
        let status = variant(name).cached.segment_cache_status();
        assert!(matches!(status, SegmentCacheStatus::On { .. }), "{name}: {status:?}");
        assert_eq!(variant(name).plain.segment_cache_status(), SegmentCacheStatus::Off, "{name}");
    }
    for (name, expected) in [("lstrip_token", "lstrip"), ("metaspace_first", "prepend_scheme: first")] {
        match variant(name).cached.segment_cache_status() {
            SegmentCacheStatus::Unsupported { reason } => {
                assert!(reason.contains(expected), "{name}: {reason}")
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    assert_eq!(Tokenizer::mock().segment_cache_status(), SegmentCacheStatus::Off);
}

/// The unsupported tokenizers still tokenize as before: "<tool>" with lstrip takes the spaces
/// before it, which a cut at "<tool>" would leave in the previous section.
#[test]
fn an_lstrip_token_still_takes_the_spaces_before_it() {
    let variant = variant("lstrip_token");
    let tool = variant.plain.encode_prompt("<tool>").unwrap();
    let text = "call   <tool> now";
    let ids = variant.cached.encode_chat_request(&chat_body(text)).unwrap();
    assert_eq!(ids, variant.plain.encode_chat_request(&chat_body(text)).unwrap());
    let call = variant.plain.encode_chat_request(&chat_body("call")).unwrap();
    assert_eq!(ids[..call.len() + 1], [call.as_slice(), &tool[1..]].concat()[..], "{ids:?}");
}

#[test]
fn a_full_cache_evicts_and_stays_within_its_capacity() {
    let variant = variant("tiny_small_cache");
    for turn in 0..50 {
        let text = format!("<|im_start|>user\nmessage number {turn}<|im_end|>\n<|im_start|>assistant\n");
        check_text(variant, &text).unwrap();
    }
    match variant.cached.segment_cache_status() {
        SegmentCacheStatus::On { weight, capacity, .. } => {
            assert!(weight <= capacity, "{weight} > {capacity}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn threads_sharing_the_cache_get_the_ids_of_the_whole_text() {
    let tiny = variant("tiny");
    let texts: Vec<String> = (0..64)
        .map(|i| {
            format!("<|im_start|>system\nshared<|im_end|>\n<|im_start|>user\nquestion {}<|im_end|>\n", i % 16)
        })
        .collect();
    let expected: Vec<Vec<u32>> =
        texts.iter().map(|text| tiny.plain.encode_chat_request(&chat_body(text)).unwrap()).collect();
    std::thread::scope(|scope| {
        for thread in 0..4 {
            let (texts, expected) = (&texts, &expected);
            scope.spawn(move || {
                for round in 0..8 {
                    for (index, text) in texts.iter().enumerate().skip(thread + round) {
                        let ids = tiny.cached.encode_chat_request(&chat_body(text)).unwrap();
                        assert_eq!(ids, expected[index], "thread {thread} round {round} text {index}");
                    }
                }
            });
        }
    });
}
