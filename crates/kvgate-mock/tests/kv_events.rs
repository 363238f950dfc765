//! KV events published over ZMQ: a SUB socket receives vLLM-format batches, in order, describing the blocks the engine stored and evicted, in either encoding.

mod common;

use common::kv::{recv_batch, subscribe, RawBatch};
use common::{spawn, words, Harness};
use kvgate_engine::{prompt_block_hashes, tokenize};
use kvgate_mock::KvEventEncoding;
use rmpv::Value as Msgpack;
use serde_json::json;

/// A worker whose cache holds 5 blocks of 16 tokens: each 32-token prompt (+1 output token)
/// takes 3 and leaves 2 cached, so the third distinct prompt evicts the first one's 2 blocks.
async fn small_cache_worker(encoding: KvEventEncoding) -> Harness {
    spawn(|args| {
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
        args.kv_events_encoding = encoding;
        args.engine_flags.kv_capacity_tokens = Some(80);
    })
    .await
}

/// Sends three distinct 32-token prompts; returns the 4 batches they cause (in order, seq
/// without gaps) and each prompt's block hashes.
async fn three_prompts(harness: &Harness) -> (Vec<RawBatch>, Vec<Vec<u64>>) {
    let (mut subscriber, _probes) = subscribe(harness).await;
    let prompts: Vec<String> = (0..3).map(|i| words(i * 100, 32)).collect();
    for prompt in &prompts {
        let body = json!({"prompt": prompt, "max_tokens": 1});
        harness.post_json("/v1/completions", &body).await;
    }
    let mut received = Vec::new();
    while received.len() < 4 {
        received.push(recv_batch(&mut subscriber).await);
    }
    let seqs: Vec<u64> = received.iter().map(|batch| batch.seq).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let expected = prompts.iter().map(|prompt| prompt_block_hashes(&tokenize(prompt), 16)).collect();
    (received, expected)
}

fn hashes(value: &Msgpack) -> Vec<u64> {
    value.as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect()
}

/// A positional batch's events as (tag, fields).
fn array_events(batch: &RawBatch) -> Vec<(String, Vec<Msgpack>)> {
    let payload = batch.decode();
    let batch = payload.as_array().unwrap();
    assert_eq!(batch.len(), 3, "[ts, events, dp_rank]");
    assert!(batch[0].as_f64().unwrap() > 1.6e9, "ts is Unix seconds");
    assert_eq!(batch[2].as_u64(), Some(0));
    let events = batch[1].as_array().unwrap().iter().map(|event| {
        let fields = event.as_array().unwrap();
        (fields[0].as_str().unwrap().to_string(), fields[1..].to_vec())
    });
    events.collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_receives_stored_and_removed_blocks_in_order() {
    let harness = small_cache_worker(KvEventEncoding::Array).await;
    let (received, expected) = three_prompts(&harness).await;
    let events: Vec<(String, Vec<Msgpack>)> = received.iter().flat_map(array_events).collect();
    let tags: Vec<&str> = events.iter().map(|(tag, _)| tag.as_str()).collect();
    assert_eq!(tags, ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored"]);
    let (_, stored) = &events[0];
    assert_eq!(stored.len(), 6, "hashes, parent, tokens, block_size, lora_id, medium");
    assert_eq!(hashes(&stored[0]), expected[0]);
    assert!(stored[1].is_nil());
    assert_eq!(stored[2].as_array().unwrap().len(), 32);
    assert_eq!(stored[2].as_array().unwrap()[0].as_u64(), Some(u64::from(tokenize("w0")[0])));
    assert_eq!(stored[3].as_u64(), Some(16));
    assert!(stored[4].is_nil() && stored[5].is_nil());
    assert_eq!(hashes(&events[1].1[0]), expected[1]);
    // The oldest prompt's blocks go, tail first.
    let (_, removed) = &events[2];
    assert_eq!(hashes(&removed[0]), vec![expected[0][1], expected[0][0]]);
    assert!(removed[1].is_nil());
    assert_eq!(hashes(&events[3].1[0]), expected[2]);
    harness.fleet.shutdown().await;
}

/// A map's entries as (key, value), keys in encoded order.
fn entries(map: &Msgpack) -> Vec<(&str, &Msgpack)> {
    let entries = map.as_map().unwrap_or_else(|| panic!("a map: {map}"));
    entries.iter().map(|(key, value)| (key.as_str().unwrap(), value)).collect()
}

fn field<'a>(map: &'a Msgpack, key: &str) -> &'a Msgpack {
    entries(map).into_iter().find(|(k, _)| *k == key).unwrap_or_else(|| panic!("no {key:?} in {map}")).1
}

fn keys(map: &Msgpack) -> Vec<&str> {
    entries(map).into_iter().map(|(key, _)| key).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_encoding_tags_events_and_names_every_field() {
    let harness = small_cache_worker(KvEventEncoding::Map).await;
    let (received, expected) = three_prompts(&harness).await;
    let payloads: Vec<Msgpack> = received.iter().map(RawBatch::decode).collect();
    for payload in &payloads {
        assert_eq!(keys(payload), ["ts", "events", "data_parallel_rank"]);
        assert!(field(payload, "ts").as_f64().unwrap() > 1.6e9, "ts is Unix seconds");
        assert_eq!(field(payload, "data_parallel_rank").as_u64(), Some(0));
    }
    let events: Vec<&Msgpack> =
        payloads.iter().flat_map(|payload| field(payload, "events").as_array().unwrap()).collect();
    let tags: Vec<&str> = events.iter().map(|event| field(event, "type").as_str().unwrap()).collect();
    assert_eq!(tags, ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored"]);

    let stored = events[0];
    let stored_keys = [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ];
    assert_eq!(keys(stored), stored_keys);
    assert_eq!(hashes(field(stored, "block_hashes")), expected[0]);
    assert!(field(stored, "parent_block_hash").is_nil());
    let token_ids: Vec<u64> =
        field(stored, "token_ids").as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let prompt_tokens: Vec<u64> = tokenize(&words(0, 32)).into_iter().map(u64::from).collect();
    assert_eq!(token_ids, prompt_tokens);
    assert_eq!(field(stored, "block_size").as_u64(), Some(16));
    assert!(["lora_id", "medium", "lora_name"].iter().all(|key| field(stored, key).is_nil()));
    assert_eq!(hashes(field(events[1], "block_hashes")), expected[1]);
    let removed = events[2];
    assert_eq!(keys(removed), ["type", "block_hashes", "medium"]);
    assert_eq!(hashes(field(removed, "block_hashes")), vec![expected[0][1], expected[0][0]]);
    assert!(field(removed, "medium").is_nil());
    assert_eq!(hashes(field(events[3], "block_hashes")), expected[2]);
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_encoding_of_a_cleared_cache_is_the_tag_alone() {
    let harness = small_cache_worker(KvEventEncoding::Map).await;
    let (_subscriber, probes) = subscribe(&harness).await;
    let payload = probes[0].decode();
    let events = field(&payload, "events").as_array().unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(entries(&events[0]), [("type", &Msgpack::from("AllBlocksCleared"))]);
    harness.fleet.shutdown().await;
}
