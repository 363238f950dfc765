//! ZeroMQ framing: PUB messages, replay replies with and without the delimiter and the topic,
//! the request.

use super::concat;
use super::positional::POSITIONAL;
use crate::{
    decode_message, decode_replay_reply, replay_request, DecodeError, KvEvent, ReplayReply, REPLAY_END,
};

/// `[0.0, [["AllBlocksCleared"]]]`
fn cleared_payload() -> Vec<u8> {
    concat(&[&[0x92, 0x00, 0x91, 0x91, 0xb0], b"AllBlocksCleared"])
}

const SEQ: [u8; 8] = [0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08];

#[test]
fn pub_message_is_topic_seq_payload() {
    let frames = [b"kv@worker-1".to_vec(), SEQ.to_vec(), concat(POSITIONAL)];
    let (seq, batch) = decode_message(&frames).unwrap();
    assert_eq!(seq, 0x0102_0304_0506_0708);
    assert_eq!(batch.events.len(), 4);
    // Borrowed frames work as well as owned ones.
    let payload = cleared_payload();
    let frames: [&[u8]; 3] = [b"", &[0; 8], &payload];
    assert_eq!(decode_message(&frames).unwrap().0, 0);
}

#[test]
fn pub_message_framing_errors() {
    let payload = cleared_payload();
    let two: [&[u8]; 2] = [&SEQ, &payload];
    assert_eq!(
        decode_message(&two),
        Err(DecodeError::FrameCount { expected: "3 (topic, seq, payload)", got: 2 })
    );
    let four: [&[u8]; 4] = [b"", &SEQ, &payload, b""];
    assert!(matches!(decode_message(&four), Err(DecodeError::FrameCount { got: 4, .. })));
    let short_seq: [&[u8]; 3] = [b"", &SEQ[..7], &payload];
    let err = decode_message(&short_seq).unwrap_err();
    assert_eq!(err, DecodeError::SeqLength { len: 7 });
    assert_eq!(err.to_string(), "sequence number frame: expected 8 bytes, got 7");
    let bad_payload: [&[u8]; 3] = [b"", &SEQ, &payload[..payload.len() - 1]];
    let err = decode_message(&bad_payload).unwrap_err();
    assert_eq!(err.to_string(), "payload: event 0: type: unexpected end of payload");
}

#[test]
fn replay_reply_with_and_without_the_delimiter() {
    let payload = cleared_payload();
    let expected = ReplayReply::Batch {
        seq: 0x0102_0304_0506_0708,
        batch: crate::EventBatch {
            ts: 0.0,
            events: vec![KvEvent::AllBlocksCleared],
            data_parallel_rank: None,
        },
    };
    let bare: [&[u8]; 2] = [&SEQ, &payload];
    assert_eq!(decode_replay_reply(&bare), Ok(expected.clone()));
    let dealer: [&[u8]; 3] = [b"", &SEQ, &payload];
    assert_eq!(decode_replay_reply(&dealer), Ok(expected.clone()));
    // vLLM 0.26 on and SGLang 0.5: the topic after the delimiter (stripped by some sockets).
    let with_topic: [&[u8]; 4] = [b"", b"kv", &SEQ, &payload];
    assert_eq!(decode_replay_reply(&with_topic), Ok(expected.clone()));
    let stripped: [&[u8]; 3] = [b"kv", &SEQ, &payload];
    assert_eq!(decode_replay_reply(&stripped), Ok(expected));
}

#[test]
fn replay_end_marker() {
    let end = (-1i64).to_be_bytes();
    assert_eq!(end, REPLAY_END.to_be_bytes());
    let dealer: [&[u8]; 3] = [b"", &end, b""];
    assert_eq!(decode_replay_reply(&dealer), Ok(ReplayReply::End));
    let bare: [&[u8]; 2] = [&end, b""];
    assert_eq!(decode_replay_reply(&bare), Ok(ReplayReply::End));
    // The current form keeps the topic frame empty even when a topic is set.
    let current: [&[u8]; 4] = [b"", b"", &end, b""];
    assert_eq!(decode_replay_reply(&current), Ok(ReplayReply::End));
}

#[test]
fn replay_framing_errors() {
    let payload = cleared_payload();
    let not_empty: [&[u8]; 4] = [b"x", b"kv", &SEQ, &payload];
    assert_eq!(decode_replay_reply(&not_empty), Err(DecodeError::Delimiter { len: 1 }));
    let not_a_topic: [&[u8]; 3] = [b"x", b"short", &payload];
    assert_eq!(decode_replay_reply(&not_a_topic), Err(DecodeError::Delimiter { len: 1 }));
    let one: [&[u8]; 1] = [&SEQ];
    assert!(matches!(decode_replay_reply(&one), Err(DecodeError::FrameCount { got: 1, .. })));
    let none: [&[u8]; 0] = [];
    assert!(matches!(decode_replay_reply(&none), Err(DecodeError::FrameCount { got: 0, .. })));
    // `[b"", END]` without the final empty frame reads as a 0-byte sequence number.
    let end = REPLAY_END.to_be_bytes();
    let truncated: [&[u8]; 2] = [b"", &end];
    assert_eq!(decode_replay_reply(&truncated), Err(DecodeError::SeqLength { len: 0 }));
}

#[test]
fn replay_request_is_delimiter_then_start_seq() {
    assert_eq!(replay_request(5), [vec![], vec![0, 0, 0, 0, 0, 0, 0, 5]]);
    assert_eq!(replay_request(u64::MAX - 1)[1], (u64::MAX - 1).to_be_bytes());
}
