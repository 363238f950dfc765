//! The engine: FIFO admission against the KV pool (or by request priority, with
//! `priority_scheduling`), chunked prefill with priority over batched decode (or, with
//! `mixed_batching`, the running decodes carried in every prefill step), and the request
//! lifecycle, advanced by an injected clock.

mod pd;
mod report;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

use crate::block_hash::adapter_block_hashes;
use crate::blocks::{BlockPool, PendingBlocks};
use crate::config::EngineConfig;
use crate::events::{
    EngineOutput, EngineRequest, KvEvent, KvEventBatch, KvEventLog, PdStage, RejectReason, RequestStats, Tier,
};
use crate::load::ThroughputWindow;
use crate::offload::HostTier;

/// A discrete-event model of one serving engine replica.
///
/// Time is the caller's: `u64` microseconds since any epoch, never decreasing between calls.
/// The host submits requests, asks `next_event_time` when the running scheduler step ends, and
/// calls `advance` at (or after) that time; both append `EngineOutput`s in time order.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    pool: BlockPool,
    /// The host-memory tier, with `cpu_offload_tokens`.
    host: Option<HostTier>,
    slots: Vec<Option<Request>>,
    free_slots: Vec<usize>,
    slot_by_id: BTreeMap<u64, usize>,
    /// Requests on their way through the front end (`frontend_latency_ms`): when each reaches
    /// the scheduler's queue, in submission order.
    arriving: VecDeque<(u64, usize)>,
    waiting: VecDeque<usize>,
    prefilling: VecDeque<usize>,
    decoding: Vec<usize>,
    /// (decode step at which the request's last token is produced, id, slot), earliest first.
    finish_queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    /// Decode steps completed so far.
    decode_steps: u64,
    step: Option<Step>,
    /// The chunks of the running prefill step (a reused buffer).
    prefill_work: Vec<PrefillChunk>,
    /// Set when admission may have become possible (a submit, a release, a cache store).
    admission_pending: bool,
    /// The block hashes of the prompts queued or prefilling (for the uncached estimate of a
    /// request submitted behind them).
    pending_blocks: PendingBlocks,
    kv_events: KvEventLog,
    evicted: Vec<u64>,
    /// KV of finished `PdStage::Prefill` requests, by id, until `release_held`.
    held: BTreeMap<u64, pd::HeldBlocks>,
    /// Set when a `PdStage::Decode` request starts decoding; cleared by the decode step that
    /// gives it (and every other such request) its first token.
    transferred_awaiting_first_token: bool,
    throughput: ThroughputWindow,
    waiting_uncached_tokens: u64,
    admitted_prefill_tokens: u64,
    total_prompt_tokens: u64,
    total_cached_tokens: u64,
    total_generated_tokens: u64,
}

#[derive(Debug)]
struct Request {
    id: u64,
    /// Kept until prefill completes (for `BlockStored` token ids), then dropped.
    prompt: Vec<u32>,
    prompt_len: u32,
    output_tokens: u32,
    /// Hashes of the prompt's full blocks (empty without prefix cache).
    block_hashes: Vec<u64>,
    /// The adapter the request runs with.
    lora: Option<crate::events::LoraAdapter>,
    /// Lower first, with `priority_scheduling`.
    priority: i32,
    total_blocks: u64,
    /// Blocks held outside the cache.
    private_blocks: u64,
    /// `block_hashes[..referenced_blocks]` are cached blocks this request references.
    referenced_blocks: usize,
    cached_tokens: u32,
    /// Of `cached_tokens`, those loaded back from the host tier.
    offloaded_tokens: u32,
    /// Uncached tokens estimated at submission (counted in `waiting_uncached_tokens`).
    uncached_estimate: u32,
    arrival_us: u64,
    admitted_us: u64,
    first_token_us: u64,
    stage: PdStage,
    /// A `PdStage::Decode` request whose first token the next decode step produces.
    awaiting_first_token: bool,
    phase: Phase,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Waiting,
    Prefilling {
        remaining: u32,
    },
    Decoding {
        /// Decode step at which the last token is produced.
        finish_step: u64,
        /// Index in `Engine::decoding`.
        position: usize,
    },
}

