//! KV events published over ZMQ: a SUB socket receives vLLM-format batches, in order, describing the blocks the engine stored and evicted.

mod common;

use std::time::Duration;

use common::{spawn, words};
use kvgate_engine::{prompt_block_hashes, tokenize};
use rmpv::Value as Msgpack;
use serde_json::json;
use zeromq::{Socket, SocketRecv, SubSocket};

/// One decoded multipart message: (sequence number, events as (tag, fields)).
struct Received {
    seq: u64,
    events: Vec<(String, Vec<Msgpack>)>,
}

fn decode(frames: Vec<bytes::Bytes>) -> Received {
    assert_eq!(frames.len(), 3, "topic, seq, payload");
    assert!(frames[0].is_empty(), "default topic is empty");
    let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
    let payload = rmpv::decode::read_value(&mut &frames[2][..]).unwrap();
    let batch = payload.as_array().unwrap();
    assert_eq!(batch.len(), 3, "[ts, events, dp_rank]");
    assert!(batch[0].as_f64().unwrap() > 1.6e9, "ts is Unix seconds");
    assert_eq!(batch[2].as_u64(), Some(0));
    let events = batch[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| {
            let fields = event.as_array().unwrap();
            (fields[0].as_str().unwrap().to_string(), fields[1..].to_vec())
        })
        .collect();
    Received { seq, events }
}

fn hashes(value: &Msgpack) -> Vec<u64> {
    value.as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_receives_stored_and_removed_blocks_in_order() {
    // 5 blocks of 16 tokens: each 32-token prompt (+1 output token) takes 3 and leaves 2
    // cached, so the third distinct prompt evicts the first one's 2 blocks.
    let harness = spawn(|args| {
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
        args.engine_flags.kv_capacity_tokens = Some(80);
    })
    .await;
    let endpoints = harness.fleet.kv_event_endpoints();
    assert_eq!(endpoints.len(), 1);
    let mut subscriber = SubSocket::new();
    subscriber.connect(&endpoints[0]).await.unwrap();
    subscriber.subscribe("").await.unwrap();
    // Wait until the subscription reaches the publisher: flushing the (empty) cache publishes
    // an `AllBlocksCleared` batch; probe at most 50 times.
    let mut subscribed = false;
    for _ in 0..50 {
        let flush = harness.client.post(format!("{}/flush_cache", harness.url)).send();
        assert_eq!(flush.await.unwrap().status(), 200);
        if let Ok(message) = tokio::time::timeout(Duration::from_millis(100), subscriber.recv()).await {
            let probe = decode(message.unwrap().into_vec());
            assert_eq!(probe.events[0].0, "AllBlocksCleared");
            subscribed = true;
            break;
        }
    }
    assert!(subscribed, "the subscriber never received a probe batch");
    // Drain probe batches still in flight.
    while let Ok(message) = tokio::time::timeout(Duration::from_millis(100), subscriber.recv()).await {
        assert_eq!(decode(message.unwrap().into_vec()).events[0].0, "AllBlocksCleared");
    }

    let prompts: Vec<String> = (0..3).map(|i| words(i * 100, 32)).collect();
    for prompt in &prompts {
        let body = json!({"prompt": prompt, "max_tokens": 1});
        harness.post_json("/v1/completions", &body).await;
    }
    let mut received = Vec::new();
    while received.len() < 4 {
        let message = tokio::time::timeout(Duration::from_secs(5), subscriber.recv())
            .await
            .expect("a KV event batch within 5 s")
            .unwrap();
        received.push(decode(message.into_vec()));
    }
    let seqs: Vec<u64> = received.iter().map(|r| r.seq).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");

    let events: Vec<&(String, Vec<Msgpack>)> = received.iter().flat_map(|r| &r.events).collect();
    let expected: Vec<Vec<u64>> =
        prompts.iter().map(|prompt| prompt_block_hashes(&tokenize(prompt), 16)).collect();
    let tags: Vec<&str> = events.iter().map(|(tag, _)| tag.as_str()).collect();
    assert_eq!(tags, ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored"]);
    let (_, stored) = events[0];
    assert_eq!(stored.len(), 6, "hashes, parent, tokens, block_size, lora_id, medium");
    assert_eq!(hashes(&stored[0]), expected[0]);
    assert!(stored[1].is_nil());
    assert_eq!(stored[2].as_array().unwrap().len(), 32);
    assert_eq!(stored[2].as_array().unwrap()[0].as_u64(), Some(u64::from(tokenize("w0")[0])));
    assert_eq!(stored[3].as_u64(), Some(16));
    assert!(stored[4].is_nil() && stored[5].is_nil());
    assert_eq!(hashes(&events[1].1[0]), expected[1]);
    // The oldest prompt's blocks go, tail first.
    let (_, removed) = events[2];
    assert_eq!(hashes(&removed[0]), vec![expected[0][1], expected[0][0]]);
    assert!(removed[1].is_nil());
    assert_eq!(hashes(&events[3].1[0]), expected[2]);
    harness.fleet.shutdown().await;
}
