//! The gateway's own header namespace, `x-kvgate-*`, both ways: an engine answering
//! `x-kvgate-worker: http://spoofed` had it delivered to clients (without
//! `--expose-routing-headers`), and a client's `x-kvgate-tenant`, `x-kvgate-priority` and
//! `x-kvgate-target-worker` reached the engines unchanged even where a key decided otherwise.
//! Now an engine's `x-kvgate-*` response headers never reach a client (the routing headers are
//! the gateway's own, with `--expose-routing-headers`), and no client `x-kvgate-*` header (nor
//! the configured tenant and priority headers) reaches an engine: the gateway's hop header
//! `x-kvgate-via` is the only one an engine sees.

use std::net::SocketAddr;

use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;

use crate::common::{chat, client, config, gateway, upstream};

/// An engine that sets routing headers of its own on every answer.
async fn spoofing_engine() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let answer = || async {
        let headers = [
            ("x-kvgate-worker", "http://spoofed"),
            ("x-kvgate-route", "spoofed"),
            ("x-kvgate-pd-path", "spoofed"),
            ("X-Kvgate-Anything", "spoofed"),
            ("x-engine-own", "kept"),
        ];
        (headers, axum::Json(json!({"object": "chat.completion", "model": "m", "choices": []})))
            .into_response()
    };
    let models = || async { axum::Json(json!({"object": "list", "data": [{"id": "m", "object": "model"}]})) };
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(answer));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_kvgate_headers_never_reach_a_client() {
    let engine = spoofing_engine().await;
    for expose in [false, true] {
        let mut cfg = config(vec![engine.clone()]);
        cfg.expose_routing_headers = expose;
        let gw = gateway(cfg).await;
        let res = client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await;
        let res = res.unwrap();
        assert_eq!(res.status(), 200);
        let headers = res.headers();
        assert_eq!(headers["x-engine-own"], "kept", "the engine's other headers pass");
        for (name, value) in headers {
            if name.as_str().starts_with("x-kvgate-") {
                assert!(expose, "{name} reached the client without --expose-routing-headers");
                assert_ne!(value, "spoofed", "{name}: the engine's value");
            }
        }
        if expose {
            assert_eq!(headers["x-kvgate-worker"], engine.as_str(), "the gateway's own value");
            assert!(headers.get("x-kvgate-pd-path").is_none(), "no PD path on a regular fleet");
            assert!(headers.get("x-kvgate-anything").is_none());
        }
        gw.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_kvgate_headers_never_reach_an_engine() {
    let worker = upstream("w", "m").await;
    let mut cfg = config(vec![worker.url.clone()]);
    cfg.client_api_keys = vec!["sk-1=team-a".into()];
    cfg.routing_key_override = true;
    let gw = gateway(cfg).await;
    let res = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .bearer_auth("sk-1")
        .header("x-kvgate-tenant", "team-b")
        .header("x-kvgate-priority", "low")
        .header("x-kvgate-target-worker", worker.url.as_str())
        .header("x-kvgate-routing-key", "session-1")
        .header("x-kvgate-worker", "http://spoofed")
        .header("x-kvgate-anything", "x")
        .header("x-request-id", "r1")
        .json(&chat("m"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let seen = worker.last_headers.lock().unwrap().clone();
    for (name, value) in &seen {
        if name.as_str().starts_with("x-kvgate-") {
            assert_eq!(name, "x-kvgate-via", "{name}: {value:?} reached the engine");
        }
    }
    assert_eq!(seen["x-request-id"], "r1", "other headers pass");
    gw.shutdown().await;

    // A tenant header of another name is the gateway's too.
    let mut cfg = config(vec![worker.url.clone()]);
    cfg.tenant_header = "x-team".into();
    cfg.priority_header = "x-class".into();
    let gw = gateway(cfg).await;
    let res = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("x-team", "team-b")
        .header("x-class", "high")
        .json(&chat("m"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let seen = worker.last_headers.lock().unwrap().clone();
    assert!(seen.get("x-team").is_none() && seen.get("x-class").is_none(), "{seen:?}");
    gw.shutdown().await;
}
