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
//! The index holds **segments**, not blocks: a segment is a run of blocks one cache holds along
//! one chain, at one tier weight, with its blocks' content hashes side by side, keyed by its first
//! block's content hash. A stored event becomes one segment, or grows the segment its parent
//! ends (so a chain stored in many events is one segment); a removal truncates or splits one.
//! Segments sit in shards by key, each behind its own `RwLock`: a writer takes one shard's write
//! lock per event (not per block), and a query one shard's read lock per segment boundary it
//! crosses, so queries never wait behind a whole event batch, only (rarely) behind one event's
//! change to one segment. Each segment carries the tiers its blocks are held in, so a query can
//! credit a CPU or disk hit at its [`TierWeights`] weight.
//!
//! A query walks the prompt's chain from its first block: each cache holding a segment there
//! matches as far as the segment agrees with the prompt, found by comparing content hashes
//! (chained, so two chains agree up to a block exactly when its hashes are equal: a binary search,
//! not a scan), then looks for its segment starting at the next block. A 4,096-block hit stored in
//! one chain costs two map lookups; per-block lookups are left only where a chain branches or was
//! partly evicted. It never claims a block the events did not say the cache holds: every block a
//! match counts lies in a segment of that cache.
//!
//! Writers are [`CacheBlocks`]: one per engine cache (worker and data-parallel rank), owned by
//! whoever feeds that cache's events; dropping it removes the cache's blocks from the index.

mod cache;
mod census;
mod hash;
mod pending;
mod residency;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};

use nohash_hasher::IntMap;
use smallvec::SmallVec;

pub use cache::{ApplyError, CacheBlocks, HeldBlock, StoredBlocks};
pub use census::{CacheCensus, Census, CensusOptions, Holder};
pub use hash::{block_content, content_hash, Adapter, ChainRoot, Namespace, ROOT_HASH};
pub use pending::{InFlightBlocks, InFlightPrompt, IN_FLIGHT_RANK};
pub use residency::{Residency, TierWeights};

use crate::prefix_match::PrefixMatch;
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

/// A run of blocks one cache holds along one chain, every block at the same best tier weight.
/// Everything a query needs of it is here (the cache, the credit), so a query reads no table
/// but the shards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    /// The cache's [`CacheId::key`].
    pub(crate) cache: u64,
    /// The writer's id for it (unique within the cache).
    pub(crate) id: u32,
    /// Credit units per token its blocks earn (their best tier's weight, [`credit_units`]).
    pub(crate) credit: u32,
    /// Content hashes in chain order; the first is the segment's key.
    pub(crate) hashes: Vec<u64>,
}

/// The segments starting at one content hash (one per cache, but for a content two engine blocks
/// of one cache name).
type Segments = SmallVec<[Segment; 1]>;
/// Block content hashes are well mixed already: no hashing of the key.
type Shard = IntMap<u64, Segments>;

/// A shard on cache lines of its own (128 bytes: two lines, the unit adjacent-line prefetch
/// pulls): a lock and a map header are 48 bytes, so unpadded two or three shards share a line
/// and two writers (or a writer and a querying thread) on neighbouring shards bounce it.
#[derive(Debug)]
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The residencies seen, by bit, and each one's weight.
#[derive(Debug)]
struct Tiers {
    residencies: Vec<Residency>,
    weights: Vec<f64>,
}

