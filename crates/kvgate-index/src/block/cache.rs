//! One engine cache's side of the block index: the engine's own block hashes mapped to kvgate's
//! content hashes, per storage medium, applied to the shared index as stored and removed events
//! arrive.

use std::sync::Arc;

use nohash_hasher::IntMap;

use super::hash::{content_hash, ROOT_HASH};
use super::{BlockIndex, CacheId};

/// A `BlockStored` event, as the index needs it.
#[derive(Clone, Copy, Debug)]
pub struct StoredBlocks<'a> {
    /// The engine's hashes of the stored blocks, in prompt order.
    pub block_hashes: &'a [u64],
    /// The engine's hash of the block before the first one (`None`: the prompt's first block).
    pub parent_block_hash: Option<u64>,
    /// Tokens of all stored blocks, `block_size` per block.
    pub token_ids: &'a [u32],
    pub block_size: u32,
    /// Where the blocks live (`None` or `"GPU"`: the engine's main cache; e.g. `"CPU"`: an
    /// offload tier). A block counts as held while any medium holds it.
    pub medium: Option<&'a str>,
}

/// Why a stored event was not applied. The index is unchanged when one is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    #[error("{tokens} token ids do not fill {blocks} blocks of {block_size}")]
    TokenCount { tokens: usize, blocks: usize, block_size: u32 },
    #[error("block size {got} differs from the model's {known}")]
    BlockSizeMismatch { got: u32, known: usize },
    #[error("parent block {0:#x} is not in this cache's index (its store was missed or removed)")]
    UnknownParent(u64),
    #[error("{adding} new blocks would take the cache past its bound of {max} blocks ({held} held)")]
    OverCapacity { held: usize, adding: usize, max: usize },
}

#[derive(Clone, Copy, Debug)]
struct EngineBlock {
    content: u64,
    /// One bit per medium holding the block.
    media: u8,
}

/// The blocks one engine cache holds, as the index knows them. One writer per cache: whoever
/// applies that cache's events owns it. Dropping it removes the cache from the index.
#[derive(Debug)]
pub struct CacheBlocks {
    index: Arc<BlockIndex>,
    id: CacheId,
    key: u64,
    engine: IntMap<u64, EngineBlock>,
    /// Content hashes held through more than one engine hash: how many more (rare; an engine
    /// that hashes extra keys, e.g. a cache salt, names the same tokens twice).
    extra_refs: IntMap<u64, u32>,
    /// Distinct content hashes held.
    distinct: usize,
    /// Medium names seen, by bit; bit 0 is the main cache (`None` or "GPU").
    media: Vec<String>,
    /// Most engine blocks held: what the engine can hold, as its host knows it.
    max_blocks: usize,
}

impl CacheBlocks {
    /// The writer for cache `id` of `index`. Two writers for one cache would fight: keep one.
    pub fn new(index: Arc<BlockIndex>, id: CacheId) -> Self {
        Self {
            index,
            id,
            key: id.key(),
            engine: IntMap::default(),
            extra_refs: IntMap::default(),
            distinct: 0,
            media: Vec::new(),
            max_blocks: usize::MAX,
        }
    }

    /// Bounds the blocks this cache may hold (its engine's capacity, as the host knows it): a
    /// stored event that would take it past the bound is refused whole
    /// ([`ApplyError::OverCapacity`]). Blocks already held stay. Unbounded until set.
    pub fn set_max_blocks(&mut self, max_blocks: usize) {
        self.max_blocks = max_blocks;
    }

    pub fn id(&self) -> CacheId {
        self.id
    }

    pub fn index(&self) -> &Arc<BlockIndex> {
        &self.index
    }

    /// Distinct blocks (by content) this cache holds.
    pub fn len(&self) -> usize {
        self.distinct
    }

    pub fn is_empty(&self) -> bool {
        self.distinct == 0
    }

