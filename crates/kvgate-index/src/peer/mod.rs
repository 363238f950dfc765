//! What other gateway replicas routed: the block-hash side index of the approximate mode across
//! replicas. A replica publishes, for each request it routes, the chained hashes of the prompt's
//! fixed-size blocks and the chosen worker; its peers apply those records here and consult this
//! index together with their own tree ([`PeerMerged`]), so each replica's approximate view
//! reflects what every replica routed. Memory is bounded (least recently used blocks go first).

mod hashes;
mod merged;

use std::sync::Mutex;

use smallvec::SmallVec;

use crate::TenantId;

pub use hashes::{prompt_blocks, prompt_hash, PromptBlocks, TEXT_BLOCK_BYTES};
pub use merged::{PeerMerged, ReadOnlyTree};

/// The workers peers routed one block to.
type Holders = SmallVec<[TenantId; 4]>;

/// Blocks peers routed, keyed by chained block hash, bounded by a block count (LRU). Nothing is
/// allocated before the first record.
#[derive(Debug)]
pub struct PeerBlocks {
    blocks: Mutex<lru::LruCache<u64, Holders>>,
    max_blocks: usize,
}

impl PeerBlocks {
    /// An index keeping at most `max_blocks` blocks (at least one).
    pub fn new(max_blocks: usize) -> Self {
        Self { blocks: Mutex::new(lru::LruCache::unbounded()), max_blocks: max_blocks.max(1) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, lru::LruCache<u64, Holders>> {
        self.blocks.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A peer routed the prompt of chained block hashes `hashes` to `tenant`. The blocks
    /// become the most recently used.
    pub fn record(&self, hashes: &[u64], tenant: TenantId) {
        let mut blocks = self.lock();
        for &hash in hashes {
            let holders = blocks.get_or_insert_mut(hash, Holders::new);
            if !holders.contains(&tenant) {
                holders.push(tenant);
            }
        }
        while blocks.len() > self.max_blocks {
            blocks.pop_lru();
        }
    }

    /// Leading blocks of `hashes` each tenant holds (consecutive from the first), as
    /// `(tenant, blocks)` sorted by tenant; tenants holding none are left out.
    pub fn leading_blocks(&self, hashes: &[u64]) -> Vec<(TenantId, usize)> {
        let mut blocks = self.lock();
        let mut alive: Vec<(TenantId, usize)> = Vec::new();
        for (position, hash) in hashes.iter().enumerate() {
            let Some(holders) = blocks.get(hash) else { break };
            if position == 0 {
                alive.extend(holders.iter().map(|&tenant| (tenant, 1)));
                alive.sort_unstable();
                continue;
            }
            let mut extended = false;
            for entry in alive.iter_mut().filter(|entry| entry.1 == position) {
                if holders.contains(&entry.0) {
                    entry.1 += 1;
                    extended = true;
                }
            }
            if !extended {
                break;
            }
        }
        alive
    }

    /// A worker left for good: forget its blocks.
    pub fn remove_tenant(&self, tenant: TenantId) {
        let mut blocks = self.lock();
        let mut emptied = Vec::new();
        for (hash, holders) in blocks.iter_mut() {
            holders.retain(|held_by| *held_by != tenant);
            if holders.is_empty() {
                emptied.push(*hash);
            }
        }
        for hash in emptied {
            blocks.pop(&hash);
        }
    }

    /// Blocks currently kept.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
