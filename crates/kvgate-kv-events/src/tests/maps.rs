//! The map encoding (current vLLM, `omit_defaults=True`), from a payload written out by hand.

use super::concat;
use crate::{block_hash_from_bytes, decode_batch, BlockRemoved, ExtraKey, KvEvent};

const SHA256: [u8; 32] = [
    0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, //
    0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f,
];

/// `{"ts": 1.25f32, "events": [6 events], "data_parallel_rank": 3}`, headers written by hand.
pub(super) const MAPS: &[&[u8]] = &[
    &[0x83], // map of 3
    b"\xa2ts",
    &[0xca, 0x3f, 0xa0, 0x00],
    b"\x00\xa6events", // float32 1.25
    &[0x96],           // array of 6
    // event 0: BlockStored, `type` first, bytes hashes, nil parent, group_idx omitted
    &[0x88], // map of 8
    b"\xa4type",
    b"\xabBlockStored",
    b"\xacblock_hashes",
    &[0x92],       // array of 2
    &[0xc4, 0x20], // bin8, 32 bytes: a sha256 digest
    &SHA256,
    &[0xc4, 0x04, 0xde, 0xad, 0xbe],
    b"\xef\xb1parent_block_hash", // bin8, 4 bytes; fixstr 17
    &[0xc0],                      // nil
    b"\xa9token_ids",
    &[0x94, 0x01, 0x02, 0x03],
    b"\x04\xaablock_size", // [1, 2, 3, 4]
    &[0x02],
    b"\xa7lora_id",
    &[0xc0],
    b"\xa6medium",
    b"\xa3GPU",
    b"\xa9lora_name",
    &[0xc0],
    // event 1: BlockStored, `type` third, a bytes parent, unknown keys, lora/medium omitted
    &[0x88], // map of 8
    b"\xacblock_hashes",
    &[0x91, 0xcd, 0x12],
    b"\x34\xaaextra_keys", // [0x1234]
    &[0x91, 0x92],         // [["mm", nil]]
    b"\xa2mm",
    &[0xc0],
    b"\xa4type",
    b"\xabBlockStored",
    b"\xb1parent_block_hash",
    &[0xc4, 0x04, 0xde, 0xad, 0xbe],
    b"\xef\xa9token_ids", // bin8 (the previous event's last hash)
    &[0x92, 0x05],
    b"\x06\xaablock_size", // [5, 6]
    &[0xcd, 0x00],
    b"\x02\xa9group_idx", // uint16 2
    &[0x01],
    b"\xabx_future_01", // unknown: skipped
    b"\xaefull_attention",
    // event 2: BlockRemoved with medium
    &[0x83], // map of 3
    b"\xa4type",
    b"\xacBlockRemoved",
    b"\xacblock_hashes",
    &[0x91, 0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    b"\xfe\xa6medium", // [int64 -2]
    b"\xa3CPU",
    // event 3: BlockRemoved, medium omitted, a BlockStored-only key holding junk (skipped)
    &[0x83], // map of 3
    b"\xa4type",
    b"\xacBlockRemoved",
    b"\xa9token_ids",
    b"\xa4junk",
    b"\xacblock_hashes",
    &[0x91, 0x01],
    // event 4: AllBlocksCleared
    &[0x81],
    b"\xa4type",
    b"\xb0AllBlocksCleared",
    // event 5: an event type from the future
    &[0x82],
    b"\xa4type",
    b"\xaaBlockMoved",
    b"\xa2to",
    b"\xa3CPU",
    b"\xb2data_parallel_rank",
    &[0xcc, 0x03], // uint8 3
];

#[test]
fn map_fixture_decodes_field_by_field() {
    let batch = decode_batch(&concat(MAPS)).unwrap();
    assert_eq!(batch.ts, 1.25);
    assert_eq!(batch.data_parallel_rank, Some(3));
    assert_eq!(batch.events.len(), 6);

    let KvEvent::BlockStored(stored) = &batch.events[0] else { panic!("{:?}", batch.events[0]) };
    let deadbeef = block_hash_from_bytes(&[0xde, 0xad, 0xbe, 0xef]);
    assert_eq!(stored.block_hashes, [block_hash_from_bytes(&SHA256), deadbeef]);
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(stored.token_ids, [1, 2, 3, 4]);
    assert_eq!(stored.block_size, 2);
    assert_eq!(stored.lora_id, None);
    assert_eq!(stored.medium.as_deref(), Some("GPU"));
    assert_eq!(stored.lora_name, None);
    assert_eq!(stored.group_idx, None);

    let KvEvent::BlockStored(stored) = &batch.events[1] else { panic!("{:?}", batch.events[1]) };
    assert_eq!(stored.block_hashes, [0x1234]);
    assert_eq!(stored.parent_block_hash, Some(deadbeef));
    assert_eq!(stored.token_ids, [5, 6]);
    assert_eq!(stored.block_size, 2);
    assert_eq!((stored.lora_id, &stored.medium, &stored.lora_name), (None, &None, &None));
    assert_eq!(stored.group_idx, Some(1));
    assert_eq!(stored.extra_keys, Some(vec![Some(vec![ExtraKey::Str("mm".into()), ExtraKey::Nil])]));

    let removed = BlockRemoved {
        block_hashes: vec![0xffff_ffff_ffff_fffe],
        medium: Some("CPU".into()),
        ..BlockRemoved::default()
    };
    assert_eq!(batch.events[2], KvEvent::BlockRemoved(removed));
    let removed = BlockRemoved { block_hashes: vec![1], ..BlockRemoved::default() };
    assert_eq!(batch.events[3], KvEvent::BlockRemoved(removed));
    assert_eq!(batch.events[4], KvEvent::AllBlocksCleared);
    assert_eq!(batch.events[5], KvEvent::Unknown("BlockMoved".into()));
}

#[test]
fn map_batch_keys_in_any_order_rank_omitted_unknown_keys_skipped() {
    let payload = concat(&[
        &[0x83], // map of 3
        b"\xa6events",
        &[0x90],             // []
        b"\xa7version",      // unknown batch key
        &[0x92, 0x01, 0x02], // [1, 2]
        b"\xa2ts",
        &[0xcb, 0x41, 0xd9, 0x99, 0xa6, 0x60, 0x20, 0x00, 0x00], // float64 1718000000.5
    ]);
    let batch = decode_batch(&payload).unwrap();
    assert_eq!((batch.ts, batch.events.len(), batch.data_parallel_rank), (1718000000.5, 0, None));
}

/// The bytes-hash fold is part of the interface (other components hash the same digests).
#[test]
fn bytes_hashes_fold_with_xxh3_64_seed_0() {
    assert_eq!(block_hash_from_bytes(b""), 0x2d06_8005_38d3_94c2);
}

#[test]
fn skipped_values_may_hold_any_msgpack_kind() {
    let payload = concat(&[
        &[0x83], // map of 3
        b"\xa2ts",
        &[0x00], // ts: 0
        b"\xa6events",
        &[0x91, 0x83], // [one event: map of 3]
        b"\xa4type",
        b"\xb0AllBlocksCleared",
        b"\xa3ext",
        &[0xd4, 0x01, 0x02], // fixext1, type 1, data 0x02
        b"\xa3big",
        &[0xde, 0x00, 0x01, 0xc3, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0], // map16 {true: 0.0}
        b"\xb2data_parallel_rank",
        &[0xc0], // nil
    ]);
    let batch = decode_batch(&payload).unwrap();
    assert_eq!((batch.events, batch.data_parallel_rank), (vec![KvEvent::AllBlocksCleared], None));
}

/// The `serde::Deserialize` impls decode the same values (without error locations).
#[test]
fn serde_deserialize_impls_match_decode_batch() {
    let payload = concat(MAPS);
    let via_serde: crate::EventBatch = rmp_serde::from_slice(&payload).unwrap();
    assert_eq!(via_serde, decode_batch(&payload).unwrap());
    let event: KvEvent =
        rmp_serde::from_slice(&concat(&[&[0x81], b"\xa4type", b"\xb0AllBlocksCleared"])).unwrap();
    assert_eq!(event, KvEvent::AllBlocksCleared);
}
