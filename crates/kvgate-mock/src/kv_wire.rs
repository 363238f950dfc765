//! An engine's KV event batch as the engine version the mock speaks sends it: the engine model's
//! events with the fields that version's engines fill in, written by `kvgate-kv-events`' encoder
//! (one wire format, in one place, checked against the engines' own captures).

use kvgate_engine::{KvEvent, KvEventBatch, Tier};
use kvgate_kv_events::{self as wire, encode_batch, WireFormat};

use crate::args::KvEventEncoding;

impl KvEventEncoding {
    pub(crate) fn wire_format(self) -> WireFormat {
        match self {
            KvEventEncoding::Vllm033 => WireFormat::Vllm033,
            KvEventEncoding::Vllm025 => WireFormat::Vllm025,
            KvEventEncoding::Vllm010 => WireFormat::Vllm010,
            KvEventEncoding::Sglang05 => WireFormat::Sglang05,
        }
    }
}

/// Encodes one batch in `encoding`, stamped `timestamp_secs` (Unix seconds), from rank `dp_rank`.
pub(crate) fn encode(
    batch: &KvEventBatch,
    timestamp_secs: f64,
    dp_rank: u32,
    encoding: KvEventEncoding,
) -> Vec<u8> {
    let format = encoding.wire_format();
    let events = batch.events.iter().map(|event| wire_event(event, format)).collect();
    encode_batch(&wire::EventBatch { ts: timestamp_secs, events, data_parallel_rank: Some(dp_rank) }, format)
}

/// The medium names: vLLM's block pool says "GPU", its offloading connector "CPU".
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
    }
}

/// What an engine of `format`'s version publishes for `event`: vLLM 0.2x and later name the
/// medium and group 0 and list one extra-key entry per GPU block (nil, or the LoRA name: vLLM
/// hashes it into each block); vLLM 0.10 has none of those fields; SGLang names the medium. A
/// LoRA adapter's stores carry `lora_name` (and vLLM's `lora_id`; SGLang sends it nil).
fn wire_event(event: &KvEvent, format: WireFormat) -> wire::KvEvent {
    let vllm = matches!(format, WireFormat::Vllm033 | WireFormat::Vllm025);
    let named = format != WireFormat::Vllm010;
    match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, tier, lora } => {
            let lora_key = lora.as_ref().map(|lora| vec![wire::ExtraKey::Str(lora.name.clone())]);
            wire::KvEvent::BlockStored(wire::BlockStored {
                block_hashes: block_hashes.clone(),
                parent_block_hash: *parent_block_hash,
                token_ids: token_ids.clone().into(),
                block_size: *block_size,
                lora_id: lora
                    .as_ref()
                    .filter(|_| format != WireFormat::Sglang05)
                    .map(|lora| i64::from(lora.id)),
                lora_name: lora.as_ref().filter(|_| named).map(|lora| lora.name.clone()),
                medium: named.then(|| medium(*tier).to_owned()),
                // The block pool's stores list their extra keys; the offloading connector's
                // placeholders do not.
                extra_keys: (vllm && *tier == Tier::Gpu).then(|| vec![lora_key; block_hashes.len()]),
                group_idx: vllm.then_some(0),
                ..wire::BlockStored::default()
            })
        }
        KvEvent::BlockRemoved { block_hashes, tier } => wire::KvEvent::BlockRemoved(wire::BlockRemoved {
            block_hashes: block_hashes.clone(),
            medium: named.then(|| medium(*tier).to_owned()),
            group_idx: vllm.then_some(0),
            ..wire::BlockRemoved::default()
        }),
        KvEvent::AllBlocksCleared => wire::KvEvent::AllBlocksCleared,
    }
}

#[cfg(test)]
mod tests {
    use kvgate_kv_events::{decode_batch, TokenIds};

    use super::*;

    fn sample() -> KvEventBatch {
        KvEventBatch {
            seq: 3,
            timestamp_us: 0,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![1, u64::MAX],
                    parent_block_hash: None,
                    token_ids: vec![7, 8],
                    block_size: 1,
                    tier: Tier::Gpu,
                    lora: None,
                },
                KvEvent::BlockStored {
                    block_hashes: vec![u64::MAX],
                    parent_block_hash: None,
                    token_ids: vec![],
                    block_size: 0,
                    tier: Tier::Cpu,
                    lora: None,
                },
                KvEvent::BlockRemoved { block_hashes: vec![1], tier: Tier::Gpu },
                KvEvent::AllBlocksCleared,
            ],
        }
    }

    #[test]
    fn every_encoding_decodes_to_the_engines_events() {
        for encoding in [KvEventEncoding::Vllm033, KvEventEncoding::Vllm025, KvEventEncoding::Sglang05] {
            let batch = decode_batch(&encode(&sample(), 1.5, 2, encoding)).unwrap();
            assert_eq!((batch.ts, batch.data_parallel_rank), (1.5, Some(2)));
            let wire::KvEvent::BlockStored(stored) = &batch.events[0] else { panic!("{batch:?}") };
            assert_eq!(
                (&stored.block_hashes, &stored.token_ids),
                (&vec![1, u64::MAX], &TokenIds::Plain(vec![7, 8]))
            );
            assert_eq!(stored.medium.as_deref(), Some("GPU"));
            let wire::KvEvent::BlockStored(placeholder) = &batch.events[1] else { panic!("{batch:?}") };
            assert_eq!((placeholder.block_size, placeholder.medium.as_deref()), (0, Some("CPU")));
            assert_eq!(batch.events[3], wire::KvEvent::AllBlocksCleared);
        }
        let old = decode_batch(&encode(&sample(), 1.5, 0, KvEventEncoding::Vllm010)).unwrap();
        let wire::KvEvent::BlockStored(stored) = &old.events[0] else { panic!("{old:?}") };
        assert_eq!((stored.medium.as_deref(), stored.group_idx), (None, None), "vLLM 0.10 has neither field");
    }
}