#[derive(Clone, Copy, Debug)]
struct Step {
    start_us: u64,
    end_us: u64,
    kind: StepKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StepKind {
    /// Prefill chunks, and with `decodes` every running decode one token (`mixed_batching`).
    Prefill {
        decodes: bool,
    },
    Decode,
}

#[derive(Clone, Copy, Debug)]
struct PrefillChunk {
    slot: usize,
    id: u64,
    tokens: u32,
}

impl Engine {
    /// An idle engine with an empty cache. The config should have passed `validate()`;
    /// zero-valued fields are clamped so the engine still makes progress.
    pub fn new(config: EngineConfig) -> Self {
        let config = EngineConfig {
            block_size: config.block_size.max(1),
            prefill_chunk_tokens: config.prefill_chunk_tokens.max(1),
            max_running_requests: config.max_running_requests.max(1),
            ..config
        };
        let host_blocks = config.cpu_offload_blocks() as usize;
        Self {
            pool: BlockPool::new(config.capacity_blocks()),
            host: (host_blocks > 0).then(|| HostTier::new(host_blocks)),
            kv_events: KvEventLog::new(config.emit_kv_events),
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            slot_by_id: BTreeMap::new(),
            arriving: VecDeque::new(),
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            decoding: Vec::new(),
            finish_queue: BinaryHeap::new(),
            decode_steps: 0,
            step: None,
            prefill_work: Vec::new(),
            admission_pending: false,
            pending_blocks: PendingBlocks::default(),
            evicted: Vec::new(),
            held: BTreeMap::new(),
            transferred_awaiting_first_token: false,
            throughput: ThroughputWindow::default(),
            waiting_uncached_tokens: 0,
            admitted_prefill_tokens: 0,
            total_prompt_tokens: 0,
            total_cached_tokens: 0,
            total_generated_tokens: 0,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// When the running scheduler step ends, or, with no step running, when the next request
    /// through the front end reaches the queue; `None` when the engine is idle.
    pub fn next_event_time(&self) -> Option<u64> {
        match self.step {
            Some(step) => Some(step.end_us),
            None => self.arriving.front().map(|&(ready, _)| ready),
        }
    }

    /// Leading tokens of `prompt` whose KV blocks are in the prefix cache now (whole blocks,
    /// before the engine's cap of `prompt - 1` cached tokens): the ground truth a prefix index
    /// is checked against.
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        let block_size = self.config.block_size as usize;
        let hashes = crate::prompt_block_hashes(prompt, block_size);
        self.pool.match_prefix(&hashes) * block_size
    }

    /// Blocks in the prefix cache (the GPU tier's), as its KV events describe them.
    pub fn cached_blocks(&self) -> usize {
        self.pool.cached_blocks() as usize
    }

    /// Requests in the engine (queued or admitted).
    pub fn num_requests(&self) -> usize {
        self.slot_by_id.len()
    }

    /// Advances to `now`, then queues `request`. A request that can never fit is answered at
    /// once with `EngineOutput::Rejected`. An idle engine starts a step at `now`; otherwise the
    /// request is considered when the running step ends (requests arriving at the same instant
    /// as a step's start join that step).
    pub fn submit(&mut self, now: u64, request: EngineRequest, out: &mut Vec<EngineOutput>) {
        self.submit_as(now, request, PdStage::Regular, out);
    }

    /// `submit` for one half of a disaggregated request (see [`PdStage`]): `Prefill` holds the
    /// request's KV after it finishes until `release_held(id)`, `Decode` admits a request whose
    /// prompt KV was transferred in and skips its prefill. The id stays taken while its KV is
    /// held (a new request with it is rejected as a duplicate).
    pub fn submit_as(
        &mut self,
        now: u64,
        request: EngineRequest,
        stage: PdStage,
        out: &mut Vec<EngineOutput>,
    ) {
        self.advance(now, out);
        let EngineRequest { id, prompt, output_tokens, lora, priority } = request;
        let output_tokens = output_tokens.max(1);
        let block_size = u64::from(self.config.block_size);
        let required_tokens = prompt.len() as u64 + u64::from(output_tokens);
        let total_blocks = required_tokens.div_ceil(block_size);
        let reject = if prompt.is_empty() {
            Some(RejectReason::EmptyPrompt)
        } else if self.slot_by_id.contains_key(&id) || self.held.contains_key(&id) {
            Some(RejectReason::DuplicateId)
        } else if total_blocks > self.pool.capacity_blocks() || prompt.len() > u32::MAX as usize {
            Some(RejectReason::ExceedsKvCapacity {
                required_tokens,
                capacity_tokens: self.pool.capacity_blocks() * block_size,
            })
        } else {
            None
        };
        if let Some(reason) = reject {
            out.push(EngineOutput::Rejected { id, reason });
            return;
        }
        let prompt_len = prompt.len() as u32;
        let block_hashes = if self.config.prefix_cache {
            adapter_block_hashes(&prompt, self.config.block_size as usize, lora.as_ref())
        } else {
            Vec::new()
        };
        // The estimate counts as cached what the prompts ahead will have cached by the time
        // this one starts (their prefills run first): a burst sharing a prefix is counted once;
        // a prefix in the host tier loads back instead of being recomputed.
        let uncached_estimate = match stage {
            PdStage::Decode => 0,
            PdStage::Regular | PdStage::Prefill => {
                let matched = self.pending_blocks.match_prefix(&self.pool, &block_hashes);
                let in_host = self.host.as_ref().map_or(0, |host| host.peek_prefix(&block_hashes[matched..]));
                self.pending_blocks.add(&block_hashes);
                prompt_len - self.cached_tokens_for(matched + in_host, prompt_len)
            }
        };
        self.waiting_uncached_tokens += u64::from(uncached_estimate);
        let request = Request {
            id,
            prompt,
            prompt_len,
            output_tokens,
            block_hashes,
            lora,
            priority,
            total_blocks,
            private_blocks: 0,
            referenced_blocks: 0,
            cached_tokens: 0,
            offloaded_tokens: 0,
            uncached_estimate,
            arrival_us: now,
            admitted_us: 0,
            first_token_us: 0,
            stage,
            awaiting_first_token: false,
            phase: Phase::Waiting,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(request);
                slot
            }
            None => {
                self.slots.push(Some(request));
                self.slots.len() - 1
            }
        };
        self.slot_by_id.insert(id, slot);
        let latency = self.config.frontend_latency_us();
        if latency > 0 {
            // Queued when it is through the front end (`advance` at `next_event_time`).
            self.arriving.push_back((now + latency, slot));
            return;
        }
        let position = self.queue_position(&self.waiting, priority);
        self.waiting.insert(position, slot);
        self.admission_pending = true;
        // An idle engine starts at once; a step that started at this very instant is planned
        // again so that simultaneous arrivals share it (nothing of it has run yet).
        if self.step.is_none_or(|step| step.start_us == now) {
            self.step = None;
            self.schedule(now);
        }
    }

