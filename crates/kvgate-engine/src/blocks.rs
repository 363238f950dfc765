//! The KV block pool: capacity accounting, the prefix cache keyed by chained block hash, and LRU eviction of unreferenced cached blocks.

use std::collections::hash_map::Entry;
use std::collections::BTreeMap;

use nohash_hasher::IntMap;

/// Blocks are counted, not placed: a block is either free, held privately by one request
/// (computing or generated tokens), or cached under its hash. Cached blocks carry a reference
/// count; those with no reference are evictable and ordered least-recently-released first.
#[derive(Debug)]
pub(crate) struct BlockPool {
    capacity_blocks: u64,
    private_blocks: u64,
    /// Keyed by chained block hashes, well mixed already: no hashing of the key.
    cached: IntMap<u64, CachedBlock>,
    /// Evictable blocks by release stamp (oldest first) -> block hash.
    lru: BTreeMap<u64, u64>,
    next_stamp: u64,
}

#[derive(Clone, Copy, Debug)]
struct CachedBlock {
    refs: u32,
    /// Key in `lru` while `refs == 0`.
    stamp: u64,
}

impl BlockPool {
    pub(crate) fn new(capacity_blocks: u64) -> Self {
        Self {
            capacity_blocks,
            private_blocks: 0,
            cached: IntMap::default(),
            lru: BTreeMap::new(),
            next_stamp: 0,
        }
    }

    pub(crate) fn capacity_blocks(&self) -> u64 {
        self.capacity_blocks
    }

    /// Blocks neither cached nor held by a request.
    pub(crate) fn free_blocks(&self) -> u64 {
        self.capacity_blocks - self.private_blocks - self.cached.len() as u64
    }

    /// Blocks in the prefix cache (referenced or not).
    pub(crate) fn cached_blocks(&self) -> u64 {
        self.cached.len() as u64
    }

    /// Cached blocks that no request references.
    pub(crate) fn evictable_blocks(&self) -> u64 {
        self.lru.len() as u64
    }

    /// Blocks held by requests, privately or through a cache reference.
    pub(crate) fn used_blocks(&self) -> u64 {
        self.private_blocks + self.cached.len() as u64 - self.lru.len() as u64
    }

    /// How many leading hashes of `hashes` are in the cache.
    pub(crate) fn match_prefix(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|hash| self.cached.contains_key(hash)).count()
    }

    /// References the cached blocks `matched` and takes `new_blocks` private blocks, evicting
    /// LRU-first as needed (evicted hashes are appended to `evicted`). Does nothing and returns
    /// false when the blocks are not available.
    pub(crate) fn try_allocate(&mut self, matched: &[u64], new_blocks: u64, evicted: &mut Vec<u64>) -> bool {
        let matched_evictable =
            matched.iter().filter(|hash| self.cached.get(hash).is_some_and(|block| block.refs == 0)).count()
                as u64;
        let available = self.free_blocks() + self.evictable_blocks() - matched_evictable;
        if available < new_blocks {
            return false;
        }
        for &hash in matched {
            self.acquire(hash);
        }
        while self.free_blocks() < new_blocks {
            let (_, hash) = self.lru.pop_first().expect("availability was checked above");
            self.cached.remove(&hash);
            evicted.push(hash);
        }
        self.private_blocks += new_blocks;
        true
    }

    /// Moves one of the caller's private blocks into the cache under `hash`, referenced once.
    /// If `hash` is already cached the private block is freed and the cached one referenced
    /// instead. Returns true when `hash` was newly inserted.
    pub(crate) fn store(&mut self, hash: u64) -> bool {
        debug_assert!(self.private_blocks > 0);
        self.private_blocks -= 1;
        match self.cached.entry(hash) {
            Entry::Vacant(vacant) => {
                vacant.insert(CachedBlock { refs: 1, stamp: 0 });
                true
            }
            Entry::Occupied(_) => {
                self.acquire(hash);
                false
            }
        }
    }

    /// Drops one reference to each of `referenced` (last block first, so a prompt's tail is
    /// evicted before its head) and frees `private` private blocks.
    pub(crate) fn release(&mut self, referenced: &[u64], private: u64) {
        for &hash in referenced.iter().rev() {
            let block = self.cached.get_mut(&hash).expect("a referenced block stays cached");
            debug_assert!(block.refs > 0);
            block.refs -= 1;
            if block.refs == 0 {
                block.stamp = self.next_stamp;
                self.lru.insert(self.next_stamp, hash);
                self.next_stamp += 1;
            }
        }
        debug_assert!(self.private_blocks >= private);
        self.private_blocks -= private;
    }

    /// Empties the cache if no cached block is referenced; returns whether it did.
    pub(crate) fn clear_if_unreferenced(&mut self) -> bool {
        if self.lru.len() != self.cached.len() {
            return false;
        }
        self.cached.clear();
        self.lru.clear();
        true
    }

    fn acquire(&mut self, hash: u64) {
        let block = self.cached.get_mut(&hash).expect("only cached blocks are acquired");
        if block.refs == 0 {
            self.lru.remove(&block.stamp);
        }
        block.refs += 1;
    }

    /// Panics if the accounting is inconsistent (tests only).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        assert!(self.private_blocks + self.cached.len() as u64 <= self.capacity_blocks);
        let unreferenced = self.cached.values().filter(|b| b.refs == 0).count();
        assert_eq!(unreferenced, self.lru.len());
        for (stamp, hash) in &self.lru {
            let block = self.cached[hash];
            assert_eq!((block.refs, block.stamp), (0, *stamp));
        }
    }
}

