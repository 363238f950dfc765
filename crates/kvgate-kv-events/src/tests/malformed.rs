//! Malformed payloads: each gives an error that says what was wrong and where: an error of the
//! whole batch when its envelope or its msgpack is broken, else an invalid event (and only that).

use super::concat;
use super::maps::MAPS;
use super::positional::POSITIONAL;
use crate::{decode_batch, DecodeError, KvEvent};

/// Decodes `parts` and compares the message: the batch's error, or its one invalid event's
/// (written as the batch error would be, `payload: ` first).
#[track_caller]
fn check(parts: &[&[u8]], expected: &str) {
    assert_eq!(problem(&concat(parts)), expected);
}

#[track_caller]
fn problem(payload: &[u8]) -> String {
    match decode_batch(payload) {
        Ok(batch) => match &batch.events[..] {
            [KvEvent::Invalid(invalid)] => format!("payload: {invalid}"),
            events => panic!("decoded {events:?}, expected an error"),
        },
        Err(err) => err.to_string(),
    }
}

/// `[0, [event]]`: a batch around one positional event whose parts follow.
const ONE_EVENT: &[u8] = &[0x92, 0x00, 0x91];
const STORED: &[u8] = b"\xabBlockStored";

#[test]
fn every_truncation_of_a_valid_payload_is_an_error() {
    for fixture in [concat(POSITIONAL), concat(MAPS)] {
        for len in 0..fixture.len() {
            let err = decode_batch(&fixture[..len]).unwrap_err();
            let DecodeError::Payload { reason, .. } = &err else { panic!("{err:?}") };
            assert_eq!(reason, "unexpected end of payload", "at {len}: {err}");
        }
        assert!(decode_batch(&fixture).is_ok());
    }
}

#[test]
fn wrong_kinds_name_the_place() {
    check(&[&[0xc0]], "payload: expected an event batch (an array or a map), got nil");
    check(&[&[0x92, 0xa1, b'x', 0x90]], "payload: ts: expected a timestamp (a number), got a string");
    check(&[&[0x92, 0x00, 0x80]], "payload: events: expected an array of events, got a map");
    check(&[ONE_EVENT, &[0x05]], "payload: event 0: expected an event (an array or a map), got an integer");
    check(
        &[ONE_EVENT, &[0x91, 0x05]],
        "payload: event 0: type: expected an event type name (a string), got 5",
    );
    check(
        &[ONE_EVENT, &[0x95], STORED, &[0x91, 0x01, 0xc0, 0xa3], b"abc", &[0x02]],
        "payload: event 0 (BlockStored): token_ids: expected an array of token ids, got a string",
    );
    check(
        &[ONE_EVENT, &[0x95], STORED, &[0x92, 0x01, 0xa1, b'h', 0xc0, 0x90, 0x02]],
        "payload: event 0 (BlockStored): block_hashes[1]: expected a block hash (an integer or bytes), got a string",
    );
    check(
        &[ONE_EVENT, &[0x95], STORED, &[0x91, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xc0, 0x90, 0x02]],
        "payload: event 0 (BlockStored): block_hashes[0]: expected a block hash (an integer or bytes), got a float",
    );
    check(
        &[ONE_EVENT, &[0x95], STORED, &[0x90, 0xc3, 0x90, 0x02]],
        "payload: event 0 (BlockStored): parent_block_hash: expected a block hash (an integer or bytes) or nil, got a boolean",
    );
    check(
        &[ONE_EVENT, &[0x97], STORED, &[0x90, 0xc0, 0x90, 0x02, 0xc0, 0x91, 0x00]],
        "payload: event 0 (BlockStored): medium: expected a string or nil, got an array",
    );
}

#[test]
fn values_that_do_not_fit_are_errors() {
    let stored = |token: &[u8], block_size: &[u8]| -> Vec<u8> {
        concat(&[ONE_EVENT, &[0x95], STORED, &[0x90, 0xc0, 0x91], token, block_size])
    };
    let token_error =
        "payload: event 0 (BlockStored): token_ids[0]: expected a token id (an integer in 0..=4294967295)";
    let huge = stored(&[0xcf, 0, 0, 0, 1, 0, 0, 0, 0], &[0x02]);
    assert_eq!(problem(&huge), format!("{token_error}, got 4294967296"));
    let negative = stored(&[0xff], &[0x02]);
    assert_eq!(problem(&negative), format!("{token_error}, got -1"));
    let size_error =
        "payload: event 0 (BlockStored): block_size: expected a block size (an integer in 0..=4294967295)";
    for (size, got) in [(&[0xe0][..], "-32"), (&[0xcf, 0, 0, 0, 1, 0, 0, 0, 0], "4294967296")] {
        assert_eq!(problem(&stored(&[0x01], size)), format!("{size_error}, got {got}"));
    }
    // Block size 0 is what vLLM's offload placeholders send.
    let KvEvent::BlockStored(placeholder) = &decode_batch(&stored(&[0x01], &[0x00])).unwrap().events[0]
    else {
        panic!("a placeholder is a BlockStored")
    };
    assert_eq!(placeholder.block_size, 0);
    check(
        &[&[0x93, 0x00, 0x90, 0xff]],
        "payload: data_parallel_rank: expected an integer in 0..=4294967295 or nil, got -1",
    );
    check(
        &[ONE_EVENT, &[0x96], STORED, &[0x90, 0xc0, 0x90, 0x02, 0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0]],
        "payload: event 0 (BlockStored): lora_id: expected a 64-bit signed integer or nil, got 9223372036854775808",
    );
    check(
        &[ONE_EVENT, &[0x94, 0xac], b"BlockRemoved", &[0x90, 0xc0, 0xd0, 0xff]],
        "payload: event 0 (BlockRemoved): group_idx: expected an integer in 0..=4294967295 or nil, got -1",
    );
}

