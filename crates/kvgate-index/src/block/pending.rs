//! Blocks of prompts in flight: a request routed to a worker will make its engine store the
//! prompt's blocks, but the engine's events say so only once prefill completes. Until the
//! request ends, its blocks count as held by that worker (under a rank of their own), so that
//! the next request sharing the prefix finds it instead of prefilling it a second time elsewhere.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nohash_hasher::IntMap;
use smallvec::SmallVec;

use super::cache::CacheBlocks;
use super::hash::Namespace;
use super::{BlockIndex, CacheId, PromptHashes};
use crate::TenantId;

/// The rank under which in-flight prompts are held (engines' own ranks are small numbers).
pub const IN_FLIGHT_RANK: u32 = u32::MAX;

/// In-flight prompt blocks of one model, written into the model's [`BlockIndex`].
#[derive(Debug)]
pub struct InFlightBlocks {
    index: Arc<BlockIndex>,
    workers: Mutex<HashMap<TenantId, Arc<Mutex<Worker>>>>,
    /// Numbers each worker's state, so a prompt added before its worker left undoes nothing
    /// after.
    generations: Mutex<u64>,
}

/// One worker's prompts in flight: a writer for its in-flight cache (the blocks' content hashes
/// serve as their engine hashes), and how many requests hold each block. Every request holds its
/// prompt from the first block, so along a chain the counts never grow: a block is new exactly
/// from the first one no request held, and leaves from the first one no request holds any more.
#[derive(Debug)]
struct Worker {
    writer: CacheBlocks,
    refs: IntMap<u64, u32>,
    generation: u64,
}

/// The blocks one request added; give it back to [`InFlightBlocks::remove`] when the request ends.
#[derive(Debug, Default)]
pub struct InFlightPrompt {
    worker: TenantId,
    generation: u64,
    chains: SmallVec<[Vec<u64>; 1]>,
}

impl InFlightBlocks {
    pub fn new(index: Arc<BlockIndex>) -> Self {
        Self { index, workers: Mutex::new(HashMap::new()), generations: Mutex::new(0) }
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
        let state = self.worker(worker);
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        let Worker { writer, refs, generation } = &mut *state;
        let mut prompt = InFlightPrompt { worker, generation: *generation, chains: SmallVec::new() };
        let gpu = writer.gpu_bit();
        for (_, hashes) in &prompt_hashes.chains {
            let mut first_new = hashes.len();
            for (i, &hash) in hashes.iter().enumerate() {
                let count = refs.entry(hash).or_insert(0);
                *count += 1;
                if *count == 1 {
                    first_new = first_new.min(i);
                }
            }
            if first_new < hashes.len() {
                // In flight means being prefilled on the GPU.
                let parent = first_new.checked_sub(1).map(|i| hashes[i]);
                let new = &hashes[first_new..];
                writer.store(0, parent, new, new, gpu);
            }
            prompt.chains.push(hashes.clone());
        }
        prompt
    }

    /// The request ended: its blocks are the engine's to report from now on.
    pub fn remove(&self, prompt: InFlightPrompt) {
        let Some(state) = self.workers.lock().unwrap_or_else(|p| p.into_inner()).get(&prompt.worker).cloned()
        else {
            return;
        };
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        let Worker { writer, refs, generation } = &mut *state;
        if *generation != prompt.generation {
            return;
        }
        let gpu = writer.gpu_bit();
        for hashes in &prompt.chains {
            let mut ended: SmallVec<[u64; 32]> = SmallVec::new();
            for &hash in hashes.iter().rev() {
                if let Some(count) = refs.get_mut(&hash) {
                    *count -= 1;
                    if *count == 0 {
                        refs.remove(&hash);
                        ended.push(hash);
                    }
                }
            }
            writer.remove(0, &ended, gpu);
        }
    }

    /// The worker left: drop its in-flight blocks (requests still running remove nothing more).
    pub fn remove_worker(&self, worker: TenantId) {
        let state = self.workers.lock().unwrap_or_else(|p| p.into_inner()).remove(&worker);
        if let Some(state) = state {
            let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
            state.writer.clear();
            state.refs.clear();
        }
    }

    /// The worker's in-flight state, created on first use.
    fn worker(&self, worker: TenantId) -> Arc<Mutex<Worker>> {
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        workers
            .entry(worker)
            .or_insert_with(|| {
                let mut generations = self.generations.lock().unwrap_or_else(|p| p.into_inner());
                *generations += 1;
                let id = CacheId { worker, rank: IN_FLIGHT_RANK };
                Arc::new(Mutex::new(Worker {
                    writer: CacheBlocks::new(self.index.clone(), id),
                    refs: IntMap::default(),
                    generation: *generations,
                }))
            })
            .clone()
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
