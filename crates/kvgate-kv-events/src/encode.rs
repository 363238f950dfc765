//! The encoder: a batch written as one engine version's publisher writes it, so that simulated
//! engines speak what users run and tests can rebuild the captures' bytes.
//!
//! Each version's events are serde structs in the engine's field order, written by rmp-serde as
//! maps (or, for vLLM 0.10, as arrays led by the tag), with msgspec's choices: fields without a
//! default always present (nil when `None`), fields defaulting to `None` left out when `None`,
//! non-negative integers unsigned, negative ones in the smallest signed width. One msgspec habit
//! serde cannot express is patched after: vLLM 0.33's `BlockStored` has 16 keys at most, so
//! msgspec sizes its header as a map16 (`de 00 0a`) however many it writes.

use bytes::Bytes;
use serde::ser::{SerializeSeq, Serializer};
use serde::Serialize;

use crate::frames::REPLAY_END;
use crate::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, TokenIds};

/// An engine version's wire format (`testdata/kv-wire/README.md` has one folder per version).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WireFormat {
    /// vLLM 0.26 to 0.33 (0.33's fields): events as maps, replay replies with the topic frame.
    #[default]
    Vllm033,
    /// vLLM 0.2x up to 0.25: events as maps (0.25's fields), replay replies without the topic.
    Vllm025,
    /// vLLM 0.10: events as arrays led by the tag, signed hashes, no medium.
    Vllm010,
    /// SGLang 0.5: events as maps (SGLang's fields), signed hashes, replay with the topic.
    Sglang05,
}

impl WireFormat {
    pub const ALL: [WireFormat; 4] =
        [WireFormat::Vllm033, WireFormat::Vllm025, WireFormat::Vllm010, WireFormat::Sglang05];

    /// The capture folder name of the version this format follows.
    pub fn publisher(self) -> &'static str {
        match self {
            WireFormat::Vllm033 => "vllm-0.33.0",
            WireFormat::Vllm025 => "vllm-0.25.0",
            WireFormat::Vllm010 => "vllm-0.10.1.1",
            WireFormat::Sglang05 => "sglang-0.5.23",
        }
    }

    /// Whether replay replies carry the topic frame (`[b"", topic, seq, payload]`).
    pub fn replay_has_topic(self) -> bool {
        matches!(self, WireFormat::Vllm033 | WireFormat::Sglang05)
    }

    /// Hashes written as signed 64-bit integers (SGLang's int64, vLLM 0.10's Python `hash()`).
    fn signed_hashes(self) -> bool {
        matches!(self, WireFormat::Vllm010 | WireFormat::Sglang05)
    }

    /// A PUB message: `[topic, seq, payload]`.
    pub fn message(self, topic: &[u8], seq: u64, payload: Bytes) -> Vec<Bytes> {
        vec![Bytes::copy_from_slice(topic), Bytes::copy_from_slice(&seq.to_be_bytes()), payload]
    }

    /// A replay reply after the ROUTER's identity and delimiter frames: `[topic, seq, payload]`
    /// or `[seq, payload]`.
    pub fn replay_reply(self, topic: &[u8], seq: u64, payload: Bytes) -> Vec<Bytes> {
        let mut frames = Vec::with_capacity(3);
        if self.replay_has_topic() {
            frames.push(Bytes::copy_from_slice(topic));
        }
        frames.push(Bytes::copy_from_slice(&seq.to_be_bytes()));
        frames.push(payload);
        frames
    }

    /// The end-of-replay marker after the identity and delimiter frames: `[b"", END, b""]` (the
    /// topic frame stays empty even when a topic is set) or `[END, b""]`.
    pub fn replay_end(self) -> Vec<Bytes> {
        let mut frames = Vec::with_capacity(3);
        if self.replay_has_topic() {
            frames.push(Bytes::new());
        }
        frames.push(Bytes::copy_from_slice(&REPLAY_END.to_be_bytes()));
        frames.push(Bytes::new());
        frames
    }
}