#[test]
fn missing_and_duplicate_fields() {
    check(&[&[0x91, 0x00]], "payload: events: missing field");
    check(&[&[0x81, 0xa2, b't', b's', 0x00]], "payload: events: missing field");
    check(&[ONE_EVENT, &[0x90]], "payload: event 0: type: missing field");
    check(
        &[ONE_EVENT, &[0x93], STORED, &[0x90, 0xc0]],
        "payload: event 0 (BlockStored): token_ids: missing field",
    );
    check(&[ONE_EVENT, &[0x81, 0xa1, b'x', 0x01]], "payload: event 0: type: missing field");
    let map_stored: &[&[u8]] =
        &[ONE_EVENT, &[0x83, 0xa4], b"type", STORED, &[0xac], b"block_hashes", &[0x90]];
    let token_ids: &[&[u8]] = &[&[0xa9], b"token_ids", &[0x90]];
    check(&[map_stored, token_ids].concat(), "payload: event 0 (BlockStored): block_size: missing field");
    let twice: &[&[u8]] = &[ONE_EVENT, &[0x82, 0xa4], b"type", STORED, &[0xa4], b"type", STORED];
    check(twice, "payload: event 0 (BlockStored): type: duplicate field");
    check(&[&[0x82, 0xa2, b't', b's', 0x00, 0xa2, b't', b's', 0x01]], "payload: ts: duplicate field");
    check(&[&[0x81, 0x01, 0x02]], "payload: expected a field name (a string), got 1");
}

#[test]
fn msgpack_level_errors() {
    check(&[&[0xc1]], "payload: invalid msgpack marker 0xc1");
    check(&[&[0x92, 0x00, 0x90, 0x00]], "payload: bytes after the end of the batch");
    // 40 nested arrays as a 4th (ignored) batch element: past the depth limit, no stack overflow.
    let deep = concat(&[&[0x94, 0x00, 0x90, 0xc0], &[0x91; 40], &[0x00]]);
    assert_eq!(decode_batch(&deep).unwrap_err().to_string(), "payload: nested deeper than 31 levels");
    // A length prefix far beyond the payload neither allocates it nor panics.
    check(&[&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]], "payload: event 0: unexpected end of payload");
    check(&[&[0x92, 0xa5, b'a']], "payload: ts: unexpected end of payload");
}

#[test]
fn a_string_that_is_not_utf8_is_not_a_string() {
    // rmp-serde hands such a string over as bytes, so the message says "bytes".
    let payload = concat(&[ONE_EVENT, &[0x93], b"\xacBlockRemoved", &[0x90, 0xa1, 0xff]]);
    assert_eq!(
        problem(&payload),
        "payload: event 0 (BlockRemoved): medium: expected a string or nil, got bytes"
    );
}

#[test]
fn a_string_event_tag_is_required_but_any_string_is_accepted() {
    let batch = decode_batch(&concat(&[ONE_EVENT, &[0x91, 0xa0]])).unwrap();
    assert_eq!(batch.events, [KvEvent::Unknown(String::new())]);
}

/// One bad event spoils itself only: the events around it decode, and so does the rest of the
/// bad event's own bytes (the stream never loses its place).
#[test]
fn a_bad_event_is_invalid_alone() {
    let payload = concat(&[
        &[0x92, 0x00, 0x94], // [0, [4 events]]
        // a BlockRemoved whose hashes hold a map and an array (each read to its end)
        &[0x92],
        b"\xacBlockRemoved",
        &[0x93, 0x01, 0x81, 0x01, 0x02, 0x92, 0x02, 0x03],
        &[0x91],
        b"\xb0AllBlocksCleared",
        // a map event with a non-string key, then a token list of the wrong kind
        &[0x83, 0xa4],
        b"type",
        STORED,
        &[0x05, 0x91, 0x90],
        b"\xa9token_ids",
        &[0xa2],
        b"xy",
        &[0x91],
        b"\xb0AllBlocksCleared",
    ]);
    let events = decode_batch(&payload).unwrap().events;
    let problems: Vec<String> = events
        .iter()
        .map(|event| match event {
            KvEvent::Invalid(invalid) => invalid.to_string(),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        problems,
        [
            "event 0 (BlockRemoved): block_hashes[1]: expected a block hash (an integer or bytes), got a map",
            "AllBlocksCleared",
            "event 2 (BlockStored): (key): expected a field name (a string), got 5",
            "AllBlocksCleared",
        ]
    );
}

#[test]
fn bigrams_must_be_pairs_and_not_mixed() {
    let with = |tokens: &[u8]| concat(&[ONE_EVENT, &[0x95], STORED, &[0x90, 0xc0], tokens, &[0x02]]);
    let pairs = decode_batch(&with(&[0x92, 0x92, 0x01, 0x02, 0x92, 0x02, 0x03])).unwrap();
    let KvEvent::BlockStored(stored) = &pairs.events[0] else { panic!("{pairs:?}") };
    assert_eq!(stored.token_ids, crate::TokenIds::Bigrams(vec![[1, 2], [2, 3]]));
    assert_eq!(stored.token_ids.tokens(), [1, 2]);
    assert_eq!(
        problem(&with(&[0x92, 0x01, 0x92, 0x02, 0x03])),
        "payload: event 0 (BlockStored): token_ids[1]: token ids and token id pairs mixed in one list"
    );
    assert_eq!(
        problem(&with(&[0x91, 0x93, 0x01, 0x02, 0x03])),
        "payload: event 0 (BlockStored): token_ids[0]: expected a pair of token ids, got an array of another length"
    );
}
