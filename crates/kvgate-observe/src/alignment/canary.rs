//! The probe's canary prompts: a random salt first (no engine holds the prompt yet, and no
//! client request shares its blocks), then fixed text. The completion's is filled to
//! [`COMPLETION_TOKENS`] tokens when the tokenizer allows it, a whole number of blocks for every
//! power-of-two block size up to that, so the last-token rule shows; the chat's is a system
//! message and a question (the system message is where a content-format mismatch shows: a
//! template printing a list of parts renders it otherwise).

use serde_json::{json, Value};

/// Tokens of the completion's prompt: 8 blocks of 16, 4 of 32.
pub const COMPLETION_TOKENS: usize = 128;

/// Words the completion is filled with: short and common, most of them one token in any
/// vocabulary, so the fill can end on the exact length.
const FILL: [&str; 24] = [
    "the", "cache", "of", "a", "route", "is", "kept", "by", "an", "engine", "and", "its", "blocks", "go",
    "to", "one", "worker", "at", "a", "time", "so", "it", "is", "on",
];

const SYSTEM: &str = "You are the gateway's alignment probe. Answer with one word.";
const QUESTION: &str = "Which worker holds the prefix of this conversation, and how many of its blocks \
    does the engine serve from its cache when the same prompt comes back a second time? Count the \
    blocks, then answer with the count alone.";

/// A salt of `bits` (random, from the caller): two words no client sends.
pub fn salt(bits: u64) -> String {
    format!("kvgate-probe {bits:016x}")
}

/// The completion prompt after `salt`, filled word by word towards `target` tokens as
/// `encode` counts them (`None`: it could not); returns the text and its length. Stops short
/// when no word fits the last tokens (the length is then whatever it reached).
pub fn fill(salt: &str, target: usize, encode: impl Fn(&str) -> Option<usize>) -> Option<(String, usize)> {
    let mut text = salt.to_string();
    let mut length = encode(&text)?;
    let mut next = 0;
    while length < target {
        // The first fill word (in turn) that keeps the prompt within the target.
        let fitting = (0..FILL.len()).map(|k| FILL[(next + k) % FILL.len()]).find_map(|word| {
            let candidate = format!("{text} {word}");
            let candidate_length = encode(&candidate)?;
            (candidate_length > length && candidate_length <= target).then_some((candidate, candidate_length))
        });
        let Some((candidate, candidate_length)) = fitting else { break };
        (text, length) = (candidate, candidate_length);
        next += 1;
    }
    Some((text, length))
}

/// The completion request's body.
pub fn completion_body(model: &str, prompt: &str, dp_rank: Option<u32>) -> Value {
    with_rank(json!({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}), dp_rank)
}

/// The chat request's body, its system message after `salt`.
pub fn chat_body(model: &str, salt: &str, dp_rank: Option<u32>) -> Value {
    let messages = json!([
        {"role": "system", "content": format!("{salt} {SYSTEM}")},
        {"role": "user", "content": QUESTION},
    ]);
    with_rank(json!({"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}), dp_rank)
}

/// A data-parallel rank's request names its rank (`--dp-aware`), as the proxy's do.
fn with_rank(mut body: Value, dp_rank: Option<u32>) -> Value {
    if let Some(rank) = dp_rank {
        body["data_parallel_rank"] = json!(rank);
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Option<usize> {
        Some(text.split_whitespace().count())
    }

    #[test]
    fn the_fill_reaches_the_target_exactly_when_words_allow() {
        let (text, length) = fill(&salt(7), 128, words).unwrap();
        assert_eq!((length, words(&text)), (128, Some(128)));
        assert!(text.starts_with("kvgate-probe 0000000000000007 the cache"), "{text}");
        // A tokenizer splitting every word of 5+ letters in two, and counting a start token.
        let split = |text: &str| {
            Some(1 + text.split_whitespace().map(|w| if w.len() >= 5 { 2 } else { 1 }).sum::<usize>())
        };
        let (text, length) = fill(&salt(7), 128, split).unwrap();
        assert_eq!((length, split(&text)), (128, Some(128)));
        // Nothing fits the last token: it stops short.
        let pairs = |text: &str| Some(2 * text.split_whitespace().count());
        assert_eq!(fill("a", 5, pairs).unwrap().1, 4);
        assert_eq!(fill("a", 5, |_| None), None);
    }

    #[test]
    fn bodies_ask_for_one_token_and_name_the_rank() {
        let body = completion_body("m", "p", Some(2));
        assert_eq!((body["max_tokens"].as_u64(), body["data_parallel_rank"].as_u64()), (Some(1), Some(2)));
        let chat = chat_body("m", "kvgate-probe 01", None);
        assert!(chat["messages"][0]["content"].as_str().unwrap().starts_with("kvgate-probe 01 "));
        assert!(chat.get("data_parallel_rank").is_none());
    }
}
