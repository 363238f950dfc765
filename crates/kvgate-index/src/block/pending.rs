//! Blocks of prompts in flight: a request routed to a worker will make its engine store the
//! prompt's blocks, but the engine's events say so only once prefill completes. Until the
//! request ends, its blocks count as held by that worker (under a rank of their own), so that
//! the next request sharing the prefix finds it instead of prefilling it a second time elsewhere.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::hash::Namespace;
use super::{BlockIndex, CacheId, Holder, PromptHashes, SHARDS};
use crate::TenantId;

/// The rank under which in-flight prompts are held (engines' own ranks are small numbers).
pub const IN_FLIGHT_RANK: u32 = u32::MAX;

/// Requests in flight per (block content hash, holder slot).
type Refs = HashMap<(u64, u32), u32>;

/// In-flight prompt blocks of one model, written into the model's [`BlockIndex`].
#[derive(Debug)]
pub struct InFlightBlocks {
    index: Arc<BlockIndex>,
    /// Per shard of the block's content hash.
    refs: Box<[Mutex<Refs>]>,
}

/// The blocks one request added; give it back to [`InFlightBlocks::remove`] when the request ends.
#[derive(Debug, Default)]
pub struct InFlightPrompt {
    worker: TenantId,
    hashes: Vec<u64>,
}

impl InFlightBlocks {
    pub fn new(index: Arc<BlockIndex>) -> Self {
        Self { index, refs: (0..SHARDS).map(|_| Mutex::new(Refs::default())).collect() }
    }

    /// Counts `tokens`' whole blocks (in `namespace`, cut as every layout the index walks) as
    /// held in GPU memory by `worker` until the returned prompt is removed. Nothing is added
    /// before the index knows a layout (no event seen yet).
    pub fn add(&self, worker: TenantId, tokens: &[u32], namespace: Namespace<'_>) -> InFlightPrompt {
        self.add_hashed(worker, &self.index.prompt_hashes(tokens, namespace))
    }

    /// [`add`](Self::add) from the prompt's hashes ([`BlockIndex::prompt_hashes`]), when the
    /// caller has them already (the gateway hashes a prompt once for its query and this).
    pub fn add_hashed(&self, worker: TenantId, prompt_hashes: &PromptHashes) -> InFlightPrompt {
        let slot = self.slot(worker);
        let blocks = prompt_hashes.chains.iter().map(|(_, hashes)| hashes.len()).sum();
        let mut prompt = InFlightPrompt { worker, hashes: Vec::with_capacity(blocks) };
        for (_, hashes) in &prompt_hashes.chains {
            for (i, &hash) in hashes.iter().enumerate() {
                prompt.hashes.push(hash);
                let mut refs = self.refs[self.index.shard_of(hash)].lock().unwrap_or_else(|p| p.into_inner());
                let count = refs.entry((hash, slot)).or_insert(0);
                *count += 1;
                if *count == 1 {
                    // In flight means being prefilled on the GPU: the GPU tier (bit 0). Each
                    // request holds its prompt from the first block, so the held blocks are
                    // always whole chains: the run is the block's position, never stale.
                    let ahead = (hashes.len() - 1 - i) as u32;
                    let holder = Holder { slot, tiers: 1, epoch: 0, run: (i + 1) as u32, ahead };
                    self.index.set_holder(hash, holder);
                }
            }
        }
        prompt
    }

    /// The request ended: its blocks are the engine's to report from now on.
    pub fn remove(&self, prompt: InFlightPrompt) {
        let key = self.slot(prompt.worker);
        for hash in prompt.hashes {
            let mut refs = self.refs[self.index.shard_of(hash)].lock().unwrap_or_else(|p| p.into_inner());
            if let Some(count) = refs.get_mut(&(hash, key)) {
                *count -= 1;
                if *count == 0 {
                    refs.remove(&(hash, key));
                    self.index.remove_holder(hash, key);
                }
            }
        }
    }

    /// The worker left: drop its in-flight blocks (requests still running remove nothing more).
    pub fn remove_worker(&self, worker: TenantId) {
        let key = self.slot(worker);
        for shard in self.refs.iter() {
            shard.lock().unwrap_or_else(|p| p.into_inner()).retain(|&(hash, holder), _| {
                if holder == key {
                    self.index.remove_holder(hash, key);
                }
                holder != key
            });
        }
    }

    /// The index's slot for `worker`'s prompts in flight.
    fn slot(&self, worker: TenantId) -> u32 {
        self.index.slot_of(CacheId { worker, rank: IN_FLIGHT_RANK }.key())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheBlocks, PrefixMatch, Residency, StoredBlocks};

    fn matched(index: &BlockIndex, tokens: &[u32], worker: TenantId) -> usize {
        let mut out = PrefixMatch::default();
        index.overlap(tokens, Namespace::BASE, &mut out);
        out.matched(worker)
    }

    #[test]
    fn in_flight_prompts_count_until_their_requests_end() {
        let index = Arc::new(BlockIndex::new());
        let in_flight = InFlightBlocks::new(index.clone());
        let tokens: Vec<u32> = (0..10).collect();
        let early = in_flight.add(1, &tokens, Namespace::BASE);
        assert_eq!(matched(&index, &tokens, 1), 0, "no block size known before the first event");
        in_flight.remove(early);
        let mut engine = CacheBlocks::new(index.clone(), CacheId { worker: 2, rank: 0 });
        let event = StoredBlocks {
            group: 0,
            block_hashes: &[9],
            parent_block_hash: None,
            token_ids: &[0, 1],
            block_size: 2,
            lookahead: &[],
            opaque: &[],
            namespace: Namespace::BASE,
            residency: &Residency::gpu(),
        };
        engine.apply_stored(event).unwrap();
        let first = in_flight.add(1, &tokens, Namespace::BASE);
        let second = in_flight.add(1, &tokens[..6], Namespace::BASE);
        assert_eq!((matched(&index, &tokens, 1), matched(&index, &tokens, 2)), (10, 2));
        in_flight.remove(first);
        assert_eq!(matched(&index, &tokens, 1), 6, "the shorter request is still in flight");
        in_flight.remove(second);
        assert_eq!(matched(&index, &tokens, 1), 0);
        assert_eq!(index.len(), 1, "only the engine's block is left");
        let third = in_flight.add(3, &tokens, Namespace::BASE);
        in_flight.remove_worker(3);
        assert_eq!(matched(&index, &tokens, 3), 0);
        in_flight.remove(third); // after its worker left: nothing to undo
        assert_eq!(index.len(), 1);
    }
}
