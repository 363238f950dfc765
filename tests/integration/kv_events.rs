//! The exact prefix index over real ZMQ sockets: the gateway subscribes to `kvgate mock` engines'
//! KV events (both encodings), keeps an index equal to what the engines cache through stores,
//! evictions, lost messages (replay or clear), engine restarts and malformed payloads, and
//! routes on it.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::kv_wire::block_stored;
use common::{client, config, eventually, gateway, metric, metrics_text, wait_kv_events_flowing};
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use kvgate_index::{BlockIndex, PrefixMatch};
use kvgate_mock::{spawn_fleet, KvEventEncoding, MockArgs, MockFleet};
use kvgate_policy::{PolicyKind, PrefixIndexMode};
use serde_json::json;

const MODEL: &str = "mock-model";

/// A prompt of `words` words (one token each for the mock engines), distinct per `seed`.
fn prompt(seed: usize, words: usize) -> String {
    (0..words).map(|i| format!("p{seed}w{i}")).collect::<Vec<_>>().join(" ")
}

fn tokens(text: &str) -> Vec<u32> {
    kvgate_engine::tokenize(text)
}

/// Engines with room for 10 blocks of 16 tokens: 48-token prompts evict each other quickly.
fn small_engines(args: &mut MockArgs) {
    args.time_scale = 50.0;
    args.kv_events_base_port = Some(0);
    args.kv_events_replay_base_port = Some(0);
    args.engine_flags.kv_capacity_tokens = Some(160);
}

async fn fleet(count: usize, tune: impl FnOnce(&mut MockArgs)) -> MockFleet {
    let mut args = MockArgs { count, ..MockArgs::default() };
    small_engines(&mut args);
    tune(&mut args);
    spawn_fleet(args).await.expect("the mock fleet starts")
}

/// A cache_aware gateway subscribed to every engine of `fleet` (with replay unless told otherwise).
/// The alignment probe is off: these tests compare the index with engine caches (some of a few
/// blocks) that only their own requests fill.
fn gateway_config(fleet: &MockFleet) -> GatewayConfig {
    GatewayConfig { expose_routing_headers: true, alignment_probe: false, ..common::kv_events_config(fleet) }
}

fn index_of(gw: &GatewayHandle) -> Arc<BlockIndex> {
    model_index(gw, MODEL)
}

fn model_index(gw: &GatewayHandle, model: &str) -> Arc<BlockIndex> {
    gw.exact_index(model).expect("the model's pool")
}

fn worker_id(gw: &GatewayHandle, url: &str) -> u32 {
    gw.worker_id(url).expect("a registered worker")
}

/// Sends a completion straight to an engine (so the gateway only sees its events).
async fn complete_on(url: &str, text: &str) {
    let res = client()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": text, "max_tokens": 1}))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
}

/// Whether, for every prompt and every engine, the gateway's index holds exactly the blocks the
/// engine's cache holds.
fn index_equals_engines(gw: &GatewayHandle, fleet: &MockFleet, prompts: &[Vec<u32>]) -> Result<(), String> {
    let index = index_of(gw);
    for prompt in prompts {
        let mut matched = PrefixMatch::default();
        index.overlap(prompt, kvgate_index::Namespace::BASE, &mut matched);
        for (worker_idx, url) in fleet.urls().iter().enumerate() {
            let engine = fleet.cached_prefix_tokens(worker_idx, prompt);
            let indexed = matched.matched(worker_id(gw, url));
            if engine != indexed {
                return Err(format!(
                    "worker {worker_idx}: engine caches {engine} tokens, index says {indexed}"
                ));
            }
        }
    }
    Ok(())
}

