//! A client's KV-transfer fields: with `--pd-conditional`, a request the rule served in place
//! carried the client's `bootstrap_host`, `bootstrap_port`, `bootstrap_room` (SGLang) or
//! `kv_transfer_params` with `do_remote_prefill`, `remote_host`, `remote_port` (vLLM) unchanged
//! to the decode engine, which would pull KV from a host the client chose; so did the
//! `--pd-fallback-in-place` retry and every request of a regular fleet. Now those fields are
//! the gateway's alone: a client's are taken out of every request on every path, and a pair's
//! are the gateway's own.
//!
//! The fields followed: SGLang's `GenerateReqInput` and its OpenAI requests
//! (`python/sglang/srt/managers/io_struct.py`, `bootstrap_host`, `bootstrap_port`,
//! `bootstrap_room`, `bootstrap_pair_key`, 0.5.x); vLLM's `kv_transfer_params` of the OpenAI
//! requests (`vllm/entrypoints/openai/protocol.py`, read by the KV connectors).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kvgate_gateway::{GatewayConfig, PdProtocol};
use kvgate_policy::PolicyKind;
use serde_json::{json, Value};

use crate::common::{client, config, gateway, upstream, Upstream};

/// The fields that steer an engine's KV transfer, both protocols.
const PD_FIELDS: [&str; 5] =
    ["bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "kv_transfer_params"];

/// A client's request carrying KV-transfer fields that point at an attacker's host.
fn hostile_chat(content: String) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
        "bootstrap_host": "10.66.66.66", "bootstrap_port": 6666, "bootstrap_room": 42,
        "bootstrap_pair_key": "attacker",
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "attacker", "remote_block_ids": [1], "remote_host": "10.66.66.66",
            "remote_port": 6666}})
}

/// About 5,000 tokens, new: the conditional rule sends it through a pair.
fn long_content(topic: &str) -> String {
    (0..2000).map(|i| format!("{topic}{i:05} ")).collect()
}

/// Whether `body` carries any of the client's values for the KV-transfer fields.
fn carries_client_fields(body: &Value) -> bool {
    body.get("bootstrap_host").is_some_and(|h| h == "10.66.66.66")
        || body.get("bootstrap_port").is_some_and(|p| p == 6666)
        || body.get("bootstrap_room").is_some_and(|r| r == 42)
        || body.get("bootstrap_pair_key").is_some()
        || body["kv_transfer_params"]["remote_host"] == "10.66.66.66"
        || body["kv_transfer_params"]["remote_engine_id"] == "attacker"
}

/// The KV-transfer part of a body, for messages.
fn pd_part(body: &Value) -> Value {
    PD_FIELDS.iter().filter_map(|field| Some((field.to_string(), body.get(*field)?.clone()))).collect()
}

fn bodies(up: &Upstream) -> Vec<Value> {
    up.bodies.lock().unwrap().clone()
}

async fn post_chat(gw: &kvgate_gateway::GatewayHandle, body: &Value) -> reqwest::Response {
    client().post(format!("{}/v1/chat/completions", gw.url())).json(body).send().await.unwrap()
}

