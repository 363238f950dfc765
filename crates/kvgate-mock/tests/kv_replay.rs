//! vLLM's KV event replay over a ZMQ ROUTER, and lost batches (fault injection) that only replay recovers.

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use common::kv::{
    dealer, delimited_batches, flush, recv_batch, replay, send, seq_of, subscribe, RawBatch, END_SEQ,
};
use common::{spawn, words, Harness};
use serde_json::json;

async fn replaying_worker(configure: impl FnOnce(&mut kvgate_mock::MockArgs)) -> Harness {
    spawn(|args| {
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
        args.kv_events_replay_base_port = Some(0);
        configure(args);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_returns_the_buffered_batches_from_a_start_seq() {
    let harness = replaying_worker(|_| {}).await;
    let endpoints = harness.fleet.kv_event_replay_endpoints();
    assert_eq!(endpoints.len(), 1);
    assert!(endpoints[0].starts_with("tcp://127.0.0.1:"), "{endpoints:?}");
    assert_ne!(endpoints, harness.fleet.kv_event_endpoints());

    let (mut subscriber, mut received) = subscribe(&harness).await;
    for i in 0..3 {
        let body = json!({"prompt": words(i * 100, 32), "max_tokens": 1});
        harness.post_json("/v1/completions", &body).await;
        received.push(recv_batch(&mut subscriber).await);
    }
    let last_seq = received.last().unwrap().seq;

    // From 0: every batch so far (probes the subscriber missed included), in seq order, with
    // the payloads the subscriber got.
    let mut dealer = dealer(&endpoints[0]).await;
    let all = delimited_batches(&replay(&mut dealer, &[b"", &0u64.to_be_bytes()]).await);
    let seqs: Vec<u64> = all.iter().map(|batch| batch.seq).collect();
    assert_eq!(seqs, (0..=last_seq).collect::<Vec<_>>());
    let by_seq: BTreeMap<u64, &Bytes> = all.iter().map(|batch| (batch.seq, &batch.payload)).collect();
    for batch in &received {
        assert_eq!(by_seq[&batch.seq], &batch.payload, "seq {}", batch.seq);
    }

    // From the middle: only the later ones.
    let middle = received[received.len() - 2].seq;
    let later = delimited_batches(&replay(&mut dealer, &[b"", &middle.to_be_bytes()]).await);
    assert_eq!(later, &all[middle as usize..]);
    // Past the end: the end marker alone.
    let none = replay(&mut dealer, &[b"", &(last_seq + 1).to_be_bytes()]).await;
    assert!(delimited_batches(&none).is_empty());
    harness.fleet.shutdown().await;
}

/// Flushes `n` times and waits until the subscriber has the last batch (the publisher keeps a
/// batch for replay before it sends it); returns its seq.
async fn flushes(harness: &Harness, subscriber: &mut zeromq::SubSocket, n: usize) -> u64 {
    let mut last = None;
    for _ in 0..n {
        flush(harness).await;
        last = Some(recv_batch(subscriber).await.seq);
    }
    last.expect("n > 0")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_answers_in_the_shape_asked_and_skips_malformed_requests() {
    let harness = replaying_worker(|_| {}).await;
    let (mut subscriber, _probes) = subscribe(&harness).await;
    let last_seq = flushes(&harness, &mut subscriber, 2).await;
    let mut dealer = dealer(&harness.fleet.kv_event_replay_endpoints()[0]).await;
    // A start frame of the wrong size, a non-empty delimiter, too many frames: ignored (no
    // answer); the next request on the same connection is answered first.
    send(&mut dealer, &[b"", b"\x00\x01"]).await;
    send(&mut dealer, &[b"x", &[0; 8]]).await;
    send(&mut dealer, &[b"", &[0; 8], b""]).await;
    // No delimiter: none in the answers either (topic, seq, payload).
    let answers = replay(&mut dealer, &[&(last_seq - 1).to_be_bytes()]).await;
    let shapes: Vec<(usize, u64)> = answers.iter().map(|frames| (frames.len(), seq_of(&frames[1]))).collect();
    assert_eq!(shapes, [(3, last_seq - 1), (3, last_seq), (3, u64::MAX)]);
    assert_eq!(answers[2], [Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()]);
    // Still served after all that.
    let delimited = delimited_batches(&replay(&mut dealer, &[b"", &0u64.to_be_bytes()]).await);
    let seqs: Vec<u64> = delimited.iter().map(|batch| batch.seq).collect();
    assert_eq!(seqs, (0..=last_seq).collect::<Vec<_>>());
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_buffer_keeps_the_last_buffer_steps_batches() {
    let harness = replaying_worker(|args| args.kv_events_buffer_steps = 2).await;
    let (mut subscriber, _probes) = subscribe(&harness).await;
    let last_seq = flushes(&harness, &mut subscriber, 3).await;
    let mut dealer = dealer(&harness.fleet.kv_event_replay_endpoints()[0]).await;
    let kept = delimited_batches(&replay(&mut dealer, &[b"", &0u64.to_be_bytes()]).await);
    assert_eq!(kept.iter().map(|batch| batch.seq).collect::<Vec<_>>(), [last_seq - 1, last_seq]);
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_is_a_gap_on_sub_and_present_in_replay() {
    let harness = replaying_worker(|_| {}).await;
    assert!(harness.fleet.drop_kv_event_batches(1, 1).is_err(), "there is no worker 1");
    let (mut subscriber, _probes) = subscribe(&harness).await;
    flush(&harness).await;
    let before = recv_batch(&mut subscriber).await;
    harness.fleet.drop_kv_event_batches(0, 1).unwrap();
    flush(&harness).await;
    flush(&harness).await;
    let after = recv_batch(&mut subscriber).await;
    assert_eq!(after.seq, before.seq + 2, "the batch in between was lost");

    let mut dealer = dealer(&harness.fleet.kv_event_replay_endpoints()[0]).await;
    let replayed = delimited_batches(&replay(&mut dealer, &[b"", &before.seq.to_be_bytes()]).await);
    let seqs: Vec<u64> = replayed.iter().map(|batch| batch.seq).collect();
    assert_eq!(seqs, [before.seq, before.seq + 1, after.seq]);
    assert_eq!((&replayed[0], &replayed[2]), (&before, &after));
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_every_loses_every_kth_batch() {
    let harness = replaying_worker(|args| args.kv_events_drop_every = Some(2)).await;
    let (mut subscriber, probes) = subscribe(&harness).await;
    for _ in 0..4 {
        flush(&harness).await;
    }
    let mut received: Vec<RawBatch> = probes;
    received.push(recv_batch(&mut subscriber).await);
    received.push(recv_batch(&mut subscriber).await);
    // seq 1, 3, 5, ... (the 2nd, 4th, 6th batch) are never published.
    let seqs: Vec<u64> = received.iter().map(|batch| batch.seq).collect();
    assert!(seqs.iter().all(|seq| seq % 2 == 0), "{seqs:?}");
    let last_seq = *seqs.last().unwrap();
    let mut dealer = dealer(&harness.fleet.kv_event_replay_endpoints()[0]).await;
    let all = delimited_batches(&replay(&mut dealer, &[b"", &0u64.to_be_bytes()]).await);
    let replayed: Vec<u64> = all.iter().map(|batch| batch.seq).collect();
    assert_eq!(replayed[..=last_seq as usize], (0..=last_seq).collect::<Vec<_>>(), "the dropped ones too");
    harness.fleet.shutdown().await;
}
