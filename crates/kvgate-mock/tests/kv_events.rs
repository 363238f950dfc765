//! KV events published over ZMQ: a SUB socket receives batches in the chosen engine version's format, in order, describing the blocks the engine stored and evicted (and offloaded).

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

/// A batch's envelope `[ts, events, dp_rank]` (every version writes it so) and its events.
fn events_of(batch: &RawBatch) -> Vec<Msgpack> {
    let payload = batch.decode();
    let batch = payload.as_array().unwrap();
    assert_eq!(batch.len(), 3, "[ts, events, dp_rank]");
    assert!(batch[0].as_f64().unwrap() > 1.6e9, "ts is Unix seconds");
    assert_eq!(batch[2].as_u64(), Some(0));
    batch[1].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_10_events_are_positional() {
    let harness = small_cache_worker(KvEventEncoding::Vllm010).await;
    let (received, expected) = three_prompts(&harness).await;
    let events: Vec<Vec<Msgpack>> =
        received.iter().flat_map(events_of).map(|event| event.as_array().unwrap().clone()).collect();
    let tags: Vec<&str> = events.iter().map(|event| event[0].as_str().unwrap()).collect();
    assert_eq!(tags, ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored"]);
    let stored = &events[0][1..];
    assert_eq!(stored.len(), 5, "hashes, parent, tokens, block_size, lora_id");
    // vLLM 0.10's builtin hashes are signed: the top bit set is a negative int.
    let signed: Vec<u64> = stored[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_i64().map_or_else(|| h.as_u64().unwrap(), |v| v as u64))
        .collect();
    assert_eq!(signed, expected[0]);
    assert!(stored[1].is_nil());
    assert_eq!(stored[2].as_array().unwrap().len(), 32);
    assert_eq!(stored[2].as_array().unwrap()[0].as_u64(), Some(u64::from(tokenize("w0")[0])));
    assert_eq!(stored[3].as_u64(), Some(16));
    assert!(stored[4].is_nil());
    // The oldest prompt's blocks go, tail first; no medium field in this version.
    assert_eq!(events[2].len(), 2);
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

/// The default: vLLM 0.33's events, as its block pool publishes them (the captures in
/// `kvgate-kv-events/testdata/kv-wire/vllm-0.33.0` hold the engine's own bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_is_todays_vllm_with_every_field_it_sends() {
    let harness = small_cache_worker(KvEventEncoding::default()).await;
    let (received, expected) = three_prompts(&harness).await;
    assert_eq!(received[0].payload[11..14], [0xde, 0x00, 0x0a], "msgspec's map16 BlockStored header");
    let events: Vec<Msgpack> = received.iter().flat_map(events_of).collect();
    let tags: Vec<&str> = events.iter().map(|event| field(event, "type").as_str().unwrap()).collect();
    assert_eq!(tags, ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored"]);
    let stored = &events[0];
    let stored_keys = [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ];
    assert_eq!(keys(stored), stored_keys);
    assert_eq!(hashes(field(stored, "block_hashes")), expected[0]);
    assert!(field(stored, "parent_block_hash").is_nil());
    let token_ids: Vec<u64> =
        field(stored, "token_ids").as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let prompt_tokens: Vec<u64> = tokenize(&words(0, 32)).into_iter().map(u64::from).collect();
    assert_eq!(token_ids, prompt_tokens);
    assert_eq!(field(stored, "block_size").as_u64(), Some(16));
    assert_eq!(field(stored, "medium").as_str(), Some("GPU"));
    assert!(["lora_id", "lora_name"].iter().all(|key| field(stored, key).is_nil()));
    assert_eq!(field(stored, "extra_keys").as_array().unwrap(), &[Msgpack::Nil, Msgpack::Nil]);
    assert_eq!(field(stored, "group_idx").as_u64(), Some(0));
    assert_eq!(hashes(field(&events[1], "block_hashes")), expected[1]);
    let removed = &events[2];
    assert_eq!(keys(removed), ["type", "block_hashes", "medium", "group_idx"]);
    assert_eq!(hashes(field(removed, "block_hashes")), vec![expected[0][1], expected[0][0]]);
    assert_eq!(field(removed, "medium").as_str(), Some("GPU"));
    assert_eq!(hashes(field(&events[3], "block_hashes")), expected[2]);
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_cache_is_the_tag_alone() {
    let harness = small_cache_worker(KvEventEncoding::Sglang05).await;
    let (_subscriber, probes) = subscribe(&harness).await;
    let events = events_of(&probes[0]);
    assert_eq!(events.len(), 1);
    assert_eq!(entries(&events[0]), [("type", &Msgpack::from("AllBlocksCleared"))]);
    harness.fleet.shutdown().await;
}

/// `--cpu-offload-tokens`: the offloading connector's default events, in the same batch as the
/// GPU stores (as `vllm-0.33.0/offload-placeholder` shows), and its removals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offload_tier_publishes_vllms_placeholders() {
    let harness = spawn(|args| {
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
        args.engine_flags.kv_capacity_tokens = Some(80);
        args.engine_flags.cpu_offload_tokens = Some(64);
    })
    .await;
    let (received, expected) = three_prompts(&harness).await;
    let events: Vec<kvgate_kv_events::KvEvent> = received
        .iter()
        .flat_map(|batch| kvgate_kv_events::decode_batch(&batch.payload).unwrap().events)
        .collect();
    let summary: Vec<(String, Option<String>, usize)> = events
        .iter()
        .map(|event| match event {
            kvgate_kv_events::KvEvent::BlockStored(stored) => {
                ("stored".into(), stored.medium.clone(), stored.token_ids.len())
            }
            kvgate_kv_events::KvEvent::BlockRemoved(removed) => ("removed".into(), removed.medium.clone(), 0),
            other => panic!("{other:?}"),
        })
        .collect();
    let gpu = Some("GPU".to_string());
    let cpu = Some("CPU".to_string());
    assert_eq!(
        summary,
        [
            ("stored".into(), gpu.clone(), 32),
            ("stored".into(), cpu.clone(), 0),
            ("stored".into(), gpu.clone(), 32),
            ("stored".into(), cpu.clone(), 0),
            ("removed".into(), gpu.clone(), 0),
            ("stored".into(), gpu, 32),
            ("removed".into(), cpu.clone(), 0),
            ("stored".into(), cpu, 0),
        ]
    );
    let kvgate_kv_events::KvEvent::BlockStored(placeholder) = &events[1] else { unreachable!() };
    assert_eq!((placeholder.block_size, placeholder.parent_block_hash), (0, None));
    assert_eq!(placeholder.block_hashes, expected[0]);
    harness.fleet.shutdown().await;
}

/// `--lora-adapters`: adapters on /v1/models with the base model as parent (vLLM's ModelCard),
/// and a request for one stores the adapter's blocks, named in its events as vLLM names them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_blocks_are_published_as_the_adapters() {
    let harness = spawn(|args| {
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
        args.lora_adapters = vec!["sql-lora".into(), "chat-lora".into()];
    })
    .await;
    let models = harness.client.get(format!("{}/v1/models", harness.url)).send().await.unwrap();
    let models: serde_json::Value = models.json().await.unwrap();
    let listed: Vec<(&str, &serde_json::Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), &m["parent"]))
        .collect();
    let base = json!("mock-model");
    assert_eq!(listed, [("mock-model", &json!(null)), ("sql-lora", &base), ("chat-lora", &base)]);
    let (mut subscriber, _probes) = subscribe(&harness).await;
    let body = json!({"model": "chat-lora", "prompt": words(0, 32), "max_tokens": 1});
    harness.post_json("/v1/completions", &body).await;
    let batch = kvgate_kv_events::decode_batch(&recv_batch(&mut subscriber).await.payload).unwrap();
    let kvgate_kv_events::KvEvent::BlockStored(stored) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!((stored.lora_id, stored.lora_name.as_deref()), (Some(2), Some("chat-lora")));
    let key = Some(vec![kvgate_kv_events::ExtraKey::Str("chat-lora".into())]);
    assert_eq!(stored.extra_keys, Some(vec![key.clone(), key]));
    assert_ne!(
        stored.block_hashes,
        prompt_block_hashes(&tokenize(&words(0, 32)), 16),
        "the adapter's own hashes"
    );
    harness.fleet.shutdown().await;
}

