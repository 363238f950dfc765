//! The simulated engines' KV block hash, chained over the parent block's hash; the word
//! tokenizer itself is `kvgate-words` (re-exported by the crate).

use kvgate_words::splitmix64;

use crate::events::LoraAdapter;

const ROOT_BLOCK_SEED: u64 = 0x6b76_6761_7465_0001;

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

#[cfg(test)]
mod tests {
    use super::*;

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
