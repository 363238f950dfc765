//! A large fleet in one process: 500 simulated engines from one `spawn_fleet` behind one
//! gateway on 127.0.0.1; every worker is registered and healthy, requests are answered and
//! spread over many workers, and the load monitor keeps a sample of every worker (power_of_two).

use crate::common;

use std::collections::HashSet;

use common::*;
use futures_util::StreamExt;
use kvgate_mock::{spawn_fleet, EngineKind, MockArgs};
use serde_json::{json, Value};

const N_WORKERS: usize = 500;

async fn readiness(gw: &kvgate_gateway::GatewayHandle) -> Value {
    let response = client().get(format!("{}/readiness", gw.url())).send().await.unwrap();
    response.json().await.unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_workers_from_one_mock_process_are_healthy_and_routed_to() {
    // Each engine takes a listener and a few connections from the gateway.
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let fleet = spawn_fleet(MockArgs { count: N_WORKERS, engine: EngineKind::Canned, ..MockArgs::default() })
        .await
        .expect("the fleet starts");
    let mut config = config(fleet.urls());
    config.routing.policy = kvgate_policy::PolicyKind::PowerOfTwo;
    config.health_check_interval_secs = 1.0;
    // Under CPU contention (CI's 2 cores) 500 probes or polls at once can take over a second: a
    // worker whose probe times out loses its load sample, and a poll times out at the interval.
    config.health_check_timeout_secs = 5.0;
    config.load_monitor_interval_ms = 1000;
    config.expose_routing_headers = true;
    let gw = gateway(config).await;

    let ready = readiness(&gw).await;
    assert_eq!(ready["total_workers"], json!(N_WORKERS), "{ready}");
    assert!(
        eventually(15.0, async || readiness(&gw).await["healthy_workers"] == json!(N_WORKERS)).await,
        "every worker healthy: {}",
        readiness(&gw).await
    );
    // Every worker's load is sampled. Under contention a round's poll can time out, and the
    // sample goes until the next one answers, so all 500 at one instant is a race: count every
    // worker seen with a sample.
    let mut sampled = HashSet::new();
    let every_worker_sampled = eventually(30.0, async || {
        let body: Value =
            client().get(format!("{}/get_loads", gw.url())).send().await.unwrap().json().await.unwrap();
        for entry in body["loads"].as_array().into_iter().flatten() {
            if let Some(worker) = entry["worker"].as_str() {
                sampled.insert(worker.to_string());
            }
        }
        sampled.len() == N_WORKERS
    })
    .await;
    assert!(every_worker_sampled, "a load sample of every worker: {} of {N_WORKERS}", sampled.len());

    // 200 requests, 50 at a time: in-flight requests spread over the fleet.
    let url = gw.url();
    let answers: Vec<(u16, Option<String>)> = futures_util::stream::iter(0..200)
        .map(|conversation| {
            let url = url.clone();
            async move {
                let body = json!({"model": "mock-model", "max_tokens": 2,
                    "messages": [{"role": "user", "content": format!("conversation {conversation}: hello there")}]});
                let response =
                    client().post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
                let worker =
                    response.headers().get("x-kvgate-worker").map(|v| v.to_str().unwrap().to_string());
                (response.status().as_u16(), worker)
            }
        })
        .buffer_unordered(50)
        .collect()
        .await;
    let fleet_urls: HashSet<String> = fleet.urls().into_iter().collect();
    let mut chosen = HashSet::new();
    for (status, worker) in answers {
        assert_eq!(status, 200);
        let worker = worker.expect("routing headers are on");
        assert!(fleet_urls.contains(&worker), "{worker} is a fleet worker");
        chosen.insert(worker);
    }
    assert!(chosen.len() >= 50, "requests spread over the fleet: {} workers chosen", chosen.len());
    // The fleet page's JSON stays small: aggregates over every worker, the top 20 listed.
    // Under contention a round's polls can time out and their samples go until the next one
    // answers: wait for a page with most of the fleet sampled.
    let (mut elapsed, mut text) = (std::time::Duration::ZERO, String::new());
    let mostly_sampled = eventually(30.0, async || {
        let started = std::time::Instant::now();
        let page = client().get(format!("{}/v1/fleet", gw.admin_url())).send().await.unwrap();
        (elapsed, text) = (started.elapsed(), page.text().await.unwrap());
        let page: Value = serde_json::from_str(&text).unwrap();
        page["pools"][0]["kv_usage"]["sampled"].as_u64().unwrap_or(0) >= N_WORKERS as u64 / 2
    })
    .await;
    let page: Value = serde_json::from_str(&text).unwrap();
    assert!(mostly_sampled, "half the workers sampled: {}", page["pools"][0]["kv_usage"]);
    let sampled: u64 = page["pools"][0]["kv_usage"]["histogram"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .sum();
    // Every sampled worker in the KV histogram (a worker briefly unhealthy under load loses its sample).
    assert_eq!(json!(sampled), page["pools"][0]["kv_usage"]["sampled"]);
    assert!(sampled >= N_WORKERS as u64 / 2, "{sampled} of {N_WORKERS} workers sampled");
    assert_eq!(page["pools"][0]["decisions_total"]["power_of_two"], json!(200));
    assert_eq!(page["workers"]["rows"].as_array().unwrap().len(), 20);
    println!("GET /v1/fleet at {N_WORKERS} workers: {} bytes in {elapsed:?}", text.len());
    gw.shutdown().await;
    fleet.shutdown().await;
}