    /// Completes every scheduler step that ends at or before `now`, appending their outputs (and
    /// queues the requests through the front end by then, an idle engine starting at once).
    pub fn advance(&mut self, now: u64, out: &mut Vec<EngineOutput>) {
        loop {
            let Some(step) = self.step else {
                match self.arriving.front() {
                    Some(&(ready, _)) if ready <= now => {
                        self.queue_arrived(ready);
                        self.schedule(ready);
                        continue;
                    }
                    _ => break,
                }
            };
            if step.end_us > now {
                break;
            }
            self.queue_arrived(step.end_us);
            self.step = None;
            match step.kind {
                StepKind::Prefill { decodes } => {
                    // The decodes first: the prefills this step completes start decoding after it.
                    if decodes {
                        self.complete_decode(step.end_us, out);
                    }
                    self.complete_prefill(step.end_us, out);
                }
                StepKind::Decode => self.complete_decode(step.end_us, out),
            }
            self.schedule(step.end_us);
        }
    }

    /// Moves the requests through the front end by `at_us` into the scheduler's queue.
    fn queue_arrived(&mut self, at_us: u64) {
        while let Some(&(ready, slot)) = self.arriving.front() {
            if ready > at_us {
                break;
            }
            self.arriving.pop_front();
            let priority = self.slots[slot].as_ref().expect("arriving slots are live").priority;
            let position = self.queue_position(&self.waiting, priority);
            self.waiting.insert(position, slot);
            self.admission_pending = true;
        }
    }

