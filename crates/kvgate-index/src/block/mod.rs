//! The exact prefix index: which engine caches hold which KV block, fed by the engines' own KV
//! events and queried concurrently by the request path.
//!
//! A block is named by kvgate's own **content hash**, chained over its parent's content hash and
//! its token ids ([`content_hash`]), so the index does not depend on an engine's hash seed and
//! two gateways fed the same events hold the same keys. The map from content hash to holders is
//! split into shards, each behind its own `RwLock`: a query takes one shard's read lock per
//! block, a writer one shard's write lock per block, so queries never wait behind a whole event
//! batch, only (rarely) behind one block's update in the same shard.
//!
//! Writers are [`CacheBlocks`]: one per engine cache (worker and data-parallel rank), owned by
//! whoever feeds that cache's events; dropping it removes the cache's blocks from the index.

mod cache;
mod hash;
mod pending;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, RwLock};

use nohash_hasher::IntMap;
use smallvec::SmallVec;

pub use cache::{ApplyError, CacheBlocks, StoredBlocks};
pub use hash::{content_hash, ROOT_HASH};
pub use pending::{InFlightBlocks, InFlightPrompt, IN_FLIGHT_RANK};

use crate::matching::PrefixMatch;
use crate::TenantId;

/// One engine cache: a worker and, for data-parallel engines, one of its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheId {
    pub worker: TenantId,
    pub rank: u32,
}

impl CacheId {
    /// Packed so that holder lists sort by worker, then rank.
    pub(crate) fn key(self) -> u64 {
        (u64::from(self.worker) << 32) | u64::from(self.rank)
    }

    pub(crate) fn worker_of(key: u64) -> TenantId {
        (key >> 32) as TenantId
    }
}

const SHARDS: usize = 64;

/// Caches holding one block, sorted by [`CacheId::key`].
type Holders = SmallVec<[u64; 2]>;
/// Block content hashes are well mixed already: no hashing of the key.
type Shard = IntMap<u64, Holders>;

/// The event-fed block index of one model. Create it in an `Arc`: each [`CacheBlocks`] keeps one.
#[derive(Debug)]
pub struct BlockIndex {
    shards: Box<[RwLock<Shard>]>,
    /// Tokens per block, learned from the first stored event (0 until then).
    block_size: AtomicU32,
    /// Distinct blocks held per cache key, refreshed after every applied event.
    sizes: Mutex<HashMap<u64, usize>>,
}

impl Default for BlockIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockIndex {
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
            block_size: AtomicU32::new(0),
            sizes: Mutex::new(HashMap::new()),
        }
    }

    /// Tokens per block (0 before the first stored block).
    pub fn block_size(&self) -> usize {
        self.block_size.load(Ordering::Relaxed) as usize
    }

    /// Per worker, how many leading tokens of `tokens` its engine caches hold (whole blocks; for a
    /// data-parallel worker, its best rank). `out.query_len()` is `tokens.len()`.
    pub fn overlap(&self, tokens: &[u32], out: &mut PrefixMatch) {
        out.reset(tokens.len());
        let block_size = self.block_size();
        if block_size == 0 {
            return;
        }
        // Caches still matching, and (cache, blocks matched) for those that stopped.
        let mut active: Holders = SmallVec::new();
        let mut stopped: SmallVec<[(u64, usize); 8]> = SmallVec::new();
        let mut parent = ROOT_HASH;
        let mut depth = 0;
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let hash = content_hash(parent, block);
            {
                let shard = self.shard(hash).read().unwrap_or_else(|p| p.into_inner());
                let holders = shard.get(&hash).map_or(&[][..], |h| h.as_slice());
                if i == 0 {
                    active.extend_from_slice(holders);
                } else {
                    active.retain(|key| {
                        let keep = holders.binary_search(key).is_ok();
                        if !keep {
                            stopped.push((*key, i));
                        }
                        keep
                    });
                }
            }
            if active.is_empty() {
                break;
            }
            depth = i + 1;
            parent = hash;
        }
        stopped.extend(active.iter().map(|&key| (key, depth)));
        stopped.sort_unstable();
        for group in stopped.chunk_by(|a, b| CacheId::worker_of(a.0) == CacheId::worker_of(b.0)) {
            let blocks = group.iter().map(|&(_, blocks)| blocks).max().unwrap_or(0);
            if blocks > 0 {
                out.push(CacheId::worker_of(group[0].0), blocks * block_size);
            }
        }
    }

    /// Distinct blocks held by a worker's caches (summed over its ranks).
    pub fn worker_blocks(&self, worker: TenantId) -> usize {
        let sizes = self.sizes.lock().unwrap_or_else(|p| p.into_inner());
        sizes.iter().filter(|(&key, _)| CacheId::worker_of(key) == worker).map(|(_, &n)| n).sum()
    }

    /// Distinct blocks in the index (held by at least one cache).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().unwrap_or_else(|p| p.into_inner()).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every (block, holders) pair, sorted: for tests comparing indexes.
    pub fn dump(&self) -> Vec<(u64, Vec<CacheId>)> {
        let mut all: Vec<(u64, Vec<CacheId>)> = Vec::new();
        for shard in self.shards.iter() {
            let shard = shard.read().unwrap_or_else(|p| p.into_inner());
            all.extend(shard.iter().map(|(&hash, holders)| {
                let ids = holders
                    .iter()
                    .map(|&key| CacheId { worker: CacheId::worker_of(key), rank: key as u32 })
                    .collect();
                (hash, ids)
            }));
        }
        all.sort_unstable();
        all
    }

    fn shard(&self, hash: u64) -> &RwLock<Shard> {
        &self.shards[self.shard_of(hash)]
    }

    /// The high bits pick the shard; the map inside uses the low bits.
    fn shard_of(&self, hash: u64) -> usize {
        (hash >> 58) as usize % SHARDS
    }

    /// Adopts `block_size` if none is known yet; false if another size is already known.
    fn accept_block_size(&self, block_size: u32) -> bool {
        match self.block_size.compare_exchange(0, block_size, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => true,
            Err(known) => known == block_size,
        }
    }

    /// Adds `key` to the block's holders; false if it held the block already.
    fn add_holder(&self, hash: u64, key: u64) -> bool {
        let mut shard = self.shard(hash).write().unwrap_or_else(|p| p.into_inner());
        let holders = shard.entry(hash).or_default();
        match holders.binary_search(&key) {
            Ok(_) => false,
            Err(at) => {
                holders.insert(at, key);
                true
            }
        }
    }

    fn remove_holder(&self, hash: u64, key: u64) {
        let mut shard = self.shard(hash).write().unwrap_or_else(|p| p.into_inner());
        if let Some(holders) = shard.get_mut(&hash) {
            if let Ok(at) = holders.binary_search(&key) {
                holders.remove(at);
            }
            if holders.is_empty() {
                shard.remove(&hash);
            }
        }
    }

    fn set_size(&self, key: u64, blocks: usize) {
        let mut sizes = self.sizes.lock().unwrap_or_else(|p| p.into_inner());
        if blocks == 0 {
            sizes.remove(&key);
        } else {
            sizes.insert(key, blocks);
        }
    }
}

#[cfg(test)]
mod tests;
