//! kvgate-words: the simulated engines' word tokenizer. One whitespace-separated word is one
//! token, its id the 32-bit FNV-1a hash of the word's UTF-8 bytes ([`tokenize`], [`token_id`]).
//! Their chat template is the one chat rendering, `kvgate_protocol::render_chat`.
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
}
