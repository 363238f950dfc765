//! The pooled cache references of a trace: what one cache as large as the whole fleet's KV would serve with LRU eviction (the pooled-LRU reference) and with clairvoyant eviction (the pooled-Belady bound).
//!
//! Both replay the requests one at a time in arrival order through a single cache of whole
//! [`MOONCAKE_BLOCK_TOKENS`]-token trace blocks (`shared/bench/SCENARIOS.md`). The definitions,
//! chosen to match the figures given there (LRU 8.9% / 5.6% / 27.1%, Belady 32.8% / 25.9% /
//! 37.4% on the conversation trace for fleets of 8 x 262,144 / 131,072 / 1,048,576 tokens):
//!
//! - A block is keyed, as for the infinite-cache ceiling, by its whole prefix (block ids up to and
//!   including it), so a block id that follows another prefix is another block. Only the blocks
//!   covering `input_length` take part.
//! - The cache holds `capacity_tokens / 512` blocks (rounded down); a partial last block takes a
//!   whole block of capacity.
//! - A request is looked up before anything of it is placed: its hit is the tokens of its leading
//!   blocks found in the cache (prefix semantics, as for the ceiling: a block found after a missing
//!   one does not count), at most `input_length`. Then its blocks are placed in prompt order: a
//!   block found is refreshed, a missing one inserted, evicting one block first when the cache is
//!   full. Every block is placed (there is no bypass: an engine holds the whole prompt to prefill
//!   it), so a prompt longer than the cache evicts its own first blocks.
//! - LRU evicts the block used longest ago (a hit is a use). Belady evicts the block whose next
//!   use (the next request, in arrival order, whose prompt has it) is furthest away, never-again
//!   first; among blocks next used by the same request, the one used longest ago goes first
//!   (LRU among ties). That tie-break reproduces SCENARIOS.md's figures; evicting the deepest
//!   block of such a tie first (what Belady over the flat stream of block references does) keeps
//!   more leading blocks and serves a little more (33.1% / 26.2% / 37.4%).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use crate::trace::{prefix_chain, Trace, TraceRequest, MOONCAKE_BLOCK_TOKENS};

/// What one pooled cache of `capacity_tokens` serves of a trace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheReference {
    pub capacity_tokens: u64,
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
}

impl CacheReference {
    /// Cached over prompt tokens, in [0, 1].
    pub fn rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }

    fn count(&mut self, request: &TraceRequest, matched_blocks: usize) {
        let cached = (matched_blocks as u64).saturating_mul(MOONCAKE_BLOCK_TOKENS as u64);
        self.cached_tokens += cached.min(u64::from(request.input_length));
        self.prompt_tokens += u64::from(request.input_length);
    }
}

/// The prompt's blocks as prefix keys, only those covering `input_length`.
fn prompt_blocks(request: &TraceRequest) -> Vec<u64> {
    let covering = (request.input_length as usize).div_ceil(MOONCAKE_BLOCK_TOKENS);
    prefix_chain(&request.hash_ids[..covering.min(request.hash_ids.len())])
}

/// Whole blocks that fit in `capacity_tokens`.
fn capacity_blocks(capacity_tokens: u64) -> usize {
    usize::try_from(capacity_tokens / MOONCAKE_BLOCK_TOKENS as u64).unwrap_or(usize::MAX)
}

impl Trace {
    /// The pooled-LRU reference: what one LRU cache of `capacity_tokens` (the whole fleet's KV)
    /// serves of the trace (see the module's definitions). O(blocks log blocks).
    pub fn pooled_lru(&self, capacity_tokens: u64) -> CacheReference {
        let mut cache = Lru::new(capacity_blocks(capacity_tokens));
        let mut reference = CacheReference { capacity_tokens, ..CacheReference::default() };
        for index in self.arrival_order() {
            let request = &self.requests[index];
            let blocks = prompt_blocks(request);
            reference.count(request, blocks.iter().take_while(|&&block| cache.contains(block)).count());
            for block in blocks {
                cache.touch(block);
            }
        }
        reference
    }