async fn assert_in_sync(gw: &GatewayHandle, fleet: &MockFleet, prompts: &[Vec<u32>]) {
    let mut last = Ok(());
    let synced = eventually(5.0, async || {
        last = index_equals_engines(gw, fleet, prompts);
        last.is_ok()
    })
    .await;
    assert!(synced, "the index matches the engines within 5 s: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_stores_and_evictions_in_every_engine_format() {
    for encoding in [KvEventEncoding::Vllm033, KvEventEncoding::Vllm010, KvEventEncoding::Sglang05] {
        let fleet = fleet(2, |args| args.kv_events_encoding = encoding).await;
        let gw = gateway(gateway_config(&fleet)).await;
        wait_kv_events_flowing(&gw).await;
        let urls = fleet.urls();
        let mut sent = Vec::new();
        // 10 prompts of 3 blocks (4 while running) on 2 engines of 10 blocks: the oldest are evicted.
        for i in 0..10 {
            let text = prompt(i, 48);
            complete_on(&urls[i % 2], &text).await;
            sent.push(tokens(&text));
        }
        assert_in_sync(&gw, &fleet, &sent).await;
        let evicted =
            sent.iter().filter(|p| fleet.cached_prefix_tokens(0, p) + fleet.cached_prefix_tokens(1, p) == 0);
        assert!(evicted.count() > 0, "{encoding:?}: some prompts were evicted");
        let text = metrics_text(&gw).await;
        assert_eq!(metric(&text, "kvgate_kv_events_malformed_total"), 0.0, "{encoding:?}");
        assert!(metric(&text, "kvgate_kv_events_batches_total") > 0.0, "{text}");
        gw.shutdown().await;
        fleet.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_batch_is_recovered_through_replay() {
    let fleet = fleet(1, |_| {}).await;
    let gw = gateway(gateway_config(&fleet)).await;
    wait_kv_events_flowing(&gw).await;
    let url = &fleet.urls()[0];
    let mut sent = Vec::new();
    for i in 0..2 {
        let text = prompt(i, 48);
        complete_on(url, &text).await;
        sent.push(tokens(&text));
    }
    assert_in_sync(&gw, &fleet, &sent).await;
    fleet.drop_kv_event_batches(0, 1).unwrap();
    for i in 2..5 {
        let text = prompt(i, 48);
        complete_on(url, &text).await;
        sent.push(tokens(&text));
    }
    assert_in_sync(&gw, &fleet, &sent).await;
    // The subscriber counts a gap after its replay reached the index.
    let mut text = String::new();
    let counted = eventually(5.0, async || {
        text = metrics_text(&gw).await;
        metric(&text, "kvgate_kv_events_gaps_total{recovery=\"replay\"}") >= 1.0
    })
    .await;
    assert!(counted, "{text}");
    assert_eq!(metric(&text, "kvgate_kv_events_gaps_total{recovery=\"cleared\"}"), 0.0);
    gw.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_after_the_fleet_served_learns_its_holdings_through_replay() {
    // The mock's default encoding is the current one (vLLM 0.33: replay replies with the topic
    // frame, 4 frames at the DEALER).
    assert_eq!(MockArgs::default().kv_events_encoding, KvEventEncoding::Vllm033);
    let fleet = fleet(2, |_| {}).await;
    let urls = fleet.urls();
    let mut sent = Vec::new();
    for i in 0..6 {
        let text = prompt(i, 40);
        complete_on(&urls[i % 2], &text).await;
        sent.push(tokens(&text));
    }
    let held = |worker: usize| sent.iter().map(|p| fleet.cached_prefix_tokens(worker, p)).sum::<usize>();
    assert!(held(0) > 0 && held(1) > 0, "both engines hold blocks before the gateway starts");
    let gw = gateway(gateway_config(&fleet)).await;
    wait_kv_events_flowing(&gw).await;
    assert_in_sync(&gw, &fleet, &sent).await;
    let text = metrics_text(&gw).await;
    assert_eq!(metric(&text, "kvgate_kv_events_gaps_total{recovery=\"cleared\"}"), 0.0, "{text}");
    assert_eq!(metric(&text, "kvgate_kv_events_malformed_total"), 0.0, "{text}");
    gw.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_a_gap_clears_the_workers_entries() {
    let fleet = fleet(1, |_| {}).await;
    let mut cfg = gateway_config(&fleet);
    cfg.kv_events_replay_endpoints.clear();
    let gw = gateway(cfg).await;
    wait_kv_events_flowing(&gw).await;
    let url = fleet.urls()[0].clone();
    // A 160-token engine keeps two 48-token prompts whole.
    let kept = tokens(&prompt(0, 48));
    complete_on(&url, &prompt(0, 48)).await;
    assert_in_sync(&gw, &fleet, std::slice::from_ref(&kept)).await;
    assert_eq!(fleet.cached_prefix_tokens(0, &kept), 48);
    fleet.drop_kv_event_batches(0, 1).unwrap();
    complete_on(&url, &prompt(1, 16)).await; // its store is lost
    complete_on(&url, &prompt(2, 16)).await; // the gap shows: clear, then apply this batch
    let index = index_of(&gw);
    let cleared = eventually(5.0, async || {
        let mut matched = PrefixMatch::default();
        index.overlap(&tokens(&prompt(2, 16)), kvgate_index::Namespace::BASE, &mut matched);
        matched.best() == 16
    })
    .await;
    assert!(cleared, "the batch after the gap is applied");
    let mut matched = PrefixMatch::default();
    index.overlap(&kept, kvgate_index::Namespace::BASE, &mut matched);
    assert_eq!(matched.best(), 0, "entries from before the gap are gone although the engine still has them");
    assert!(fleet.cached_prefix_tokens(0, &kept) > 0);
    // The gap is counted once the batch after it is applied, not before.
    let mut text = String::new();
    let counted = eventually(5.0, async || {
        text = metrics_text(&gw).await;
        metric(&text, "kvgate_kv_events_gaps_total{recovery=\"cleared\"}") >= 1.0
    })
    .await;
    assert!(counted, "{text}");
    assert_eq!(metric(&text, "kvgate_kv_events_gaps_total{recovery=\"cleared\"}"), 1.0, "{text}");
    gw.shutdown().await;
    fleet.shutdown().await;
}

/// Free loopback ports for a restartable one-engine fleet (HTTP, KV events, replay).
async fn free_ports() -> [u16; 3] {
    let mut ports = [0; 3];
    let listeners: Vec<_> =
        futures_util::future::join_all((0..3).map(|_| tokio::net::TcpListener::bind("127.0.0.1:0"))).await;
    for (port, listener) in ports.iter_mut().zip(listeners) {
        *port = listener.unwrap().local_addr().unwrap().port();
    }
    ports
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_clears_its_entries() {
    let [http, events, replay] = free_ports().await;
    let pinned = |args: &mut MockArgs| {
        args.base_port = http;
        args.kv_events_base_port = Some(events);
        args.kv_events_replay_base_port = Some(replay);
    };
    let first = fleet(1, pinned).await;
    let gw = gateway(gateway_config(&first)).await;
    wait_kv_events_flowing(&gw).await;
    let url = first.urls()[0].clone();
    let before = tokens(&prompt(0, 48));
    complete_on(&url, &prompt(0, 48)).await;
    assert_in_sync(&gw, &first, std::slice::from_ref(&before)).await;
    first.shutdown().await;

    let second = fleet(1, pinned).await;
    let index = index_of(&gw);
    let id = worker_id(&gw, &url);
    let forgotten = eventually(10.0, async || index.worker_blocks(id) == 0).await;
    assert!(forgotten, "the restarted engine's old blocks leave the index");
    wait_kv_events_flowing(&gw).await;
    let after = tokens(&prompt(1, 48));
    complete_on(&url, &prompt(1, 48)).await;
    assert_in_sync(&gw, &second, &[before, after]).await;
    gw.shutdown().await;
    second.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_fed_the_same_streams_hold_the_same_index() {
    let fleet = fleet(2, |_| {}).await;
    let first = gateway(gateway_config(&fleet)).await;
    wait_kv_events_flowing(&first).await;
    // Traffic through the first gateway only; the second starts late and replays.
    let mut sent = Vec::new();
    for i in 0..5 {
        let text = prompt(i, 40 + i);
        let res = client()
            .post(format!("{}/v1/completions", first.url()))
            .json(&json!({"model": MODEL, "prompt": text, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        sent.push(tokens(&text));
    }
    let second = gateway(gateway_config(&fleet)).await;
    wait_kv_events_flowing(&second).await;
    assert_in_sync(&first, &fleet, &sent).await;
    assert_in_sync(&second, &fleet, &sent).await;
    // Worker ids are each gateway's own: compare the dumps by worker URL.
    let by_url = |gw: &GatewayHandle| {
        let url_of = |id: u32| fleet.urls().into_iter().find(|url| gw.worker_id(url) == Some(id));
        index_of(gw)
            .dump()
            .into_iter()
            .map(|(block, holders)| {
                (block, holders.iter().map(|c| (url_of(c.worker), c.rank)).collect::<Vec<_>>())
            })
            .collect::<Vec<_>>()
    };
    let dump = by_url(&first);
    assert!(dump.len() >= 4, "{} blocks", dump.len());
    assert_eq!(dump, by_url(&second));
    first.shutdown().await;
    second.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapters_and_the_base_route_to_the_holders_of_their_own_blocks() {
    let fleet = fleet(3, |args| {
        args.engine_flags.kv_capacity_tokens = Some(4096);
        args.lora_adapters = vec!["adapter-a".into(), "adapter-b".into()];
    })
    .await;
    let gw = gateway(gateway_config(&fleet)).await;
    wait_kv_events_flowing(&gw).await;
    let urls = fleet.urls();
    let text = prompt(11, 120);
    // The same prompt, cached by a different engine for each model: the base on engine 0, the
    // adapters on engines 1 and 2 (each with blocks of its own, named by the adapter).
    let holders = [(MODEL, &urls[0]), ("adapter-a", &urls[1]), ("adapter-b", &urls[2])];
    for (model, url) in holders {
        let res = client()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": model, "prompt": text, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{model}");
    }
    let index = index_of(&gw);
    let stored =
        eventually(5.0, async || urls.iter().all(|url| index.worker_blocks(worker_id(&gw, url)) >= 120 / 16))
            .await;
    assert!(stored, "every engine's blocks are indexed");
    for _ in 0..2 {
        for (model, url) in holders {
            let res = client()
                .post(format!("{}/v1/completions", gw.url()))
                .json(&json!({"model": model, "prompt": format!("{text} and more"), "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 200, "{model}");
            assert_eq!(res.headers()["x-kvgate-worker"], url.as_str(), "{model}");
            assert_eq!(res.headers()["x-kvgate-route"], "cache_hit", "{model}");
        }
    }
    gw.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_route_on_the_exact_index_and_say_so() {
    let fleet = fleet(3, |args| args.engine_flags.kv_capacity_tokens = Some(4096)).await;
    let gw = gateway(gateway_config(&fleet)).await;
    wait_kv_events_flowing(&gw).await;
    let text = prompt(7, 200);
    // Cached on engine 2 behind the gateway's back: only its KV events tell.
    complete_on(&fleet.urls()[2], &text).await;
    let index = index_of(&gw);
    assert!(eventually(5.0, async || index.worker_blocks(worker_id(&gw, &fleet.urls()[2])) > 0).await);
    for body in [
        json!({"model": MODEL, "prompt": format!("{text} and more"), "max_tokens": 1}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "unrelated"}], "max_tokens": 1}),
    ] {
        let path = if body.get("prompt").is_some() { "completions" } else { "chat/completions" };
        let res = client().post(format!("{}/v1/{path}", gw.url())).json(&body).send().await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["x-kvgate-prefix-index"], "exact");
        if path == "completions" {
            assert_eq!(res.headers()["x-kvgate-route"], "cache_hit");
            assert_eq!(res.headers()["x-kvgate-worker"], fleet.urls()[2].as_str());
        }
    }
    let text = metrics_text(&gw).await;
    assert_eq!(
        metric(
            &text,
            "kvgate_routing_decisions_total{index=\"exact\",model=\"mock-model\",reason=\"cache_hit\"}"
        ),
        1.0,
        "{text}"
    );
    assert!(metric(&text, "kvgate_kv_index_blocks{model=\"mock-model\"}") >= 12.0, "{text}");
    gw.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_events_from_every_worker_auto_uses_the_tree() {
    let fleet = fleet(2, |_| {}).await;
    let mut cfg = gateway_config(&fleet);
    cfg.kv_events_endpoints[1] = "-".into();
    cfg.kv_events_replay_endpoints[1] = "-".into();
    let gw = gateway(cfg).await;
    let with_events = fleet.urls()[0].clone();
    let flowing = async || {
        common::workers(&gw)
            .await
            .iter()
            .any(|w| w["url"] == with_events.as_str() && common::kv_events_flowing(w))
    };
    assert!(eventually(10.0, flowing).await);
    let body = json!({"model": MODEL, "prompt": prompt(1, 20), "max_tokens": 1});
    let res = client().post(format!("{}/v1/completions", gw.url())).json(&body).send().await.unwrap();
    assert_eq!(res.headers()["x-kvgate-prefix-index"], "approximate");
    gw.shutdown().await;
    // Forcing the exact index routes on it anyway (the worker without events holds nothing).
    let mut cfg = gateway_config(&fleet);
    cfg.kv_events_endpoints[1] = "-".into();
    cfg.kv_events_replay_endpoints[1] = "-".into();
    cfg.routing.prefix_index = PrefixIndexMode::Exact;
    let gw = gateway(cfg).await;
    let res = client().post(format!("{}/v1/completions", gw.url())).json(&body).send().await.unwrap();
    assert_eq!(res.headers()["x-kvgate-prefix-index"], "exact");
    gw.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_added_at_run_time_subscribe_and_removed_ones_take_their_blocks() {
    let fleet = fleet(1, |_| {}).await;
    let mut cfg = config(Vec::new());
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.mock_tokenizer = true;
    let gw = gateway(cfg).await;
    let url = fleet.urls()[0].clone();
    let body = json!({
        "url": url,
        "kv_events_endpoint": fleet.kv_event_endpoints()[0],
        "kv_events_replay_endpoint": fleet.kv_event_replay_endpoints()[0],
    });
    let res = client().post(format!("{}/workers", gw.admin_url())).json(&body).send().await.unwrap();
    assert_eq!(res.status(), 201);
    wait_kv_events_flowing(&gw).await;
    let listed: serde_json::Value =
        client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    let events = &listed["workers"][0]["kv_events"];
    assert_eq!(
        (events["flowing"].as_bool(), events["live_ranks"].as_u64()),
        (Some(true), Some(1)),
        "{listed}"
    );
    complete_on(&url, &prompt(3, 48)).await;
    let index = index_of(&gw);
    let id = worker_id(&gw, &url);
    assert!(eventually(5.0, async || index.worker_blocks(id) == 3).await);
    let encoded = url.replace(':', "%3A").replace('/', "%2F");
    let res = client().delete(format!("{}/workers/{encoded}", gw.admin_url())).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(eventually(5.0, async || index.worker_blocks(id) == 0 && index.is_empty()).await);
    let bad = json!({"url": "http://127.0.0.1:1", "kv_events_endpoint": "tcp://*:5557"});
    let res = client().post(format!("{}/workers", gw.admin_url())).json(&bad).send().await.unwrap();
    assert_eq!(res.status(), 400);
    gw.shutdown().await;
    fleet.shutdown().await;
}

/// `[ts, [events], 0]` (positional encoding) with one event, hand-built.
fn batch(event: &[u8]) -> Vec<u8> {
    let mut payload = vec![0x93, 0xcb];
    payload.extend_from_slice(&1.0f64.to_be_bytes());
    payload.push(0x91);
    payload.extend_from_slice(event);
    payload.push(0x00);
    payload
}

fn all_blocks_cleared() -> Vec<u8> {
    let mut event = vec![0x91, 0xb0];
    event.extend_from_slice(b"AllBlocksCleared");
    event
}

/// A KV event publisher the test drives by hand (an engine that says what the test wants).
struct Publisher {
    socket: zeromq::PubSocket,
    endpoint: String,
    seq: u64,
}

impl Publisher {
    async fn bind() -> Publisher {
        use zeromq::Socket;
        let mut socket = zeromq::PubSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        Publisher { socket, endpoint, seq: 0 }
    }

    async fn send(&mut self, frames: Vec<Vec<u8>>) {
        use zeromq::SocketSend;
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        self.socket.send(zeromq::ZmqMessage::try_from(frames).unwrap()).await.unwrap();
    }

    /// Publishes `payload` as the next batch.
    async fn publish(&mut self, payload: Vec<u8>) {
        let seq = self.seq;
        self.seq += 1;
        self.send(vec![Vec::new(), seq.to_be_bytes().to_vec(), payload]).await;
    }

    /// Probes until the gateway's subscription reached us (ZMQ's slow joiner).
    async fn wait_subscribed(&mut self, gw: &GatewayHandle) {
        for _ in 0..100 {
            self.publish(batch(&all_blocks_cleared())).await;
            if metric(&metrics_text(gw).await, "kvgate_kv_events_batches_total") > 0.0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the gateway's subscription never reached the publisher");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_counted_and_survived() {
    let upstream = common::upstream("w", MODEL).await;
    let mut publisher = Publisher::bind().await;
    let mut cfg = config(vec![upstream.url.clone()]);
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.kv_events_endpoints = vec![publisher.endpoint.clone()];
    cfg.mock_tokenizer = true;
    let gw = gateway(cfg).await;
    publisher.wait_subscribed(&gw).await;
    let seq = publisher.seq;
    let garbage = [
        vec![Vec::new(), seq.to_be_bytes().to_vec()], // two frames
        vec![Vec::new(), vec![0; 7], batch(&all_blocks_cleared())], // a 7-byte sequence
        vec![Vec::new(), (seq + 1).to_be_bytes().to_vec(), vec![0xc1, 0xff]], // not msgpack
        // An event that is not one: refused alone, the batch is applied.
        vec![Vec::new(), (seq + 2).to_be_bytes().to_vec(), batch(&[0xa3, b'B', b'a', b'd'])],
    ];
    for frames in garbage {
        publisher.send(frames).await;
    }
    // Still alive: a well-formed batch with an unknown event and stored blocks are applied.
    publisher.seq = 100;
    let mut future = vec![0x91, 0xa6];
    future.extend_from_slice(b"Future");
    publisher.publish(batch(&future)).await;
    publisher.publish(batch(&block_stored(&[1], None, &[7, 8], 2))).await;
    publisher.publish(batch(&block_stored(&[2], Some(1), &[9, 10], 2))).await;
    let index = index_of(&gw);
    let applied = eventually(5.0, async || {
        let mut matched = PrefixMatch::default();
        index.overlap(&[7, 8, 9, 10, 11], kvgate_index::Namespace::BASE, &mut matched);
        matched.best() == 4
    })
    .await;
    assert!(applied, "the batches after the garbage were applied");
    let text = metrics_text(&gw).await;
    assert_eq!(metric(&text, "kvgate_kv_events_malformed_total"), 3.0, "{text}");
    assert_eq!(metric(&text, "kvgate_kv_events_refused_total{reason=\"malformed\"}"), 1.0, "{text}");
    assert_eq!(metric(&text, "kvgate_kv_events_refused_total{reason=\"unknown_event\"}"), 1.0, "{text}");
    let res =
        client().post(format!("{}/v1/completions", gw.url())).json(&json!({"prompt": "hi"})).send().await;
    assert_eq!(res.unwrap().status(), 200, "the gateway still serves");
    gw.shutdown().await;
}

/// The gateway tokenizes chat and completion requests with the shipped tokenizer and chat
/// template exactly as the engine-side reference (transformers' `apply_chat_template`, recorded
/// in the tokenizer crate's reference.json) does: an engine that stored the reference token ids
/// matches every whole block of the gateway's own tokenization.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_tokenization_matches_the_engine_side_reference() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/kvgate-tokenizer/testdata");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("reference.json")).unwrap()).unwrap();
    let model = "tiny-chatml";
    let holder = common::upstream("holder", model).await;
    let other = common::upstream("other", model).await;
    let mut publisher = Publisher::bind().await;
    let mut cfg = config(vec![holder.url.clone(), other.url.clone()]);
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.routing.prefix_index = PrefixIndexMode::Exact;
    cfg.kv_events_endpoints = vec![publisher.endpoint.clone(), "-".into()];
    cfg.tokenizer_path = Some(root.join("tiny-chatml"));
    // The reference is transformers' rendering of the messages as sent (vLLM's rebuilding of the
    // messages is checked against vLLM itself in tests/real_vllm).
    cfg.chat_template_content_format = kvgate_tokenizer::ContentFormatOption::AsSent;
    cfg.expose_routing_headers = true;
    let gw = gateway(cfg).await;
    publisher.wait_subscribed(&gw).await;
    let chosen_sum =
        async || metric(&metrics_text(&gw).await, "kvgate_prefix_match_rate_sum{kind=\"chosen\"}");
    let mut checked = 0;
    let mut next_hash = 1u64;
    for case in reference["cases"].as_array().unwrap() {
        let path = match case["kind"].as_str() {
            Some("chat") => "/v1/chat/completions",
            Some("completion") => "/v1/completions",
            _ => continue,
        };
        let ids: Vec<u32> =
            case["ids"].as_array().unwrap().iter().map(|id| id.as_u64().unwrap() as u32).collect();
        let whole = ids.len() / 16 * 16;
        if whole < 32 {
            continue; // the cache threshold needs a few blocks to call it a hit
        }
        let hashes: Vec<u64> = (next_hash..next_hash + whole as u64 / 16).collect();
        next_hash += hashes.len() as u64;
        publisher.publish(batch(&block_stored(&hashes, None, &ids[..whole], 16))).await;
        let index = model_index(&gw, model);
        assert!(
            eventually(5.0, async || index.worker_blocks(worker_id(&gw, &holder.url)) >= whole / 16).await
        );
        let before = chosen_sum().await;
        // The body as the reference sent it: key order matters to templates that print JSON.
        let body = match case["request"].as_str() {
            Some(request) => request.to_string(),
            None => json!({"model": model, "prompt": case["prompt"], "max_tokens": 1}).to_string(),
        };
        let res = client()
            .post(format!("{}{path}", gw.url()))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{}", case["name"]);
        assert_eq!(res.headers()["x-kvgate-route"], "cache_hit", "{}", case["name"]);
        assert_eq!(res.headers()["x-kvgate-worker"], holder.url.as_str(), "{}", case["name"]);
        let rate = chosen_sum().await - before;
        // The engine serves whole blocks of all but the last token.
        let expected = ((ids.len() - 1) / 16 * 16) as f64 / ids.len() as f64;
        assert!(
            (rate - expected).abs() < 1e-9,
            "{}: matched {rate} of the prompt, expected {expected}",
            case["name"]
        );
        publisher.publish(batch(&all_blocks_cleared())).await;
        assert!(eventually(5.0, async || index.is_empty()).await);
        checked += 1;
    }
    assert!(checked >= 10, "{checked} reference cases checked");
    let text = metrics_text(&gw).await;
    assert_eq!(metric(&text, "kvgate_tokenize_failures_total"), 0.0, "{text}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_in_flight_counts_as_held_until_its_request_ends() {
    let one = common::upstream("one", MODEL).await;
    let two = common::upstream("two", MODEL).await;
    let mut publisher = Publisher::bind().await;
    let mut cfg = config(vec![one.url.clone(), two.url.clone()]);
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.routing.prefix_index = PrefixIndexMode::Exact;
    cfg.kv_events_endpoints = vec![publisher.endpoint.clone(), "-".into()];
    cfg.mock_tokenizer = true;
    cfg.expose_routing_headers = true;
    let gw = gateway(cfg).await;
    publisher.wait_subscribed(&gw).await;
    // The engine's block size comes with its first stored block (of another prompt).
    publisher.publish(batch(&block_stored(&[1], None, &tokens(&prompt(99, 16)), 16))).await;
    let index = index_of(&gw);
    assert!(eventually(5.0, async || index.block_size() == 16).await);

    // Both workers take 600 ms per request; both requests carry the same 64-token prompt.
    for worker in [&one, &two] {
        worker.delay_ms.store(600, std::sync::atomic::Ordering::SeqCst);
    }
    let body = json!({"model": MODEL, "prompt": prompt(5, 64), "max_tokens": 1});
    let url = format!("{}/v1/completions", gw.url());
    let first = tokio::spawn({
        let (url, body) = (url.clone(), body.clone());
        async move { client().post(url).json(&body).send().await.unwrap() }
    });
    // Wait until the first request is in flight on some worker.
    let busy = async || common::workers(&gw).await.into_iter().find(|w| w["in_flight"].as_u64() > Some(0));
    assert!(eventually(5.0, async || busy().await.is_some()).await);
    let busy = busy().await.unwrap()["url"].as_str().unwrap().to_string();
    let second = client().post(&url).json(&body).send().await.unwrap();
    let first = first.await.unwrap();
    let first_worker = first.headers()["x-kvgate-worker"].to_str().unwrap().to_string();
    assert_eq!(first_worker, busy);
    assert_eq!(second.headers()["x-kvgate-route"], "cache_hit", "the prompt in flight counts as held");
    assert_eq!(second.headers()["x-kvgate-worker"], first_worker.as_str());
    // Both ended and no engine reported the blocks: nobody holds them any more.
    for worker in [&one, &two] {
        worker.delay_ms.store(0, std::sync::atomic::Ordering::SeqCst);
    }
    let third = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(third.headers()["x-kvgate-route"], "cache_miss");
    gw.shutdown().await;
}