/// Encodes `batch` as `format`'s publisher does: `[ts, events, data_parallel_rank]` (the rank 0
/// when `None`, as a publisher stamps its own). An [`KvEvent::Invalid`] has nothing to encode and
/// is left out; an [`KvEvent::Unknown`] is written as its bare tag.
pub fn encode_batch(batch: &EventBatch, format: WireFormat) -> Vec<u8> {
    let events: Vec<&KvEvent> = batch.events.iter().filter(|e| !matches!(e, KvEvent::Invalid(_))).collect();
    let mut out = Vec::with_capacity(64 + 16 * events.len());
    // Writing into a Vec cannot fail, and no list here reaches 2^32 items.
    let _ = rmp::encode::write_array_len(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, batch.ts);
    let _ = rmp::encode::write_array_len(&mut out, events.len() as u32);
    for event in events {
        let start = out.len();
        write_event(&mut out, event, format);
        if format == WireFormat::Vllm033 && matches!(event, KvEvent::BlockStored(_)) {
            widen_map_header(&mut out, start);
        }
    }
    let _ = rmp::encode::write_uint(&mut out, u64::from(batch.data_parallel_rank.unwrap_or(0)));
    out
}

fn write_event(out: &mut Vec<u8>, event: &KvEvent, format: WireFormat) {
    let signed = format.signed_hashes();
    let written = match format {
        WireFormat::Vllm033 => to_map(out, &vllm033::Event::of(event, signed)),
        WireFormat::Vllm025 => to_map(out, &vllm025::Event::of(event, signed)),
        WireFormat::Sglang05 => to_map(out, &sglang05::Event::of(event, signed)),
        WireFormat::Vllm010 => {
            vllm010::event(event, signed).serialize(&mut rmp_serde::Serializer::new(&mut *out))
        }
    };
    debug_assert!(written.is_ok(), "encoding into a Vec cannot fail: {written:?}");
}

fn to_map<T: Serialize>(out: &mut Vec<u8>, value: &T) -> Result<(), rmp_serde::encode::Error> {
    value.serialize(&mut rmp_serde::Serializer::new(out).with_struct_map())
}

/// Rewrites the fixmap header at `start` as msgspec's map16 (`de 00 NN`).
fn widen_map_header(out: &mut Vec<u8>, start: usize) {
    if let Some(&header) = out.get(start) {
        if header & 0xf0 == 0x80 {
            out.splice(start..=start, [0xde, 0x00, header & 0x0f]);
        }
    }
}

/// Block hashes as the format writes them.
struct Hashes<'a> {
    hashes: &'a [u64],
    signed: bool,
}

impl Serialize for Hashes<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.hashes.len()))?;
        for &hash in self.hashes {
            seq.serialize_element(&Hash { hash, signed: self.signed })?;
        }
        seq.end()
    }
}

struct Hash {
    hash: u64,
    signed: bool,
}

impl Serialize for Hash {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.signed {
            true => serializer.serialize_i64(self.hash as i64),
            false => serializer.serialize_u64(self.hash),
        }
    }
}

fn parent(stored: &BlockStored, signed: bool) -> Option<Hash> {
    stored.parent_block_hash.map(|hash| Hash { hash, signed })
}

impl Serialize for TokenIds {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            TokenIds::Plain(ids) => ids.serialize(serializer),
            TokenIds::Bigrams(pairs) => pairs.serialize(serializer),
        }
    }
}

impl Serialize for ExtraKey {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ExtraKey::Nil => serializer.serialize_unit(),
            ExtraKey::Bool(v) => serializer.serialize_bool(*v),
            ExtraKey::Int(v) if *v < 0 => serializer.serialize_i64(*v as i64),
            ExtraKey::Int(v) => serializer.serialize_u64(*v as u64),
            ExtraKey::Float(bits) => serializer.serialize_f64(f64::from_bits(*bits)),
            ExtraKey::Str(text) => serializer.serialize_str(text),
            ExtraKey::Bytes(data) => serializer.serialize_bytes(data),
            ExtraKey::Array(items) => items.serialize(serializer),
        }
    }
}

/// vLLM 0.33 (`vllm/distributed/kv_events.py`): 15 `BlockStored` fields, 5 `BlockRemoved` ones.
mod vllm033 {
    use super::*;

