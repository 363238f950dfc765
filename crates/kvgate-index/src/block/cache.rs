//! One engine cache's side of the block index: per KV-cache group, the engine's own block hashes
//! mapped to kvgate's content hashes and the tiers holding each block, applied to the shared
//! index as stored and removed events arrive.

use std::collections::HashMap;
use std::sync::Arc;

use nohash_hasher::IntMap;
use smallvec::SmallVec;

use super::hash::{block_content, ChainRoot, Namespace};
use super::residency::Residency;
use super::{BlockIndex, CacheId, Holder, Layout, EPOCH_UNTRUSTED};

/// Epochs run below this, then wrap (tests wrap often, so the renumbering is exercised).
const EPOCH_LIMIT: u16 = if cfg!(test) { 5 } else { EPOCH_UNTRUSTED - 1 };

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

/// One engine block this cache holds: its content, the tiers holding it, and what the index's
/// run of its content rests on. Keyed by the engine's hash, so a store writes one entry here and
/// one holder in the shared index (a separate map by content cost a third write per block).
#[derive(Clone, Copy, Debug)]
struct EngineBlock {
    content: u64,
    /// The parent's engine hash (same group), when `has_parent`.
    parent: u64,
    /// One bit per residency holding the block.
    tiers: u16,
    /// The epoch `run` was computed in (as in the index's holder entry).
    epoch: u16,
    /// The parent's epoch when this block counted itself among its children (so a later
    /// block under the parent's hash is not debited for it).
    parent_epoch: u16,
    has_parent: bool,
    run: u32,
    /// Engine blocks of this cache whose parent is this one (counted while both are held).
    children: u32,
}

/// The engine blocks of one KV-cache group, by engine hash.
type Group = IntMap<u64, EngineBlock>;

/// A content named by more than one engine block of this cache (rare: an engine hash reused,
/// or keys kvgate does not model): how many beyond the first, and the tiers of them together
/// (only added to until the content is named once again).
#[derive(Clone, Copy, Debug)]
struct Shared {
    extra: u32,
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
    /// The cache's slot in the index (what its holder entries carry).
    pub(crate) slot: u32,
    groups: SmallVec<[(u32, Group); 1]>,
    /// Distinct contents held.
    distinct: usize,
    /// Contents named by more than one engine block.
    shared: IntMap<u64, Shared>,
    /// Tier copies named for blocks this cache does not hold (yet): an offload placeholder for
    /// a hash whose own store is missing. A later store of the hash picks them up.
    pending: HashMap<(u32, u64), u16>,
    /// This writer's view of the index's residency bits, with each one's tier weight.
    bits: Vec<(Residency, u16, f64)>,
    /// Most engine blocks held: what the engine can hold, as its host knows it.
    max_blocks: usize,
    /// This cache's epoch: runs computed in an earlier one are not trusted.
    epoch: u16,
}

