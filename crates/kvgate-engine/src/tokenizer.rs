//! The simulated engines' tokenizer (one whitespace-separated word = one token), chat template and KV block hash.

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

const ROOT_BLOCK_SEED: u64 = 0x6b76_6761_7465_0001;

use crate::events::LoraAdapter;

/// Hash of one KV block: chained over the parent block's hash (`None` for the first block) and
/// the block's token ids. FxHash-style word mixing with a splitmix64 finaliser; stable across runs.
pub fn block_hash(parent_block_hash: Option<u64>, tokens: &[u32]) -> u64 {
    let mut hash = parent_block_hash.unwrap_or(ROOT_BLOCK_SEED);
    for &token in tokens {
        hash = (hash.rotate_left(5) ^ u64::from(token)).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    splitmix64(hash ^ tokens.len() as u64)
}

/// Hashes of every full block of `tokens`, each chained on the previous one.
pub fn prompt_block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    adapter_block_hashes(tokens, block_size, None)
}

/// The block hashes of a prompt for a LoRA adapter (`None`: the base model): an adapter's KV
/// differs from the base model's for the same tokens, so its chain has a root of its own (as
/// engines put the adapter into the block hash).
pub fn adapter_block_hashes(tokens: &[u32], block_size: usize, lora: Option<&LoraAdapter>) -> Vec<u64> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = lora.map(|lora| {
        let name =
            lora.name.bytes().fold(ROOT_BLOCK_SEED, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        splitmix64(name ^ u64::from(lora.id))
    });
    for block in tokens.chunks_exact(block_size.max(1)) {
        let hash = block_hash(parent, block);
        hashes.push(hash);
        parent = Some(hash);
    }
    hashes
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

    #[test]
    fn block_hashes_chain() {
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = prompt_block_hashes(&tokens, 16);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[0], block_hash(None, &tokens[..16]));
        assert_eq!(hashes[1], block_hash(Some(hashes[0]), &tokens[16..32]));
        // Same block content under a different parent hashes differently.
        assert_ne!(block_hash(None, &tokens[16..32]), hashes[1]);
    }
}
