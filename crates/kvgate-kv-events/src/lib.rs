//! kvgate-kv-events: the KV-cache event wire format vLLM and SGLang publish over ZeroMQ, decoded
//! and encoded in one place, and the pure logic that applies a publisher's batches to the block
//! index.
//!
//! The crate is a pure core: bytes in, values out. No sockets, no threads, no clock; the gateway's
//! subscriber owns the ZeroMQ side and feeds frames here, the mock engines encode with it.
//!
//! # Wire format
//!
//! Every publisher (vLLM's and SGLang's `ZmqEventPublisher`) sends the same envelope; the
//! versions differ in the event fields and in the replay frames (see `testdata/kv-wire/README.md`,
//! captured from the engines' own publisher code):
//!
//! * **PUB** message: `[topic, seq, payload]`; `seq` is an 8-byte big-endian `u64` (per publisher,
//!   from 0, +1 per batch); `payload` is one msgpack `KVEventBatch`. See [`decode_message`].
//! * **Replay** (ROUTER): a DEALER sends `[b"", start_seq]` ([`replay_request`]) and receives one
//!   message per buffered batch with `seq >= start_seq`, then an end marker whose `seq` is -1 as
//!   8 signed big-endian bytes ([`REPLAY_END`]). vLLM up to 0.25 answers `[b"", seq, payload]`
//!   and ends with `[b"", END, b""]`; vLLM 0.26 on and SGLang 0.5 answer
//!   `[b"", topic, seq, payload]` and end with `[b"", b"", END, b""]`. [`decode_replay_reply`]
//!   reads every form.
//! * **Batch** `[ts, events, data_parallel_rank]` (msgspec `array_like`); a map
//!   `{"ts", "events", "data_parallel_rank"}` decodes too.
//! * **Events**, tagged by class name: as maps with a `"type"` key (vLLM 0.2x and later, SGLang)
//!   or as arrays led by the tag (vLLM 0.10: `["BlockStored", hashes, parent, tokens, size,
//!   lora_id]`). `BlockStored`, `BlockRemoved`, `AllBlocksCleared`; any other tag decodes as
//!   [`KvEvent::Unknown`].
//!
//! Integers are accepted in any msgpack width and floats as float32 or float64 (liberal in
//! widths, since msgspec writes non-minimal headers), but a value of the wrong kind is a problem
//! (strict in kinds), and so is a value that does not fit its field (a negative token id). A
//! problem spoils **its own event only**: the event decodes as [`KvEvent::Invalid`] saying what
//! and where, and the batch's other events decode as usual. Only a payload whose msgpack structure
//! itself is broken (truncated, an invalid marker, the envelope of the wrong kind) is an error of
//! the whole batch. Block hashes become `u64`: integers as they are (a negative one as its
//! two's-complement bit pattern), `bytes` hashes (a sha256 digest) folded with xxh3-64.
//! Decoding never panics, whatever the input.
//!
//! ```
//! use kvgate_kv_events::{decode_message, KvEvent};
//!
//! // [1.5, [{"type": "AllBlocksCleared"}], 0] in msgpack, published as batch 7 on an empty topic.
//! let payload = [&[0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91, 0x81, 0xa4][..], b"type",
//!     &[0xb0], b"AllBlocksCleared", &[0x00]].concat();
//! let frames = [Vec::new(), 7u64.to_be_bytes().to_vec(), payload];
//! let (seq, batch) = decode_message(&frames).unwrap();
//! assert_eq!((seq, batch.ts, batch.events), (7, 1.5, vec![KvEvent::AllBlocksCleared]));
//! ```

mod apply;
mod batch;
mod encode;
mod error;
mod event;
mod extra;
mod feed;
mod frames;
mod leaf;
mod sequence;
mod tokens;

#[cfg(test)]
mod tests;

pub use apply::{apply_batch, apply_event, Refusal};
pub use encode::{encode_batch, WireFormat};
pub use error::DecodeError;
pub use extra::ExtraKey;
pub use feed::{Feed, FeedCounts, Live, Recovery, Replayed};
pub use frames::{decode_message, decode_replay_reply, replay_request, ReplayReply, REPLAY_END};
pub use sequence::{Sequence, Verdict};
pub use tokens::TokenIds;

/// One published batch of KV-cache events.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The engine's wall-clock timestamp (seconds since the Unix epoch) when the batch was made.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The engine's data-parallel rank (SGLang: its attention-DP rank).
    pub data_parallel_rank: Option<u32>,
}

/// One KV-cache event.
// Most events are stores: boxing the large variant would add an allocation to nearly each one.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
    /// An event type this decoder does not know (a newer engine); holds the tag.
    Unknown(String),
    /// An event this decoder could not read (a field of the wrong kind, a missing field); the
    /// batch's other events are unaffected.
    Invalid(InvalidEvent),
}

/// What was wrong with one event, e.g. `event 3 (BlockStored): token_ids[5]: expected a token id
/// (an integer in 0..=4294967295), got -1`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{location}: {reason}")]
pub struct InvalidEvent {
    /// Where: the event's index in its batch, its tag when known, the field and element.
    pub location: String,
    pub reason: String,
}

/// Blocks the engine has filled and now holds in one of its cache tiers.
///
/// Fields are vLLM 0.33's (SGLang's `cache_salt` included); an engine that does not send a field
/// leaves it `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockStored {
    /// The stored blocks' hashes, in chain order (see [`block_hash_from_bytes`] for bytes hashes).
    pub block_hashes: Vec<u64>,
    /// The hash of the block before the first one, `None` when the chain starts at the root (and
    /// in vLLM's offload placeholders, which name a tier's chunk without its chain).
    pub parent_block_hash: Option<u64>,
    /// The tokens of the stored blocks, as sent (the decoder does not check the length).
    pub token_ids: TokenIds,
    /// Tokens per block; 0 in vLLM's offload placeholders (no tokens at all).
    pub block_size: u32,
    pub lora_id: Option<i64>,
    /// The cache tier, e.g. `"GPU"`, `"CPU"`, `"CPU_PINNED"`, `"STORAGE"`.
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// Per block, the extra keys that entered its hash (multimodal items, a cache salt, a LoRA
    /// name), `None` for a block with none.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// The KV-cache group (hybrid models have several).
    pub group_idx: Option<u32>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// Where the tier is (e.g. `"LOCAL"` storage).
    pub locality: Option<String>,
    /// Which component owns that copy (e.g. `"kvcr"`, a secondary tier's).
    pub ownership: Option<String>,
    /// The session that stored the blocks (attribution only; not part of any hash).
    pub session_id: Option<String>,
    /// Per block, the tokens after it that entered its hash (EAGLE block drop).
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
    /// SGLang: the request's cache salt, which seeded the hashes.
    pub cache_salt: Option<String>,
}

/// Blocks the engine has evicted from one tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

/// Decodes one msgpack `KVEventBatch` payload (either event form).
///
/// Bytes after the batch are an error, as they are for the engines' own msgspec decoder.
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
