//! kvgate-engine: a pure, clock-injected discrete-event model of one SGLang/vLLM-like serving engine replica.
//!
//! The same [`Engine`] runs in the virtual-time simulator and, driven by a real-time task, behind
//! the simulated engines' HTTP servers (`kvgate-mock`). The crate does no I/O, reads no clock,
//! spawns no thread and draws no random number (`clippy.toml` enforces it): time is a `u64` of
//! microseconds passed in by the host, and the same inputs always give the same outputs.
//!
//! # The model
//! - **Scheduler steps.** Each step is a *prefill* step — up to `prefill_chunk_tokens` uncached
//!   prompt tokens of admitted requests, first-come first-served, a long prompt chunked across
//!   steps, lasting `tokens / prefill_tokens_per_sec` — or, when no prefill work is pending, a
//!   *decode* step giving every decoding request one token and lasting
//!   `decode_base_ms + decode_per_request_ms × batch`. Prefill has priority (SGLang without mixed
//!   chunking). A request's first token is emitted at the end of the step completing its prefill;
//!   it then needs `output_tokens - 1` decode steps. A prefill step may have a fixed cost
//!   (`prefill_base_ms`, a forward pass's overhead); with `mixed_batching` the running decodes
//!   ride in every prefill step (vLLM v1), which pays the larger fixed cost once; with
//!   `prefill_context_ns` a step also pays attention's cost, per (new token, context token)
//!   pair, so new tokens after a long cached prefix cost more (vLLM's CPU build shows it).
//! - **Front end.** `frontend_latency_ms` delays each request's entry into the scheduler's queue
//!   (the engine's HTTP server, tokenization, the hop to its engine core and back), a constant
//!   every client-side time to first token includes.
//! - **Profiles.** [`EngineProfile`] names measured parameter sets (`--engine-profile`):
//!   `vllm-cpu-tiny` reproduces two of vLLM's CPU-build engines sharing 2 cores on the
//!   real-engine harness's tiny model.
//! - **KV cache.** Capacity is counted in blocks of `block_size` tokens. A request reserves
//!   `ceil((prompt + output) / block_size)` blocks at admission, minus the full prompt blocks
//!   already in the prefix cache (matched by chained block hash, see [`block_hash`]). Admission is
//!   FIFO and head-of-line: the head waits until fewer than `max_running_requests` run and enough
//!   blocks are free after evicting unreferenced cached blocks, least recently released first. A
//!   request that could never fit is rejected at once.
//! - **Prefix cache.** Cached tokens are the matched blocks' tokens, capped at `prompt - 1` (one
//!   token is always computed); prefill time depends only on uncached tokens. When prefill
//!   completes, the prompt's full blocks enter the cache ([`KvEvent::BlockStored`]); when the
//!   request finishes they become evictable, and its other blocks are freed. Eviction emits
//!   [`KvEvent::BlockRemoved`].
//! - **Host tier** (`cpu_offload_tokens`, vLLM's offloading connector). Blocks entering the prefix
//!   cache are also copied to host memory, announced by the connector's default placeholder
//!   events (`BlockStored` in [`Tier::Cpu`] with the hashes only); the tier evicts least recently
//!   used blocks. A prompt whose prefix continues in host memory past its GPU hit counts those
//!   tokens as cached but loads them back, which holds it in prefill as long as computing
//!   `tokens × prefill_tokens_per_sec / cpu_load_tokens_per_sec` tokens would.
//! - **Load.** [`Engine::load`] reports SGLang's `/v1/loads` fields; `token_usage` counts blocks
//!   held by admitted requests (and KV held for transfer, below) only (evictable cached blocks
//!   are free capacity).
//! - **Prefill/decode disaggregation.** [`Engine::submit_as`] takes a [`PdStage`]. A
//!   `PdStage::Prefill` request runs as usual, but its KV stays held after it finishes, counted
//!   in `token_usage` and never evicted, until the host calls [`Engine::release_held`] (the
//!   decode side pulled it, or nobody did in time: the hold timeout is the host's). A
//!   `PdStage::Decode` request's prompt KV arrived from a prefill engine: it is admitted with
//!   blocks for prompt + output, computes no prefill, and produces its first token at its first
//!   decode step. The transfer itself (when, how long) is the host's.
//!
//! # The tokenizer
//! One whitespace-separated word is one token; its id is the 32-bit FNV-1a hash of the word's
//! UTF-8 bytes ([`tokenize`], [`token_id`]), in the leaf crate `kvgate-words` (re-exported
//! here), which the gateway's mock tokenizer and the trace use without linking the engine model.
//! The simulated engines' chat template is the one chat rendering, `kvgate_protocol::render_chat`.
//!
//! # Driving an engine
//! ```
//! use kvgate_engine::{Engine, EngineConfig, EngineOutput, EngineRequest, tokenize};
//!
//! let mut engine = Engine::new(EngineConfig::default());
//! let mut out = Vec::new();
//! let prompt = tokenize(&"word ".repeat(4096));
//! engine.submit(0, EngineRequest::new(1, prompt, 1), &mut out);
//! while let Some(at) = engine.next_event_time() {
//!     engine.advance(at, &mut out);
//! }
//! // Two prefill steps of 2,048 tokens at 8,000 tokens/s.
//! assert_eq!(out[0], EngineOutput::FirstToken { id: 1, at: 512_000 });
//! ```

mod block_hash;
mod blocks;
mod config;
mod events;
mod flags;
mod load;
mod offload;
mod profile;
mod scheduler;

pub use block_hash::{adapter_block_hashes, block_hash, prompt_block_hashes};
pub use config::EngineConfig;
pub use events::{
    EngineOutput, EngineRequest, KvEvent, KvEventBatch, LoraAdapter, PdStage, RejectReason, RequestStats,
    Tier,
};
pub use flags::EngineFlags;
pub use kvgate_config::{FieldError, ValidationErrors};
pub use kvgate_words::{count_tokens, splitmix64, token_id, tokenize};
pub use load::{EngineLoad, THROUGHPUT_WINDOW_US};
pub use profile::EngineProfile;
pub use scheduler::Engine;

#[cfg(test)]
mod tests;
