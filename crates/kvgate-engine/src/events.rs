//! What goes into and comes out of an engine: requests, per-request outputs and stats, and KV cache events.

use serde::{Deserialize, Serialize};

/// One generation request, already tokenized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRequest {
    /// Caller-chosen id, unique among the engine's live requests.
    pub id: u64,
    /// Prompt token ids (see `tokenize`).
    pub prompt: Vec<u32>,
    /// Tokens to generate; 0 is treated as 1.
    pub output_tokens: u32,
    /// The LoRA adapter the request runs with (`None`: the base model).
    pub lora: Option<LoraAdapter>,
    /// Its priority under `EngineConfig::priority_scheduling`, in vLLM's convention: lower
    /// values are served first, 0 is the default (ignored otherwise).
    pub priority: i32,
}

impl EngineRequest {
    /// A base-model request of the default priority.
    pub fn new(id: u64, prompt: Vec<u32>, output_tokens: u32) -> Self {
        EngineRequest { id, prompt, output_tokens, lora: None, priority: 0 }
    }

    /// The request with `priority` (lower first).
    pub fn with_priority(self, priority: i32) -> Self {
        EngineRequest { priority, ..self }
    }
}

/// A LoRA adapter as vLLM names it in its KV events: `lora_id` (the `LoRARequest`'s integer
/// id) and `lora_name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoraAdapter {
    pub id: u32,
    pub name: String,
}

/// Which half of a request an engine serves under prefill/decode (PD) disaggregation.
///
/// A PD fleet splits one request across two engines: a prefill engine computes the prompt's KV
/// (and the first token) and keeps that KV held until it has been transferred; a decode engine
/// receives the transferred KV and generates the output. The host moves the KV between them
/// (and decides how long a transfer takes); the engines only account for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PdStage {
    /// Prefill and decode on this engine; the request's KV is released when it finishes.
    #[default]
    Regular,
    /// The prefill half: the request runs as a regular one (hosts usually ask for one output
    /// token), but when it finishes its KV blocks stay held: counted in `token_usage`, never
    /// evicted, until the host calls `Engine::release_held` (once the decode side has pulled
    /// the KV, or when the host gives up waiting for it).
    Prefill,
    /// The decode half: the prompt's KV was computed elsewhere and transferred in. The request
    /// is admitted with blocks for its prompt and output like any other (prefix-cache hits
    /// reused, the prompt's full blocks entering the cache at admission), but computes nothing
    /// of its prompt: no prefill step. Its first token comes from its first decode step and it
    /// takes `output_tokens` decode steps in all.
    Decode,
}

/// Timing and token counts of one finished request. Times are the caller's microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestStats {
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache (not prefilled), host-memory hits included (as
    /// vLLM reports them).
    pub cached_tokens: u32,
    /// Of `cached_tokens`, those loaded back from the host-memory tier.
    #[serde(default)]
    pub offloaded_tokens: u32,
    pub completion_tokens: u32,
    pub arrival_us: u64,
    pub admitted_us: u64,
    pub first_token_us: u64,
    pub finished_us: u64,
}

impl RequestStats {
    /// Time to first token: `first_token_us - arrival_us`.
    pub fn ttft_us(&self) -> u64 {
        self.first_token_us.saturating_sub(self.arrival_us)
    }

    /// End-to-end latency: `finished_us - arrival_us`.
    pub fn latency_us(&self) -> u64 {
        self.finished_us.saturating_sub(self.arrival_us)
    }
}

/// Why a request was refused at submission.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("a request with this id is already in the engine")]
    DuplicateId,
    #[error(
        "the request needs {required_tokens} KV tokens (prompt + output) but the KV cache holds {capacity_tokens}"
    )]
    ExceedsKvCapacity { required_tokens: u64, capacity_tokens: u64 },
}

/// An event for the host, emitted by `Engine::submit` and `Engine::advance` in time order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineOutput {
    /// The request's first token was produced: at the end of the step completing its prefill,
    /// or of its first decode step for a `PdStage::Decode` request.
    FirstToken { id: u64, at: u64 },
    /// One more token (the 2nd and later); only with `emit_token_events`.
    Token { id: u64, at: u64 },
    /// The request produced its last token; its blocks were released (or, for a
    /// `PdStage::Prefill` request, held until `Engine::release_held`).
    Finished { id: u64, stats: RequestStats },
    /// The request was refused at submission and never entered the engine.
    Rejected { id: u64, reason: RejectReason },
}

impl EngineOutput {
    /// The request this output concerns.
    pub fn id(&self) -> u64 {
        match self {
            Self::FirstToken { id, .. }
            | Self::Token { id, .. }
            | Self::Finished { id, .. }
            | Self::Rejected { id, .. } => *id,
        }
    }
}

/// Where a cached block lives: the engine's GPU prefix cache, or the host-memory tier of an
/// engine with KV offloading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    #[default]
    Gpu,
    Cpu,
}

/// A change to the prefix cache, in the shape of vLLM's KV events.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEvent {
    /// Consecutive blocks of one prompt were stored in `tier`; `block_hashes[0]` chains on
    /// `parent_block_hash`. The host tier sends vLLM's offload placeholders: the hashes only
    /// (no tokens, block size 0, no parent), as its offloading connector does by default.
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        /// Tokens of all stored blocks, `block_size` per block.
        token_ids: Vec<u32>,
        block_size: u32,
        #[serde(default)]
        tier: Tier,
        /// The adapter whose KV the blocks are (`None`: the base model's).
        #[serde(default)]
        lora: Option<LoraAdapter>,
    },
    /// Blocks were evicted from `tier`.
    BlockRemoved {
        block_hashes: Vec<u64>,
        #[serde(default)]
        tier: Tier,
    },
    /// The whole prefix cache was cleared (every tier).
    AllBlocksCleared,
}

/// KV events that happened at one instant, numbered in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventBatch {
    /// Strictly increasing from 0 within one engine.
    pub seq: u64,
    pub timestamp_us: u64,
    pub events: Vec<KvEvent>,
}

/// Collects the KV events of one instant and numbers them into batches for the host.
#[derive(Debug)]
pub(crate) struct KvEventLog {
    enabled: bool,
    pending: Vec<KvEvent>,
    batches: Vec<KvEventBatch>,
    next_seq: u64,
}

impl KvEventLog {
    pub(crate) fn new(enabled: bool) -> Self {
        Self { enabled, pending: Vec::new(), batches: Vec::new(), next_seq: 0 }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    pub(crate) fn push(&mut self, event: KvEvent) {
        if self.enabled {
            self.pending.push(event);
        }
    }

    /// Closes the events pushed since the last flush into one batch stamped `at_us`.
    pub(crate) fn flush(&mut self, at_us: u64) {
        if self.pending.is_empty() {
            return;
        }
        self.batches.push(KvEventBatch {
            seq: self.next_seq,
            timestamp_us: at_us,
            events: std::mem::take(&mut self.pending),
        });
        self.next_seq += 1;
    }

    pub(crate) fn drain(&mut self) -> Vec<KvEventBatch> {
        std::mem::take(&mut self.batches)
    }
}
