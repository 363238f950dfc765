//! The exact prefix index: which engine caches hold which KV block, in which tiers, fed by the
//! engines' own KV events and queried concurrently by the request path.
//!
//! A block is named by kvgate's own **content hash**, chained over its parent's content hash and
//! its token ids ([`block_content`]), so the index does not depend on an engine's hash seed and
//! two gateways fed the same events hold the same keys. A chain starts at a root of its own per
//! namespace (base model or LoRA adapter, cache salt), KV-cache group and lookahead length
//! ([`ChainRoot`]), so an adapter's blocks only ever match that adapter's requests and a group's
//! removals never touch another group's blocks.
//!
//! The map from content hash to holders is split into shards, each behind its own `RwLock`: a
//! query takes one shard's read lock per block, a writer one shard's write lock per block, so
//! queries never wait behind a whole event batch, only (rarely) behind one block's update in the
//! same shard. Each holder entry carries the tiers the cache holds the block in, so a query can
//! credit a CPU or disk hit at its [`TierWeights`] weight.
//!
//! Writers are [`CacheBlocks`]: one per engine cache (worker and data-parallel rank), owned by
//! whoever feeds that cache's events; dropping it removes the cache's blocks from the index.

mod cache;
mod hash;
mod pending;
mod residency;

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};

use nohash_hasher::IntMap;
use smallvec::SmallVec;

pub use cache::{ApplyError, CacheBlocks, HeldBlock, StoredBlocks};
pub use hash::{block_content, content_hash, Adapter, ChainRoot, Namespace, ROOT_HASH};
pub use pending::{InFlightBlocks, InFlightPrompt, IN_FLIGHT_RANK};
pub use residency::{Residency, TierWeights};

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

/// How a query cuts a prompt into blocks: tokens per block, and tokens after each block that
/// its hash covers (EAGLE). Only the first KV-cache group's layouts are walked (vLLM lists full
/// attention first; a sliding-window or state group's blocks are held under their own keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Layout {
    pub block_size: u32,
    pub lookahead: u32,
}

/// Most layouts a query walks: a model has one or two; more is a misbehaving publisher.
pub const MAX_LAYOUTS: usize = 4;

/// Most distinct residencies per index (the bits of a holder's tier mask).
const MAX_RESIDENCIES: usize = 16;

/// One cache holding a block, with the tiers it holds it in (one bit per interned residency).
/// Queries use only the best weight among them, so a writer updates the mask when that weight
/// changes: it may lag behind a slower tier added or removed next to a faster one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) key: u64,
    pub(crate) tiers: u16,
}

/// Caches holding one block, sorted by [`CacheId::key`].
type Holders = SmallVec<[Holder; 2]>;
/// Block content hashes are well mixed already: no hashing of the key.
type Shard = IntMap<u64, Holders>;

/// The residencies seen, by bit, and each one's weight.
#[derive(Debug)]
struct Tiers {
    residencies: Vec<Residency>,
    weights: Vec<f64>,
}

/// The event-fed block index of one model. Create it in an `Arc`: each [`CacheBlocks`] keeps one.
#[derive(Debug)]
pub struct BlockIndex {
    shards: Box<[RwLock<Shard>]>,
    /// Group 0's layouts, in the order first seen.
    layouts: RwLock<Vec<Layout>>,
    tiers: RwLock<Tiers>,
    tier_weights: TierWeights,
    /// Distinct blocks held per cache key, refreshed after every applied event.
    sizes: Mutex<HashMap<u64, usize>>,
}

impl Default for BlockIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockIndex {
    /// An index crediting tiers at the default [`TierWeights`].
    pub fn new() -> Self {
        Self::with_tier_weights(TierWeights::default())
    }

