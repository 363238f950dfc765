//! kvgate's block content hash: xxh3 of a block's token ids chained on its parent's hash, and
//! the chain roots that keep the blocks of one adapter, salt, KV-cache group or lookahead layout
//! apart from everyone else's.

/// The "parent" of a base-model prompt's first block (group 0, no salt, no lookahead).
pub const ROOT_HASH: u64 = 0x6b76_6761_7465_5f30;

/// Content hash of one KV block: xxh3-64 of its token ids (native byte order) seeded with the
/// parent block's content hash ([`ROOT_HASH`] for the first block). The same tokens under the
/// same prefix always give the same hash, whatever engine stored them.
#[inline]
pub fn content_hash(parent: u64, tokens: &[u32]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(bytemuck::cast_slice(tokens), parent)
}

/// The block index's content hash of a block: xxh3-64 of its token ids alone, then chained on
/// the parent's content hash by a multiply, rotate and xor ([`chain_step`]). The blocks' own
/// hashes do not depend on each other, so a long prompt's blocks are hashed in parallel by the
/// CPU and only the short chaining step is serial (seeding each block's xxh3 with its parent
/// made hashing a 4,096-block prompt latency-bound: 2.2x slower; an xxh3 of the 8-byte digest
/// as the chaining step cost a third of the time of a query from tokens, `benches/dynamo-index`).
/// It also covers the `lookahead` tokens after the block (EAGLE:
/// vLLM's `lookahead_token_ids`, SGLang's bigram pages), and `opaque`, a digest of extra keys
/// kvgate cannot reproduce from a request (multimodal items; 0: none).
#[inline]
pub fn block_content(parent: u64, tokens: &[u32], lookahead: &[u32], opaque: u64) -> u64 {
    let own = xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(tokens));
    let mut hash = chain_step(parent, own);
    if !lookahead.is_empty() {
        hash = content_hash(hash ^ LOOKAHEAD_MIX, lookahead);
    }
    if opaque != 0 {
        hash = xxhash_rust::xxh3::xxh3_64_with_seed(&opaque.to_le_bytes(), hash ^ OPAQUE_MIX);
    }
    hash
}

/// Appends to `out` the chained content hashes of `tokens`' whole blocks of `block_size` tokens
/// (no lookahead, no opaque keys), the first chained on `parent`: the values of
/// [`block_content`] in a loop. The common block sizes get loops of their own, where xxh3's
/// dispatch on the input's length folds away (with the size only known at run time a query
/// from tokens spent about a third more on hashing, `benches/dynamo-index`'s `HASH` lines).
pub(crate) fn extend_chain<E: Extend<u64>>(out: &mut E, parent: u64, tokens: &[u32], block_size: usize) {
    match block_size {
        16 => extend_fixed::<16, E>(out, parent, tokens),
        32 => extend_fixed::<32, E>(out, parent, tokens),
        64 => extend_fixed::<64, E>(out, parent, tokens),
        0 => {}
        _ => {
            let mut parent = parent;
            out.extend(tokens.chunks_exact(block_size).map(|block| {
                parent = block_content(parent, block, &[], 0);
                parent
            }));
        }
    }
}

#[inline(always)]
fn extend_fixed<const N: usize, E: Extend<u64>>(out: &mut E, mut parent: u64, tokens: &[u32]) {
    let (blocks, _) = tokens.as_chunks::<N>();
    out.extend(blocks.iter().map(|block| {
        parent = block_content(parent, block, &[], 0);
        parent
    }));
}

/// Chains a block's own digest (xxh3, uniformly distributed) on its parent's content hash: the
/// parent is multiplied by an odd constant and rotated (a bijection), then xored in, so the
/// result is as uniform as the digest, two chains differing in their parents differ here, and
/// the serial part of hashing a chain is one multiply per block.
#[inline]
fn chain_step(parent: u64, own: u64) -> u64 {
    own ^ parent.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29)
}

const LOOKAHEAD_MIX: u64 = 0x6c6f_6f6b_6168_6561;
const OPAQUE_MIX: u64 = 0x6f70_6171_7565_6b65;

/// Whose blocks a chain holds: the base model's or one LoRA adapter's, with or without a cache
/// salt. A request only matches blocks of its own namespace (vLLM and SGLang hash both in).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Namespace<'a> {
    pub adapter: Option<Adapter<'a>>,
    /// The request's `cache_salt` (vLLM, SGLang): its blocks are only ever shared with requests
    /// carrying the same salt.
    pub cache_salt: Option<&'a str>,
}

