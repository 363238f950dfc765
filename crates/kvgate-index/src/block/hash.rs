//! kvgate's block content hash (xxh3 of a block's token ids, seeded with its parent's hash) and
//! the pass-through hasher for maps keyed by such hashes.

use std::hash::Hasher;

/// The "parent" of a prompt's first block.
pub const ROOT_HASH: u64 = 0x6b76_6761_7465_5f30;

/// Content hash of one KV block: xxh3-64 of its token ids (native byte order) seeded with the
/// parent block's content hash ([`ROOT_HASH`] for the first block). The same tokens under the
/// same prefix always give the same hash, whatever engine stored them.
#[inline]
pub fn content_hash(parent: u64, tokens: &[u32]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(bytemuck::cast_slice(tokens), parent)
}

/// Hasher for keys that are already well-mixed 64-bit hashes.
#[derive(Default)]
pub(crate) struct PreHashed(u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not used by u64 keys; a plain fold keeps it correct for anything else.
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
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