    pub fn with_tier_weights(tier_weights: TierWeights) -> Self {
        let gpu = Residency::gpu();
        let tiers = Tiers { weights: vec![tier_weights.weight(&gpu.medium)], residencies: vec![gpu] };
        Self {
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
            layouts: RwLock::new(Vec::new()),
            tiers: RwLock::new(tiers),
            tier_weights,
            sizes: Mutex::new(HashMap::new()),
        }
    }

    pub fn tier_weights(&self) -> &TierWeights {
        &self.tier_weights
    }

    /// Tokens per block of the first layout seen (0 before the first stored block).
    pub fn block_size(&self) -> usize {
        self.layouts().first().map_or(0, |layout| layout.block_size as usize)
    }

    /// The layouts a query walks (group 0's), in the order first seen.
    pub fn layouts(&self) -> Vec<Layout> {
        self.layouts.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Per worker, how many leading tokens of `tokens` its engine caches hold in `namespace`
    /// (whole blocks; for a data-parallel worker, its best rank; over every layout, the best),
    /// and how many of them count once tiers are weighed ([`PrefixMatch::credited`]).
    /// `out.query_len()` is `tokens.len()`.
    pub fn overlap(&self, tokens: &[u32], namespace: Namespace<'_>, out: &mut PrefixMatch) {
        out.reset(tokens.len());
        let layouts: SmallVec<[Layout; MAX_LAYOUTS]> =
            self.layouts.read().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
        if layouts.is_empty() {
            return;
        }
        let tiers = self.tiers.read().unwrap_or_else(|p| p.into_inner());
        let weights = &tiers.weights;
        // (cache key, tokens matched, credited tokens) for every cache that matched anything.
        let mut reached: SmallVec<[(u64, usize, f64); 8]> = SmallVec::new();
        for layout in layouts {
            self.walk(tokens, namespace, layout, weights, &mut reached);
        }
        drop(tiers);
        // Per worker: the best cache (rank, layout) by matched tokens, then by credit.
        reached.sort_unstable_by_key(|a| a.0);
        for group in reached.chunk_by(|a, b| CacheId::worker_of(a.0) == CacheId::worker_of(b.0)) {
            let best = group
                .iter()
                .copied()
                .max_by(|a, b| a.1.cmp(&b.1).then(a.2.total_cmp(&b.2)))
                .expect("chunks are not empty");
            if best.1 > 0 {
                out.push_credited(CacheId::worker_of(best.0), best.1, best.2.round() as usize);
            }
        }
    }

    /// One layout's walk: appends (cache, matched tokens, credit) for every cache it reached.
    fn walk(
        &self,
        tokens: &[u32],
        namespace: Namespace<'_>,
        layout: Layout,
        weights: &[f64],
        reached: &mut SmallVec<[(u64, usize, f64); 8]>,
    ) {
        let (block_size, lookahead) = (layout.block_size as usize, layout.lookahead as usize);
        let blocks = tokens.len().saturating_sub(lookahead) / block_size.max(1);
        let mut parent = ChainRoot { namespace, group: 0, lookahead: layout.lookahead }.hash();
        // Caches still matching, with their credit so far.
        let mut active: SmallVec<[(u64, f64); 4]> = SmallVec::new();
        for i in 0..blocks {
            let start = i * block_size;
            let block = &tokens[start..start + block_size];
            let after = &tokens[start + block_size..start + block_size + lookahead];
            let hash = block_content(parent, block, after, 0);
            {
                let shard = self.shard(hash).read().unwrap_or_else(|p| p.into_inner());
                let holders = shard.get(&hash).map_or(&[][..], |h| h.as_slice());
                let credit = |tiers: u16| tier_weight(weights, tiers) * block_size as f64;
                if i == 0 {
                    active.extend(holders.iter().map(|h| (h.key, credit(h.tiers))));
                } else {
                    active.retain(|(key, credited)| match holders.binary_search_by(|h| h.key.cmp(key)) {
                        Ok(at) => {
                            *credited += credit(holders[at].tiers);
                            true
                        }
                        Err(_) => {
                            reached.push((*key, i * block_size, *credited));
                            false
                        }
                    });
                }
            }
            if active.is_empty() {
                return;
            }
            parent = hash;
        }
        reached.extend(active.iter().map(|&(key, credited)| (key, blocks * block_size, credited)));
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
                    .map(|h| CacheId { worker: CacheId::worker_of(h.key), rank: h.key as u32 })
                    .collect();
                (hash, ids)
            }));
        }
        all.sort_unstable();
        all
    }

    /// The residencies of a tier mask, in bit order.
    pub(crate) fn residencies(&self, tiers: u16) -> Vec<Residency> {
        let table = self.tiers.read().unwrap_or_else(|p| p.into_inner());
        (0..table.residencies.len())
            .filter(|bit| tiers & (1 << bit) != 0)
            .map(|bit| table.residencies[bit].clone())
            .collect()
    }

    /// The bit of `residency`, interned on first use (the 16th and later share the last bit).
    pub(crate) fn residency_bit(&self, residency: &Residency) -> u16 {
        if let Some(bit) = self.find_residency(residency) {
            return bit;
        }
        let mut table = self.tiers.write().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = table.residencies.iter().position(|known| known == residency) {
            return 1 << at;
        }
        if table.residencies.len() == MAX_RESIDENCIES {
            return 1 << (MAX_RESIDENCIES - 1);
        }
        table.weights.push(self.tier_weights.weight(&residency.medium));
        table.residencies.push(residency.clone());
        1 << (table.residencies.len() - 1)
    }

    fn find_residency(&self, residency: &Residency) -> Option<u16> {
        let table = self.tiers.read().unwrap_or_else(|p| p.into_inner());
        table.residencies.iter().position(|known| known == residency).map(|at| 1 << at)
    }

    /// Makes `layout` one a query walks (group 0's); false when [`MAX_LAYOUTS`] are known already.
    pub(crate) fn accept_layout(&self, layout: Layout) -> bool {
        if self.layouts.read().unwrap_or_else(|p| p.into_inner()).contains(&layout) {
            return true;
        }
        let mut layouts = self.layouts.write().unwrap_or_else(|p| p.into_inner());
        if layouts.contains(&layout) {
            return true;
        }
        if layouts.len() == MAX_LAYOUTS {
            return false;
        }
        layouts.push(layout);
        true
    }

    fn shard(&self, hash: u64) -> &RwLock<Shard> {
        &self.shards[self.shard_of(hash)]
    }

    /// The high bits pick the shard; the map inside uses the low bits.
    fn shard_of(&self, hash: u64) -> usize {
        (hash >> 58) as usize % SHARDS
    }

    /// Sets `key`'s tiers for the block (adding the holder if new); true if it was new.
    fn set_holder(&self, hash: u64, key: u64, tiers: u16) -> bool {
        let mut shard = self.shard(hash).write().unwrap_or_else(|p| p.into_inner());
        let holders = shard.entry(hash).or_default();
        match holders.binary_search_by(|h| h.key.cmp(&key)) {
            Ok(at) => {
                holders[at].tiers = tiers;
                false
            }
            Err(at) => {
                holders.insert(at, Holder { key, tiers });
                true
            }
        }
    }

    fn remove_holder(&self, hash: u64, key: u64) {
        let mut shard = self.shard(hash).write().unwrap_or_else(|p| p.into_inner());
        if let Some(holders) = shard.get_mut(&hash) {
            if let Ok(at) = holders.binary_search_by(|h| h.key.cmp(&key)) {
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

/// The best weight among a holder's tiers.
fn tier_weight(weights: &[f64], tiers: u16) -> f64 {
    if tiers == 1 {
        return weights[0];
    }
    (0..weights.len()).filter(|bit| tiers & (1 << bit) != 0).map(|bit| weights[bit]).fold(0.0, f64::max)
}

#[cfg(test)]
mod tests;