/// `--kv-events-block-size-override`: every store states the overriding block size over the
/// engine's own blocks (a publisher configured apart from its cache).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_can_state_another_block_size() {
    let harness = spawn(|args| {
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
        args.kv_events_block_size_override = Some(32);
    })
    .await;
    let (mut subscriber, _probes) = subscribe(&harness).await;
    harness.post_json("/v1/completions", &json!({"prompt": words(0, 33), "max_tokens": 1})).await;
    let batch = kvgate_kv_events::decode_batch(&recv_batch(&mut subscriber).await.payload).unwrap();
    let kvgate_kv_events::KvEvent::BlockStored(stored) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!(stored.block_size, 32, "the stated size");
    assert_eq!(stored.block_hashes, prompt_block_hashes(&tokenize(&words(0, 33)), 16), "the engine's blocks");
    harness.fleet.shutdown().await;
}

/// `MockFleet::restart_engine`: the engine comes back with an empty cache and publishes nothing
/// until its next step, which starts its sequence again at 0; its replay buffer is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_starts_empty_and_numbers_from_zero() {
    let harness = spawn(|args| {
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
    })
    .await;
    let (mut subscriber, _probes) = subscribe(&harness).await;
    let prompt = json!({"prompt": words(0, 33), "max_tokens": 1});
    harness.post_json("/v1/completions", &prompt).await;
    harness.post_json("/v1/completions", &json!({"prompt": words(100, 33), "max_tokens": 1})).await;
    let seq = [recv_batch(&mut subscriber).await.seq, recv_batch(&mut subscriber).await.seq];
    assert!(seq[1] > 0, "{seq:?}");
    let tokens = tokenize(&words(0, 33));
    assert_eq!(harness.fleet.cached_prefix_tokens(0, &tokens), 32);
    harness.fleet.restart_engine(0).unwrap();
    assert_eq!(harness.fleet.cached_prefix_tokens(0, &tokens), 0, "an empty cache");
    let answer = harness.post_json("/v1/completions", &prompt).await;
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{answer}");
    assert_eq!(recv_batch(&mut subscriber).await.seq, 0, "numbered from 0 again");
    assert!(harness.fleet.restart_engine(7).is_err());
    harness.fleet.shutdown().await;
}
