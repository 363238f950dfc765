//! The positional encoding (msgspec `array_like=True`), from a payload written out by hand.

use super::concat;
use crate::{decode_batch, BlockRemoved, BlockStored, ExtraKey, KvEvent};

/// `[1718000000.5, [4 events], 1]`, every msgpack header written by hand from the spec.
pub(super) const POSITIONAL: &[&[u8]] = &[
    &[0x93],                                                 // array of 3: ts, events, data_parallel_rank
    &[0xcb, 0x41, 0xd9, 0x99, 0xa6, 0x60, 0x20, 0x00, 0x00], // float64 1718000000.5
    &[0x94],                                                 // events: array of 4
    // event 0: BlockStored, int hashes, no parent, through `medium` (7 elements)
    &[0x97],                                                 // array of 7
    b"\xabBlockStored",                                      // fixstr 11
    &[0x93],                                                 // block_hashes: array of 3
    &[0x01],                                                 // positive fixint 1
    &[0xcd, 0x12, 0x34],                                     // uint16 0x1234
    &[0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe], // int64 -2
    &[0xc0],                                                 // parent_block_hash: nil
    &[0x96],                                                 // token_ids: array of 6
    &[0x01],                                                 // 1
    &[0xcc, 0xc8],                                           // uint8 200
    &[0xcd, 0x01, 0x00],                                     // uint16 256
    &[0xce, 0x00, 0x01, 0x86, 0xa0],                         // uint32 100000
    &[0xce, 0xff, 0xff, 0xff, 0xff],                         // uint32 4294967295 (u32::MAX)
    &[0x00],                                                 // 0
    &[0x02],                                                 // block_size: 2
    &[0xc0],                                                 // lora_id: nil
    b"\xa3GPU",                                              // medium: fixstr 3
    // event 1: BlockStored with a parent, the oldest form (stops after lora_id: 6 elements)
    &[0x96], // array of 6
    b"\xabBlockStored",
    &[0x91],                                                 // block_hashes: array of 1
    &[0xcf, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00], // uint64 2^63
    &[0xd0, 0xfe],       // parent_block_hash: int8 -2 (event 0's last hash, narrower encoding)
    &[0x92],             // token_ids: array of 2
    &[0xd1, 0x00, 0x05], // int16 5 (a signed width holding a positive value)
    &[0x07],             // 7
    &[0xd0, 0x02],       // block_size: int8 2
    &[0x2a],             // lora_id: 42
    // event 2: BlockRemoved with group_idx and one extra trailing element (7 elements)
    &[0x97],             // array of 7
    b"\xacBlockRemoved", // fixstr 12
    &[0x92],             // block_hashes: array of 2
    &[0x01],             // 1
    &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    b"\xff\xa3CPU", // uint64 u64::MAX; medium
    &[0x03],        // group_idx: 3
    &[0xc0, 0xc0],  // locality, ownership: nil
    b"\xa5extra",   // a field from a future version: ignored
    // event 3: AllBlocksCleared (1 element)
    &[0x91],                 // array of 1
    b"\xb0AllBlocksCleared", // fixstr 16
    &[0x01],                 // data_parallel_rank: 1
];

