//! Per-model policies and the hash and session policies through the gateway: each model's pool
//! has its own policy and state, policies are named per model in YAML or by a model's first
//! worker (snake_case or CamelCase), session keys come from the routing-key header or `user`,
//! and a client may name its worker when the gateway allows it.

use crate::common;

use std::collections::BTreeSet;

use common::*;
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use serde_json::{json, Value};

fn config_with_models(urls: Vec<String>, models_yaml: &str) -> GatewayConfig {
    let file = GatewayConfig::with_file(models_yaml, &GatewayConfig::default(), &[]).unwrap();
    let mut cfg = config(urls);
    cfg.models = file.models;
    cfg.routing = file.routing;
    cfg.expose_routing_headers = true;
    cfg
}

async fn send(gw: &GatewayHandle, body: &Value, headers: &[(&str, &str)]) -> (u16, String, String) {
    let mut request = client().post(format!("{}/v1/chat/completions", gw.url())).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    let header =
        |name: &str| response.headers().get(name).map_or(String::new(), |v| v.to_str().unwrap().to_string());
    let (worker, route) = (header("x-kvgate-worker"), header("x-kvgate-route"));
    (response.status().as_u16(), worker, route)
}

fn ask(model: &str, text: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn each_model_routes_with_its_own_policy_and_state() {
    let (a, b) = (upstream("a", "m1").await, upstream("b", "m1").await);
    let (c, d) = (upstream("c", "m2").await, upstream("d", "m2").await);
    let yaml = "routing:\n  policy: round_robin\nmodels:\n  m1:\n    policy: CacheAware\n";
    let gw =
        gateway(config_with_models(vec![a.url.clone(), b.url.clone(), c.url.clone(), d.url.clone()], yaml))
            .await;
    let m1 = BTreeSet::from([a.url.clone(), b.url.clone()]);
    let m2 = BTreeSet::from([c.url.clone(), d.url.clone()]);
    let prompt = format!("a long shared system prompt {}", "word ".repeat(60));

    // m2 (round_robin from routing:) sees the prompt first; m1's own tree has never seen it.
    for _ in 0..4 {
        let (status, worker, route) = send(&gw, &ask("m2", &prompt), &[]).await;
        assert_eq!((status, route.as_str()), (200, "round_robin"));
        assert!(m2.contains(&worker), "m2's request stayed on m2's workers");
    }
    let (status, first, route) = send(&gw, &ask("m1", &prompt), &[]).await;
    assert_eq!((status, route.as_str()), (200, "cache_miss"), "m1's tree holds only m1's prompts");
    assert!(m1.contains(&first));
    for _ in 0..3 {
        let (_, worker, route) = send(&gw, &ask("m1", &prompt), &[]).await;
        assert_eq!((worker.as_str(), route.as_str()), (first.as_str(), "cache_hit"));
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_models_first_worker_names_its_policy_and_sessions_stick() {
    let gw = gateway({
        let mut cfg = config(Vec::new());
        cfg.expose_routing_headers = true;
        cfg
    })
    .await;
    let add = |body: Value| {
        let url = format!("{}/workers", gw.admin_url());
        async move { client().post(url).json(&body).send().await.unwrap().status().as_u16() }
    };
    let ups =
        [upstream("h1", "hashed").await, upstream("h2", "hashed").await, upstream("h3", "hashed").await];
    assert_eq!(
        add(json!({"url": ups[0].url, "model_id": "hashed", "policy": "ConsistentHashing"})).await,
        201
    );
    assert_eq!(add(json!({"url": ups[1].url, "model_id": "hashed"})).await, 201);
    assert_eq!(
        add(json!({"url": ups[2].url, "model_id": "hashed", "policy": "consistent_hashing"})).await,
        201
    );
    // Naming another policy for a model that has one is a conflict; a policy without a model is refused.
    let other = upstream("o", "hashed").await;
    assert_eq!(add(json!({"url": other.url, "model_id": "hashed", "policy": "round_robin"})).await, 409);
    assert_eq!(add(json!({"url": other.url, "policy": "round_robin"})).await, 400);

    // The routing-key header keys the ring: one key, one worker; keys spread.
    let mut homes = BTreeSet::new();
    for key in 0..40 {
        let key = format!("tenant-{key}");
        let (status, worker, route) =
            send(&gw, &ask("hashed", "hi"), &[("x-kvgate-routing-key", &key)]).await;
        assert_eq!((status, route.as_str()), (200, "consistent_hash"));
        for _ in 0..2 {
            assert_eq!(
                send(&gw, &ask("hashed", "other text"), &[("x-kvgate-routing-key", &key)]).await.1,
                worker
            );
        }
        homes.insert(worker);
    }
    assert_eq!(homes.len(), 3, "keys spread over the ring");

    // `user` is the key when no header is given.
    let with_user =
        json!({"model": "hashed", "user": "alice", "messages": [{"role": "user", "content": "x"}]});
    let first = send(&gw, &with_user, &[]).await.1;
    for _ in 0..3 {
        assert_eq!(send(&gw, &with_user, &[]).await.1, first);
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn manual_sessions_from_yaml_and_the_target_worker_override() {
    let ups = [upstream("s1", "m").await, upstream("s2", "m").await, upstream("s3", "m").await];
    let urls: Vec<String> = ups.iter().map(|u| u.url.clone()).collect();
    let yaml = "models:\n  m:\n    policy: manual\n    assignment_mode: min_group\n";
    let mut cfg = config_with_models(urls.clone(), yaml);
    cfg.routing_key_override = true;
    let gw = gateway(cfg).await;
    let mut per_worker = std::collections::BTreeMap::<String, usize>::new();
    for session in 0..9 {
        let key = format!("conversation-{session}");
        let (status, home, route) = send(&gw, &ask("m", "turn 1"), &[("x-kvgate-routing-key", &key)]).await;
        assert_eq!((status, route.as_str()), (200, "session_assigned"));
        for turn in 2..4 {
            let (_, worker, route) =
                send(&gw, &ask("m", &format!("turn {turn}")), &[("x-kvgate-routing-key", &key)]).await;
            assert_eq!((worker.as_str(), route.as_str()), (home.as_str(), "sticky"));
        }
        *per_worker.entry(home).or_default() += 1;
    }
    assert!(per_worker.values().all(|&n| n == 3), "min_group: {per_worker:?}");

    // The client names its worker; an unknown one is a clear 400.
    let (status, worker, route) = send(&gw, &ask("m", "x"), &[("x-kvgate-target-worker", &urls[2])]).await;
    assert_eq!((status, worker.as_str(), route.as_str()), (200, urls[2].as_str(), "target_worker"));
    let (status, _, _) = send(&gw, &ask("m", "x"), &[("x-kvgate-target-worker", "http://127.0.0.1:1")]).await;
    assert_eq!(status, 400);
    gw.shutdown().await;

    // Without --routing-key-override the header is ignored.
    let gw = gateway(config_with_models(urls.clone(), yaml)).await;
    let (status, _, route) =
        send(&gw, &ask("m", "x"), &[("x-kvgate-target-worker", "http://127.0.0.1:1")]).await;
    assert_eq!((status, route.as_str()), (200, "session_assigned"));
    gw.shutdown().await;
}