    /// Drops request `id` (client disconnect), releasing its blocks. Emits nothing; returns
    /// whether the request was in the engine. A step already running still takes its time.
    /// KV held after a `PdStage::Prefill` request finished is not touched (see `release_held`).
    pub fn cancel(&mut self, id: u64) -> bool {
        let Some(slot) = self.slot_by_id.remove(&id) else {
            return false;
        };
        let request = self.slots[slot].take().expect("indexed slots are live");
        self.free_slots.push(slot);
        if matches!(request.phase, Phase::Waiting | Phase::Prefilling { .. })
            && request.stage != PdStage::Decode
        {
            self.pending_blocks.remove(&request.block_hashes);
        }
        match request.phase {
            Phase::Waiting => {
                remove_value(&mut self.waiting, slot);
                self.arriving.retain(|&(_, arriving)| arriving != slot);
                self.waiting_uncached_tokens -= u64::from(request.uncached_estimate);
                self.admission_pending = true;
                return true;
            }
            Phase::Prefilling { remaining } => {
                remove_value(&mut self.prefilling, slot);
                self.admitted_prefill_tokens -= u64::from(remaining);
            }
            Phase::Decoding { position, .. } => self.remove_from_decoding(position),
        }
        self.pool.release(&request.block_hashes[..request.referenced_blocks], request.private_blocks);
        self.admission_pending = true;
        true
    }

    /// KV event batches recorded since the last drain, oldest first.
    pub fn drain_kv_events(&mut self) -> Vec<KvEventBatch> {
        self.kv_events.drain()
    }

    /// Clears the prefix cache (emitting `AllBlocksCleared`) if no cached block is in use;
    /// returns whether it did.
    pub fn reset_prefix_cache(&mut self, now: u64) -> bool {
        if !self.pool.clear_if_unreferenced() {
            return false;
        }
        if let Some(host) = &mut self.host {
            host.clear();
        }
        self.kv_events.push(KvEvent::AllBlocksCleared);
        self.kv_events.flush(now);
        true
    }

    /// Cached prompt tokens for `matched` full cached blocks: whole blocks within the prompt's
    /// first `len - 1` tokens, as vLLM and SGLang serve them (the last prompt token is always
    /// computed, and a hit is block-aligned: vLLM 0.32 `kv_cache_manager.py`,
    /// `max_cache_hit_length = num_tokens - 1`; SGLang `max_prefix_len = input_len - 1`).
    fn cached_tokens_for(&self, matched: usize, prompt_len: u32) -> u32 {
        let block_size = u64::from(self.config.block_size.max(1));
        let servable_blocks = u64::from(prompt_len.saturating_sub(1)) / block_size;
        ((matched as u64).min(servable_blocks) * block_size) as u32
    }

    fn running(&self) -> usize {
        self.prefilling.len() + self.decoding.len()
    }

    /// Where a request of `priority` joins `queue` (of slots): at the end first come, first
    /// served; with `priority_scheduling`, after every request as urgent or more (vLLM's
    /// priority queue orders by `(priority, arrival_time)`: `vllm/v1/core/sched/request_queue.py`).
    fn queue_position(&self, queue: &VecDeque<usize>, priority: i32) -> usize {
        if !self.config.priority_scheduling {
            return queue.len();
        }
        let priority_of =
            |slot: usize| self.slots[slot].as_ref().map_or(i32::MIN, |request| request.priority);
        queue.len() - queue.iter().rev().take_while(|&&slot| priority_of(slot) > priority).count()
    }

    /// Prefill tokens admitted and not yet computed that go before a request of `priority`:
    /// all of them first come, first served; with `priority_scheduling`, those of requests as
    /// urgent or more (a less urgent prefill yields the step's budget to it).
    fn prefill_tokens_ahead(&self, priority: i32) -> u64 {
        if !self.config.priority_scheduling {
            return self.admitted_prefill_tokens;
        }
        self.prefilling
            .iter()
            .filter_map(|&slot| self.slots[slot].as_ref())
            .filter(|request| request.priority <= priority)
            .map(|request| match request.phase {
                Phase::Prefilling { remaining } => u64::from(remaining),
                _ => 0,
            })
            .sum()
    }

    /// The prefill tokens a step may carry: the chunk budget, less one token per running decode
    /// with `mixed_batching` (vLLM v1 counts a decode's token against `token_budget`).
    fn prefill_budget(&self) -> u32 {
        match self.config.mixed_batching {
            true => self.config.prefill_chunk_tokens.saturating_sub(self.decoding.len() as u32),
            false => self.config.prefill_chunk_tokens,
        }
    }

