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
//! A long hit does not cost one map access per block: each holder entry also carries its
//! **run**, how many blocks of the chain up to and including this one the cache holds at the
//! same tier weight, and the cache's **epoch** when the run was computed. A cache's epoch moves
//! on whenever a run could have become false (a block leaves the cache while it holds a child of
//! it, or a block with children changes tier weight), so a query trusts a run only when its
//! epoch is the cache's current one. The walk then jumps: it probes a block far ahead and, when
//! every cache still matching holds it with a trusted run reaching back to where the walk
//! stands, skips the blocks in between (galloping: 32, 64, 128 ... blocks ahead), and walks
//! block by block only across a window where some cache stops. It never claims a block the
//! events did not say the cache holds.
//!
//! Writers are [`CacheBlocks`]: one per engine cache (worker and data-parallel rank), owned by
//! whoever feeds that cache's events; dropping it removes the cache's blocks from the index.

mod cache;
mod hash;
mod pending;
mod residency;

use std::collections::HashMap;
use std::sync::{Mutex, RwLock, RwLockReadGuard};

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
/// changes: it may lag behind a slower tier added or removed next to a faster one. A
/// block held by one cache keeps its holder inline in the shard's entry (16 bytes: the width of
/// the pointer and length it shares the entry with when spilled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    /// The cache's slot ([`BlockIndex::slot_of`]).
    pub(crate) slot: u32,
    pub(crate) tiers: u16,
    /// The cache's epoch when `run` was computed: the run holds only while it is current.
    pub(crate) epoch: u16,
    /// Blocks of the chain ending here (this one included) the cache holds at this block's
    /// tier weight.
    pub(crate) run: u32,
    /// A hint, never trusted alone: how many blocks after this one the cache stored along one
    /// chain from it (to the end of the event, or of the event continuing from it). A query
    /// probes there first when it looks for where a match ends.
    pub(crate) ahead: u32,
}

/// How far ahead a query first probes (then doubling while probes succeed).
const JUMP: usize = if cfg!(test) { 2 } else { 32 };

/// The epoch no holder carries: set while a cache's entries are being renumbered.
pub(crate) const EPOCH_UNTRUSTED: u16 = u16::MAX;

/// Caches holding one block, sorted by slot.
type Holders = SmallVec<[Holder; 1]>;
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
    /// The caches' slots and current epochs.
    caches: RwLock<CacheTable>,
}

