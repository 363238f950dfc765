//! Shared helpers of the KV event tests: a subscribed SUB socket (past ZMQ's slow joiner), raw batches, replay requests over a DEALER.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::timeout;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::Harness;

/// Every wait for a message gives up after this long.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);

/// The replay end marker's sequence frame: -1 as 8 signed big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// One published message: its sequence number and msgpack payload.
#[derive(Clone, Debug, PartialEq)]
pub struct RawBatch {
    pub seq: u64,
    pub payload: Bytes,
}

impl RawBatch {
    /// `[topic, seq, payload]` with the default (empty) topic.
    pub fn from_frames(frames: Vec<Bytes>) -> Self {
        assert_eq!(frames.len(), 3, "topic, seq, payload");
        assert!(frames[0].is_empty(), "default topic is empty");
        Self { seq: seq_of(&frames[1]), payload: frames[2].clone() }
    }

    pub fn decode(&self) -> rmpv::Value {
        rmpv::decode::read_value(&mut &self.payload[..]).expect("a msgpack payload")
    }
}

pub fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().expect("an 8-byte sequence frame"))
}

/// The next published batch, within `MESSAGE_TIMEOUT`.
pub async fn recv_batch(subscriber: &mut SubSocket) -> RawBatch {
    let message = timeout(MESSAGE_TIMEOUT, subscriber.recv()).await.expect("a KV event batch within 5 s");
    RawBatch::from_frames(message.expect("a SUB message").into_vec())
}

/// A SUB socket on worker 0's publisher whose subscription has reached it, and the probe
/// batches it received. A fresh subscription takes a moment to reach the publisher (ZMQ's slow
/// joiner), so flush the (empty) cache, which publishes an `AllBlocksCleared` batch, until one
/// arrives (at most 50 times), then drain the probes still in flight.
pub async fn subscribe(harness: &Harness) -> (SubSocket, Vec<RawBatch>) {
    let endpoints = harness.fleet.kv_event_endpoints();
    let mut subscriber = SubSocket::new();
    subscriber.connect(&endpoints[0]).await.unwrap();
    subscriber.subscribe("").await.unwrap();
    let mut probes = Vec::new();
    for _ in 0..50 {
        flush(harness).await;
        if let Ok(message) = timeout(Duration::from_millis(100), subscriber.recv()).await {
            probes.push(RawBatch::from_frames(message.unwrap().into_vec()));
            break;
        }
    }
    assert!(!probes.is_empty(), "the subscriber never received a probe batch");
    while let Ok(message) = timeout(Duration::from_millis(100), subscriber.recv()).await {
        probes.push(RawBatch::from_frames(message.unwrap().into_vec()));
    }
    (subscriber, probes)
}

/// Flushes worker 0's (idle) prefix cache: one `AllBlocksCleared` batch.
pub async fn flush(harness: &Harness) {
    let response = harness.client.post(format!("{}/flush_cache", harness.url)).send().await;
    assert_eq!(response.expect("/flush_cache is answered").status(), 200);
}

/// A DEALER connected to a replay endpoint.
pub async fn dealer(endpoint: &str) -> DealerSocket {
    let mut dealer = DealerSocket::new();
    timeout(MESSAGE_TIMEOUT, dealer.connect(endpoint)).await.expect("connected within 5 s").unwrap();
    dealer
}

/// Sends one request (the frames after the identity the ROUTER adds) and returns the answers
/// up to and including the end marker, each without the identity.
pub async fn replay(dealer: &mut DealerSocket, request: &[&[u8]]) -> Vec<Vec<Bytes>> {
    send(dealer, request).await;
    let mut answers = Vec::new();
    loop {
        let message = timeout(MESSAGE_TIMEOUT, dealer.recv()).await.expect("a replay answer within 5 s");
        let frames = message.unwrap().into_vec();
        assert!(frames.len() >= 2, "{frames:?}");
        let end = frames[frames.len() - 2][..] == END_SEQ;
        answers.push(frames);
        if end {
            return answers;
        }
    }
}

/// Sends one multipart message.
pub async fn send(dealer: &mut DealerSocket, frames: &[&[u8]]) {
    let frames: Vec<Bytes> = frames.iter().map(|frame| Bytes::copy_from_slice(frame)).collect();
    dealer.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
}

/// Today's `[b"", topic, seq, payload]` answers (end marker `[b"", b"", END, b""]` excluded) as
/// batches, with the default (empty) topic.
pub fn delimited_batches(answers: &[Vec<Bytes>]) -> Vec<RawBatch> {
    let (end, batches) = answers.split_last().expect("at least the end marker");
    assert_eq!(end, &[Bytes::new(), Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()]);
    batches
        .iter()
        .map(|frames| {
            assert_eq!(frames.len(), 4, "delimiter, topic, seq, payload");
            assert!(frames[0].is_empty(), "the delimiter is echoed");
            assert!(frames[1].is_empty(), "the default topic");
            RawBatch { seq: seq_of(&frames[2]), payload: frames[3].clone() }
        })
        .collect()
}