    #[derive(Serialize)]
    #[serde(tag = "type")]
    pub(super) enum Event<'a> {
        BlockStored(Stored<'a>),
        BlockRemoved(Removed<'a>),
        AllBlocksCleared {},
        #[serde(untagged)]
        Unknown(Tag<'a>),
    }

    #[derive(Serialize)]
    pub(super) struct Stored<'a> {
        block_hashes: Hashes<'a>,
        parent_block_hash: Option<Hash>,
        token_ids: &'a TokenIds,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<&'a str>,
        lora_name: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        extra_keys: Option<&'a Vec<Option<Vec<ExtraKey>>>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        group_idx: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        kv_cache_spec_kind: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        kv_cache_spec_sliding_window: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        locality: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        ownership: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        session_id: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        lookahead_token_ids: Option<&'a Vec<Vec<u32>>>,
    }

    #[derive(Serialize)]
    pub(super) struct Removed<'a> {
        block_hashes: Hashes<'a>,
        medium: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        group_idx: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        locality: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        ownership: Option<&'a str>,
    }

    impl<'a> Event<'a> {
        pub(super) fn of(event: &'a KvEvent, signed: bool) -> Self {
            match event {
                KvEvent::BlockStored(s) => Event::BlockStored(Stored {
                    block_hashes: Hashes { hashes: &s.block_hashes, signed },
                    parent_block_hash: parent(s, signed),
                    token_ids: &s.token_ids,
                    block_size: s.block_size,
                    lora_id: s.lora_id,
                    medium: s.medium.as_deref(),
                    lora_name: s.lora_name.as_deref(),
                    extra_keys: s.extra_keys.as_ref(),
                    group_idx: s.group_idx,
                    kv_cache_spec_kind: s.kv_cache_spec_kind.as_deref(),
                    kv_cache_spec_sliding_window: s.kv_cache_spec_sliding_window,
                    locality: s.locality.as_deref(),
                    ownership: s.ownership.as_deref(),
                    session_id: s.session_id.as_deref(),
                    lookahead_token_ids: s.lookahead_token_ids.as_ref(),
                }),
                KvEvent::BlockRemoved(r) => Event::BlockRemoved(removed(r, signed)),
                KvEvent::AllBlocksCleared => Event::AllBlocksCleared {},
                KvEvent::Unknown(tag) => Event::Unknown(Tag { r#type: tag }),
                // Left out by `encode_batch`.
                KvEvent::Invalid(_) => Event::Unknown(Tag { r#type: "Invalid" }),
            }
        }
    }

    fn removed(r: &BlockRemoved, signed: bool) -> Removed<'_> {
        Removed {
            block_hashes: Hashes { hashes: &r.block_hashes, signed },
            medium: r.medium.as_deref(),
            group_idx: r.group_idx,
            locality: r.locality.as_deref(),
            ownership: r.ownership.as_deref(),
        }
    }
}

/// An event of a type the encoder does not know: `{"type": tag}`.
#[derive(Serialize)]
struct Tag<'a> {
    r#type: &'a str,
}

/// vLLM 0.25: 11 `BlockStored` fields, 3 `BlockRemoved` ones.
mod vllm025 {
    use super::*;

    #[derive(Serialize)]
    #[serde(tag = "type")]
    pub(super) enum Event<'a> {
        BlockStored(Stored<'a>),
        BlockRemoved(Removed<'a>),
        AllBlocksCleared {},
        #[serde(untagged)]
        Unknown(Tag<'a>),
    }

    #[derive(Serialize)]
    pub(super) struct Stored<'a> {
        block_hashes: Hashes<'a>,
        parent_block_hash: Option<Hash>,
        token_ids: &'a TokenIds,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<&'a str>,
        lora_name: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        extra_keys: Option<&'a Vec<Option<Vec<ExtraKey>>>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        group_idx: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        kv_cache_spec_kind: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        kv_cache_spec_sliding_window: Option<u32>,
    }

    #[derive(Serialize)]
    pub(super) struct Removed<'a> {
        block_hashes: Hashes<'a>,
        medium: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        group_idx: Option<u32>,
    }

