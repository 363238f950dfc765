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

#[derive(Clone, Copy, Debug)]
struct EngineBlock {
    content: u64,
    /// One bit per residency holding the block.
    tiers: u16,
}

/// The engine blocks of one KV-cache group, by engine hash.
type Group = IntMap<u64, EngineBlock>;

/// How many engine blocks of this cache name one content (more than one is rare: an engine
/// hash reused, or keys kvgate does not model), the tiers they hold it in together, and what
/// the index's run of this block rests on.
#[derive(Clone, Copy, Debug)]
struct ContentRef {
    refs: u32,
    tiers: u16,
    /// The epoch `run` was computed in (as in the index's holder entry).
    epoch: u16,
    run: u32,
    /// Contents this cache holds whose parent is this one (counted while both are held).
    children: u32,
    /// The parent's content hash, and the parent's epoch when this block counted itself among
    /// its children (so a later holder of the parent's hash is not debited for it).
    parent: u64,
    parent_epoch: u16,
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
    contents: IntMap<u64, ContentRef>,
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
        let epoch = index.epoch_of(id.key()).min(EPOCH_LIMIT - 1);
        Self {
            index,
            id,
            key: id.key(),
            groups: SmallVec::new(),
            contents: IntMap::default(),
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
        self.contents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.contents.is_empty()
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
        for (i, &engine_hash) in stored.block_hashes.iter().enumerate() {
            let tokens = &stored.token_ids[i * block_size..(i + 1) * block_size];
            let after = &stored.lookahead[i * lookahead..(i + 1) * lookahead];
            let opaque = stored.opaque.get(i).copied().unwrap_or(0);
            let content = block_content(parent, tokens, after, opaque);
            let parent_content = std::mem::replace(&mut parent, content);
            match self.group(group).and_then(|blocks| blocks.get(&engine_hash)).copied() {
                Some(block) if block.content == content => {
                    self.set_tiers(group, engine_hash, block.tiers | bit)
                }
                Some(_) => {
                    // The engine reused a hash for other content: the old block is gone.
                    self.forget(group, engine_hash);
                    self.hold(group, engine_hash, content, parent_content, bit);
                }
                None => {
                    let tiers = bit | self.pending.remove(&(group, engine_hash)).unwrap_or(0);
                    self.hold(group, engine_hash, content, parent_content, tiers);
                }
            }
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
        for &engine_hash in block_hashes {
            match self.group(group).and_then(|blocks| blocks.get(&engine_hash)).copied() {
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
        self.index.set_size(self.key, self.len());
        unknown
    }

    /// Forgets every block of this cache (`AllBlocksCleared`, an engine restart, a gap replay
    /// could not fill).
    pub fn clear(&mut self) {
        for &content in self.contents.keys() {
            self.index.remove_holder(content, self.key);
        }
        self.groups.clear();
        self.contents.clear();
        self.pending.clear();
        self.index.set_size(self.key, 0);
    }

    fn group(&self, group: u32) -> Option<&Group> {
        self.groups.iter().find(|(idx, _)| *idx == group).map(|(_, blocks)| blocks)
    }

    fn group_mut(&mut self, group: u32) -> &mut Group {
        let at = match self.groups.iter().position(|(idx, _)| *idx == group) {
            Some(at) => at,
            None => {
                self.groups.push((group, Group::default()));
                self.groups.len() - 1
            }
        };
        &mut self.groups[at].1
    }

    fn hold(&mut self, group: u32, engine_hash: u64, content: u64, parent: u64, tiers: u16) {
        self.group_mut(group).insert(engine_hash, EngineBlock { content, tiers });
        if let Some(entry) = self.contents.get_mut(&content) {
            // Another engine hash for a content held already.
            let before = entry.tiers;
            entry.refs += 1;
            entry.tiers |= tiers;
            let after = entry.tiers;
            self.tiers_changed(content, before, after);
            return;
        }
        let weight = best_weight(&self.bits, tiers);
        let (run, parent_epoch) = match self.contents.get_mut(&parent) {
            Some(up) => {
                up.children += 1;
                let extends = up.epoch == self.epoch && best_weight(&self.bits, up.tiers) == weight;
                (if extends { up.run.saturating_add(1) } else { 1 }, up.epoch)
            }
            None => (1, 0),
        };
        let entry = ContentRef { refs: 1, tiers, epoch: self.epoch, run, children: 0, parent, parent_epoch };
        self.contents.insert(content, entry);
        self.index.set_holder(content, self.holder(entry));
    }

    fn holder(&self, entry: ContentRef) -> Holder {
        Holder { key: self.key, tiers: entry.tiers, epoch: entry.epoch, run: entry.run }
    }

    /// A held content's tiers went from `before` to `after`. Queries read a holder's best tier
    /// weight only: a copy in a slower tier next to a GPU copy (every offloaded block) changes
    /// nothing there, and costs no shard write. A changed weight ends the runs through this
    /// block (a new epoch when it has children) and restarts its own.
    fn tiers_changed(&mut self, content: u64, before: u16, after: u16) {
        if best_weight(&self.bits, before) == best_weight(&self.bits, after) {
            return;
        }
        let has_children = self.contents.get(&content).is_some_and(|entry| entry.children > 0);
        if has_children {
            self.next_epoch();
        }
        let epoch = self.epoch;
        let Some(entry) = self.contents.get_mut(&content) else { return };
        entry.run = 1;
        entry.epoch = epoch;
        let entry = *entry;
        self.index.set_holder(content, self.holder(entry));
    }

    /// Starts a new epoch: every run computed so far stops counting. Published before the change
    /// that caused it is applied, so no query trusts a run the change makes false. Once in 65,534
    /// times the numbers wrap: every entry is renumbered (run 1) first, and children recounted.
    fn next_epoch(&mut self) {
        if self.epoch + 1 < EPOCH_LIMIT {
            self.epoch += 1;
            self.index.set_epoch(self.key, self.epoch);
            return;
        }
        self.index.set_epoch(self.key, EPOCH_UNTRUSTED);
        self.epoch = 0;
        let mut children: IntMap<u64, u32> = IntMap::default();
        for entry in self.contents.values() {
            *children.entry(entry.parent).or_insert(0) += 1;
        }
        let contents: Vec<u64> = self.contents.keys().copied().collect();
        for content in contents {
            let Some(entry) = self.contents.get_mut(&content) else { continue };
            entry.run = 1;
            entry.epoch = 0;
            entry.parent_epoch = 0;
            entry.children = children.get(&content).copied().unwrap_or(0);
            let entry = *entry;
            self.index.set_holder(content, self.holder(entry));
        }
        self.index.set_epoch(self.key, 0);
    }

    /// Sets a held block's tiers (never empty: a block no tier holds is forgotten).
    fn set_tiers(&mut self, group: u32, engine_hash: u64, tiers: u16) {
        let blocks = self.group_mut(group);
        let Some(block) = blocks.get_mut(&engine_hash) else { return };
        block.tiers = tiers;
        let content = block.content;
        let Some(entry) = self.contents.get_mut(&content) else { return };
        // One engine block per content (the rule): its tiers are the content's. With more
        // (rare), tiers are only added until the others are gone.
        let before = entry.tiers;
        entry.tiers = if entry.refs == 1 { tiers } else { entry.tiers | tiers };
        let after = entry.tiers;
        self.tiers_changed(content, before, after);
    }

    fn forget(&mut self, group: u32, engine_hash: u64) {
        let Some(block) = self.group_mut(group).remove(&engine_hash) else { return };
        let Some(entry) = self.contents.get_mut(&block.content) else { return };
        entry.refs -= 1;
        if entry.refs > 0 {
            return;
        }
        let entry = *entry;
        if entry.children > 0 {
            // Runs through this block would claim it after it is gone.
            self.next_epoch();
        }
        if let Some(up) = self.contents.get_mut(&entry.parent) {
            if up.epoch == entry.parent_epoch {
                up.children = up.children.saturating_sub(1);
            }
        }
        self.contents.remove(&block.content);
        self.index.remove_holder(block.content, self.key);
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

/// The best weight among `tiers` (the bits a writer interned).
fn best_weight(bits: &[(Residency, u16, f64)], tiers: u16) -> f64 {
    bits.iter().filter(|(_, bit, _)| tiers & bit != 0).map(|(_, _, weight)| *weight).fold(0.0, f64::max)
}

impl Drop for CacheBlocks {
    fn drop(&mut self) {
        self.clear();
    }
}