    /// Admits what fits, then starts the next step at `at_us`: prefill first (carrying the
    /// running decodes with `mixed_batching`), else decode.
    fn schedule(&mut self, at_us: u64) {
        if self.admission_pending {
            self.admit(at_us);
        }
        self.kv_events.flush(at_us);
        let mut budget = self.prefill_budget();
        if !self.prefilling.is_empty() && budget > 0 {
            self.prefill_work.clear();
            let (mut step_tokens, mut step_pairs) = (0u64, 0u64);
            for &slot in &self.prefilling {
                let request = self.slots[slot].as_ref().expect("prefilling slots are live");
                let Phase::Prefilling { remaining } = request.phase else {
                    unreachable!("the prefilling queue holds prefilling requests");
                };
                let tokens = remaining.min(budget);
                self.prefill_work.push(PrefillChunk { slot, id: request.id, tokens });
                budget -= tokens;
                step_tokens += u64::from(tokens);
                let context = request.prompt_len.saturating_sub(remaining);
                step_pairs += EngineConfig::context_pairs(context, tokens);
                if budget == 0 {
                    break;
                }
            }
            let decodes = self.config.mixed_batching && !self.decoding.is_empty();
            let step_us = match decodes {
                true => self.config.mixed_step_us(step_tokens, self.decoding.len()),
                false => self.config.prefill_step_us(step_tokens),
            } + self.config.context_us(step_pairs);
            self.step =
                Some(Step { start_us: at_us, end_us: at_us + step_us, kind: StepKind::Prefill { decodes } });
        } else if !self.decoding.is_empty() {
            self.step = Some(Step {
                start_us: at_us,
                end_us: at_us + self.config.decode_step_us(self.decoding.len()),
                kind: StepKind::Decode,
            });
        }
    }

    /// Admits queued requests head-of-line while a running slot and their blocks are available
    /// and, for a request to prefill, the next step's prefill budget is not already taken by
    /// the requests prefilling (vLLM v1's scheduler takes waiting requests only while
    /// `token_budget > 0` after the running ones, SGLang's `PrefillAdder` the same with its
    /// chunk budget): its prefix is matched when its prefill can start, so a burst of
    /// requests sharing a long prefix computes it once, not once per request admitted early.
    fn admit(&mut self, at_us: u64) {
        self.admission_pending = false;
        let max_running = self.config.max_running_requests as usize;
        let budget = u64::from(self.prefill_budget());
        while let Some(&slot) = self.waiting.front() {
            if self.running() >= max_running {
                break;
            }
            let request = self.slots[slot].as_ref().expect("waiting slots are live");
            if request.stage != PdStage::Decode && self.prefill_tokens_ahead(request.priority) >= budget {
                break;
            }
            let matched = self.pool.match_prefix(&request.block_hashes);
            let new_blocks = request.total_blocks - matched as u64;
            self.evicted.clear();
            if !self.pool.try_allocate(&request.block_hashes[..matched], new_blocks, &mut self.evicted) {
                break;
            }
            if !self.evicted.is_empty() && self.kv_events.enabled() {
                self.kv_events
                    .push(KvEvent::BlockRemoved { block_hashes: self.evicted.clone(), tier: Tier::Gpu });
            }
            // The prefix continues in host memory: those blocks load back into the new ones.
            let in_host = match (&mut self.host, request.stage) {
                (Some(host), PdStage::Regular | PdStage::Prefill) => {
                    host.match_prefix(&request.block_hashes[matched..])
                }
                _ => 0,
            };
            let cached_tokens = self.cached_tokens_for(matched + in_host, request.prompt_len);
            let offloaded_tokens = cached_tokens - self.cached_tokens_for(matched, request.prompt_len);
            let load_work = self.config.load_work_tokens(offloaded_tokens);
            let request = self.slots[slot].as_mut().expect("waiting slots are live");
            request.cached_tokens = cached_tokens;
            request.offloaded_tokens = offloaded_tokens;
            request.referenced_blocks = matched;
            request.private_blocks = new_blocks;
            request.admitted_us = at_us;
            self.waiting_uncached_tokens -= u64::from(request.uncached_estimate);
            self.total_prompt_tokens += u64::from(request.prompt_len);
            self.total_cached_tokens += u64::from(cached_tokens);
            self.waiting.pop_front();
            if request.stage == PdStage::Decode {
                self.start_transferred(slot);
            } else {
                let remaining = request.prompt_len - cached_tokens + load_work;
                request.phase = Phase::Prefilling { remaining };
                let priority = request.priority;
                self.admitted_prefill_tokens += u64::from(remaining);
                let position = self.queue_position(&self.prefilling, priority);
                self.prefilling.insert(position, slot);
            }
        }
    }

