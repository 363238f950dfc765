//! Gateway replicas route as one in exact mode: three gateways subscribed to the same eight
//! `kvgate mock` engines' KV events (one of them started late, so it replays the engines'
//! history) hold the same exact index and, asked through `POST /v1/route` before each request
//! of a fixed sequence, all name the same worker; each request then goes through one replica
//! (round-robin, as an L4 balancer spreads them) to the worker they named.

use crate::common;

use std::time::Duration;

use common::{client, eventually, gateway, metrics_text};
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use kvgate_index::PrefixMatch;
use kvgate_mock::{spawn_fleet, MockArgs, MockFleet};
use serde_json::{json, Value};

const MODEL: &str = "mock-model";
const ENGINES: usize = 8;
const REPLICAS: usize = 3;

/// Eight engines publishing KV events (with replay), small enough to evict.
async fn engines() -> MockFleet {
    let mut args = MockArgs { count: ENGINES, ..MockArgs::default() };
    args.time_scale = 50.0;
    args.kv_events_base_port = Some(0);
    args.kv_events_replay_base_port = Some(0);
    args.engine_flags.kv_capacity_tokens = Some(320);
    spawn_fleet(args).await.expect("the mock fleet starts")
}

/// The alignment probe is off: each replica's probes would change what the engines hold between
/// the replicas' dry runs and the live decision.
fn replica_config(fleet: &MockFleet) -> GatewayConfig {
    GatewayConfig {
        expose_routing_headers: true,
        admin_api_key: Some("admin".into()),
        alignment_probe: false,
        ..common::kv_events_config(fleet)
    }
}

/// A multi-turn workload: `sessions` conversations, each with its own system prompt, each
/// turn repeating the conversation so far (one mock token per word).
fn sequence(sessions: usize, turns: usize) -> Vec<String> {
    let mut prompts = Vec::new();
    let mut history: Vec<String> =
        (0..sessions).map(|s| (0..24).map(|w| format!("sys{s}w{w}")).collect::<Vec<_>>().join(" ")).collect();
    for turn in 0..turns {
        for (s, conversation) in history.iter_mut().enumerate() {
            let said: Vec<String> = (0..12).map(|w| format!("s{s}t{turn}w{w}")).collect();
            conversation.push(' ');
            conversation.push_str(&said.join(" "));
            prompts.push(conversation.clone());
        }
    }
    prompts
}

/// Whether every replica's exact index holds exactly what the engines cache for `prompts`, and
/// no replica has a request in flight.
async fn converged(
    replicas: &[GatewayHandle],
    fleet: &MockFleet,
    prompts: &[Vec<u32>],
) -> Result<(), String> {
    for (r, gw) in replicas.iter().enumerate() {
        let workers = common::workers_with_key(gw, Some("admin")).await;
        if let Some(busy) = workers.iter().find(|w| w["in_flight"].as_u64() > Some(0)) {
            return Err(format!("replica {r} has a request in flight on {}", busy["url"]));
        }
        let index = gw.exact_index(MODEL).ok_or("no pool yet")?;
        for prompt in prompts {
            let mut matched = PrefixMatch::default();
            index.overlap(prompt, kvgate_index::Namespace::BASE, &mut matched);
            for (engine, url) in fleet.urls().iter().enumerate() {
                let id = gw.worker_id(url).ok_or("a worker is missing")?;
                let (cached, indexed) = (fleet.cached_prefix_tokens(engine, prompt), matched.matched(id));
                if cached != indexed {
                    return Err(format!(
                        "replica {r}, engine {engine}: caches {cached}, index says {indexed}"
                    ));
                }
            }
        }
    }
    Ok(())
}

async fn wait_converged(replicas: &[GatewayHandle], fleet: &MockFleet, prompts: &[Vec<u32>]) {
    let mut last = Ok(());
    let done = eventually(10.0, async || {
        last = converged(replicas, fleet, prompts).await;
        last.is_ok()
    })
    .await;
    assert!(done, "the replicas converge on the engines' caches within 10 s: {last:?}");
}

async fn wait_flowing(gw: &GatewayHandle) {
    let flowing = eventually(10.0, async || {
        let workers = common::workers_with_key(gw, Some("admin")).await;
        workers.len() == ENGINES && workers.iter().all(common::kv_events_flowing)
    })
    .await;
    assert!(flowing, "every engine's KV events flow within 10 s");
}

