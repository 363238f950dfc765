//! kvgate-words: the simulated engines' word tokenizer. One whitespace-separated word is one
//! token, its id the 32-bit FNV-1a hash of the word's UTF-8 bytes ([`tokenize`], [`token_id`]);
//! the chat template ([`render_chat`]) renders each message as `<|role|> content ` in order, then
//! `<|assistant|>`, so successive turns of one conversation share a prefix.
//!
//! A leaf crate: the engine model (`kvgate-engine`), the gateway's mock tokenizer
//! (`kvgate-tokenizer`) and the trace's prompts (`kvgate-trace`) all compute the same ids
//! without the gateway linking the engine model.

/// Token id of one word: 32-bit FNV-1a of its UTF-8 bytes. Stable across runs and platforms.
pub fn token_id(word: &str) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for &byte in word.as_bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash
}

/// Splits `text` on Unicode whitespace; every word becomes one token (`token_id(word)`).
pub fn tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace().map(token_id).collect()
}

/// Number of tokens `tokenize(text)` would return, without allocating.
pub fn count_tokens(text: &str) -> usize {
    text.split_whitespace().count()
}

/// Renders a conversation with the simulated engines' chat template.
///
/// Every message becomes `<|role|> content ` in order, followed by `<|assistant|>`, so successive
/// turns of one conversation share their whole earlier rendering as a prefix.
pub fn render_chat<R: AsRef<str>, C: AsRef<str>>(messages: &[(R, C)]) -> String {
    let capacity = messages
        .iter()
        .map(|(role, content)| role.as_ref().len() + content.as_ref().len() + 6)
        .sum::<usize>()
        + 13;
    let mut rendered = String::with_capacity(capacity);
    for (role, content) in messages {
        rendered.push_str("<|");
        rendered.push_str(role.as_ref());
        rendered.push_str("|> ");
        rendered.push_str(content.as_ref());
        rendered.push(' ');
    }
    rendered.push_str("<|assistant|>");
    rendered
}

/// The splitmix64 finaliser: a cheap, well-mixing bijection on u64.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_word_one_token() {
        assert_eq!(tokenize("  hello   world\nagain\t"), tokenize("hello world again"));
        assert_eq!(tokenize("hello world again").len(), 3);
        assert_eq!(count_tokens(" a b  c "), 3);
        assert!(tokenize(" \n ").is_empty());
        // FNV-1a 32 reference values.
        assert_eq!(token_id(""), 0x811c_9dc5);
        assert_eq!(token_id("a"), 0xe40c_292c);
        assert_ne!(token_id("hello"), token_id("world"));
    }

    #[test]
    fn chat_turns_share_a_prefix() {
        let first = render_chat(&[("system", "be brief"), ("user", "hi there")]);
        assert_eq!(first, "<|system|> be brief <|user|> hi there <|assistant|>");
        let second = render_chat(&[
            ("system", "be brief"),
            ("user", "hi there"),
            ("assistant", "hello"),
            ("user", "more"),
        ]);
        let first_tokens = tokenize(&first);
        let second_tokens = tokenize(&second);
        assert_eq!(first_tokens[..first_tokens.len() - 1], second_tokens[..first_tokens.len() - 1]);
    }
}
