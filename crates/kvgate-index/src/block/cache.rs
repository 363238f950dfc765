//! One engine cache's side of the block index: per KV-cache group, the engine's own block hashes
//! mapped to kvgate's content hashes and the tiers holding each block, applied to the shared
//! index as stored and removed events arrive.

use std::collections::HashMap;
use std::sync::Arc;

use nohash_hasher::IntMap;
use smallvec::SmallVec;

use super::hash::{block_content, ChainRoot, Namespace};
use super::residency::Residency;
use super::{BlockIndex, CacheId, Layout, Segment};

/// A `BlockStored` event, as the index needs it.
#[derive(Clone, Copy, Debug)]
pub struct StoredBlocks<'a> {
    /// The KV-cache group (0 for engines with one).
    pub group: u32,
    /// The engine's hashes of the stored blocks, in prompt order.
    pub block_hashes: &'a [u64],
    /// The engine's hash of the block before the first one (`None`: the chain's first block).
    pub parent_block_hash: Option<u64>,
    /// Tokens of all stored blocks, `block_size` per block. Empty with `block_size` 0: a tier
    /// placeholder (vLLM's offloading connector), which names blocks without their content.
    pub token_ids: &'a [u32],
    pub block_size: u32,
    /// Per block, the tokens after it that its hash covers, the same number for every block
    /// (EAGLE); empty when none.
    pub lookahead: &'a [u32],
    /// Per block, a digest of the extra keys kvgate cannot reproduce from a request (multimodal
    /// items; 0: none), or empty when no block has any.
    pub opaque: &'a [u64],
    /// Whose blocks these are, when the chain starts here (a continuation inherits its
    /// parent's).
    pub namespace: Namespace<'a>,
    /// The tier copy the event reports.
    pub residency: &'a Residency,
}

/// Why a stored event was not applied. The index is unchanged when one is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error(
        "block_size 0 with token ids: only an offload placeholder has no block size, and it has no tokens"
    )]
    ZeroBlockSize,
    #[error("{tokens} token ids do not fill {blocks} blocks of {block_size}")]
    TokenCount { tokens: usize, blocks: usize, block_size: u32 },
    #[error("{lookahead} lookahead tokens or {opaque} extra-key digests for {blocks} blocks")]
    PerBlockCount { lookahead: usize, opaque: usize, blocks: usize },
    #[error("parent block {0:#x} is not in this cache's index (its store was missed or removed)")]
    UnknownParent(u64),
    #[error("a {got:?} layout would make more than {max} ways to cut a prompt", max = super::MAX_LAYOUTS)]
    TooManyLayouts { got: Layout },
    #[error("{adding} new blocks would take the cache past its bound of {max} blocks ({held} held)")]
    OverCapacity { held: usize, adding: usize, max: usize },
}

/// One engine block this cache holds: where it lies in the cache's segments (its content is
/// read there) and the tiers holding it. Keyed by the engine's hash: a store writes one entry
/// here per block, and one segment change in the shared index per event. Eight bytes, so an
/// entry is 16: the map's insert (a cache miss per block) is most of a store's time, and a
/// smaller entry is fewer misses and a cheaper growth (`benches/block.rs`, "STORE FLOOR").
#[derive(Clone, Copy, Debug)]
struct EngineBlock {
    /// Its segment ([`CacheBlocks::segments`]) and its place there.
    segment: u32,
    offset: u16,
    /// One bit per residency holding the block.
    tiers: u16,
}

/// Most blocks in one segment (its offsets are 16 bits): a longer run continues in another.
pub(crate) const MAX_SEGMENT_BLOCKS: usize = 1 << 16;

/// The engine blocks of one KV-cache group, by engine hash.
type Group = IntMap<u64, EngineBlock>;

/// The writer's side of one of its segments in the index.
#[derive(Clone, Debug, Default)]
struct SegmentMeta {
    /// The content hash of its first block (its key in the index).
    key: u64,
    /// Its blocks' engine hashes, in chain order (empty: a free id).
    engines: Vec<u64>,
    /// Their content hashes (the index's copy is behind a shard lock).
    contents: Vec<u64>,
    tiers: u16,
}

