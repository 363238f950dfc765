//! kvgate-kv-events: pure decoding of the KV-cache events vLLM (and SGLang) publish over ZeroMQ.
//!
//! The crate is a pure core: bytes in, values out. No sockets, no threads, no clock; the gateway's
//! subscriber owns the ZeroMQ side and feeds frames here.
//!
//! # Wire format (vLLM `vllm/distributed/kv_events.py`)
//!
//! * **PUB** message: `[topic, seq, payload]`; `seq` is an 8-byte big-endian `u64` (per publisher,
//!   from 0, +1 per batch); `payload` is one msgpack `KVEventBatch`. See [`decode_message`].
//! * **Replay** (ROUTER): a DEALER sends `[b"", start_seq]` ([`replay_request`]) and receives
//!   `[b"", seq, payload]` for every buffered batch with `seq >= start_seq`, then
//!   `[b"", END, b""]` with `END` = -1 as an 8-byte big-endian signed integer ([`REPLAY_END`]).
//!   [`decode_replay_reply`] also accepts a reply without the empty delimiter frame.
//! * **Batch** `KVEventBatch(ts: float, events: list, data_parallel_rank: int | None)`.
//! * **Events** (tag = class name): `BlockStored(block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//!   kv_cache_spec_sliding_window)`, `BlockRemoved(block_hashes, medium, group_idx)`,
//!   `AllBlocksCleared()`. Older vLLM versions stop earlier in those field lists.
//!
//! Two encodings have shipped and both decode:
//! 1. *positional* (msgspec `array_like=True`): `[ts, [events], dp_rank]`, each event
//!    `["BlockStored", block_hashes, parent, ...]`; missing trailing optional fields are `None`,
//!    extra trailing elements are ignored;
//! 2. *maps* (`omit_defaults=True`): `{"ts": .., "events": [..]}`, each event
//!    `{"type": "BlockStored", "block_hashes": [..], ...}`; keys in any order, unknown keys
//!    ignored, fields with defaults may be omitted.
//!
//! Integers are accepted in any msgpack width and floats as float32 or float64 (liberal in
//! widths), but a value of the wrong kind is an error (strict in kinds), and so is a value that
//! does not fit its field (a negative token id, a zero block size). Block hashes become `u64`:
//! integers as they are (a negative one as its two's-complement bit pattern), `bytes` hashes
//! (newer vLLM: a sha256 digest) folded with xxh3-64. An event with an unknown tag decodes as
//! [`KvEvent::Unknown`]. Decoding never panics, whatever the input.
//!
//! ```
//! use kvgate_kv_events::{decode_message, KvEvent};
//!
//! // [1.5, [["AllBlocksCleared"]]] in msgpack, published as batch 7 on an empty topic.
//! let payload = [0x92, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xb0];
//! let payload = [&payload[..], b"AllBlocksCleared"].concat();
//! let frames = [Vec::new(), 7u64.to_be_bytes().to_vec(), payload];
//! let (seq, batch) = decode_message(&frames).unwrap();
//! assert_eq!((seq, batch.ts, batch.events), (7, 1.5, vec![KvEvent::AllBlocksCleared]));
//! ```

mod batch;
mod error;
mod event;
mod frames;
mod leaf;

#[cfg(test)]
mod tests;

pub use error::DecodeError;
pub use frames::{decode_message, decode_replay_reply, replay_request, ReplayReply, REPLAY_END};

/// One published batch of KV-cache events.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The engine's wall-clock timestamp (seconds since the Unix epoch) when the batch was made.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The engine's data-parallel rank, when it runs with data parallelism.
    pub data_parallel_rank: Option<u32>,
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
    /// An event type this decoder does not know (a newer engine); holds the tag.
    Unknown(String),
}

/// Blocks the engine has filled and now holds in its prefix cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockStored {
    /// The stored blocks' hashes, in chain order (see [`block_hash_from_bytes`] for bytes hashes).
    pub block_hashes: Vec<u64>,
    /// The hash of the block before the first one, `None` when the chain starts at the root.
    pub parent_block_hash: Option<u64>,
    /// The tokens of the stored blocks, as sent (the decoder does not check the length).
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    /// The cache tier, e.g. `"GPU"` or `"CPU"`.
    pub medium: Option<String>,
    /// The KV-cache group (hybrid models have several).
    pub group_idx: Option<u32>,
}

/// Blocks the engine has evicted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
}

/// Decodes one msgpack `KVEventBatch` payload (either encoding).
///
/// Bytes after the batch are an error, as they are for vLLM's own msgspec decoder.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    batch::decode(payload)
}

/// A `bytes` block hash as the `u64` this crate reports for it: xxh3-64 of the bytes, seed 0.
///
/// Stable across versions and platforms, so a hash computed elsewhere from the same bytes (e.g.
/// by a tokenizer-side block hasher) matches the decoded events.
pub fn block_hash_from_bytes(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
