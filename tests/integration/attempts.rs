//! One attempt-outcome classification on every path (issue 42): a worker whose connection breaks
//! after it read the request and before it answered (nothing reached the client) is a failure of
//! that worker, and the request goes to another within the retry budget, on a single worker as on
//! either side of a disaggregated pair, in both PD protocols. With no other worker left, the
//! client gets 502 `upstream_unreachable`. (Before, a single worker's broken exchange was a 502 at
//! once while either side of a pair retried it.)

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use kvgate_gateway::{GatewayHandle, PdProtocol};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A worker on loopback that reads each request whole, then closes the connection without a
/// byte of answer; it counts the requests it hung up on.
async fn hang_up() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let hung_up = Arc::new(AtomicUsize::new(0));
    let count = hung_up.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                // The head, then the body its content-length announces.
                while let Ok(n @ 1..) = socket.read(&mut buffer).await {
                    request.extend_from_slice(&buffer[..n]);
                    let text = String::from_utf8_lossy(&request);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|line| {
                                line.to_ascii_lowercase().strip_prefix("content-length:").map(str::to_string)
                            })
                            .and_then(|value| value.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                let _ = socket.shutdown().await;
            });
        }
    });
    (url, hung_up)
}

/// A gateway without health checks (the hang-up worker answers none), the circuit breaker off
/// (each request meets the hang-up worker again), up to 3 retries; PD when `pd`.
async fn gateway_for(pd: Option<PdProtocol>) -> GatewayHandle {
    let mut cfg = config(Vec::new());
    cfg.disable_health_check = true;
    cfg.disable_circuit_breaker = true;
    cfg.expose_routing_headers = true;
    cfg.retry_max_retries = 3;
    if let Some(protocol) = pd {
        cfg.pd_disaggregation = true;
        cfg.pd_protocol = protocol;
    }
    gateway(cfg).await
}

async fn add(gw: &GatewayHandle, body: Value) {
    let response = client().post(format!("{}/workers", gw.admin_url())).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 201, "{body}");
}

async fn ask(gw: &GatewayHandle) -> reqwest::Response {
    client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap()
}

#[tokio::test]
async fn a_single_workers_broken_exchange_is_retried_on_another() {
    let gw = gateway_for(None).await;
    let (broken, hung_up) = hang_up().await;
    let good = upstream("good", "m").await;
    add(&gw, json!({"url": broken, "model_id": "m"})).await;
    add(&gw, json!({"url": good.url, "model_id": "m"})).await;
    // round_robin meets the broken worker every other request: each of those is retried.
    for _ in 0..4 {
        let response = ask(&gw).await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-kvgate-worker"], good.url.as_str());
    }
    assert!(hung_up.load(Ordering::SeqCst) >= 2, "the broken worker was tried");
    let metrics = metrics_text(&gw).await;
    assert!(metrics.contains(r#"kvgate_retries_total{endpoint="chat_completions"} "#), "{metrics}");
    gw.shutdown().await;

    // No other worker: 502 upstream_unreachable, naming the worker.
    let gw = gateway_for(None).await;
    add(&gw, json!({"url": broken, "model_id": "m"})).await;
    let response = ask(&gw).await;
    assert_eq!(response.status(), 502);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["code"], "upstream_unreachable", "{error}");
    assert!(error["error"]["message"].as_str().unwrap().contains(&broken), "{error}");
    gw.shutdown().await;
}

#[tokio::test]
async fn either_side_of_a_pair_with_a_broken_exchange_is_retried_on_another() {
    let (prefill, decode) = (upstream("p", "m").await, upstream("d", "m").await);
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        // On the broken side one worker hangs up and another answers; the other side answers.
        for (side, header, good) in
            [("prefill", "x-kvgate-prefill-worker", &prefill), ("decode", "x-kvgate-worker", &decode)]
        {
            let gw = gateway_for(Some(protocol)).await;
            let (broken, hung_up) = hang_up().await;
            add(&gw, json!({"url": broken, "model_id": "m", "worker_type": side})).await;
            add(&gw, json!({"url": prefill.url, "model_id": "m", "worker_type": "prefill"})).await;
            add(&gw, json!({"url": decode.url, "model_id": "m", "worker_type": "decode"})).await;
            for _ in 0..4 {
                let response = ask(&gw).await;
                assert_eq!(response.status(), 200, "{protocol:?}, {side}");
                assert_eq!(response.headers()[header], good.url.as_str(), "{protocol:?}, {side}");
            }
            assert!(hung_up.load(Ordering::SeqCst) >= 1, "{protocol:?}: the broken {side} worker was tried");
            gw.shutdown().await;
        }
    }
}