    fn complete_prefill(&mut self, at_us: u64, out: &mut Vec<EngineOutput>) {
        let work = std::mem::take(&mut self.prefill_work);
        let mut first_tokens = 0;
        for chunk in &work {
            let Some(request) = self.slots[chunk.slot].as_mut() else {
                continue; // cancelled during the step
            };
            let Phase::Prefilling { remaining } = &mut request.phase else {
                continue; // cancelled, and the slot reused by a queued request
            };
            if request.id != chunk.id {
                continue;
            }
            *remaining -= chunk.tokens;
            self.admitted_prefill_tokens -= u64::from(chunk.tokens);
            if *remaining == 0 {
                first_tokens += 1;
                self.finish_prefill(chunk.slot, at_us, out);
            } else {
                let computed = (request.prompt_len - *remaining) as usize;
                self.store_blocks(chunk.slot, computed / self.config.block_size as usize);
            }
        }
        self.prefill_work = work;
        // The budget the step used is free again: the queue head may start its prefill.
        self.admission_pending = true;
        while let Some(&slot) = self.prefilling.front() {
            match &self.slots[slot] {
                Some(request) if matches!(request.phase, Phase::Prefilling { .. }) => break,
                _ => {
                    self.prefilling.pop_front();
                }
            }
        }
        self.total_generated_tokens += first_tokens;
        self.throughput.record(at_us, first_tokens);
    }

    /// The request's prefill is done: emit its first token, cache its prompt blocks, and move
    /// it to decoding (or finish it).
    fn finish_prefill(&mut self, slot: usize, at_us: u64, out: &mut Vec<EngineOutput>) {
        let request = self.slots[slot].as_mut().expect("checked by the caller");
        request.first_token_us = at_us;
        out.push(EngineOutput::FirstToken { id: request.id, at: at_us });
        self.pending_blocks.remove(&request.block_hashes);
        self.store_prompt_blocks(slot);
        let request = self.slots[slot].as_mut().expect("checked by the caller");
        if request.output_tokens == 1 {
            self.finish(slot, at_us, out);
            return;
        }
        let finish_step = self.decode_steps + u64::from(request.output_tokens) - 1;
        request.phase = Phase::Decoding { finish_step, position: self.decoding.len() };
        self.finish_queue.push(Reverse((finish_step, request.id, slot)));
        self.decoding.push(slot);
    }

    /// The request's prompt KV is complete: its full blocks not yet cached enter the prefix
    /// cache (recording `BlockStored` events), and its prompt tokens are dropped.
    fn store_prompt_blocks(&mut self, slot: usize) {
        let n_full = self.slots[slot].as_ref().expect("checked by the caller").block_hashes.len();
        self.store_blocks(slot, n_full);
        let request = self.slots[slot].as_mut().expect("checked by the caller");
        request.prompt = Vec::new();
    }

