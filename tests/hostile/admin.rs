//! The admin surface: one unauthenticated `POST /workers` put an attacker's server into the
//! real model's pool (it received a third of other clients' prompts and their Authorization
//! headers), and made the gateway send HTTP to any address; 10,000 registrations had no cap.
//! Now the admin API is on a listener of its own (loopback by default) or on the main one only
//! behind `--admin-api-key`; a non-loopback admin listener needs the key (or an explicit
//! `--admin-insecure`); registrations are capped (`--max-workers`) and can be confined
//! (`--worker-url-allow`).

use std::sync::atomic::Ordering;

use kvgate_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::common::{chat, client, config, dead_url, gateway, upstream};

async fn post_worker(base: &str, key: Option<&str>, body: Value) -> (u16, Value) {
    let mut request = client().post(format!("{base}/workers")).json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let res = request.send().await.unwrap();
    (res.status().as_u16(), res.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_the_main_listener_serves_no_admin_api() {
    let real = upstream("real", "m").await;
    let attacker = upstream("attacker", "m").await;
    let gw = gateway(config(vec![real.url.clone()])).await;
    assert_ne!(gw.admin_url(), gw.url(), "an admin listener of its own");
    let (status, body) = post_worker(&gw.url(), None, json!({"url": attacker.url, "model_id": "m"})).await;
    assert_eq!(status, 404, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("admin listener"), "{body}");
    let admin_paths = [
        ("GET", "/workers"),
        ("DELETE", "/workers/x"),
        ("POST", "/v1/route"),
        ("GET", "/v1/fleet"),
        ("GET", "/dashboard"),
    ];
    for (method, path) in admin_paths {
        let request = client().request(method.parse().unwrap(), format!("{}{path}", gw.url()));
        assert_eq!(request.json(&chat("m")).send().await.unwrap().status(), 404, "{method} {path}");
    }
    for _ in 0..6 {
        let res = client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await;
        assert_eq!(res.unwrap().status(), 200);
    }
    assert_eq!(attacker.requests.load(Ordering::SeqCst), 0, "the attacker got no prompt");
    // The operator, on the loopback admin listener, can; and it serves no proxied traffic.
    let (status, _) = post_worker(&gw.admin_url(), None, json!({"url": attacker.url, "model_id": "m"})).await;
    assert_eq!(status, 201);
    let res = client().post(format!("{}/v1/chat/completions", gw.admin_url())).json(&chat("m")).send().await;
    assert_eq!(res.unwrap().status(), 404);
    // Nor is the admin listener a worker, however spelled.
    let port = gw.admin_addr.unwrap().port();
    let (status, body) =
        post_worker(&gw.admin_url(), None, json!({"url": format!("http://127.1:{port}"), "model_id": "m"}))
            .await;
    assert_eq!(status, 400, "{body}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_key_every_listener_requires_it() {
    let attacker = upstream("attacker", "m").await;
    let mut cfg = config(Vec::new());
    cfg.admin_api_key = Some("operator-key".into());
    cfg.admin_port = Some(0);
    let gw = gateway(cfg).await;
    for base in [gw.url(), gw.admin_url()] {
        let (status, _) = post_worker(&base, None, json!({"url": attacker.url, "model_id": "m"})).await;
        assert_eq!(status, 401, "{base}");
        let (status, _) =
            post_worker(&base, Some("wrong"), json!({"url": attacker.url, "model_id": "m"})).await;
        assert_eq!(status, 401, "{base}");
        for path in ["/workers", "/v1/fleet", "/dashboard"] {
            let res = client().get(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(res.status(), 401, "{base}{path}");
        }
    }
    assert!(gw.state.registry.snapshot().workers.is_empty());
    let (status, _) =
        post_worker(&gw.url(), Some("operator-key"), json!({"url": attacker.url, "model_id": "m"})).await;
    assert_eq!(status, 201);
    gw.shutdown().await;
}

#[test]
fn a_non_loopback_admin_listener_needs_a_key_or_an_explicit_override() {
    let open = GatewayConfig { admin_host: "0.0.0.0".into(), ..GatewayConfig::default() };
    let errors = open.validate().unwrap_err().to_string();
    assert!(
        errors.contains("admin_host (--admin-host)") && errors.contains("not a loopback address"),
        "{errors}"
    );
    let keyed = GatewayConfig { admin_api_key: Some("k".into()), ..open.clone() };
    assert!(keyed.validate().is_ok());
    let insecure = GatewayConfig { admin_insecure: true, ..open };
    assert!(insecure.validate().is_ok());
    // The README's real-engine example: traffic on every address, the admin API on loopback.
    let example = GatewayConfig { host: "0.0.0.0".into(), ..GatewayConfig::default() };
    assert!(example.validate().is_ok());
    assert_eq!(example.admin_listener(), Some(("127.0.0.1".to_string(), 30001)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_are_capped_and_confined() {
    let mut cfg = config(Vec::new());
    cfg.max_workers = 3;
    cfg.worker_url_allow = vec!["127.0.0.1/32".into()];
    let gw = gateway(cfg).await;
    let admin = gw.admin_url();
    // Outside the allow-list: refused before anything is sent there (no connection, no probe).
    for url in ["http://10.1.2.3:6379", "http://192.168.1.1", "http://[::1]:8000"] {
        let (status, body) = post_worker(&admin, None, json!({"url": url, "model_id": "m"})).await;
        assert_eq!(status, 403, "{url}: {body}");
    }
    let events =
        json!({"url": dead_url().await, "model_id": "m", "kv_events_endpoint": "tcp://10.0.0.1:5557"});
    assert_eq!(post_worker(&admin, None, events).await.0, 403, "KV event publishers are confined too");
    // Inside it, spelled as the connector reads it: allowed, up to the cap.
    let first = upstream("a", "m").await;
    let spelled = first.url.replace("127.0.0.1", "127.1");
    assert_eq!(post_worker(&admin, None, json!({"url": spelled, "model_id": "m"})).await.0, 201);
    // Distinct addresses (a just-freed port can come back from the next bind: a repeat would be
    // refused as already registered, not by the cap).
    let mut urls = std::collections::BTreeSet::new();
    while urls.len() < 52 {
        urls.insert(dead_url().await);
    }
    let mut urls = urls.into_iter();
    for url in urls.by_ref().take(2) {
        assert_eq!(post_worker(&admin, None, json!({"url": url, "model_id": "m"})).await.0, 201);
    }
    for url in urls {
        let (status, body) = post_worker(&admin, None, json!({"url": url, "model_id": "m"})).await;
        assert_eq!(status, 409, "{body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("--max-workers"), "{body}");
    }
    assert_eq!(gw.state.registry.snapshot().workers.len(), 3);
    gw.shutdown().await;
}