/// The event-fed block index of one model. Create it in an `Arc`: each [`CacheBlocks`] keeps one.
#[derive(Debug)]
pub struct BlockIndex {
    shards: Box<[Padded<RwLock<Shard>>]>,
    /// Group 0's layouts, in the order first seen: read by every query, so atomics (a read
    /// lock's counter bounced between two querying cores: 2.6x fewer queries/s on two threads
    /// than on one, `benches/dynamo-index`); added under `layouts_added`.
    layouts: [AtomicU64; MAX_LAYOUTS],
    n_layouts: AtomicUsize,
    layouts_added: Mutex<()>,
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
            shards: (0..SHARDS).map(|_| Padded(RwLock::new(Shard::default()))).collect(),
            layouts: Default::default(),
            n_layouts: AtomicUsize::new(0),
            layouts_added: Mutex::new(()),
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
        self.layouts_now().into_vec()
    }

    fn layouts_now(&self) -> SmallVec<[Layout; MAX_LAYOUTS]> {
        let n = self.n_layouts.load(Ordering::Acquire);
        self.layouts[..n]
            .iter()
            .map(|packed| {
                let packed = packed.load(Ordering::Relaxed);
                Layout { block_size: (packed >> 32) as u32, lookahead: packed as u32 }
            })
            .collect()
    }

    /// Per worker, how many leading tokens of `tokens` its engine caches hold in `namespace`
    /// (whole blocks; for a data-parallel worker, its best rank; over every layout, the best),
    /// and how many of them count once tiers are weighed ([`PrefixMatch::credited`]).
    /// `out.query_len()` is `tokens.len()`.
    pub fn overlap(&self, tokens: &[u32], namespace: Namespace<'_>, out: &mut PrefixMatch) {
        let layouts = self.layouts_now();
        let chains = layouts.iter().map(|&layout| Chain::of_tokens(tokens, namespace, layout));
        self.overlap_chains(tokens.len(), chains, out);
    }

    /// [`overlap`](Self::overlap) as the engine will serve it from cache: only the whole blocks of
    /// the prompt's first `len - 1` tokens, since neither engine serves a prompt's last token from
    /// cache (it recomputes it for the first output's logits: vLLM 0.32
    /// `vllm/v1/core/kv_cache_manager.py`, `max_cache_hit_length = num_tokens - 1`; SGLang
    /// `managers/schedule_batch.py`, `max_prefix_len = input_len - 1`, page-aligned). A fully
    /// held prompt of N tokens, N a multiple of the block size, is served N - block size.
    pub fn served_overlap(&self, tokens: &[u32], namespace: Namespace<'_>, out: &mut PrefixMatch) {
        let layouts = self.layouts_now();
        let limit = served_limit(tokens.len());
        let chains = layouts.iter().map(|&layout| Chain::of_tokens(tokens, namespace, layout).capped(limit));
        self.overlap_chains(tokens.len(), chains, out);
    }

    /// [`served_overlap`](Self::served_overlap) from hashes computed already.
    pub fn served_overlap_hashed(&self, prompt: &PromptHashes, out: &mut PrefixMatch) {
        let limit = served_limit(prompt.query_len);
        let chains =
            prompt.chains.iter().map(|(layout, hashes)| Chain::of_hashes(*layout, hashes).capped(limit));
        self.overlap_chains(prompt.query_len, chains, out);
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
        // (cache key, tokens matched, credit) for every cache that matched anything.
        let mut reached: SmallVec<[(u64, usize, u64); 8]> = SmallVec::new();
        for mut chain in chains {
            self.walk(&mut chain, &mut reached);
        }
        if reached.is_empty() {
            return;
        }
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
    fn walk(&self, chain: &mut Chain<'_>, reached: &mut SmallVec<[(u64, usize, u64); 8]>) {
        let (blocks, block_size) = (chain.blocks, chain.block_size);
        if blocks == 0 {
            return;
        }
        // Caches holding every block before their position, waiting for their segment starting
        // there: (cache key, block position, credit so far). At block 0 every segment starts one.
        let mut waiting: SmallVec<[Active; 8]> = SmallVec::new();
        let mut advanced: SmallVec<[Active; 8]> = SmallVec::new();
        let mut pos = 0;
        loop {
            let hash = chain.hash(pos);
            {
                let shard = self.shard(hash).read().unwrap_or_else(|p| p.into_inner());
                let segments = shard.get(&hash).map_or(&[][..], |s| s.as_slice());
                for segment in segments {
                    let at = waiting.iter().position(|w| w.0 == segment.cache && w.1 == pos);
                    if pos > 0 && at.is_none() {
                        continue;
                    }
                    let credit_so_far = at.map_or(0, |at| waiting[at].2);
                    let matched = chain.agree(pos, &segment.hashes);
                    let credit = credit_so_far + u64::from(segment.credit) * (matched * block_size) as u64;
                    let here = (segment.cache, pos + matched, credit);
                    // A cache with two segments here (a content two of its engine blocks name):
                    // the one reaching further.
                    match advanced.iter_mut().find(|a| a.0 == segment.cache) {
                        Some(best) if (best.1, best.2) >= (here.1, here.2) => {}
                        Some(best) => *best = here,
                        None => advanced.push(here),
                    }
                }
            }
            // Caches waiting here with no segment stop here.
            waiting.retain(|w| {
                if w.1 != pos {
                    return true;
                }
                if !advanced.iter().any(|a| a.0 == w.0) {
                    reached.push((w.0, pos * block_size, w.2));
                }
                false
            });
            for (cache, at, credit) in advanced.drain(..) {
                if at == blocks {
                    reached.push((cache, at * block_size, credit));
                } else {
                    waiting.push((cache, at, credit));
                }
            }
            match waiting.iter().map(|w| w.1).min() {
                Some(next) => pos = next,
                None => return,
            }
        }
    }

    /// Distinct blocks held by a worker's caches (summed over its ranks).
    pub fn worker_blocks(&self, worker: TenantId) -> usize {
        let sizes = self.sizes.lock().unwrap_or_else(|p| p.into_inner());
        sizes.iter().filter(|(&key, _)| CacheId::worker_of(key) == worker).map(|(_, &n)| n).sum()
    }

    /// Distinct blocks in the index (held by at least one cache). Counts every segment's
    /// blocks: for tests and diagnostics, not a request path.
    pub fn len(&self) -> usize {
        let mut distinct: std::collections::HashSet<u64, nohash_hasher::BuildNoHashHasher<u64>> =
            Default::default();
        for shard in self.shards.iter() {
            let shard = shard.read().unwrap_or_else(|p| p.into_inner());
            for segment in shard.values().flatten() {
                distinct.extend(segment.hashes.iter().copied());
            }
        }
        distinct.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| s.read().unwrap_or_else(|p| p.into_inner()).is_empty())
    }

    /// Every (block, holders) pair, sorted: for tests comparing indexes.
    pub fn dump(&self) -> Vec<(u64, Vec<CacheId>)> {
        let mut holders: HashMap<u64, Vec<CacheId>> = HashMap::new();
        for shard in self.shards.iter() {
            let shard = shard.read().unwrap_or_else(|p| p.into_inner());
            for segment in shard.values().flatten() {
                let key = segment.cache;
                let id = CacheId { worker: CacheId::worker_of(key), rank: key as u32 };
                for &hash in &segment.hashes {
                    holders.entry(hash).or_default().push(id);
                }
            }
        }
        let mut all: Vec<(u64, Vec<CacheId>)> = holders
            .into_iter()
            .map(|(hash, mut ids)| {
                ids.sort_unstable();
                ids.dedup();
                (hash, ids)
            })
            .collect();
        all.sort_unstable();
        all
    }

    /// The lengths of every segment, sorted: for tests of how events become segments.
    #[cfg(test)]
    pub(crate) fn segments(&self) -> Vec<usize> {
        let mut lengths: Vec<usize> = self
            .shards
            .iter()
            .flat_map(|shard| {
                let shard = shard.read().unwrap_or_else(|p| p.into_inner());
                shard.values().flatten().map(|segment| segment.hashes.len()).collect::<Vec<_>>()
            })
            .collect();
        lengths.sort_unstable();
        lengths
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
        if self.layouts_now().contains(&layout) {
            return true;
        }
        let _adding = self.layouts_added.lock().unwrap_or_else(|p| p.into_inner());
        let known = self.layouts_now();
        if known.contains(&layout) {
            return true;
        }
        if known.len() == MAX_LAYOUTS {
            return false;
        }
        let packed = (u64::from(layout.block_size) << 32) | u64::from(layout.lookahead);
        self.layouts[known.len()].store(packed, Ordering::Relaxed);
        self.n_layouts.store(known.len() + 1, Ordering::Release);
        true
    }

    fn shard(&self, hash: u64) -> &RwLock<Shard> {
        &self.shards[self.shard_of(hash)].0
    }

    /// Middle bits pick the shard: the map inside takes the bucket from the low bits and its
    /// control byte from the top seven (hashbrown's `h2`). Picking shards by the top bits left
    /// every key of a shard with one of two control bytes, so each probe compared about half a
    /// group's keys, in different cache lines: 3-5x slower lookups (`benches/dynamo-index`).
    fn shard_of(&self, hash: u64) -> usize {
        (hash >> 40) as usize % SHARDS
    }

    /// Adds a segment under its first block's hash.
    fn insert_segment(&self, segment: Segment) {
        let key = segment.hashes[0];
        let mut shard = self.shard(key).write().unwrap_or_else(|p| p.into_inner());
        shard.entry(key).or_default().push(segment);
    }

    /// Appends blocks to a cache's segment.
    fn append_segment(&self, key: u64, cache: u64, id: u32, hashes: &[u64]) {
        let mut shard = self.shard(key).write().unwrap_or_else(|p| p.into_inner());
        if let Some(segment) =
            shard.get_mut(&key).and_then(|s| s.iter_mut().find(|s| s.cache == cache && s.id == id))
        {
            segment.hashes.extend_from_slice(hashes);
        }
    }

    /// Keeps the first `len` blocks of a cache's segment (none: removes it).
    fn truncate_segment(&self, key: u64, cache: u64, id: u32, len: usize) {
        let mut shard = self.shard(key).write().unwrap_or_else(|p| p.into_inner());
        let Some(segments) = shard.get_mut(&key) else { return };
        let Some(at) = segments.iter().position(|s| s.cache == cache && s.id == id) else { return };
        if len == 0 {
            segments.remove(at);
            if segments.is_empty() {
                shard.remove(&key);
            }
            return;
        }
        let hashes = &mut segments[at].hashes;
        hashes.truncate(len);
        if hashes.capacity() > 4 * len + 16 {
            hashes.shrink_to_fit();
        }
    }

    /// Sets the credit of a cache's segment.
    fn set_segment_credit(&self, key: u64, cache: u64, id: u32, credit: u32) {
        let mut shard = self.shard(key).write().unwrap_or_else(|p| p.into_inner());
        if let Some(segment) =
            shard.get_mut(&key).and_then(|s| s.iter_mut().find(|s| s.cache == cache && s.id == id))
        {
            segment.credit = credit;
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

/// The most leading tokens of a prompt of `len` tokens an engine serves from cache (whole blocks
/// within them): all but the last.
fn served_limit(len: usize) -> usize {
    len.saturating_sub(1)
}

/// A cache in a walk: its key, the block it has reached, its credit so far.
type Active = (u64, usize, u64);

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
        let blocks = tokens.len().saturating_sub(lookahead) / block_size.max(1);
        Chain {
            tokens,
            block_size,
            lookahead,
            root: ChainRoot { namespace, group: 0, lookahead: layout.lookahead }.hash(),
            blocks,
            given: &[],
            // Room for every block at once: a walk extends the hashes a segment at a time, and
            // growing the vector on the way cost a query of short segments a copy per doubling.
            hashes: Vec::with_capacity(blocks),
        }
    }

    /// The chain walked only over the whole blocks within its first `max_tokens` tokens.
    fn capped(mut self, max_tokens: usize) -> Self {
        let blocks = max_tokens.saturating_sub(self.lookahead) / self.block_size.max(1);
        self.blocks = self.blocks.min(blocks);
        self
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

    /// How many blocks from `pos` on the chain shares with `segment` (whose first block is the
    /// chain's block `pos`). Content hashes are chained: two chains agree on a block exactly when
    /// they agree on every block before it, so the last shared block is found by bisection.
    fn agree(&mut self, pos: usize, segment: &[u64]) -> usize {
        let n = segment.len().min(self.blocks - pos);
        if n == 0 {
            return 0;
        }
        if self.given.is_empty() && self.hashes.len() < pos + n {
            self.extend_to(pos + n);
        }
        let ours = if self.given.is_empty() { &self.hashes[pos..pos + n] } else { &self.given[pos..pos + n] };
        if ours[n - 1] == segment[n - 1] {
            return n;
        }
        if ours[0] != segment[0] {
            return 0;
        }
        // ours[lo] == segment[lo], ours[hi] != segment[hi].
        let (mut lo, mut hi) = (0, n - 1);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if ours[mid] == segment[mid] {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo + 1
    }

    /// Hashes blocks up to `n` in one tight loop (a push per block and call was 2-3x slower
    /// than the hashing itself).
    fn extend_to(&mut self, n: usize) {
        let (block_size, lookahead, from) = (self.block_size, self.lookahead, self.hashes.len());
        let mut parent = self.hashes.last().copied().unwrap_or(self.root);
        if lookahead == 0 {
            hash::extend_chain(
                &mut self.hashes,
                parent,
                &self.tokens[from * block_size..n * block_size],
                block_size,
            );
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
pub(crate) fn credit_units(weight: f64) -> u64 {
    (weight * CREDIT_ONE).round() as u64
}

/// Credited tokens of a credit sum (halves round up).
fn credited_tokens(credit: u64) -> usize {
    ((credit + (CREDIT_ONE as u64) / 2) >> 16) as usize
}

#[cfg(test)]
mod tests;