    impl<'a> Event<'a> {
        pub(super) fn of(event: &'a KvEvent, signed: bool) -> Self {
            match event {
                KvEvent::BlockStored(s) => Event::BlockStored(Stored {
                    block_hashes: Hashes { hashes: &s.block_hashes, signed },
                    parent_block_hash: parent(s, signed),
                    token_ids: &s.token_ids,
                    block_size: s.block_size,
                    lora_id: s.lora_id,
                    medium: s.medium.as_deref(),
                    lora_name: s.lora_name.as_deref(),
                    extra_keys: s.extra_keys.as_ref(),
                    group_idx: s.group_idx,
                    kv_cache_spec_kind: s.kv_cache_spec_kind.as_deref(),
                    kv_cache_spec_sliding_window: s.kv_cache_spec_sliding_window,
                }),
                KvEvent::BlockRemoved(r) => Event::BlockRemoved(Removed {
                    block_hashes: Hashes { hashes: &r.block_hashes, signed },
                    medium: r.medium.as_deref(),
                    group_idx: r.group_idx,
                }),
                KvEvent::AllBlocksCleared => Event::AllBlocksCleared {},
                KvEvent::Unknown(tag) => Event::Unknown(Tag { r#type: tag }),
                // Left out by `encode_batch`.
                KvEvent::Invalid(_) => Event::Unknown(Tag { r#type: "Invalid" }),
            }
        }
    }
}

/// SGLang 0.5 (`sglang/srt/disaggregation/kv_events.py`): `lora_id` always (nil), the rest
/// omitted when `None`.
mod sglang05 {
    use super::*;

    #[derive(Serialize)]
    #[serde(tag = "type")]
    pub(super) enum Event<'a> {
        BlockStored(Stored<'a>),
        BlockRemoved(Removed<'a>),
        AllBlocksCleared {},
        #[serde(untagged)]
        Unknown(Tag<'a>),
    }

    #[derive(Serialize)]
    pub(super) struct Stored<'a> {
        block_hashes: Hashes<'a>,
        parent_block_hash: Option<Hash>,
        token_ids: &'a TokenIds,
        block_size: u32,
        lora_id: Option<i64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        medium: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_salt: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        session_id: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        lora_name: Option<&'a str>,
    }

    #[derive(Serialize)]
    pub(super) struct Removed<'a> {
        block_hashes: Hashes<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        medium: Option<&'a str>,
    }

    impl<'a> Event<'a> {
        pub(super) fn of(event: &'a KvEvent, signed: bool) -> Self {
            match event {
                KvEvent::BlockStored(s) => Event::BlockStored(Stored {
                    block_hashes: Hashes { hashes: &s.block_hashes, signed },
                    parent_block_hash: parent(s, signed),
                    token_ids: &s.token_ids,
                    block_size: s.block_size,
                    lora_id: s.lora_id,
                    medium: s.medium.as_deref(),
                    cache_salt: s.cache_salt.as_deref(),
                    session_id: s.session_id.as_deref(),
                    lora_name: s.lora_name.as_deref(),
                }),
                KvEvent::BlockRemoved(r) => Event::BlockRemoved(Removed {
                    block_hashes: Hashes { hashes: &r.block_hashes, signed },
                    medium: r.medium.as_deref(),
                }),
                KvEvent::AllBlocksCleared => Event::AllBlocksCleared {},
                KvEvent::Unknown(tag) => Event::Unknown(Tag { r#type: tag }),
                // Left out by `encode_batch`.
                KvEvent::Invalid(_) => Event::Unknown(Tag { r#type: "Invalid" }),
            }
        }
    }
}

/// vLLM 0.10 (msgspec `array_like=True`): `["BlockStored", hashes, parent, tokens, block_size,
/// lora_id]`, `["BlockRemoved", hashes]`, `["AllBlocksCleared"]`.
mod vllm010 {
    use super::*;

    #[derive(Serialize)]
    #[serde(untagged)]
    pub(super) enum Event<'a> {
        BlockStored(&'static str, Hashes<'a>, Option<Hash>, &'a TokenIds, u32, Option<i64>),
        BlockRemoved(&'static str, Hashes<'a>),
        Tag((&'a str,)),
    }

    pub(super) fn event(event: &KvEvent, signed: bool) -> Event<'_> {
        match event {
            KvEvent::BlockStored(s) => Event::BlockStored(
                "BlockStored",
                Hashes { hashes: &s.block_hashes, signed },
                parent(s, signed),
                &s.token_ids,
                s.block_size,
                s.lora_id,
            ),
            KvEvent::BlockRemoved(r) => {
                Event::BlockRemoved("BlockRemoved", Hashes { hashes: &r.block_hashes, signed })
            }
            KvEvent::AllBlocksCleared => Event::Tag(("AllBlocksCleared",)),
            KvEvent::Unknown(tag) => Event::Tag((tag,)),
            // Left out by `encode_batch`.
            KvEvent::Invalid(_) => Event::Tag(("Invalid",)),
        }
    }
}