/// Every cache the index has seen, by slot (a small number its holder entries carry instead of
/// the 8-byte [`CacheId::key`]), with its current epoch. Slots are never reused: a cache that
/// comes back gets its old one.
#[derive(Debug, Default)]
struct CacheTable {
    slots: IntMap<u64, u32>,
    /// Per slot: the cache's key, and its current epoch.
    keys: Vec<u64>,
    epochs: Vec<u16>,
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
            caches: RwLock::new(CacheTable::default()),
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
        let layouts: SmallVec<[Layout; MAX_LAYOUTS]> =
            self.layouts.read().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
        let chains = layouts.iter().map(|&layout| Chain::of_tokens(tokens, namespace, layout));
        self.overlap_chains(tokens.len(), chains, out);
    }

    /// A prompt's block hashes along every layout the index walks now, for
    /// [`overlap_hashed`](Self::overlap_hashed): a caller that needs them more than once (the
    /// query, then holding the prompt in flight) hashes the prompt once.
    pub fn prompt_hashes(&self, tokens: &[u32], namespace: Namespace<'_>) -> PromptHashes {
        let layouts = self.layouts();
        let chains = layouts
            .into_iter()
            .map(|layout| {
                let mut chain = Chain::of_tokens(tokens, namespace, layout);
                chain.extend_to(chain.blocks);
                (layout, chain.hashes)
            })
            .collect();
        PromptHashes { query_len: tokens.len(), chains }
    }

    /// [`overlap`](Self::overlap) from hashes computed already (the layouts the index walked
    /// when they were).
    pub fn overlap_hashed(&self, prompt: &PromptHashes, out: &mut PrefixMatch) {
        let chains = prompt.chains.iter().map(|(layout, hashes)| Chain::of_hashes(*layout, hashes));
        self.overlap_chains(prompt.query_len, chains, out);
    }

    fn overlap_chains<'a>(
        &self,
        query_len: usize,
        chains: impl Iterator<Item = Chain<'a>>,
        out: &mut PrefixMatch,
    ) {
        out.reset(query_len);
        let tiers = self.tiers.read().unwrap_or_else(|p| p.into_inner());
        let weights = &tiers.weights;
        // (cache slot, tokens matched, credit) for every cache that matched anything.
        let mut reached: SmallVec<[(u32, usize, u64); 8]> = SmallVec::new();
        // Read once a walk needs the caches' epochs, or a cache matched.
        let mut caches = None;
        for mut chain in chains {
            self.walk(&mut chain, weights, &mut caches, &mut reached);
        }
        drop(tiers);
        if reached.is_empty() {
            return;
        }
        let caches = caches.get_or_insert_with(|| self.caches.read().unwrap_or_else(|p| p.into_inner()));
        let mut reached: SmallVec<[(u64, usize, u64); 8]> = reached
            .iter()
            .map(|&(slot, matched, credit)| (caches.keys[slot as usize], matched, credit))
            .collect();
        // Per worker: the best cache (rank, layout) by matched tokens, then by credit.
        reached.sort_unstable_by_key(|a| a.0);
        for group in reached.chunk_by(|a, b| CacheId::worker_of(a.0) == CacheId::worker_of(b.0)) {
            let best = group
                .iter()
                .copied()
                .max_by(|a, b| a.1.cmp(&b.1).then(a.2.cmp(&b.2)))
                .expect("chunks are not empty");
            if best.1 > 0 {
                out.push_credited(CacheId::worker_of(best.0), best.1, credited_tokens(best.2));
            }
        }
    }

    /// One layout's walk: appends (cache, matched tokens, credit) for every cache it reached.
    fn walk<'s>(
        &'s self,
        chain: &mut Chain<'_>,
        weights: &[f64],
        caches: &mut Option<RwLockReadGuard<'s, CacheTable>>,
        reached: &mut SmallVec<[(u32, usize, u64); 8]>,
    ) {
        let (blocks, block_size) = (chain.blocks, chain.block_size);
        if blocks == 0 {
            return;
        }
        let credit =
            |tiers: u16, n: usize| credit_units(tier_weight(weights, tiers)) * (n * block_size) as u64;
        // Caches still matching: (slot, credit so far, current epoch once read, the hint of the
        // last holder entry read).
        let mut active: SmallVec<[Active; 4]> = SmallVec::new();
        {
            let hash = chain.hash(0);
            let shard = self.shard(hash).read().unwrap_or_else(|p| p.into_inner());
            let holders = shard.get(&hash).map_or(&[][..], |h| h.as_slice());
            active.extend(holders.iter().map(|h| (h.slot, credit(h.tiers, 1), EPOCH_UNTRUSTED, h.ahead)));
        }
        // Every active cache holds blocks 0..=pos.
        let (mut pos, mut stride) = (0, JUMP);
        let mut epochs_read = false;
        while pos + 1 < blocks && !active.is_empty() {
            let next = (pos + stride).min(blocks - 1);
            if next - pos > 1 {
                if !epochs_read {
                    let caches =
                        caches.get_or_insert_with(|| self.caches.read().unwrap_or_else(|p| p.into_inner()));
                    for entry in active.iter_mut() {
                        entry.2 = caches.epochs[entry.0 as usize];
                    }
                    epochs_read = true;
                }
                match self.probe(chain, next, pos, &mut active, &credit) {
                    Probe::Spans => {
                        pos = next;
                        stride = stride.saturating_mul(2);
                        continue;
                    }
                    Probe::Absent => {
                        // Some cache stops in (pos, next]: bisect to a block where not every
                        // cache spans, with every cache spanning the block before it. `hi` is
                        // always a block some cache lacks.
                        let (mut lo, mut hi) = (pos, next);
                        // First where the caches' chains were stored to from `lo`: most
                        // matches end at the end of a stored event.
                        let guess = lo + active.iter().map(|a| a.3 as usize).min().unwrap_or(0);
                        if guess > lo && guess < hi {
                            match self.probe(chain, guess, lo, &mut active, &credit) {
                                Probe::Spans => lo = guess,
                                Probe::Absent => hi = guess,
                                Probe::Unknown => {}
                            }
                            if lo == guess && guess + 1 < hi {
                                match self.probe(chain, guess + 1, lo, &mut active, &credit) {
                                    Probe::Spans => lo = guess + 1,
                                    Probe::Absent => hi = guess + 1,
                                    Probe::Unknown => {}
                                }
                            }
                        }
                        while hi - lo > 1 {
                            let mid = lo + (hi - lo) / 2;
                            match self.probe(chain, mid, lo, &mut active, &credit) {
                                Probe::Spans => lo = mid,
                                Probe::Absent => hi = mid,
                                Probe::Unknown => break,
                            }
                        }
                        if hi - lo == 1 && active.len() == 1 {
                            // One cache, holding `lo` and lacking `hi`: it stops there.
                            let (slot, credited, ..) = active[0];
                            reached.push((slot, hi * block_size, credited));
                            return;
                        }
                        // Then block by block from there (one block unless a run was not
                        // trusted on the way).
                        for i in lo + 1..=hi {
                            if !self.step(chain, i, &mut active, &credit, reached) {
                                return;
                            }
                        }
                        pos = hi;
                        stride = JUMP;
                        continue;
                    }
                    Probe::Unknown if next - pos > JUMP => {
                        stride = JUMP;
                        continue;
                    }
                    Probe::Unknown => {}
                }
            }
            // Block by block across a window where a run could not be trusted.
            for i in pos + 1..=next {
                if !self.step(chain, i, &mut active, &credit, reached) {
                    return;
                }
            }
            pos = next;
            stride = JUMP;
        }
        reached.extend(active.iter().map(|&(slot, credited, ..)| (slot, blocks * block_size, credited)));
    }

    /// Whether every active cache holds blocks `from + 1..=at` by a trusted run ending at `at`;
    /// if so, credits them.
    fn probe(
        &self,
        chain: &mut Chain<'_>,
        at: usize,
        from: usize,
        active: &mut SmallVec<[Active; 4]>,
        credit: &impl Fn(u16, usize) -> u64,
    ) -> Probe {
        let hash = chain.hash(at);
        let shard = self.shard(hash).read().unwrap_or_else(|p| p.into_inner());
        let holders = shard.get(&hash).map_or(&[][..], |h| h.as_slice());
        let mut verdict = Probe::Spans;
        for &(slot, _, epoch, _) in active.iter() {
            match holders.binary_search_by(|h| h.slot.cmp(&slot)) {
                Err(_) => verdict = Probe::Absent,
                Ok(i) => {
                    let h = holders[i];
                    let trusted = h.epoch == epoch && epoch != EPOCH_UNTRUSTED && h.run as usize >= at - from;
                    if !trusted {
                        return Probe::Unknown;
                    }
                }
            }
        }
        if verdict == Probe::Spans {
            for entry in active.iter_mut() {
                let i = holders.binary_search_by(|h| h.slot.cmp(&entry.0)).expect("every cache spans");
                entry.1 += credit(holders[i].tiers, at - from);
                entry.3 = holders[i].ahead;
            }
        }
        verdict
    }

    /// One block, every active cache holding blocks before it: caches without it stop there
    /// (appended to `reached`). False when none is left.
    fn step(
        &self,
        chain: &mut Chain<'_>,
        at: usize,
        active: &mut SmallVec<[Active; 4]>,
        credit: &impl Fn(u16, usize) -> u64,
        reached: &mut SmallVec<[(u32, usize, u64); 8]>,
    ) -> bool {
        let hash = chain.hash(at);
        let shard = self.shard(hash).read().unwrap_or_else(|p| p.into_inner());
        let holders = shard.get(&hash).map_or(&[][..], |h| h.as_slice());
        active.retain(|(slot, credited, _, ahead)| match holders.binary_search_by(|h| h.slot.cmp(slot)) {
            Ok(i) => {
                *credited += credit(holders[i].tiers, 1);
                *ahead = holders[i].ahead;
                true
            }
            Err(_) => {
                reached.push((*slot, at * chain.block_size, *credited));
                false
            }
        });
        !active.is_empty()
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
        let caches = self.caches.read().unwrap_or_else(|p| p.into_inner());
        for shard in self.shards.iter() {
            let shard = shard.read().unwrap_or_else(|p| p.into_inner());
            all.extend(shard.iter().map(|(&hash, holders)| {
                let mut ids: Vec<CacheId> = holders
                    .iter()
                    .map(|h| caches.keys[h.slot as usize])
                    .map(|key| CacheId { worker: CacheId::worker_of(key), rank: key as u32 })
                    .collect();
                ids.sort_unstable();
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

    /// Middle bits pick the shard: the map inside takes the bucket from the low bits and its
    /// control byte from the top seven (hashbrown's `h2`). Picking shards by the top bits left
    /// every key of a shard with one of two control bytes, so each probe compared about half a
    /// group's keys, in different cache lines: 3-5x slower lookups (`benches/dynamo-index`).
    fn shard_of(&self, hash: u64) -> usize {
        (hash >> 40) as usize % SHARDS
    }

    /// Sets the cache's entry for the block (adding the holder if new; an entry's hint only
    /// grows).
    fn set_holder(&self, hash: u64, holder: Holder) {
        let mut shard = self.shard(hash).write().unwrap_or_else(|p| p.into_inner());
        let holders = shard.entry(hash).or_default();
        match holders.binary_search_by(|h| h.slot.cmp(&holder.slot)) {
            Ok(at) => holders[at] = Holder { ahead: holders[at].ahead.max(holder.ahead), ..holder },
            Err(at) => holders.insert(at, holder),
        }
    }

    /// The cache stored `ahead` blocks after the block (an event continuing from it): its hint
    /// grows to that.
    fn extend_ahead(&self, hash: u64, slot: u32, ahead: u32) {
        let mut shard = self.shard(hash).write().unwrap_or_else(|p| p.into_inner());
        let Some(holders) = shard.get_mut(&hash) else { return };
        if let Ok(at) = holders.binary_search_by(|h| h.slot.cmp(&slot)) {
            holders[at].ahead = holders[at].ahead.max(ahead);
        }
    }

    /// Adds `holder` for the block unless its cache holds the block already: then returns the
    /// entry it has, unchanged.
    fn insert_holder(&self, hash: u64, holder: Holder) -> Option<Holder> {
        let mut shard = self.shard(hash).write().unwrap_or_else(|p| p.into_inner());
        let holders = shard.entry(hash).or_default();
        match holders.binary_search_by(|h| h.slot.cmp(&holder.slot)) {
            Ok(at) => Some(holders[at]),
            Err(at) => {
                holders.insert(at, holder);
                None
            }
        }
    }

    /// The slot of cache `key`, given on first use (its epoch starts at 0).
    pub(crate) fn slot_of(&self, key: u64) -> u32 {
        if let Some(&slot) = self.caches.read().unwrap_or_else(|p| p.into_inner()).slots.get(&key) {
            return slot;
        }
        let mut caches = self.caches.write().unwrap_or_else(|p| p.into_inner());
        let next = caches.keys.len() as u32;
        let slot = *caches.slots.entry(key).or_insert(next);
        if slot == next {
            caches.keys.push(key);
            caches.epochs.push(0);
        }
        slot
    }

    /// A cache's current epoch.
    pub(crate) fn epoch_of(&self, slot: u32) -> u16 {
        self.caches.read().unwrap_or_else(|p| p.into_inner()).epochs[slot as usize]
    }

    /// Makes `epoch` the cache's current one: runs computed under another stop counting.
    pub(crate) fn set_epoch(&self, slot: u32, epoch: u16) {
        self.caches.write().unwrap_or_else(|p| p.into_inner()).epochs[slot as usize] = epoch;
    }

    fn remove_holder(&self, hash: u64, slot: u32) {
        let mut shard = self.shard(hash).write().unwrap_or_else(|p| p.into_inner());
        if let Some(holders) = shard.get_mut(&hash) {
            if let Ok(at) = holders.binary_search_by(|h| h.slot.cmp(&slot)) {
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

/// A prompt's block hashes along each layout ([`BlockIndex::prompt_hashes`]).
#[derive(Clone, Debug, Default)]
pub struct PromptHashes {
    query_len: usize,
    chains: SmallVec<[(Layout, Vec<u64>); 1]>,
}

impl PromptHashes {
    /// The content hashes of the prompt's whole blocks along `layout` (empty if not computed).
    pub fn hashes(&self, layout: Layout) -> &[u64] {
        self.chains.iter().find(|(l, _)| *l == layout).map_or(&[], |(_, hashes)| hashes)
    }
}

/// A cache still matching in a walk: its slot, its credit so far, its current epoch (once
/// read), and the hint of the last holder entry read.
type Active = (u32, u64, u16, u32);

/// What a probe far ahead found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    /// Every active cache holds every block up to the probe (trusted runs).
    Spans,
    /// Some cache does not hold the probed block; the others span.
    Absent,
    /// Some cache holds it but its run cannot vouch for the blocks before it.
    Unknown,
}

/// A query's block hashes along one layout: given, or computed as far as the walk has looked.
struct Chain<'a> {
    tokens: &'a [u32],
    block_size: usize,
    lookahead: usize,
    root: u64,
    blocks: usize,
    given: &'a [u64],
    hashes: Vec<u64>,
}

impl<'a> Chain<'a> {
    fn of_tokens(tokens: &'a [u32], namespace: Namespace<'_>, layout: Layout) -> Self {
        let (block_size, lookahead) = (layout.block_size as usize, layout.lookahead as usize);
        Chain {
            tokens,
            block_size,
            lookahead,
            root: ChainRoot { namespace, group: 0, lookahead: layout.lookahead }.hash(),
            blocks: tokens.len().saturating_sub(lookahead) / block_size.max(1),
            given: &[],
            hashes: Vec::new(),
        }
    }

    fn of_hashes(layout: Layout, hashes: &'a [u64]) -> Self {
        Chain {
            tokens: &[],
            block_size: layout.block_size as usize,
            lookahead: layout.lookahead as usize,
            root: 0,
            blocks: hashes.len(),
            given: hashes,
            hashes: Vec::new(),
        }
    }

    /// The content hash of block `i` (every block before it is hashed on the way).
    #[inline]
    fn hash(&mut self, i: usize) -> u64 {
        if let Some(&hash) = self.given.get(i) {
            return hash;
        }
        if i >= self.hashes.len() {
            self.extend_to(i + 1);
        }
        self.hashes[i]
    }

    /// Hashes blocks up to `n` in one tight loop (a push per block and call was 2-3x slower
    /// than the hashing itself).
    fn extend_to(&mut self, n: usize) {
        let (block_size, lookahead, from) = (self.block_size, self.lookahead, self.hashes.len());
        let mut parent = self.hashes.last().copied().unwrap_or(self.root);
        if lookahead == 0 {
            let blocks = self.tokens[from * block_size..n * block_size].chunks_exact(block_size);
            self.hashes.extend(blocks.map(|block| {
                parent = block_content(parent, block, &[], 0);
                parent
            }));
            return;
        }
        self.hashes.extend((from..n).map(|at| {
            let start = at * block_size;
            let (block, after) = self.tokens[start..start + block_size + lookahead].split_at(block_size);
            parent = block_content(parent, block, after, 0);
            parent
        }));
    }
}

/// Credit is counted in fixed point (1/65,536 of a token), so a sum does not depend on how the
/// walk grouped its blocks.
const CREDIT_ONE: f64 = 65_536.0;

/// A tier weight as credit units per token.
fn credit_units(weight: f64) -> u64 {
    (weight * CREDIT_ONE).round() as u64
}

/// Credited tokens of a credit sum (halves round up).
fn credited_tokens(credit: u64) -> usize {
    ((credit + (CREDIT_ONE as u64) / 2) >> 16) as usize
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