/// One block as [`CacheBlocks::holdings`] lists it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HeldBlock {
    pub group: u32,
    pub engine_hash: u64,
    /// kvgate's content hash ([`block_content`] chained from its [`ChainRoot`]).
    pub content: u64,
    pub residencies: Vec<Residency>,
}

/// The blocks one engine cache holds, as the index knows them. One writer per cache: whoever
/// applies that cache's events owns it. Dropping it removes the cache from the index.
#[derive(Debug)]
pub struct CacheBlocks {
    index: Arc<BlockIndex>,
    id: CacheId,
    key: u64,
    groups: SmallVec<[(u32, Group); 1]>,
    /// Engine blocks held.
    held: usize,
    /// Blocks removed so far (removal events and clears): [`removed_blocks`](Self::removed_blocks).
    removed: u64,
    /// This cache's segments by id, and the ids free for reuse.
    segments: Vec<SegmentMeta>,
    free: Vec<u32>,
    /// Tier copies named for blocks this cache does not hold (yet): an offload placeholder for
    /// a hash whose own store is missing. A later store of the hash picks them up.
    pending: HashMap<(u32, u64), u16>,
    /// This writer's view of the index's residency bits, with each one's tier weight.
    bits: Vec<(Residency, u16, f64)>,
    /// Most engine blocks held: what the engine can hold, as its host knows it.
    max_blocks: usize,
}

/// Blocks gathered for one segment while an event is applied, written to the index in one go.
struct Open {
    segment: u32,
    /// Whether the segment is new (inserted, not appended to).
    new: bool,
    hashes: SmallVec<[u64; 32]>,
}