#[test]
fn positional_fixture_decodes_field_by_field() {
    let batch = decode_batch(&concat(POSITIONAL)).unwrap();
    assert_eq!(batch.ts, 1718000000.5);
    assert_eq!(batch.data_parallel_rank, Some(1));
    assert_eq!(batch.events.len(), 4);

    let KvEvent::BlockStored(stored) = &batch.events[0] else { panic!("{:?}", batch.events[0]) };
    assert_eq!(stored.block_hashes, [1, 0x1234, 0xffff_ffff_ffff_fffe]);
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(stored.token_ids, [1, 200, 256, 100_000, u32::MAX, 0]);
    assert_eq!(stored.block_size, 2);
    assert_eq!(stored.lora_id, None);
    assert_eq!(stored.medium.as_deref(), Some("GPU"));
    assert_eq!(stored.lora_name, None);
    assert_eq!(stored.group_idx, None);

    let KvEvent::BlockStored(stored) = &batch.events[1] else { panic!("{:?}", batch.events[1]) };
    assert_eq!(stored.block_hashes, [1 << 63]);
    assert_eq!(stored.parent_block_hash, Some(0xffff_ffff_ffff_fffe));
    assert_eq!(stored.token_ids, [5, 7]);
    assert_eq!(stored.block_size, 2);
    assert_eq!(stored.lora_id, Some(42));
    assert_eq!((&stored.medium, &stored.lora_name, stored.group_idx), (&None, &None, None));

    let expected_removed = BlockRemoved {
        block_hashes: vec![1, u64::MAX],
        medium: Some("CPU".into()),
        group_idx: Some(3),
        locality: None,
        ownership: None,
    };
    assert_eq!(batch.events[2], KvEvent::BlockRemoved(expected_removed));
    assert_eq!(batch.events[3], KvEvent::AllBlocksCleared);
}

#[test]
fn positional_batch_without_rank_and_with_nil_rank() {
    // [1.0 as float32, []]
    let two = [0x92, 0xca, 0x3f, 0x80, 0x00, 0x00, 0x90];
    let batch = decode_batch(&two).unwrap();
    assert_eq!((batch.ts, batch.events.len(), batch.data_parallel_rank), (1.0, 0, None));
    // [7 (an integer ts), [], nil, "future"]
    let nil_rank = concat(&[&[0x94, 0x07, 0x90, 0xc0], b"\xa6future"]);
    let batch = decode_batch(&nil_rank).unwrap();
    assert_eq!((batch.ts, batch.events.len(), batch.data_parallel_rank), (7.0, 0, None));
}

#[test]
fn positional_newest_block_stored_has_every_field() {
    let payload = concat(&[
        &[0x92, 0x00, 0x91], // [0, [event]]
        &[0x9d],             // array of 13: the tag and 12 fields
        b"\xabBlockStored",
        &[0x91, 0x09], // block_hashes [9]
        &[0x08],       // parent 8
        &[0x91, 0x05], // token_ids [5]
        &[0x01],       // block_size 1
        &[0xff],       // lora_id -1 (negative fixint)
        b"\xa3GPU",    // medium
        b"\xa4sql1",   // lora_name
        &[0x91, 0x92], // extra_keys: [["mm", 3]]
        b"\xa2mm",
        &[0x03],
        &[0x02],               // group_idx 2
        b"\xaefull_attention", // kv_cache_spec_kind
        &[0xc0],               // kv_cache_spec_sliding_window: nil
        b"\xa5LOCAL",          // locality
    ]);
    let batch = decode_batch(&payload).unwrap();
    let expected = BlockStored {
        block_hashes: vec![9],
        parent_block_hash: Some(8),
        token_ids: vec![5].into(),
        block_size: 1,
        lora_id: Some(-1),
        lora_name: Some("sql1".into()),
        medium: Some("GPU".into()),
        extra_keys: Some(vec![Some(vec![ExtraKey::Str("mm".into()), ExtraKey::Int(3)])]),
        group_idx: Some(2),
        kv_cache_spec_kind: Some("full_attention".into()),
        locality: Some("LOCAL".into()),
        ..BlockStored::default()
    };
    assert_eq!(batch.events, [KvEvent::BlockStored(expected)]);
}

#[test]
fn positional_unknown_event_and_old_block_removed() {
    let payload = concat(&[
        &[0x92, 0x00, 0x92], // [0, [2 events]]
        &[0x93],             // ["BlockMoved", "x", {}]
        b"\xaaBlockMoved",
        b"\xa1x",
        &[0x80],
        &[0x92], // ["BlockRemoved", [5]]: no medium (older vLLM)
        b"\xacBlockRemoved",
        &[0x91, 0x05],
    ]);
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.events[0], KvEvent::Unknown("BlockMoved".into()));
    let removed = BlockRemoved { block_hashes: vec![5], ..BlockRemoved::default() };
    assert_eq!(batch.events[1], KvEvent::BlockRemoved(removed));
}