    /// Applies a `BlockStored` event. A block already held gains the medium.
    pub fn apply_stored(&mut self, stored: StoredBlocks<'_>) -> Result<(), ApplyError> {
        let block_size = stored.block_size;
        if block_size == 0 {
            return Err(ApplyError::ZeroBlockSize);
        }
        let blocks = stored.block_hashes.len();
        if stored.token_ids.len() != blocks * block_size as usize {
            return Err(ApplyError::TokenCount { tokens: stored.token_ids.len(), blocks, block_size });
        }
        let mut parent = match stored.parent_block_hash {
            None => ROOT_HASH,
            Some(engine_hash) => match self.engine.get(&engine_hash) {
                Some(block) => block.content,
                None => return Err(ApplyError::UnknownParent(engine_hash)),
            },
        };
        if self.engine.len().saturating_add(blocks) > self.max_blocks {
            let adding = stored.block_hashes.iter().filter(|hash| !self.engine.contains_key(hash)).count();
            if self.engine.len() + adding > self.max_blocks {
                let held = self.engine.len();
                return Err(ApplyError::OverCapacity { held, adding, max: self.max_blocks });
            }
        }
        if !self.index.accept_block_size(block_size) {
            return Err(ApplyError::BlockSizeMismatch { got: block_size, known: self.index.block_size() });
        }
        let bit = self.medium_bit(stored.medium);
        let chunks = stored.token_ids.chunks_exact(block_size as usize);
        for (&engine_hash, tokens) in stored.block_hashes.iter().zip(chunks) {
            let content = content_hash(parent, tokens);
            parent = content;
            match self.engine.get_mut(&engine_hash) {
                Some(block) if block.content == content => block.media |= bit,
                Some(_) => {
                    // The engine reused a hash for other content: the old block is gone.
                    self.forget(engine_hash);
                    self.hold(engine_hash, content, bit);
                }
                None => self.hold(engine_hash, content, bit),
            }
        }
        self.index.set_size(self.key, self.len());
        Ok(())
    }

    /// Applies a `BlockRemoved` event; returns how many of the hashes were unknown (ignored).
    pub fn apply_removed(&mut self, block_hashes: &[u64], medium: Option<&str>) -> usize {
        let bit = self.medium_bit(medium);
        let mut unknown = 0;
        for &engine_hash in block_hashes {
            match self.engine.get_mut(&engine_hash) {
                Some(block) => {
                    block.media &= !bit;
                    if block.media == 0 {
                        self.forget(engine_hash);
                    }
                }
                None => unknown += 1,
            }
        }
        self.index.set_size(self.key, self.len());
        unknown
    }

    /// Forgets every block of this cache (`AllBlocksCleared`, a gap in the event stream, an
    /// engine restart).
    pub fn clear(&mut self) {
        for block in self.engine.values() {
            // A content held twice is removed once; the second call finds nothing.
            self.index.remove_holder(block.content, self.key);
        }
        self.engine.clear();
        self.extra_refs.clear();
        self.distinct = 0;
        self.index.set_size(self.key, 0);
    }

    fn hold(&mut self, engine_hash: u64, content: u64, bit: u8) {
        self.engine.insert(engine_hash, EngineBlock { content, media: bit });
        if self.index.add_holder(content, self.key) {
            self.distinct += 1;
        } else {
            *self.extra_refs.entry(content).or_insert(0) += 1;
        }
    }

    fn forget(&mut self, engine_hash: u64) {
        let Some(block) = self.engine.remove(&engine_hash) else { return };
        match self.extra_refs.get_mut(&block.content) {
            Some(extra) => {
                *extra -= 1;
                if *extra == 0 {
                    self.extra_refs.remove(&block.content);
                }
            }
            None => {
                self.index.remove_holder(block.content, self.key);
                self.distinct -= 1;
            }
        }
    }

    /// The bit of a medium name; the main cache (`None`, "GPU") is bit 0, at most 8 media (the
    /// eighth and later share the last bit).
    fn medium_bit(&mut self, medium: Option<&str>) -> u8 {
        let name = match medium {
            None => return 1,
            Some(name) if name.eq_ignore_ascii_case("gpu") => return 1,
            Some(name) => name,
        };
        let position = match self.media.iter().position(|known| known == name) {
            Some(position) => position,
            None if self.media.len() < 7 => {
                self.media.push(name.to_string());
                self.media.len() - 1
            }
            None => 6,
        };
        1 << (position + 1)
    }
}

impl Drop for CacheBlocks {
    fn drop(&mut self) {
        self.clear();
    }
}
