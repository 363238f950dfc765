//! Integration tests of the load monitor and the load-driven policies against loopback upstreams.

use crate::common;

use std::sync::atomic::Ordering;

use common::*;
use kvgate_policy::{PolicyConfig, PolicyKind};
use serde_json::Value;

fn with_policy(urls: Vec<String>, routing: PolicyConfig) -> kvgate_gateway::GatewayConfig {
    let mut cfg = config(urls);
    cfg.routing = routing;
    cfg.load_monitor_interval_ms = 50;
    cfg
}

async fn loads(gw: &kvgate_gateway::GatewayHandle) -> Value {
    client().get(format!("{}/get_loads", gw.url())).send().await.unwrap().json().await.unwrap()
}

#[tokio::test]
async fn polls_for_cache_aware_with_a_kv_threshold_and_not_otherwise() {
    let up = upstream("a", "m").await;
    let kv_aware = PolicyConfig { balance_token_usage_threshold: 0.5, ..PolicyConfig::default() };
    let gw = gateway(with_policy(vec![up.url.clone()], kv_aware)).await;
    let gw_url = gw.url();
    assert!(
        eventually(5.0, async || {
            let body: Value =
                client().get(format!("{gw_url}/get_loads")).send().await.unwrap().json().await.unwrap();
            body["polling"] == true && body["loads"].as_array().is_some_and(|l| l.len() == 1)
        })
        .await
    );
    let body = loads(&gw).await;
    assert_eq!(body["loads"][0]["worker"], up.url.as_str());
    assert!(body["loads"][0]["age_ms"].as_u64().unwrap() < 5000);
    gw.shutdown().await;

    // Default cache_aware (both KV terms 1.0) and round_robin consume no loads: no polling.
    for routing in
        [PolicyConfig::default(), PolicyConfig { policy: PolicyKind::RoundRobin, ..PolicyConfig::default() }]
    {
        let quiet = upstream("q", "m").await;
        let gw = gateway(with_policy(vec![quiet.url.clone()], routing)).await;
        // Four health probes (0.1 s apart) span at least six load-monitor intervals of 50 ms.
        let probed = eventually(5.0, async || quiet.health_checks.load(Ordering::SeqCst) >= 4).await;
        assert!(probed, "the health loop runs");
        assert_eq!(quiet.loads_polls.load(Ordering::SeqCst), 0);
        let body = loads(&gw).await;
        assert_eq!(body["polling"], false);
        assert_eq!(body["loads"].as_array().unwrap().len(), 0);
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn a_hung_worker_does_not_delay_the_others_and_removed_workers_vanish() {
    let fast = upstream("fast", "m").await;
    let hung = upstream("hung", "m").await;
    hung.loads_delay_ms.store(60_000, Ordering::SeqCst);
    let routing = PolicyConfig { policy: PolicyKind::PowerOfTwo, ..PolicyConfig::default() };
    let mut cfg = with_policy(vec![fast.url.clone(), hung.url.clone()], routing);
    cfg.load_monitor_interval_ms = 100;
    let gw = gateway(cfg).await;
    let gw_url = gw.url();
    let admin = gw.admin_url();
    assert!(
        eventually(2.0, async || {
            let body: Value =
                client().get(format!("{gw_url}/get_loads")).send().await.unwrap().json().await.unwrap();
            body["loads"].as_array().unwrap().iter().any(|l| l["worker"] == fast.url.as_str())
        })
        .await,
        "the fast worker's entry is published while the other hangs"
    );
    // Its polls go on while the other hangs, and its entry stays fresh: ages near the interval,
    // not the hung worker's delay.
    let polled = fast.loads_polls.load(Ordering::SeqCst);
    let fresh = eventually(5.0, async || {
        let body = loads(&gw).await;
        let entries = body["loads"].as_array().unwrap();
        fast.loads_polls.load(Ordering::SeqCst) >= polled + 4
            && entries.len() == 1
            && entries[0]["age_ms"].as_u64().unwrap() < 400
    })
    .await;
    assert!(fresh, "{}", loads(&gw).await);
    let metrics = client().get(format!("{gw_url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(&format!("kvgate_load_poll_failures_total{{worker=\"{}\"}}", hung.url)));
    assert!(metrics.contains("kvgate_load_poll_duration_seconds_count"));
    assert!(metrics.contains(&format!("kvgate_load_snapshot_age_seconds{{worker=\"{}\"}}", fast.url)));

    let encoded: String = fast.url.bytes().map(|c| format!("%{c:02X}")).collect();
    client().delete(format!("{admin}/workers/{encoded}")).send().await.unwrap();
    let body = loads(&gw).await;
    assert_eq!(body["loads"].as_array().unwrap().len(), 0, "removed at once: {body}");
    gw.shutdown().await;
}

#[tokio::test]
async fn vllm_metrics_are_used_when_there_is_no_v1_loads_and_garbage_is_skipped() {
    let vllm = upstream("vllm", "m").await;
    vllm.loads_body.lock().unwrap().clear(); // 404: not SGLang
    *vllm.metrics_body.lock().unwrap() = "# HELP vllm:kv_cache_usage_perc x\n\
        vllm:kv_cache_usage_perc{model_name=\"m\"} 0.42\nvllm:num_requests_running{model_name=\"m\"} 3\n\
        vllm:num_requests_waiting{model_name=\"m\"} 1\n"
        .into();
    let garbage = upstream("garbage", "m").await;
    *garbage.loads_body.lock().unwrap() = "{not json".into();
    let routing = PolicyConfig { policy: PolicyKind::LeastLoad, ..PolicyConfig::default() };
    let gw = gateway(with_policy(vec![vllm.url.clone(), garbage.url.clone()], routing)).await;
    let gw_url = gw.url();
    assert!(
        eventually(5.0, async || {
            let body: Value =
                client().get(format!("{gw_url}/get_loads")).send().await.unwrap().json().await.unwrap();
            body["loads"].as_array().unwrap().len() == 1
        })
        .await
    );
    let body = loads(&gw).await;
    let entry = &body["loads"][0];
    assert_eq!(entry["worker"], vllm.url.as_str());
    assert_eq!((entry["token_usage"].as_f64(), entry["num_running_reqs"].as_u64()), (Some(0.42), Some(3)));
    // The worker with a malformed report has no entry, and routing still works.
    for _ in 0..4 {
        let res =
            client().post(format!("{gw_url}/v1/chat/completions")).json(&chat("m")).send().await.unwrap();
        assert_eq!(res.status(), 200);
    }
    gw.shutdown().await;
}

async fn share_of_idle(policy: PolicyKind) -> usize {
    let busy = upstream("busy", "m").await;
    let idle = upstream("idle", "m").await;
    *busy.loads_body.lock().unwrap() = sglang_loads(0.9, 200, 50_000);
    *idle.loads_body.lock().unwrap() = sglang_loads(0.05, 1, 0);
    let mut cfg = with_policy(
        vec![busy.url.clone(), idle.url.clone()],
        PolicyConfig { policy, ..PolicyConfig::default() },
    );
    // A sample is fresh for three intervals: at 50 ms a starved runtime (a loaded CI machine) lets
    // both go stale between two polls, and a policy rightly routes blind on in-flight counts.
    cfg.load_monitor_interval_ms = 1000;
    let gw = gateway(cfg).await;
    let gw_url = gw.url();
    assert!(
        eventually(5.0, async || {
            let body: Value =
                client().get(format!("{gw_url}/get_loads")).send().await.unwrap().json().await.unwrap();
            body["loads"].as_array().unwrap().len() == 2
        })
        .await
    );
    for _ in 0..20 {
        let res = client()
            .post(format!("{gw_url}/v1/completions"))
            .json(&serde_json::json!({"model": "m", "prompt": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
    }
    gw.shutdown().await;
    idle.requests.load(Ordering::SeqCst)
}

#[tokio::test]
async fn power_of_two_and_least_load_prefer_the_idle_engine() {
    assert_eq!(share_of_idle(PolicyKind::PowerOfTwo).await, 20);
    let least_load = share_of_idle(PolicyKind::LeastLoad).await;
    assert!(least_load >= 19, "least_load sent {least_load}/20 to the idle engine");
}

#[tokio::test]
async fn a_sample_is_stamped_when_its_poll_was_sent() {
    // The engine answers its load poll after 200 ms: requests routed meanwhile are younger than
    // the sample's stamp, so the in-flight correction counts them.
    let slow = upstream("slow", "m").await;
    slow.loads_delay_ms.store(200, Ordering::SeqCst);
    let kv_aware = PolicyConfig { balance_token_usage_threshold: 0.5, ..PolicyConfig::default() };
    let mut cfg = with_policy(vec![slow.url.clone()], kv_aware);
    cfg.load_monitor_interval_ms = 1000;
    let gw = gateway(cfg).await;
    let gw_url = gw.url();
    let published = eventually(5.0, async || {
        let body: Value =
            client().get(format!("{gw_url}/get_loads")).send().await.unwrap().json().await.unwrap();
        body["loads"].as_array().is_some_and(|l| l.len() == 1)
    })
    .await;
    assert!(published);
    let age = loads(&gw).await["loads"][0]["age_ms"].as_u64().unwrap();
    assert!(age >= 200, "the sample is as old as its poll (stamped at send time): {age} ms");
    gw.shutdown().await;
}

#[tokio::test]
async fn kv_aware_routes_to_the_engine_with_less_prefill_queued_and_says_why() {
    let busy = upstream("busy", "m").await;
    let idle = upstream("idle", "m").await;
    *busy.loads_body.lock().unwrap() = sglang_loads(0.2, 4, 80_000);
    *idle.loads_body.lock().unwrap() = sglang_loads(0.2, 4, 800);
    let routing = PolicyConfig { policy: PolicyKind::KvAware, ..PolicyConfig::default() };
    let mut cfg = with_policy(vec![busy.url.clone(), idle.url.clone()], routing);
    cfg.expose_routing_headers = true;
    let gw = gateway(cfg).await;
    let gw_url = gw.url();
    let polled = eventually(5.0, async || {
        let body: Value =
            client().get(format!("{gw_url}/get_loads")).send().await.unwrap().json().await.unwrap();
        body["loads"].as_array().is_some_and(|l| l.len() == 2)
    })
    .await;
    assert!(polled);
    for _ in 0..3 {
        let res = client()
            .post(format!("{gw_url}/v1/completions"))
            .json(&serde_json::json!({"model": "m", "prompt": "a short prompt"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["x-kvgate-route"], "kv_aware");
        assert_eq!(res.headers()["x-kvgate-worker"], idle.url.as_str());
        let predicted = res.headers()["x-kvgate-predicted-ttft"].to_str().unwrap().to_string();
        // 800 queued tokens at 8,000 tokens/s: at most 100 ms ahead (draining since the report).
        let queue_ms: f64 = predicted
            .split("; ")
            .find_map(|term| term.strip_prefix("queue="))
            .and_then(|ms| ms.trim_end_matches("ms").parse().ok())
            .expect("a queue term");
        assert!(queue_ms <= 100.0, "{predicted}");
        for term in ["total=", "prefill=", "decode=", "kv="] {
            assert!(predicted.contains(term), "{predicted}");
        }
    }
    let metrics = client().get(format!("{gw_url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(r#"kvgate_predicted_ttft_seconds_count{model="m",term="queue"} 3"#),
        "{metrics}"
    );
    assert!(metrics
        .contains(r#"kvgate_routing_decisions_total{index="approximate",model="m",reason="kv_aware"} 3"#));
    gw.shutdown().await;
}

/// An SGLang `/v1/loads` body with `waiting` queued requests.
fn waiting_loads(token_usage: f64, waiting: u64) -> String {
    let mut body: Value = serde_json::from_str(&sglang_loads(token_usage, 1, 0)).unwrap();
    body["loads"][0]["num_waiting_reqs"] = waiting.into();
    body.to_string()
}

#[tokio::test]
async fn worker_overload_protection_leaves_a_queued_or_full_engine_out_and_sheds_when_all_are() {
    let queued = upstream("queued", "m").await;
    let full = upstream("full", "m").await;
    let free = upstream("free", "m").await;
    *queued.loads_body.lock().unwrap() = waiting_loads(0.1, 8);
    *full.loads_body.lock().unwrap() = waiting_loads(0.85, 0);
    *free.loads_body.lock().unwrap() = waiting_loads(0.5, 7);
    // round_robin reads no loads: the protection alone makes the monitor poll, and it holds for
    // every policy (SMG's --worker-overload-* bounds, inclusive).
    let mut cfg = with_policy(
        vec![queued.url.clone(), full.url.clone(), free.url.clone()],
        PolicyConfig { policy: PolicyKind::RoundRobin, ..PolicyConfig::default() },
    );
    cfg.worker_overload_waiting_requests = Some(8);
    cfg.worker_overload_token_usage = Some(0.8);
    let gw = gateway(cfg.clone()).await;
    assert!(eventually(5.0, async || loads(&gw).await["loads"].as_array().unwrap().len() == 3).await);
    let gw_url = gw.url();
    let complete = async |url: &str| {
        client()
            .post(format!("{url}/v1/completions"))
            .json(&serde_json::json!({"model": "m", "prompt": "hi"}))
            .send()
            .await
            .unwrap()
    };
    for _ in 0..9 {
        assert_eq!(complete(&gw_url).await.status(), 200);
    }
    assert_eq!(free.requests.load(Ordering::SeqCst), 9);
    assert_eq!((queued.requests.load(Ordering::SeqCst), full.requests.load(Ordering::SeqCst)), (0, 0));
    assert!(metric_line_appears(&gw, "kvgate_worker_overload_left_out_total{model=\"m\"} 18").await);
    // Every engine over a bound: the least loaded (fewest waiting) takes it...
    *free.loads_body.lock().unwrap() = waiting_loads(0.9, 9);
    let sees_it =
        async || loads(&gw).await["loads"].as_array().unwrap().iter().any(|l| l["token_usage"] == 0.9);
    assert!(eventually(5.0, sees_it).await);
    assert_eq!(complete(&gw_url).await.status(), 200);
    assert_eq!(full.requests.load(Ordering::SeqCst), 1, "the full engine has no queue");
    gw.shutdown().await;
    // ... or, with --worker-overload-shed, nobody: 503 with SMG's code and Retry-After.
    cfg.worker_overload_shed = true;
    let gw = gateway(cfg).await;
    assert!(eventually(5.0, async || loads(&gw).await["loads"].as_array().unwrap().len() == 3).await);
    // Shed once every sample is fresh (a stale one never drives the bounds: under contention
    // the three entries can be there and one already too old).
    let mut last = None;
    let shed_once_fresh = eventually(10.0, async || {
        let res = complete(&gw.url()).await;
        let shed = res.status() == 503;
        last = Some(res);
        shed
    })
    .await;
    assert!(shed_once_fresh, "{:?}", last.map(|res| res.status()));
    let shed = last.unwrap();
    assert_eq!(shed.status(), 503);
    assert!(shed.headers().get("retry-after").is_some());
    let body: Value = shed.json().await.unwrap();
    assert_eq!(body["error"]["code"], "worker_overload_protection_shed", "{body}");
    gw.shutdown().await;
}