fn conditional(prefill: &Upstream, decode: &str, protocol: PdProtocol) -> GatewayConfig {
    let mut cfg = config(Vec::new());
    cfg.pd_disaggregation = true;
    cfg.pd_protocol = protocol;
    cfg.expose_routing_headers = true;
    cfg.prefill = vec![prefill.url.clone(), "8998".into()];
    cfg.decode = vec![decode.to_string()];
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.routing.pd_conditional = true;
    cfg.disable_circuit_breaker = true;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_served_in_place_or_on_a_regular_fleet_carries_none_of_the_clients_pd_fields() {
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let p = upstream("p", "m").await;
        let d = upstream("d", "m").await;
        let gw = gateway(conditional(&p, &d.url, protocol)).await;
        let response = post_chat(&gw, &hostile_chat("a short question".into())).await;
        assert_eq!(response.status(), 200, "{protocol:?}");
        let path = response.headers()["x-kvgate-pd-path"].to_str().unwrap().to_string();
        assert!(path.starts_with("in_place;"), "{protocol:?}: {path}");
        let seen = bodies(&d);
        assert_eq!(seen.len(), 1, "{protocol:?}");
        for field in PD_FIELDS {
            assert!(
                seen[0].get(field).is_none(),
                "{protocol:?}: in place carried {field}: {}",
                pd_part(&seen[0])
            );
        }
        assert_eq!(seen[0]["messages"][0]["content"], "a short question", "the rest is the client's");
        // Through a pair, each side gets the gateway's fields, never the client's.
        let response = post_chat(&gw, &hostile_chat(long_content("alpha"))).await;
        assert_eq!(response.status(), 200, "{protocol:?}");
        for body in bodies(&d).iter().chain(&bodies(&p)) {
            assert!(
                !carries_client_fields(body),
                "{protocol:?}: a pair carried the client's: {}",
                pd_part(body)
            );
        }
        gw.shutdown().await;
    }
    let regular = upstream("r", "m").await;
    let gw = gateway(config(vec![regular.url.clone()])).await;
    for endpoint in ["/v1/chat/completions", "/generate"] {
        let mut body = hostile_chat("hello".into());
        body["text"] = json!("hello");
        let response = client().post(format!("{}{endpoint}", gw.url())).json(&body).send().await.unwrap();
        assert_eq!(response.status(), 200, "{endpoint}");
        let seen = bodies(&regular).pop().unwrap();
        for field in PD_FIELDS {
            assert!(
                seen.get(field).is_none(),
                "{endpoint}: a regular fleet forwarded {field}: {}",
                pd_part(&seen)
            );
        }
    }
    gw.shutdown().await;
}

/// A decode engine whose KV transfers always fail: a request carrying transfer fields (a pair's
/// half) gets a 500, a plain one is served; every body is kept.
struct FailingDecode {
    url: String,
    bodies: Mutex<Vec<Value>>,
}

async fn failing_decode_answer(
    State(engine): State<Arc<FailingDecode>>,
    body: axum::body::Bytes,
) -> Response {
    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
    engine.bodies.lock().unwrap().push(request.clone());
    let transfer =
        request.get("bootstrap_room").is_some() || request["kv_transfer_params"]["do_remote_prefill"] == true;
    if transfer {
        let error = json!({"error": {"message": "KV transfer failed", "type": "server_error", "code": 500}});
        return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(error)).into_response();
    }
    axum::Json(json!({"object": "chat.completion", "model": "m", "choices": []})).into_response()
}

async fn failing_decode() -> Arc<FailingDecode> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let engine = Arc::new(FailingDecode { url: format!("http://{addr}"), bodies: Mutex::new(Vec::new()) });
    let models = || async { axum::Json(json!({"object": "list", "data": [{"id": "m", "object": "model"}]})) };
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(failing_decode_answer))
        .with_state(engine.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    engine
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fallback_in_place_carries_none_of_the_clients_pd_fields() {
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let p = upstream("p", "m").await;
        let d = failing_decode().await;
        let mut cfg = conditional(&p, &d.url, protocol);
        cfg.pd_fallback_in_place = true;
        cfg.disable_retries = true;
        let gw = gateway(cfg).await;
        let response = post_chat(&gw, &hostile_chat(long_content("bravo"))).await;
        let path = response.headers().get("x-kvgate-pd-path").map(|v| v.to_str().unwrap().to_string());
        let status = response.status();
        let seen = d.bodies.lock().unwrap().clone();
        let parts: Vec<Value> = seen.iter().map(pd_part).collect();
        assert_eq!(seen.len(), 2, "{protocol:?}: the pair's half, then in place: {parts:?}");
        for field in PD_FIELDS {
            assert!(seen[1].get(field).is_none(), "{protocol:?}: the fallback carried {field}: {}", parts[1]);
        }
        assert!(!carries_client_fields(&seen[0]), "{protocol:?}: {}", parts[0]);
        assert_eq!(status, 200, "{protocol:?}: {path:?}");
        assert!(path.unwrap().starts_with("in_place; why=transfer_failed"), "{protocol:?}");
        gw.shutdown().await;
    }
}