    /// The request's full blocks before `upto` not yet cached enter the prefix cache (recording
    /// `BlockStored` events): after each prefill chunk for the blocks it completed, as vLLM
    /// (v1 `KVCacheManager.allocate_slots` caches a request's full blocks as they are
    /// scheduled) and SGLang (`cache_unfinished_req` after each chunk) do, so a request admitted
    /// later matches what an earlier one has computed so far.
    fn store_blocks(&mut self, slot: usize, upto: usize) {
        let block_size = self.config.block_size as usize;
        let request = self.slots[slot].as_mut().expect("checked by the caller");
        let upto = upto.min(request.block_hashes.len());
        if upto <= request.referenced_blocks {
            return;
        }
        let mut run_start = None;
        let (mut offloaded, mut host_evicted) = (Vec::new(), Vec::new());
        for index in request.referenced_blocks..=upto {
            let inserted = index < upto && self.pool.store(request.block_hashes[index]);
            match (inserted, run_start) {
                (true, None) => run_start = Some(index),
                (false, Some(start)) => {
                    run_start = None;
                    if self.kv_events.enabled() {
                        self.kv_events.push(KvEvent::BlockStored {
                            block_hashes: request.block_hashes[start..index].to_vec(),
                            parent_block_hash: start.checked_sub(1).map(|p| request.block_hashes[p]),
                            token_ids: request.prompt[start * block_size..index * block_size].to_vec(),
                            block_size: block_size as u32,
                            tier: Tier::Gpu,
                            lora: request.lora.clone(),
                        });
                    }
                    if let Some(host) = &mut self.host {
                        host.offload(&request.block_hashes[start..index], &mut offloaded, &mut host_evicted);
                    }
                }
                _ => {}
            }
        }
        if self.kv_events.enabled() {
            if !host_evicted.is_empty() {
                self.kv_events.push(KvEvent::BlockRemoved { block_hashes: host_evicted, tier: Tier::Cpu });
            }
            if !offloaded.is_empty() {
                // vLLM's offloading connector's default events: the hashes only.
                self.kv_events.push(KvEvent::BlockStored {
                    block_hashes: offloaded,
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    block_size: 0,
                    tier: Tier::Cpu,
                    lora: None,
                });
            }
        }
        request.private_blocks -= (upto - request.referenced_blocks) as u64;
        request.referenced_blocks = upto;
        self.admission_pending = true;
    }

    fn complete_decode(&mut self, at_us: u64, out: &mut Vec<EngineOutput>) {
        self.decode_steps += 1;
        let batch = self.decoding.len() as u64;
        self.total_generated_tokens += batch;
        self.throughput.record(at_us, batch);
        if self.transferred_awaiting_first_token {
            self.emit_decode_tokens_with_first(at_us, out);
        } else if self.config.emit_token_events {
            out.extend(self.decoding.iter().map(|&slot| EngineOutput::Token {
                id: self.slots[slot].as_ref().expect("decoding slots are live").id,
                at: at_us,
            }));
        }
        while let Some(&Reverse((finish_step, id, slot))) = self.finish_queue.peek() {
            if finish_step > self.decode_steps {
                break;
            }
            self.finish_queue.pop();
            let current = self.slots[slot].as_ref().is_some_and(|request| {
                request.id == id
                    && matches!(request.phase, Phase::Decoding { finish_step: f, .. } if f == finish_step)
            });
            if current {
                self.finish(slot, at_us, out);
            }
        }
    }

    /// The request produced its last token: release (or hold) its blocks and report its stats.
    fn finish(&mut self, slot: usize, at_us: u64, out: &mut Vec<EngineOutput>) {
        let mut request = self.slots[slot].take().expect("finishing slots are live");
        self.free_slots.push(slot);
        self.slot_by_id.remove(&request.id);
        if let Phase::Decoding { position, .. } = request.phase {
            self.remove_from_decoding(position);
        }
        if request.stage == PdStage::Prefill {
            let mut referenced = std::mem::take(&mut request.block_hashes);
            referenced.truncate(request.referenced_blocks);
            self.hold(request.id, referenced, request.private_blocks);
        } else {
            self.pool.release(&request.block_hashes[..request.referenced_blocks], request.private_blocks);
            self.admission_pending = true;
        }
        out.push(EngineOutput::Finished {
            id: request.id,
            stats: RequestStats {
                prompt_tokens: request.prompt_len,
                cached_tokens: request.cached_tokens,
                offloaded_tokens: request.offloaded_tokens,
                completion_tokens: request.output_tokens,
                arrival_us: request.arrival_us,
                admitted_us: request.admitted_us,
                first_token_us: request.first_token_us,
                finished_us: at_us,
            },
        });
    }

    fn remove_from_decoding(&mut self, position: usize) {
        self.decoding.swap_remove(position);
        if let Some(&moved) = self.decoding.get(position) {
            if let Some(Request { phase: Phase::Decoding { position: p, .. }, .. }) =
                self.slots[moved].as_mut()
            {
                *p = position;
            }
        }
    }
}

fn remove_value(queue: &mut VecDeque<usize>, value: usize) {
    if let Some(index) = queue.iter().position(|&v| v == value) {
        queue.remove(index);
    }
}