/// The block hashes of the prompts queued or prefilling in an engine, counted: blocks that will
/// be cached by the time a request submitted now starts its prefill (prefills run in order).
#[derive(Debug, Default)]
pub(crate) struct PendingBlocks {
    counts: IntMap<u64, u32>,
}

impl PendingBlocks {
    pub(crate) fn add(&mut self, hashes: &[u64]) {
        for &hash in hashes {
            *self.counts.entry(hash).or_insert(0) += 1;
        }
    }

    pub(crate) fn remove(&mut self, hashes: &[u64]) {
        for hash in hashes {
            if let Entry::Occupied(mut entry) = self.counts.entry(*hash) {
                *entry.get_mut() -= 1;
                if *entry.get() == 0 {
                    entry.remove();
                }
            }
        }
    }

    /// Leading hashes of `hashes` cached in `pool` or pending here.
    pub(crate) fn match_prefix(&self, pool: &BlockPool, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|hash| pool.cached.contains_key(hash) || self.counts.contains_key(hash))
            .count()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_store_release_evict() {
        let mut pool = BlockPool::new(4);
        let mut evicted = Vec::new();
        assert!(pool.try_allocate(&[], 3, &mut evicted));
        assert!(pool.store(10));
        assert!(pool.store(11));
        assert_eq!((pool.free_blocks(), pool.used_blocks()), (1, 3));
        pool.release(&[10, 11], 1);
        assert_eq!((pool.free_blocks(), pool.evictable_blocks()), (2, 2));
        assert_eq!(pool.used_blocks(), 0);
        // Matching 10 pins it; needing 3 new blocks evicts 11 (the tail, released first).
        assert_eq!(pool.match_prefix(&[10, 11]), 2);
        assert!(pool.try_allocate(&[10], 3, &mut evicted));
        assert_eq!(evicted, [11]);
        assert_eq!(pool.free_blocks(), 0);
        assert!(!pool.try_allocate(&[], 1, &mut evicted));
        pool.check_invariants();
    }

    #[test]
    fn storing_a_duplicate_frees_the_private_block() {
        let mut pool = BlockPool::new(4);
        let mut evicted = Vec::new();
        assert!(pool.try_allocate(&[], 1, &mut evicted));
        assert!(pool.try_allocate(&[], 1, &mut evicted));
        assert!(pool.store(7));
        assert!(!pool.store(7));
        assert_eq!((pool.used_blocks(), pool.free_blocks()), (1, 3));
        pool.release(&[7], 0);
        assert_eq!(pool.used_blocks(), 1);
        assert!(!pool.clear_if_unreferenced());
        pool.release(&[7], 0);
        assert!(pool.clear_if_unreferenced());
        assert_eq!(pool.free_blocks(), 4);
        pool.check_invariants();
    }
}