    /// The pooled-Belady bound: what one cache of `capacity_tokens` that evicts the block used
    /// again furthest in the future serves of the trace (see the module's definitions).
    /// O(blocks log blocks).
    pub fn pooled_belady(&self, capacity_tokens: u64) -> CacheReference {
        let order = self.arrival_order();
        let prompts: Vec<Vec<u64>> = order.iter().map(|&i| prompt_blocks(&self.requests[i])).collect();
        let next_uses = next_uses(&prompts);
        let mut cache = Belady::new(capacity_blocks(capacity_tokens));
        let mut reference = CacheReference { capacity_tokens, ..CacheReference::default() };
        let mut tick = 0u64;
        for ((&index, blocks), next) in order.iter().zip(&prompts).zip(&next_uses) {
            let matched = blocks.iter().take_while(|&&block| cache.contains(block)).count();
            reference.count(&self.requests[index], matched);
            for (&block, &next_use) in blocks.iter().zip(next) {
                tick += 1;
                cache.place(block, Rank { next_use, last_use: Reverse(tick) });
            }
        }
        reference
    }
}

/// For each prompt (in replay order) and block, the index of the next prompt holding that block
/// (`usize::MAX`: never).
fn next_uses(prompts: &[Vec<u64>]) -> Vec<Vec<usize>> {
    let mut seen_at: HashMap<u64, usize> = HashMap::new();
    let mut next_uses = vec![Vec::new(); prompts.len()];
    for (index, blocks) in prompts.iter().enumerate().rev() {
        next_uses[index] =
            blocks.iter().map(|block| seen_at.get(block).copied().unwrap_or(usize::MAX)).collect();
        for &block in blocks {
            seen_at.insert(block, index);
        }
    }
    next_uses
}

/// A cache of block keys evicting the least recently used.
struct Lru {
    capacity: usize,
    /// Block → the tick of its last use.
    last_use: HashMap<u64, u64>,
    /// Tick of last use → block, oldest first.
    by_age: BTreeMap<u64, u64>,
    tick: u64,
}

impl Lru {
    fn new(capacity: usize) -> Lru {
        Lru { capacity, last_use: HashMap::new(), by_age: BTreeMap::new(), tick: 0 }
    }

    fn contains(&self, block: u64) -> bool {
        self.last_use.contains_key(&block)
    }

    /// Marks `block` used now, inserting it (and evicting the oldest if full) when absent.
    fn touch(&mut self, block: u64) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        if let Some(previous) = self.last_use.insert(block, self.tick) {
            self.by_age.remove(&previous);
        } else if self.last_use.len() > self.capacity {
            if let Some((_, oldest)) = self.by_age.pop_first() {
                self.last_use.remove(&oldest);
            }
        }
        self.by_age.insert(self.tick, block);
    }
}

/// Eviction order of a block in the Belady cache: the greatest goes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    /// Index of the next prompt holding the block (`usize::MAX`: never).
    next_use: usize,
    /// When the block was last placed (unique), reversed: of blocks with the same next use, the
    /// one used longest ago goes first.
    last_use: Reverse<u64>,
}

/// A cache of block keys evicting the block used again furthest in the future.
struct Belady {
    capacity: usize,
    ranks: HashMap<u64, Rank>,
    /// Every resident block by rank (ranks are unique).
    by_rank: BTreeSet<(Rank, u64)>,
}

impl Belady {
    fn new(capacity: usize) -> Belady {
        Belady { capacity, ranks: HashMap::new(), by_rank: BTreeSet::new() }
    }

    fn contains(&self, block: u64) -> bool {
        self.ranks.contains_key(&block)
    }

    /// Places `block` with its new rank; when absent and the cache is full, first evicts the
    /// resident block of greatest rank.
    fn place(&mut self, block: u64, rank: Rank) {
        if self.capacity == 0 {
            return;
        }
        match self.ranks.get(&block) {
            Some(&previous) => {
                self.by_rank.remove(&(previous, block));
            }
            None if self.ranks.len() >= self.capacity => {
                if let Some((_, victim)) = self.by_rank.pop_last() {
                    self.ranks.remove(&victim);
                }
            }
            None => {}
        }
        self.ranks.insert(block, rank);
        self.by_rank.insert((rank, block));
    }
}

#[cfg(test)]
mod tests;
