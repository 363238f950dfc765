//! The admin surface: one unauthenticated `POST /workers` put an attacker's server into the
//! real model's pool (it received a third of other clients' prompts and their Authorization
//! headers), and made the gateway send HTTP to any address; 10,000 registrations had no cap.
//! Now the admin API is on a listener of its own (loopback by default) or on the main one only
//! behind `--admin-api-key`; a non-loopback admin listener needs the key (or an explicit
//! `--admin-insecure`); registrations are capped (`--max-workers`) and can be confined
//! (`--worker-url-allow`).
//!
//! Second round (issue 40): a web page opened in a browser on the gateway's host drove the
//! loopback admin listener (a `text/plain` or form `POST /workers` from `Origin:
//! http://evil.example` registered a worker: 201) and a DNS-rebound name reached it (`Host:
//! attacker.example` answered). Now the admin API refuses cross-site requests (`Origin` not the
//! listener's own, `Sec-Fetch-Site: cross-site`/`same-site`), writes that are not JSON, and,
//! without a key, a `Host` that is not one of the listener's own names (or `--admin-allowed-hosts`).

use std::sync::atomic::Ordering;

use kvgate_gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::common::{chat, client, config, dead_url, gateway, upstream, workers, workers_with_key};

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
    assert!(workers_with_key(&gw, Some("operator-key")).await.is_empty());
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
    assert_eq!(workers(&gw).await.len(), 3);
    gw.shutdown().await;
}

/// Registrations a web page could send: each carries a browser's cross-site marks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_drive_the_admin_api() {
    let attacker = upstream("attacker", "m").await;
    let gw = gateway(config(Vec::new())).await;
    let admin = gw.admin_url();
    let register = json!({"url": attacker.url, "model_id": "m"}).to_string();
    let evil = "http://evil.example";
    // "Simple" requests a page sends without a preflight: text/plain, a form, multipart.
    for content_type in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
    {
        for origin in [Some(evil), None] {
            let mut request = client()
                .post(format!("{admin}/workers"))
                .header("content-type", content_type)
                .body(register.clone());
            if let Some(origin) = origin {
                request = request.header("origin", origin);
            }
            let status = request.send().await.unwrap().status().as_u16();
            assert!(status == 403 || status == 415, "{content_type} from {origin:?}: {status}");
        }
    }
    // JSON from another site (a preflight it would not pass, or a browser's mark).
    let cross_site = [
        vec![("origin", evil)],
        vec![("sec-fetch-site", "cross-site")],
        vec![("sec-fetch-site", "same-site"), ("origin", "http://other.localhost:1")],
        vec![("origin", "null")],
    ];
    for marks in &cross_site {
        let mut request = client().post(format!("{admin}/workers")).json(&json!({"url": attacker.url}));
        for (name, value) in marks {
            request = request.header(*name, *value);
        }
        assert_eq!(request.send().await.unwrap().status(), 403, "{marks:?}");
        let mut read = client().get(format!("{admin}/v1/fleet"));
        for (name, value) in marks {
            read = read.header(*name, *value);
        }
        assert_eq!(read.send().await.unwrap().status(), 403, "GET /v1/fleet {marks:?}");
    }
    let removal = client().delete(format!("{admin}/workers/x")).header("origin", evil).send().await.unwrap();
    assert_eq!(removal.status(), 403);
    // DNS rebinding: the page's own name, resolved to this gateway.
    for (method, path) in
        [("GET", "/v1/fleet"), ("GET", "/workers"), ("GET", "/dashboard"), ("POST", "/workers")]
    {
        let request = client()
            .request(method.parse().unwrap(), format!("{admin}{path}"))
            .header("host", "attacker.example")
            .json(&json!({"url": attacker.url, "model_id": "m"}));
        assert_eq!(request.send().await.unwrap().status(), 403, "{method} {path} for Host attacker.example");
    }
    assert!(workers(&gw).await.is_empty(), "no page registered a worker");
    // The operator's own tools: no Origin (curl), or the page the listener serves itself.
    let port = gw.admin_addr.unwrap().port();
    let same_origin = format!("http://127.0.0.1:{port}");
    let res = client()
        .get(format!("{admin}/v1/fleet"))
        .header("origin", &same_origin)
        .header("sec-fetch-site", "same-origin")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let res =
        client().get(format!("{admin}/workers")).header("host", format!("localhost:{port}")).send().await;
    assert_eq!(res.unwrap().status(), 200, "localhost is the loopback listener's own name");
    let (status, body) = post_worker(&admin, None, json!({"url": attacker.url, "model_id": "m"})).await;
    assert_eq!(status, 201, "{body}");
    gw.shutdown().await;

    // A name the operator reaches the admin listener by, when told.
    let mut cfg = config(Vec::new());
    cfg.admin_allowed_hosts = vec!["gateway.internal".into()];
    let gw = gateway(cfg).await;
    let read =
        |host: &'static str| client().get(format!("{}/workers", gw.admin_url())).header("host", host).send();
    assert_eq!(read("gateway.internal").await.unwrap().status(), 200);
    assert_eq!(read("attacker.example").await.unwrap().status(), 403);
    gw.shutdown().await;
}