impl CacheBlocks {
    /// The writer for cache `id` of `index`. Two writers for one cache would fight: keep one.
    pub fn new(index: Arc<BlockIndex>, id: CacheId) -> Self {
        Self {
            index,
            id,
            key: id.key(),
            groups: SmallVec::new(),
            held: 0,
            removed: 0,
            segments: Vec::new(),
            free: Vec::new(),
            pending: HashMap::new(),
            bits: Vec::new(),
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

    /// Engine blocks this cache holds (a content two engine hashes name counts twice).
    pub fn len(&self) -> usize {
        self.held
    }

    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// kvgate's content hash of an engine block this cache holds.
    pub fn content_of(&self, group: u32, engine_hash: u64) -> Option<u64> {
        self.group(group).and_then(|blocks| blocks.get(&engine_hash)).map(|&block| self.content(block))
    }

    fn content(&self, block: EngineBlock) -> u64 {
        self.segments[block.segment as usize].contents[block.offset as usize]
    }

    /// Every block this cache holds, sorted by (group, engine hash).
    pub fn holdings(&self) -> Vec<HeldBlock> {
        let mut all: Vec<HeldBlock> = self
            .groups
            .iter()
            .flat_map(|(group, blocks)| {
                blocks.iter().map(|(&engine_hash, block)| HeldBlock {
                    group: *group,
                    engine_hash,
                    content: self.content(*block),
                    residencies: self.index.residencies(block.tiers),
                })
            })
            .collect();
        all.sort();
        all
    }

    /// Applies a `BlockStored` event. A block already held gains the residency.
    pub fn apply_stored(&mut self, stored: StoredBlocks<'_>) -> Result<(), ApplyError> {
        if stored.block_size == 0 {
            return match stored.token_ids.is_empty() {
                true => {
                    self.apply_placeholder(stored);
                    Ok(())
                }
                false => Err(ApplyError::ZeroBlockSize),
            };
        }
        let (blocks, block_size) = (stored.block_hashes.len(), stored.block_size as usize);
        if stored.token_ids.len() != blocks * block_size {
            return Err(ApplyError::TokenCount {
                tokens: stored.token_ids.len(),
                blocks,
                block_size: stored.block_size,
            });
        }
        let per_block =
            |len: usize| if blocks == 0 { Some(0) } else { len.is_multiple_of(blocks).then(|| len / blocks) };
        let lookahead = per_block(stored.lookahead.len());
        let opaque_ok = stored.opaque.is_empty() || stored.opaque.len() == blocks;
        let Some(lookahead) = lookahead.filter(|_| opaque_ok) else {
            return Err(ApplyError::PerBlockCount {
                lookahead: stored.lookahead.len(),
                opaque: stored.opaque.len(),
                blocks,
            });
        };
        let group = stored.group;
        let mut parent = match stored.parent_block_hash {
            None => ChainRoot { namespace: stored.namespace, group, lookahead: lookahead as u32 }.hash(),
            Some(engine_hash) => match self.content_of(group, engine_hash) {
                Some(content) => content,
                None => return Err(ApplyError::UnknownParent(engine_hash)),
            },
        };
        if self.len().saturating_add(blocks) > self.max_blocks {
            let held_group = self.group(group);
            let adding = stored
                .block_hashes
                .iter()
                .filter(|hash| !held_group.is_some_and(|held| held.contains_key(hash)))
                .count();
            if self.len() + adding > self.max_blocks {
                return Err(ApplyError::OverCapacity { held: self.len(), adding, max: self.max_blocks });
            }
        }
        let layout = Layout { block_size: stored.block_size, lookahead: lookahead as u32 };
        if group == 0 && !self.index.accept_layout(layout) {
            return Err(ApplyError::TooManyLayouts { got: layout });
        }
        let bit = self.bit(stored.residency);
        let mut contents: SmallVec<[u64; 32]> = SmallVec::new();
        if lookahead == 0 && stored.opaque.is_empty() {
            super::hash::extend_chain(
                &mut contents,
                parent,
                &stored.token_ids[..blocks * block_size],
                block_size,
            );
        } else {
            contents.extend((0..blocks).map(|i| {
                let tokens = &stored.token_ids[i * block_size..(i + 1) * block_size];
                let after = &stored.lookahead[i * lookahead..(i + 1) * lookahead];
                let opaque = stored.opaque.get(i).copied().unwrap_or(0);
                parent = block_content(parent, tokens, after, opaque);
                parent
            }));
        }
        self.store(group, stored.parent_block_hash, stored.block_hashes, &contents, bit);
        Ok(())
    }

    /// Holds `engine_hashes` (contents `contents`) in `tiers`, chained on the held engine block
    /// `parent` (`None`: a chain's first block). Blocks held already gain the tiers.
    pub(crate) fn store(
        &mut self,
        group: u32,
        parent: Option<u64>,
        engine_hashes: &[u64],
        contents: &[u64],
        tiers: u16,
    ) {
        let mut open: Option<Open> = None;
        let mut previous = parent;
        // The previous block's segment when it was placed at that segment's end in this event
        // (the next block then extends it without a lookup), with its tiers' weight.
        let mut placed: Option<(u32, f64)> = None;
        for (i, (&engine_hash, &content)) in engine_hashes.iter().zip(contents).enumerate() {
            let up = previous.replace(engine_hash);
            let mut after = placed.take();
            match self.group(group).and_then(|blocks| blocks.get(&engine_hash)).copied() {
                Some(block) if self.content(block) == content => {
                    self.flush(&mut open);
                    self.set_tiers(group, engine_hash, block.tiers | tiers);
                    continue;
                }
                Some(block) => {
                    // The engine reused a hash for other content: the old block is gone (and
                    // its segment cut, maybe where the previous block lies).
                    self.flush(&mut open);
                    self.drop_blocks(group, &[(engine_hash, block)]);
                    after = None;
                }
                None => {}
            }
            let pending = match self.pending.is_empty() {
                true => 0,
                false => self.pending.remove(&(group, engine_hash)).unwrap_or(0),
            };
            let tiers = tiers | pending;
            let weight = best_weight(&self.bits, tiers);
            // The segment this block extends: its parent's, when the parent ends it at this
            // block's weight.
            let extends = match after {
                Some((segment, placed_weight)) => (placed_weight == weight).then_some(segment),
                None => up
                    .and_then(|up| self.group(group).and_then(|blocks| blocks.get(&up)).copied())
                    .filter(|up_block| {
                        let meta = &self.segments[up_block.segment as usize];
                        up_block.offset as usize + 1 == meta.engines.len()
                            && best_weight(&self.bits, meta.tiers) == weight
                    })
                    .map(|up_block| up_block.segment),
            }
            .filter(|&segment| self.segments[segment as usize].engines.len() < MAX_SEGMENT_BLOCKS);
            let segment = match extends {
                Some(segment) if open.as_ref().is_some_and(|o| o.segment == segment) => segment,
                Some(segment) => {
                    self.flush(&mut open);
                    open = Some(Open { segment, new: false, hashes: SmallVec::new() });
                    segment
                }
                None => {
                    self.flush(&mut open);
                    let segment = self.new_segment(content, tiers, engine_hashes.len() - i);
                    open = Some(Open { segment, new: true, hashes: SmallVec::new() });
                    segment
                }
            };
            open.as_mut().expect("a segment is open").hashes.push(content);
            let meta = &mut self.segments[segment as usize];
            meta.engines.push(engine_hash);
            meta.contents.push(content);
            let offset = (meta.engines.len() - 1) as u16;
            group_of(&mut self.groups, group).insert(engine_hash, EngineBlock { segment, offset, tiers });
            self.held += 1;
            placed = Some((segment, best_weight(&self.bits, self.segments[segment as usize].tiers)));
        }
        self.flush(&mut open);
        self.index.set_size(self.key, self.len());
    }

    /// Writes the blocks gathered for a segment to the index.
    fn flush(&mut self, open: &mut Option<Open>) {
        let Some(open) = open.take() else { return };
        let meta = &self.segments[open.segment as usize];
        match open.new {
            true => self.index.insert_segment(Segment {
                cache: self.key,
                id: open.segment,
                credit: credit_of(&self.bits, meta.tiers),
                hashes: open.hashes.into_vec(),
            }),
            false => self.index.append_segment(meta.key, self.key, open.segment, &open.hashes),
        }
    }

    /// A new segment's id (not in the index until its blocks are flushed), with room for
    /// `blocks`.
    fn new_segment(&mut self, key: u64, tiers: u16, blocks: usize) -> u32 {
        let meta = SegmentMeta {
            key,
            engines: Vec::with_capacity(blocks),
            contents: Vec::with_capacity(blocks),
            tiers,
        };
        match self.free.pop() {
            Some(id) => {
                self.segments[id as usize] = meta;
                id
            }
            None => {
                self.segments.push(meta);
                (self.segments.len() - 1) as u32
            }
        }
    }

    /// A placeholder names each hash as held in its tier: a block held already gains the
    /// residency, an unknown hash is remembered for when its store arrives.
    fn apply_placeholder(&mut self, stored: StoredBlocks<'_>) {
        let bit = self.bit(stored.residency);
        for &engine_hash in stored.block_hashes {
            match self.group(stored.group).and_then(|blocks| blocks.get(&engine_hash)).copied() {
                Some(block) => self.set_tiers(stored.group, engine_hash, block.tiers | bit),
                None => *self.pending.entry((stored.group, engine_hash)).or_insert(0) |= bit,
            }
        }
    }

    /// Applies a `BlockRemoved` event: the blocks leave that tier, and the index once no tier
    /// holds them. Returns how many of the hashes named nothing this cache holds (ignored).
    pub fn apply_removed(&mut self, group: u32, block_hashes: &[u64], residency: &Residency) -> usize {
        let bit = self.bit(residency);
        let unknown = self.remove(group, block_hashes, bit);
        self.removed += block_hashes.len().saturating_sub(unknown) as u64;
        unknown
    }

    /// How many blocks this cache has had removed (by removal events, and all it held at each
    /// clear), ever: the closed loop tells a block evicted after a routing decision by it.
    pub fn removed_blocks(&self) -> u64 {
        self.removed
    }

    /// [`apply_removed`](Self::apply_removed) for the tiers `bit`.
    pub(crate) fn remove(&mut self, group: u32, block_hashes: &[u64], bit: u16) -> usize {
        let mut unknown = 0;
        // Blocks leaving the cache, taken out of their segments together at the end of the
        // event (engines list a chain's blocks parent first or leaf first: either way each
        // segment is cut once), and blocks only changing tiers, after them.
        let mut gone: SmallVec<[(u64, EngineBlock); 32]> = SmallVec::new();
        let mut retiered: SmallVec<[(u64, u16); 8]> = SmallVec::new();
        for &engine_hash in block_hashes {
            let held = self.group(group).and_then(|blocks| blocks.get(&engine_hash)).copied();
            match held {
                Some(block) if block.tiers & !bit == 0 => gone.push((engine_hash, block)),
                Some(block) => retiered.push((engine_hash, block.tiers & !bit)),
                None => match self.pending.get_mut(&(group, engine_hash)) {
                    Some(tiers) => {
                        *tiers &= !bit;
                        if *tiers == 0 {
                            self.pending.remove(&(group, engine_hash));
                        }
                    }
                    None => unknown += 1,
                },
            }
        }
        // A hash listed twice: the second names a block gone already.
        let listed = gone.len();
        gone.sort_unstable_by_key(|(hash, _)| *hash);
        gone.dedup_by_key(|(hash, _)| *hash);
        unknown += listed - gone.len();
        self.drop_blocks(group, &gone);
        for (engine_hash, tiers) in retiered {
            if let Some(block) = self.group(group).and_then(|blocks| blocks.get(&engine_hash)).copied() {
                // Tiers seen twice in one event: both removals apply.
                self.set_tiers(group, engine_hash, block.tiers & tiers);
            }
        }
        self.index.set_size(self.key, self.len());
        unknown
    }

    /// Forgets held blocks (distinct engine hashes, as looked up now): each segment they lie in
    /// keeps its blocks before the first of them, and its other runs of blocks left become
    /// segments of their own.
    fn drop_blocks(&mut self, group: u32, gone: &[(u64, EngineBlock)]) {
        if gone.is_empty() {
            return;
        }
        let blocks = group_of(&mut self.groups, group);
        for (engine_hash, _) in gone {
            blocks.remove(engine_hash);
        }
        self.held -= gone.len();
        let mut cuts: SmallVec<[(u32, u32); 32]> =
            gone.iter().map(|(_, block)| (block.segment, u32::from(block.offset))).collect();
        cuts.sort_unstable();
        for cut in cuts.chunk_by(|a, b| a.0 == b.0) {
            let segment = cut[0].0;
            let len = self.segments[segment as usize].engines.len() as u32;
            // Runs left after the first cut, as offset ranges.
            let mut runs: SmallVec<[(u32, u32); 4]> = SmallVec::new();
            let mut start = cut[0].1 + 1;
            for &(_, offset) in &cut[1..] {
                if offset > start {
                    runs.push((start, offset));
                }
                start = offset + 1;
            }
            if start < len {
                runs.push((start, len));
            }
            for &(from, to) in &runs {
                self.split_off(group, segment, from, to);
            }
            self.truncate(segment, cut[0].1);
        }
    }

    /// Makes blocks `from..to` of `segment` a segment of their own (in the index too); the
    /// original keeps them until truncated.
    fn split_off(&mut self, group: u32, segment: u32, from: u32, to: u32) -> u32 {
        let meta = &self.segments[segment as usize];
        let (from, to) = (from as usize, to as usize);
        let engines: Vec<u64> = meta.engines[from..to].to_vec();
        let hashes: Vec<u64> = meta.contents[from..to].to_vec();
        let tiers = meta.tiers;
        let new = self.new_segment(hashes[0], tiers, 0);
        let blocks = group_of(&mut self.groups, group);
        for (offset, engine_hash) in engines.iter().enumerate() {
            let block = blocks.get_mut(engine_hash).expect("a segment's blocks are held");
            block.segment = new;
            block.offset = offset as u16;
        }
        let meta = &mut self.segments[new as usize];
        meta.engines = engines;
        meta.contents = hashes.clone();
        self.index.insert_segment(Segment {
            cache: self.key,
            id: new,
            credit: credit_of(&self.bits, tiers),
            hashes,
        });
        new
    }

    /// Keeps the first `len` blocks of `segment` (none: frees it).
    fn truncate(&mut self, segment: u32, len: u32) {
        let meta = &mut self.segments[segment as usize];
        self.index.truncate_segment(meta.key, self.key, segment, len as usize);
        if len == 0 {
            *meta = SegmentMeta::default();
            self.free.push(segment);
        } else {
            meta.engines.truncate(len as usize);
            meta.contents.truncate(len as usize);
            if meta.engines.capacity() > 4 * meta.engines.len() + 16 {
                meta.engines.shrink_to_fit();
                meta.contents.shrink_to_fit();
            }
        }
    }

    /// Forgets every block of this cache (`AllBlocksCleared`, an engine restart, a gap replay
    /// could not fill).
    pub fn clear(&mut self) {
        self.removed += self.held as u64;
        for (id, meta) in self.segments.iter().enumerate() {
            if !meta.engines.is_empty() {
                self.index.truncate_segment(meta.key, self.key, id as u32, 0);
            }
        }
        self.segments.clear();
        self.free.clear();
        self.groups.clear();
        self.pending.clear();
        self.held = 0;
        self.index.set_size(self.key, 0);
    }

    fn group(&self, group: u32) -> Option<&Group> {
        self.groups.iter().find(|(idx, _)| *idx == group).map(|(_, blocks)| blocks)
    }

    /// Sets a held block's tiers (never empty: a block no tier holds is forgotten). Queries read
    /// a segment's best tier weight only: a copy in a slower tier next to a GPU copy (every
    /// offloaded block) changes nothing there. A block whose weight changes becomes a segment
    /// of its own.
    fn set_tiers(&mut self, group: u32, engine_hash: u64, tiers: u16) {
        let bits = &self.bits;
        let Some(block) = group_of(&mut self.groups, group).get_mut(&engine_hash) else { return };
        let before = std::mem::replace(&mut block.tiers, tiers);
        if best_weight(bits, before) == best_weight(bits, tiers) {
            return;
        }
        let (segment, offset) = (block.segment, u32::from(block.offset));
        let len = self.segments[segment as usize].engines.len() as u32;
        if offset + 1 < len {
            self.split_off(group, segment, offset + 1, len);
        }
        let alone = match offset {
            0 => segment,
            _ => {
                let alone = self.split_off(group, segment, offset, offset + 1);
                self.truncate(segment, offset);
                alone
            }
        };
        if offset == 0 && len > 1 {
            self.truncate(segment, 1);
        }
        let meta = &mut self.segments[alone as usize];
        meta.tiers = tiers;
        self.index.set_segment_credit(meta.key, self.key, alone, credit_of(&self.bits, tiers));
    }

    /// The index's bit for a residency, cached by this writer.
    fn bit(&mut self, residency: &Residency) -> u16 {
        if let Some((_, bit, _)) = self.bits.iter().find(|(known, ..)| known == residency) {
            return *bit;
        }
        let bit = self.index.residency_bit(residency);
        let weight = self.index.tier_weights().weight(&residency.medium);
        self.bits.push((residency.clone(), bit, weight));
        bit
    }

    /// The GPU's bit, interned in this writer (for prompts held in flight).
    pub(crate) fn gpu_bit(&mut self) -> u16 {
        self.bit(&Residency::gpu())
    }
}

/// The blocks of `group`, created empty on first use.
fn group_of(groups: &mut SmallVec<[(u32, Group); 1]>, group: u32) -> &mut Group {
    let at = match groups.iter().position(|(idx, _)| *idx == group) {
        Some(at) => at,
        None => {
            groups.push((group, Group::default()));
            groups.len() - 1
        }
    };
    &mut groups[at].1
}

/// A segment's credit units per token at `tiers`.
fn credit_of(bits: &[(Residency, u16, f64)], tiers: u16) -> u32 {
    super::credit_units(best_weight(bits, tiers)) as u32
}

/// The best weight among `tiers` (the bits a writer interned).
fn best_weight(bits: &[(Residency, u16, f64)], tiers: u16) -> f64 {
    bits.iter().filter(|(_, bit, _)| tiers & bit != 0).map(|(_, _, weight)| *weight).fold(0.0, f64::max)
}

impl Drop for CacheBlocks {
    fn drop(&mut self) {
        self.clear();
    }
}
