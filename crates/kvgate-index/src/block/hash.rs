//! kvgate's block content hash: xxh3 of a block's token ids, seeded with its parent's hash.

/// The "parent" of a prompt's first block.
pub const ROOT_HASH: u64 = 0x6b76_6761_7465_5f30;

/// Content hash of one KV block: xxh3-64 of its token ids (native byte order) seeded with the
/// parent block's content hash ([`ROOT_HASH`] for the first block). The same tokens under the
/// same prefix always give the same hash, whatever engine stored them.
#[inline]
pub fn content_hash(parent: u64, tokens: &[u32]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(bytemuck::cast_slice(tokens), parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_and_content_addressed() {
        let tokens: Vec<u32> = (0..32).collect();
        let first = content_hash(ROOT_HASH, &tokens[..16]);
        assert_eq!(first, content_hash(ROOT_HASH, &(0..16).collect::<Vec<u32>>()));
        let second = content_hash(first, &tokens[16..]);
        assert_ne!(second, content_hash(ROOT_HASH, &tokens[16..]), "the parent is part of the hash");
        assert_ne!(first, content_hash(ROOT_HASH, &tokens[..15]));
    }
}
