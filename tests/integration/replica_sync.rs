//! Approximate routing across replicas through a real Redis (`redis-server` started by the
//! test on a free 127.0.0.1 port): three replicas spreading a multi-turn replay round-robin keep
//! the engines' prefix-cache hit rate of one replica (without sync they lose it), peers' requests
//! in flight count in each replica's candidates, and a Redis that dies mid-run leaves every
//! request served, the replica routing on its own state, `kvgate_replica_sync_connected 0`, until
//! it comes back.

use crate::common;

use std::time::Duration;

use common::redis::Redis;
use common::{client, config, eventually, gateway, metric, metrics_at, metrics_text};
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use kvgate_mock::{spawn_fleet, MockArgs, MockFleet};
use kvgate_policy::PolicyKind;
use serde_json::json;

const MODEL: &str = "mock-model";

/// Eight simulated engines with room for a few conversations each (no KV events: the
/// gateways route on their approximate trees).
async fn engines(count: usize) -> MockFleet {
    let mut args = MockArgs { count, ..MockArgs::default() };
    args.time_scale = 50.0;
    args.engine_flags.kv_capacity_tokens = Some(2048);
    spawn_fleet(args).await.expect("the mock fleet starts")
}

fn replica_config(fleet: &MockFleet, redis: Option<&Redis>) -> GatewayConfig {
    let mut cfg = config(fleet.urls());
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.expose_routing_headers = true;
    cfg.replica_sync_redis_url = redis.map(Redis::url);
    cfg.replica_sync_secret = redis.map(|_| SECRET.to_string());
    cfg.replica_sync_interval_ms = 50;
    cfg
}

/// The replicas' shared secret in these tests.
const SECRET: &str = "replica-sync-test-secret";

/// The engines' prefix-cache hit rate: cached prompt tokens over prompt tokens, fleet-wide.
async fn hit_rate(fleet: &MockFleet) -> f64 {
    let (mut hits, mut queries) = (0.0, 0.0);
    for url in fleet.urls() {
        let text = metrics_at(&url).await;
        hits += metric(&text, "vllm:prefix_cache_hits_total");
        queries += metric(&text, "vllm:prefix_cache_queries_total");
    }
    hits / queries
}

/// A multi-turn workload: `sessions` conversations over four shared system prompts, each turn
/// repeating the conversation so far; turns of different sessions interleave.
fn conversations(sessions: usize, turns: usize) -> Vec<String> {
    let mut history: Vec<String> = (0..sessions)
        .map(|s| (0..40).map(|w| format!("sys{}w{w}", s % 4)).collect::<Vec<_>>().join(" "))
        .collect();
    let mut prompts = Vec::new();
    for turn in 0..turns {
        for (s, conversation) in history.iter_mut().enumerate() {
            let said: Vec<String> = (0..30).map(|w| format!("s{s}t{turn}w{w}")).collect();
            conversation.push(' ');
            conversation.push_str(&said.join(" "));
            prompts.push(conversation.clone());
        }
    }
    prompts
}

async fn complete(gw: &GatewayHandle, prompt: &str) -> reqwest::StatusCode {
    let res = client()
        .post(format!("{}/v1/completions", gw.url()))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    let status = res.status();
    res.bytes().await.unwrap();
    status
}

async fn wait_ready(gw: &GatewayHandle, workers: usize) {
    let ready = eventually(10.0, async || {
        let listed = common::workers(gw).await;
        listed.iter().filter(|w| w["model_id"] == MODEL && w["worker_type"] == "regular").count() == workers
    })
    .await;
    assert!(ready, "the gateway knows its {workers} workers within 10 s");
}

async fn wait_peers(replicas: &[GatewayHandle]) {
    let peers = replicas.len() as f64 - 1.0;
    for gw in replicas {
        let mut text = String::new();
        let connected = eventually(10.0, async || {
            text = metrics_text(gw).await;
            metric(&text, "kvgate_replica_sync_connected") == 1.0
                && metric(&text, "kvgate_replica_sync_peers") == peers
        })
        .await;
        assert!(connected, "every replica is connected and hears its peers within 10 s:\n{text}");
    }
}

/// Replays `prompts` through `replicas` round-robin, sequentially; with sync, each request
/// waits (bounded) until every replica applied its peers' records so far, so the run does not
/// depend on timing. Returns the engines' hit rate.
async fn replay(fleet: &MockFleet, replicas: &[GatewayHandle], prompts: &[String], synced: bool) -> f64 {
    let mut routed_via = vec![0u64; replicas.len()];
    for (i, prompt) in prompts.iter().enumerate() {
        let via = i % replicas.len();
        assert_eq!(complete(&replicas[via], prompt).await, 200);
        routed_via[via] += 1;
        if synced {
            let total: u64 = routed_via.iter().sum();
            for (r, gw) in replicas.iter().enumerate() {
                let expected = (total - routed_via[r]) as f64;
                let mut applied = 0.0;
                let done = eventually(5.0, async || {
                    applied = metric(&metrics_text(gw).await, "kvgate_replica_sync_records_applied_total");
                    applied >= expected
                })
                .await;
                assert!(done, "replica {r} applied its peers' {expected} records within 5 s (has {applied})");
            }
        }
    }
    hit_rate(fleet).await
}