impl CacheBlocks {
    /// The writer for cache `id` of `index`. Two writers for one cache would fight: keep one.
    pub fn new(index: Arc<BlockIndex>, id: CacheId) -> Self {
        // A writer after an earlier one for the same cache carries on its epochs.
        let slot = index.slot_of(id.key());
        let epoch = index.epoch_of(slot).min(EPOCH_LIMIT - 1);
        Self {
            index,
            id,
            key: id.key(),
            slot,
            groups: SmallVec::new(),
            distinct: 0,
            shared: IntMap::default(),
            pending: HashMap::new(),
            bits: Vec::new(),
            max_blocks: usize::MAX,
            epoch,
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

    /// kvgate's content hash of an engine block this cache holds.
    pub fn content_of(&self, group: u32, engine_hash: u64) -> Option<u64> {
        self.group(group).and_then(|blocks| blocks.get(&engine_hash)).map(|block| block.content)
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
                    content: block.content,
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
        let root = stored.parent_block_hash.is_none();
        let mut parent = match stored.parent_block_hash {
            None => ChainRoot { namespace: stored.namespace, group, lookahead: lookahead as u32 }.hash(),
            Some(engine_hash) => match self.content_of(group, engine_hash) {
                Some(content) => content,
                None => return Err(ApplyError::UnknownParent(engine_hash)),
            },
        };
        let continues = (!root).then_some(parent);
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
        let mut parent_engine = stored.parent_block_hash;
        for (i, &engine_hash) in stored.block_hashes.iter().enumerate() {
            let tokens = &stored.token_ids[i * block_size..(i + 1) * block_size];
            let after = &stored.lookahead[i * lookahead..(i + 1) * lookahead];
            let opaque = stored.opaque.get(i).copied().unwrap_or(0);
            let content = block_content(parent, tokens, after, opaque);
            parent = content;
            let up = parent_engine.replace(engine_hash);
            let ahead = (blocks - 1 - i) as u32;
            match self.group(group).and_then(|blocks| blocks.get(&engine_hash)).copied() {
                Some(block) if block.content == content => {
                    self.set_tiers(group, engine_hash, block.tiers | bit)
                }
                Some(_) => {
                    // The engine reused a hash for other content: the old block is gone.
                    self.forget(group, engine_hash);
                    self.hold(group, engine_hash, content, up, bit, ahead);
                }
                None => {
                    let pending = match self.pending.is_empty() {
                        true => 0,
                        false => self.pending.remove(&(group, engine_hash)).unwrap_or(0),
                    };
                    self.hold(group, engine_hash, content, up, bit | pending, ahead);
                }
            }
        }
        if let Some(parent) = continues.filter(|_| blocks > 0) {
            self.index.extend_ahead(parent, self.slot, blocks as u32);
        }
        self.index.set_size(self.key, self.len());
        Ok(())
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
        let mut unknown = 0;
        // Blocks leaving with children still held wait for the end of the event: engines list a
        // chain's blocks parent first or leaf first, and taken leaf first no run through them
        // is broken, so the cache's epoch (every run it has) survives a chain's eviction.
        let mut deferred: SmallVec<[u64; 32]> = SmallVec::new();
        for &engine_hash in block_hashes {
            match self.group(group).and_then(|blocks| blocks.get(&engine_hash)).copied() {
                Some(block) if block.tiers & !bit == 0 && block.children > 0 => deferred.push(engine_hash),
                Some(block) if block.tiers & !bit == 0 => self.forget(group, engine_hash),
                Some(block) => self.set_tiers(group, engine_hash, block.tiers & !bit),
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
        for &engine_hash in deferred.iter().rev() {
            self.forget(group, engine_hash);
        }
        self.index.set_size(self.key, self.len());
        unknown
    }

    /// Forgets every block of this cache (`AllBlocksCleared`, an engine restart, a gap replay
    /// could not fill).
    pub fn clear(&mut self) {
        for (_, blocks) in &self.groups {
            for block in blocks.values() {
                self.index.remove_holder(block.content, self.slot);
            }
        }
        self.groups.clear();
        self.shared.clear();
        self.pending.clear();
        self.distinct = 0;
        self.index.set_size(self.key, 0);
    }

    fn group(&self, group: u32) -> Option<&Group> {
        self.groups.iter().find(|(idx, _)| *idx == group).map(|(_, blocks)| blocks)
    }

    /// Holds a new engine block (its hash not held in `group`), under the engine block `parent`.
    /// `ahead`: blocks of its event after it (the holder's hint).
    fn hold(
        &mut self,
        group: u32,
        engine_hash: u64,
        content: u64,
        parent: Option<u64>,
        tiers: u16,
        ahead: u32,
    ) {
        let (bits, epoch) = (&self.bits, self.epoch);
        let weight = best_weight(bits, tiers);
        let blocks = group_of(&mut self.groups, group);
        let (run, parent_epoch) = match parent.and_then(|up| blocks.get_mut(&up)) {
            Some(up) => {
                up.children += 1;
                let extends = up.epoch == epoch && best_weight(bits, up.tiers) == weight;
                (if extends { up.run.saturating_add(1) } else { 1 }, up.epoch)
            }
            None => (1, 0),
        };
        let block = EngineBlock {
            content,
            parent: parent.unwrap_or(0),
            tiers,
            epoch,
            parent_epoch,
            has_parent: parent.is_some(),
            run,
            children: 0,
        };
        blocks.insert(engine_hash, block);
        let Some(held) =
            self.index.insert_holder(content, Holder { slot: self.slot, tiers, epoch, run, ahead })
        else {
            self.distinct += 1;
            return;
        };
        // Another engine block of this cache names this content already: the holder keeps its
        // run and gains the tiers. (A run through this content vouches for the engine blocks'
        // own tiers, which the holder's include, so it never credits more than they hold.)
        let shared = self.shared.entry(content).or_insert(Shared { extra: 0, tiers: held.tiers });
        shared.extra += 1;
        let before = shared.tiers;
        shared.tiers |= tiers;
        let after = shared.tiers;
        self.holder_weight_changed(content, before, after);
    }

    /// The holder of a content named by several engine blocks gained tiers: when its weight
    /// changed, its run restarts at the new weight.
    fn holder_weight_changed(&mut self, content: u64, before: u16, after: u16) {
        if best_weight(&self.bits, before) != best_weight(&self.bits, after) {
            let holder = Holder { slot: self.slot, tiers: after, epoch: self.epoch, run: 1, ahead: 0 };
            self.index.set_holder(content, holder);
        }
    }

    /// Starts a new epoch: every run computed so far stops counting. Published before the change
    /// that caused it is applied, so no query trusts a run the change makes false. Once in 65,534
    /// times the numbers wrap: every entry is renumbered (run 1) first, and children recounted.
    fn next_epoch(&mut self) {
        if self.epoch + 1 < EPOCH_LIMIT {
            self.epoch += 1;
            self.index.set_epoch(self.slot, self.epoch);
            return;
        }
        self.index.set_epoch(self.slot, EPOCH_UNTRUSTED);
        self.epoch = 0;
        let (index, shared, slot) = (&self.index, &self.shared, self.slot);
        for (_, blocks) in self.groups.iter_mut() {
            let mut children: IntMap<u64, u32> = IntMap::default();
            for block in blocks.values().filter(|block| block.has_parent) {
                *children.entry(block.parent).or_insert(0) += 1;
            }
            for (engine_hash, block) in blocks.iter_mut() {
                block.run = 1;
                block.epoch = 0;
                block.parent_epoch = 0;
                block.children = children.get(engine_hash).copied().unwrap_or(0);
                let tiers = shared.get(&block.content).map_or(block.tiers, |shared| shared.tiers);
                index.set_holder(block.content, Holder { slot, tiers, epoch: 0, run: 1, ahead: 0 });
            }
        }
        self.index.set_epoch(self.slot, 0);
    }

    /// Sets a held block's tiers (never empty: a block no tier holds is forgotten). Queries read
    /// a holder's best tier weight only: a copy in a slower tier next to a GPU copy (every
    /// offloaded block) changes nothing there, and costs no shard write. A changed weight ends
    /// the runs through this block (a new epoch when it has children) and restarts its own.
    fn set_tiers(&mut self, group: u32, engine_hash: u64, tiers: u16) {
        let bits = &self.bits;
        let Some(block) = group_of(&mut self.groups, group).get_mut(&engine_hash) else { return };
        let before = std::mem::replace(&mut block.tiers, tiers);
        let (content, children) = (block.content, block.children);
        let changed = best_weight(bits, before) != best_weight(bits, tiers);
        if changed {
            if children > 0 {
                self.next_epoch();
            }
            let epoch = self.epoch;
            if let Some(block) = group_of(&mut self.groups, group).get_mut(&engine_hash) {
                block.run = 1;
                block.epoch = epoch;
            }
        }
        match self.shared.get_mut(&content) {
            Some(shared) => {
                let before = shared.tiers;
                shared.tiers |= tiers;
                let after = shared.tiers;
                self.holder_weight_changed(content, before, after);
            }
            None if changed => {
                let holder = Holder { slot: self.slot, tiers, epoch: self.epoch, run: 1, ahead: 0 };
                self.index.set_holder(content, holder);
            }
            None => {}
        }
    }

    fn forget(&mut self, group: u32, engine_hash: u64) {
        let blocks = group_of(&mut self.groups, group);
        let Some(block) = blocks.remove(&engine_hash) else { return };
        if block.has_parent {
            if let Some(up) = blocks.get_mut(&block.parent) {
                if up.epoch == block.parent_epoch {
                    up.children = up.children.saturating_sub(1);
                }
            }
        }
        if block.children > 0 {
            // Runs through this block would claim it after it is gone.
            self.next_epoch();
        }
        if let Some(shared) = self.shared.get_mut(&block.content) {
            // Another engine block still names the content.
            shared.extra -= 1;
            if shared.extra == 0 {
                self.shared.remove(&block.content);
            }
            return;
        }
        self.distinct -= 1;
        self.index.remove_holder(block.content, self.slot);
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

/// The best weight among `tiers` (the bits a writer interned).
fn best_weight(bits: &[(Residency, u16, f64)], tiers: u16) -> f64 {
    bits.iter().filter(|(_, bit, _)| tiers & bit != 0).map(|(_, _, weight)| *weight).fold(0.0, f64::max)
}

impl Drop for CacheBlocks {
    fn drop(&mut self) {
        self.clear();
    }
}
