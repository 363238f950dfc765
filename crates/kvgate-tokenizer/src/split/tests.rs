//! The splitter's pieces (leftmost-longest, adjacent and edge tokens) and the tokenizers it refuses, on variants of the tiny ChatML tokenizer.

use serde_json::{json, Value};

use super::{listed_added_tokens, Piece, Splitter};

fn tiny_json() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chatml/tokenizer.json");
    serde_json::from_slice(&std::fs::read(path).expect("read tokenizer.json")).expect("parse tokenizer.json")
}

fn added(id: u64, content: &str, special: bool, normalized: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": normalized, "special": special})
}

/// The tiny tokenizer with `extra` appended to its added tokens, then `edit`ed.
fn splitter_for(extra: Vec<Value>, edit: impl FnOnce(&mut Value)) -> Result<Splitter, String> {
    let mut file = tiny_json();
    file["added_tokens"].as_array_mut().expect("added_tokens").extend(extra);
    edit(&mut file);
    let bytes = serde_json::to_vec(&file).expect("serialize");
    let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).expect("load variant");
    Splitter::for_tokenizer(&tokenizer, &listed_added_tokens(&bytes)?)
}

fn tiny() -> Splitter {
    splitter_for(vec![], |_| {}).expect("tiny splits")
}

fn pieces<'a>(splitter: &'a Splitter, text: &'a str) -> Vec<Piece<'a>> {
    splitter.pieces(text).collect()
}

#[test]
fn chatml_text_splits_at_each_special_token() {
    let splitter = tiny();
    let text = "<|endoftext|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(
        pieces(&splitter, text),
        vec![
            Piece::Token(0),
            Piece::Token(1),
            Piece::Section("user\nHi"),
            Piece::Token(2),
            Piece::Section("\n"),
            Piece::Token(1),
            Piece::Section("assistant\n"),
        ]
    );
}

#[test]
fn texts_without_tokens_are_one_section_and_empty_texts_nothing() {
    let splitter = tiny();
    assert_eq!(pieces(&splitter, "plain <|im_ text|>"), vec![Piece::Section("plain <|im_ text|>")]);
    assert_eq!(pieces(&splitter, ""), vec![]);
    assert_eq!(pieces(&splitter, "<|im_end|>"), vec![Piece::Token(2)]);
    assert_eq!(
        pieces(&splitter, "a<|im_end|><|im_end|>b"),
        vec![Piece::Section("a"), Piece::Token(2), Piece::Token(2), Piece::Section("b"),]
    );
}

#[test]
fn overlapping_tokens_match_leftmost_then_longest() {
    let extra = vec![
        added(3000, "<a>", false, false),
        added(3001, "<a>b>", false, false),
        added(3002, "b>c", false, false),
    ];
    let splitter = splitter_for(extra, |_| {}).expect("splits");
    // "<a>" and "<a>b>" start at the same place: the longest; "b>c" starts later: not matched.
    assert_eq!(
        pieces(&splitter, "x<a>b>c"),
        vec![Piece::Section("x"), Piece::Token(3001), Piece::Section("c")]
    );
    // "b>c" starts before any "<a>".
    assert_eq!(pieces(&splitter, "b>c<a>"), vec![Piece::Token(3002), Piece::Token(3000)]);
}

#[test]
fn normalized_added_tokens_are_left_inside_sections() {
    let splitter = splitter_for(vec![added(3000, "tool", false, true)], |_| {}).expect("splits");
    assert_eq!(pieces(&splitter, "a tool<|im_end|>"), vec![Piece::Section("a tool"), Piece::Token(2)]);
}

fn refusal(extra: Vec<Value>, edit: impl FnOnce(&mut Value)) -> String {
    match splitter_for(extra, edit) {
        Ok(_) => panic!("expected the splitter to be refused"),
        Err(reason) => reason,
    }
}

#[test]
fn tokens_whose_match_depends_on_their_surroundings_are_refused() {
    for flag in ["lstrip", "rstrip", "single_word"] {
        let mut token = added(3000, "<tool>", false, false);
        token[flag] = json!(true);
        let reason = refusal(vec![token], |_| {});
        assert!(reason.contains("<tool>") && reason.contains(flag), "{flag}: {reason}");
    }
    // On a normalized token they act inside the section, which encode(section) does itself.
    let mut token = added(3000, "<tool>", false, true);
    token["lstrip"] = json!(true);
    assert!(splitter_for(vec![token], |_| {}).is_ok());
}

#[test]
fn position_dependent_or_random_pipelines_are_refused() {
    let first = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
    let reason = refusal(vec![], |file| {
        file["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [first]});
    });
    assert!(reason.contains("prepend_scheme: first"), "{reason}");
    let always = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true});
    assert!(splitter_for(vec![], |file| file["pre_tokenizer"] = always).is_ok());

    let reason = refusal(vec![], |file| file["model"]["dropout"] = json!(0.1));
    assert!(reason.contains("dropout"), "{reason}");
    assert!(splitter_for(vec![], |file| file["model"]["dropout"] = json!(0.0)).is_ok());
}

#[test]
fn an_added_vocabulary_other_than_listed_is_refused() {
    // Listed twice with other flags: tokenizers matches with one entry's flags and looks up
    // the other's.
    let reason = refusal(vec![added(1, "<|im_start|>", true, true)], |_| {});
    assert!(reason.contains("more than once"), "{reason}");
}

#[test]
fn encoding_special_tokens_as_text_is_refused() {
    let bytes = serde_json::to_vec(&tiny_json()).expect("serialize");
    let mut tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).expect("load");
    tokenizer.set_encode_special_tokens(true);
    let listed = listed_added_tokens(&bytes).expect("listed");
    assert!(Splitter::for_tokenizer(&tokenizer, &listed).is_err());
}