async fn run(replica_count: usize, redis: Option<&Redis>, prompts: &[String]) -> f64 {
    let fleet = engines(8).await;
    let mut replicas = Vec::new();
    for _ in 0..replica_count {
        let gw = gateway(replica_config(&fleet, redis)).await;
        wait_ready(&gw, 8).await;
        replicas.push(gw);
    }
    if redis.is_some() {
        wait_peers(&replicas).await;
    }
    let rate = replay(&fleet, &replicas, prompts, redis.is_some()).await;
    for gw in replicas {
        gw.shutdown().await;
    }
    fleet.shutdown().await;
    rate
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_synced_replicas_keep_the_hit_rate_of_one() {
    let Some(redis) = Redis::start() else { return };
    // 25 conversations of 5 turns: 125 requests, the same sequence in every run; 25 is not a
    // multiple of 3, so a conversation's turns go through different replicas.
    let prompts = conversations(25, 5);
    let one = run(1, None, &prompts).await;
    let apart = run(3, None, &prompts).await;
    let synced = run(3, Some(&redis), &prompts).await;
    eprintln!("engines' prefix-cache hit rate: 1 replica {one:.3}, 3 without sync {apart:.3}, 3 with sync {synced:.3}");
    assert!(synced >= 0.95 * one, "3 synced replicas {synced:.3} keep 95% of one replica's {one:.3}");
    assert!(apart < synced, "without sync the replicas lose affinity ({apart:.3} vs {synced:.3})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_requests_in_flight_count_in_the_candidates() {
    let Some(redis) = Redis::start() else { return };
    let upstream = common::upstream("held", MODEL).await;
    upstream.hold_stream.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut cfg = config(vec![upstream.url.clone()]);
    cfg.replica_sync_redis_url = Some(redis.url());
    cfg.replica_sync_secret = Some(SECRET.to_string());
    cfg.replica_sync_interval_ms = 50;
    let replicas = vec![gateway(cfg.clone()).await, gateway(cfg).await];
    wait_peers(&replicas).await;
    let (a, b) = (&replicas[0], &replicas[1]);
    let url = a.url();
    let mut held = Vec::new();
    for _ in 0..3 {
        let response = client()
            .post(format!("{url}/v1/chat/completions"))
            .json(&json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        held.push(response);
    }
    let seen = eventually(10.0, async || b.peer_in_flight().get(&upstream.url) == Some(&3)).await;
    assert!(seen, "replica b counts replica a's 3 requests in flight: {:?}", b.peer_in_flight());
    upstream.release.notify_waiters();
    drop(held);
    let gone = eventually(10.0, async || b.peer_in_flight().get(&upstream.url).is_none()).await;
    assert!(gone, "finished requests leave the peers' count");
    for gw in replicas {
        gw.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_redis_degrades_to_local_routing_and_reconnects() {
    let Some(redis) = Redis::start() else { return };
    let port = redis.port;
    let fleet = engines(2).await;
    let replicas = vec![
        gateway(replica_config(&fleet, Some(&redis))).await,
        gateway(replica_config(&fleet, Some(&redis))).await,
    ];
    for gw in &replicas {
        wait_ready(gw, 2).await;
    }
    wait_peers(&replicas).await;
    let prompts = conversations(4, 6);
    for (i, prompt) in prompts[..8].iter().enumerate() {
        assert_eq!(complete(&replicas[i % 2], prompt).await, 200);
    }
    drop(redis); // killed mid-run
    for (i, prompt) in prompts[8..].iter().enumerate() {
        assert_eq!(complete(&replicas[i % 2], prompt).await, 200, "requests keep succeeding without Redis");
    }
    for gw in &replicas {
        let mut text = String::new();
        let down = eventually(10.0, async || {
            text = metrics_text(gw).await;
            metric(&text, "kvgate_replica_sync_connected") == 0.0
        })
        .await;
        assert!(down, "the metric shows the replica disconnected:\n{text}");
        assert!(metric(&text, "kvgate_replica_sync_errors_total") > 0.0, "{text}");
    }
    let _back = Redis::start_on(port).expect("redis-server restarts");
    wait_peers(&replicas).await;
    assert_eq!(complete(&replicas[0], &prompts[0]).await, 200);
    for gw in replicas {
        gw.shutdown().await;
    }
    fleet.shutdown().await;
}

#[test]
fn bad_replica_sync_options_are_configuration_errors() {
    let config = GatewayConfig {
        replica_sync_redis_url: Some("http://127.0.0.1:6379".into()),
        replica_sync_channel: String::new(),
        replica_sync_interval_ms: 0,
        replica_sync_max_blocks: 0,
        replica_sync_max_peers: 0,
        ..GatewayConfig::default()
    };
    let fields: Vec<_> = config.validate().unwrap_err().iter().map(|e| e.field.clone()).collect();
    assert_eq!(
        fields,
        [
            "replica_sync_redis_url",
            "replica_sync_channel",
            "replica_sync_interval_ms",
            "replica_sync_max_blocks",
            "replica_sync_secret",
            "replica_sync_max_peers"
        ]
    );
    let fine = GatewayConfig {
        replica_sync_redis_url: Some("redis://127.0.0.1:6379/2".into()),
        replica_sync_secret: Some(SECRET.into()),
        ..GatewayConfig::default()
    };
    assert!(fine.validate().is_ok());
    // Redis AUTH (user and password in the URL) and TLS (rediss://) are accepted as documented.
    for url in [
        "redis://:s3cret@127.0.0.1:6379",
        "redis://kvgate:s3cret@127.0.0.1:6379/1",
        "rediss://:s3cret@127.0.0.1:6380",
    ] {
        let config = GatewayConfig { replica_sync_redis_url: Some(url.into()), ..fine.clone() };
        assert!(config.validate().is_ok(), "{url}");
    }
    let short = GatewayConfig { replica_sync_secret: Some("short".into()), ..fine };
    let errors = short.validate().unwrap_err().to_string();
    assert!(
        errors.contains("replica_sync_secret (--replica-sync-secret): must be at least 16 bytes"),
        "{errors}"
    );
}
