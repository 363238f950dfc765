//! Properties: any model batch written in either encoding with any widths decodes to itself;
//! arbitrary and mutated bytes never panic.

use proptest::prelude::*;

use super::concat;
use super::maps::MAPS;
use super::positional::POSITIONAL;
use super::writer::{self, EventIn, HashIn, Style};
use crate::{
    decode_batch, decode_message, decode_replay_reply, BlockRemoved, BlockStored, EventBatch, TokenIds,
};

fn hash() -> impl Strategy<Value = HashIn> {
    prop_oneof![
        (i64::MIN..=i64::MAX).prop_map(|v| HashIn::Int(v.into())),
        any::<u64>().prop_map(|v| HashIn::Int(v.into())),
        (0..128i128).prop_map(HashIn::Int),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(HashIn::Bytes),
    ]
}

fn opt_name() -> impl Strategy<Value = Option<String>> {
    prop::option::of("[A-Za-z0-9_]{0,40}")
}

fn event() -> impl Strategy<Value = EventIn> {
    let stored = (
        prop::collection::vec(hash(), 0..6),
        prop::option::of(hash()),
        prop_oneof![
            prop::collection::vec(any::<u32>(), 0..40).prop_map(TokenIds::Plain),
            prop::collection::vec(any::<[u32; 2]>(), 1..20).prop_map(TokenIds::Bigrams),
        ],
        0..=u32::MAX,
        prop::option::of(any::<i64>()),
        opt_name(),
        opt_name(),
        prop::option::of(any::<u32>()),
        (opt_name(), opt_name()),
    )
        .prop_map(
            |(
                hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                group_idx,
                (locality, session_id),
            )| {
                let stored = BlockStored {
                    token_ids,
                    block_size,
                    lora_id,
                    lora_name,
                    medium,
                    group_idx,
                    locality,
                    session_id,
                    ..BlockStored::default()
                };
                EventIn::Stored { hashes, parent, stored }
            },
        );
    let removed =
        (prop::collection::vec(hash(), 0..6), opt_name(), prop::option::of(any::<u32>()), opt_name())
            .prop_map(|(hashes, medium, group_idx, ownership)| EventIn::Removed {
                hashes,
                removed: BlockRemoved { medium, group_idx, ownership, ..BlockRemoved::default() },
            });
    let unknown = "[A-Z][A-Za-z]{0,20}"
        .prop_filter("a known tag", |tag| {
            !["BlockStored", "BlockRemoved", "AllBlocksCleared"].contains(&tag.as_str())
        })
        .prop_map(EventIn::Unknown);
    prop_oneof![4 => stored, 3 => removed, 1 => Just(EventIn::Cleared), 1 => unknown]
}

proptest! {
    #[test]
    fn any_batch_in_either_encoding_decodes_to_itself(
        ts in any::<f32>().prop_filter("finite", |ts| ts.is_finite()),
        events in prop::collection::vec(event(), 0..8),
        data_parallel_rank in prop::option::of(any::<u32>()),
        positional in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let expected = EventBatch { ts: ts.into(), events: events.iter().map(EventIn::decoded).collect(), data_parallel_rank };
        let payload = writer::batch(&expected, &events, positional, &mut Style(seed));
        prop_assert_eq!(decode_batch(&payload), Ok(expected));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode_batch(&bytes);
        let _ = decode_message(&[&bytes[..], &[0; 8], &bytes]);
        let _ = decode_replay_reply(&[&bytes[..bytes.len().min(8)], &bytes]);
    }

    #[test]
    fn mutated_fixtures_never_panic(
        positional in any::<bool>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..6),
    ) {
        let mut bytes = concat(if positional { POSITIONAL } else { MAPS });
        for (at, byte, op) in edits {
            let at = at.index(bytes.len() + 1);
            match op {
                0 if at < bytes.len() => bytes[at] = byte,
                1 => bytes.insert(at, byte),
                _ if at < bytes.len() => { bytes.remove(at); }
                _ => {}
            }
        }
        // Same bytes, same answer: no hidden state between calls (compared as text: a mutated
        // timestamp may be NaN, which is decoded as sent).
        prop_assert_eq!(format!("{:?}", decode_batch(&bytes)), format!("{:?}", decode_batch(&bytes)));
    }
}
