//! A prompt as replicas exchange it: the chained hashes of its whole fixed-size blocks (token
//! ids in blocks of the tree's block size, or text in blocks of [`TEXT_BLOCK_BYTES`] bytes).

use crate::block::{content_hash, ROOT_HASH};
use crate::PromptKey;

/// Text prompts are exchanged in blocks of this many UTF-8 bytes.
pub const TEXT_BLOCK_BYTES: usize = 256;

/// The parent hash of a text prompt's first block (token prompts use [`ROOT_HASH`]), so that a
/// text block never collides with a token block by construction.
const TEXT_ROOT_HASH: u64 = ROOT_HASH ^ 0x7465_7874;

/// A prompt's whole blocks as chained hashes: block `i`'s hash covers elements `0..(i+1) *
/// block_len`, so equal hashes mean equal prefixes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptBlocks {
    pub hashes: Vec<u64>,
    /// Elements (bytes or token ids) per block.
    pub block_len: usize,
}

/// The whole blocks of `key` (a trailing partial block is left out). `token_block_size` is the
/// approximate tree's block size for token prompts.
pub fn prompt_blocks(key: PromptKey<'_>, token_block_size: usize) -> PromptBlocks {
    match key {
        PromptKey::Text(text) => {
            let hashes =
                chain(text.as_bytes().chunks_exact(TEXT_BLOCK_BYTES), TEXT_ROOT_HASH, |parent, block| {
                    xxhash_rust::xxh3::xxh3_64_with_seed(block, parent)
                });
            PromptBlocks { hashes, block_len: TEXT_BLOCK_BYTES }
        }
        PromptKey::Tokens(ids) => {
            let block_len = token_block_size.max(1);
            let hashes = chain(ids.chunks_exact(block_len), ROOT_HASH, content_hash);
            PromptBlocks { hashes, block_len }
        }
    }
}

fn chain<'a, T: 'a>(
    blocks: impl Iterator<Item = &'a [T]>,
    root: u64,
    hash: impl Fn(u64, &[T]) -> u64,
) -> Vec<u64> {
    let mut parent = root;
    blocks
        .map(|block| {
            parent = hash(parent, block);
            parent
        })
        .collect()
}

/// One hash of the whole prompt (xxh3 of its bytes or token ids), e.g. to seed a tie-break that
/// every replica computes alike for the same request.
pub fn prompt_hash(key: PromptKey<'_>) -> u64 {
    match key {
        PromptKey::Text(text) => xxhash_rust::xxh3::xxh3_64_with_seed(text.as_bytes(), TEXT_ROOT_HASH),
        PromptKey::Tokens(ids) => content_hash(ROOT_HASH, ids),
    }
}