/// A LoRA adapter as an engine names its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Adapter<'a> {
    /// `lora_name` (vLLM 0.2x on, SGLang): the name requests use as their `model`.
    Name(&'a str),
    /// Only `lora_id` (vLLM 0.10): an integer no request names, so those blocks match nothing.
    Id(i64),
}

impl<'a> Namespace<'a> {
    pub const BASE: Namespace<'static> = Namespace { adapter: None, cache_salt: None };

    /// The namespace of requests for `adapter` (a model name that is a LoRA adapter).
    pub fn adapter(name: &'a str) -> Self {
        Namespace { adapter: Some(Adapter::Name(name)), cache_salt: None }
    }

    pub fn with_salt(self, cache_salt: Option<&'a str>) -> Self {
        Namespace { cache_salt, ..self }
    }
}

/// Where a block's chain hangs: one root per namespace, KV-cache group and lookahead length, so
/// that chains of different kinds never share a key in the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainRoot<'a> {
    pub namespace: Namespace<'a>,
    pub group: u32,
    pub lookahead: u32,
}

impl ChainRoot<'_> {
    /// The parent hash of the chain's first block; [`ROOT_HASH`] for the base model's group 0.
    pub fn hash(&self) -> u64 {
        let ns = self.namespace;
        if ns.adapter.is_none() && ns.cache_salt.is_none() && self.group == 0 && self.lookahead == 0 {
            return ROOT_HASH;
        }
        // A length-prefixed rendering: no two roots write the same bytes.
        let mut bytes = Vec::with_capacity(64);
        bytes.extend_from_slice(&self.group.to_le_bytes());
        bytes.extend_from_slice(&self.lookahead.to_le_bytes());
        let mut text = |tag: u8, value: &[u8]| {
            bytes.push(tag);
            bytes.extend_from_slice(&(value.len() as u64).to_le_bytes());
            bytes.extend_from_slice(value);
        };
        match ns.adapter {
            None => {}
            Some(Adapter::Name(name)) => text(b'n', name.as_bytes()),
            Some(Adapter::Id(id)) => text(b'i', &id.to_le_bytes()),
        }
        if let Some(salt) = ns.cache_salt {
            text(b's', salt.as_bytes());
        }
        xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, ROOT_HASH)
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
        let block = block_content(ROOT_HASH, &tokens[..16], &[], 0);
        let next = block_content(block, &tokens[16..], &[], 0);
        assert_eq!(block, block_content(ROOT_HASH, &(0..16).collect::<Vec<u32>>(), &[], 0));
        assert_ne!(next, block_content(ROOT_HASH, &tokens[16..], &[], 0), "the parent is part of it");
        assert_ne!(block, block_content(ROOT_HASH, &tokens[..15], &[], 0));
        assert_ne!(block_content(block, &tokens[16..], &[32], 0), next, "the lookahead is part of it");
        assert_ne!(block_content(block, &tokens[16..], &[], 7), next, "and so are opaque keys");
    }

    #[test]
    fn the_specialised_chains_give_block_contents_values() {
        let tokens: Vec<u32> = (0..64 * 9 + 5u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        for block_size in [1, 3, 16, 32, 64] {
            let mut parent = ROOT_HASH;
            let expected: Vec<u64> = tokens
                .chunks_exact(block_size)
                .map(|block| {
                    parent = block_content(parent, block, &[], 0);
                    parent
                })
                .collect();
            let mut got = Vec::new();
            extend_chain(&mut got, ROOT_HASH, &tokens, block_size);
            assert_eq!(got, expected, "block size {block_size}");
        }
        let mut none: Vec<u64> = Vec::new();
        extend_chain(&mut none, ROOT_HASH, &tokens, 0);
        assert!(none.is_empty());
    }

    #[test]
    fn every_namespace_group_and_layout_has_its_own_root() {
        let root = |adapter, cache_salt, group, lookahead| {
            ChainRoot { namespace: Namespace { adapter, cache_salt }, group, lookahead }.hash()
        };
        let roots = [
            root(None, None, 0, 0),
            root(Some(Adapter::Name("sql")), None, 0, 0),
            root(Some(Adapter::Name("sq")), Some("l"), 0, 0),
            root(Some(Adapter::Id(7)), None, 0, 0),
            root(None, Some("sql"), 0, 0),
            root(None, None, 1, 0),
            root(None, None, 0, 1),
        ];
        assert_eq!(roots[0], ROOT_HASH);
        for (i, a) in roots.iter().enumerate() {
            for b in &roots[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