/// What `gw` would decide for a completion of `prompt` (`POST /v1/route`).
async fn dry_run(gw: &GatewayHandle, prompt: &str) -> Value {
    let res = client()
        .post(format!("{}/v1/route", gw.admin_url()))
        .bearer_auth("admin")
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    res.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_in_exact_mode_make_identical_decisions() {
    let fleet = engines().await;
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS - 1 {
        replicas.push(gateway(replica_config(&fleet)).await);
    }
    for gw in &replicas {
        wait_flowing(gw).await;
    }
    let prompts = sequence(12, 4);
    let late_start = 12;
    let mut sent: Vec<Vec<u32>> = Vec::new();
    let mut workers = std::collections::BTreeSet::new();
    let mut hits = 0;
    for (i, prompt) in prompts.iter().enumerate() {
        if i == late_start {
            // A replica joining late learns the history through the engines' replay.
            let late = gateway(replica_config(&fleet)).await;
            wait_flowing(&late).await;
            replicas.push(late);
        }
        wait_converged(&replicas, &fleet, &sent).await;
        let mut answers = Vec::new();
        for gw in &replicas {
            answers.push(dry_run(gw, prompt).await);
        }
        for (r, answer) in answers.iter().enumerate() {
            assert_eq!(
                answer["worker"], answers[0]["worker"],
                "request {i}: replica {r} disagrees: {answers:?}"
            );
            assert_eq!(answer["reason"], answers[0]["reason"], "request {i}: {answers:?}");
            assert_eq!(answer["index"], "exact", "request {i}: {answer}");
        }
        let via = &replicas[i % replicas.len()];
        let res = client()
            .post(format!("{}/v1/completions", via.url()))
            .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        let worker = res.headers()["x-kvgate-worker"].to_str().unwrap().to_string();
        res.bytes().await.unwrap();
        assert_eq!(worker, answers[0]["worker"], "request {i}: the live decision is the dry run's");
        workers.insert(worker);
        hits += (answers[0]["reason"] == "cache_hit") as usize;
        sent.push(kvgate_engine::tokenize(prompt));
    }
    assert!(hits >= prompts.len() / 2, "most requests hit a cache ({hits} of {})", prompts.len());
    assert!(workers.len() >= 4, "the load spreads over the engines: {workers:?}");
    for gw in replicas {
        gw.shutdown().await;
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dry_run_needs_the_admin_key_and_records_nothing() {
    let fleet = engines().await;
    let mut cfg = replica_config(&fleet);
    cfg.kv_events_endpoints.clear();
    cfg.kv_events_replay_endpoints.clear();
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/route", gw.admin_url());
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]});
    let res = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(res.status(), 401);
    let ready = eventually(10.0, async || {
        let workers = common::workers_with_key(&gw, Some("admin")).await;
        workers.iter().filter(|w| w["model_id"] == MODEL && w["worker_type"] == "regular").count() == ENGINES
    })
    .await;
    assert!(ready);
    let first = dry_run_chat(&gw, &body).await;
    assert_eq!(first["index"], "approximate", "{first}");
    assert_eq!(first["endpoint"], "chat_completions");
    assert_eq!(first["reason"], "cache_miss");
    for _ in 0..3 {
        let again = dry_run_chat(&gw, &body).await;
        assert_eq!(again["reason"], "cache_miss", "a dry run teaches the tree nothing: {again}");
        assert_eq!(again["worker"], first["worker"], "the tie-break is a function of the prompt");
    }
    let metrics = metrics_text(&gw).await;
    assert!(!metrics.contains("kvgate_routing_decisions_total{"), "dry runs are not counted:\n{metrics}");
    let bad =
        client().post(format!("{url}?endpoint=nope")).bearer_auth("admin").json(&body).send().await.unwrap();
    assert_eq!(bad.status(), 400);
    gw.shutdown().await;
    fleet.shutdown().await;
}

async fn dry_run_chat(gw: &GatewayHandle, body: &Value) -> Value {
    let res = client()
        .post(format!("{}/v1/route", gw.admin_url()))
        .bearer_auth("admin")
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    res.json().await.unwrap()
}
