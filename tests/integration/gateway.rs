//! Integration tests of `kvgate launch`'s gateway against real HTTP upstreams on 127.0.0.1.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

#[tokio::test]
async fn round_robin_spreads_evenly() {
    let ups = [upstream("a", "m").await, upstream("b", "m").await, upstream("c", "m").await];
    let gw = gateway(config(ups.iter().map(|u| u.url.clone()).collect())).await;
    let client = client();
    for _ in 0..30 {
        let res =
            client.post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
        assert_eq!(res.status(), 200);
    }
    for up in &ups {
        assert_eq!(up.requests.load(Ordering::SeqCst), 10, "worker {}", up.name);
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn non_streaming_body_and_endpoints_pass_through() {
    let up = upstream("a", "m").await;
    let mut cfg = config(vec![up.url.clone()]);
    cfg.expose_routing_headers = true;
    let gw = gateway(cfg).await;
    let client = client();
    for path in ["/v1/chat/completions", "/v1/completions", "/generate", "/v1/embeddings"] {
        let res = client
            .post(format!("{}{path}", gw.url()))
            .json(&json!({"model": "m", "prompt": "x", "text": "x", "input": "x",
                "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{path}");
        assert_eq!(res.headers()["x-kvgate-worker"], up.url.as_str());
        assert_eq!(res.headers()["x-kvgate-route"], "round_robin");
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["worker"], "a");
        assert_eq!(body["model"], "m");
    }
    // Routing headers are off by default.
    let gw2 = gateway(config(vec![up.url.clone()])).await;
    let res =
        client.post(format!("{}/v1/chat/completions", gw2.url())).json(&chat("m")).send().await.unwrap();
    assert!(res.headers().get("x-kvgate-worker").is_none());
    gw.shutdown().await;
    gw2.shutdown().await;
}

#[tokio::test]
async fn sse_first_chunk_arrives_before_upstream_finishes() {
    let up = upstream("a", "m").await;
    up.hold_stream.store(true, Ordering::SeqCst);
    let gw = gateway(config(vec![up.url.clone()])).await;
    let res = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let mut stream = res.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("first chunk arrives while the upstream is still holding the stream")
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&first).contains("\"i\":0"));
    up.release.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(5), stream.next()).await.unwrap() {
        rest.extend_from_slice(&chunk.unwrap());
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.contains("\"i\":2"), "{rest}");
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    gw.shutdown().await;
}

#[tokio::test]
async fn dead_worker_is_retried_elsewhere_without_client_error() {
    let live = upstream("live", "m").await;
    let mut cfg = config(vec![dead_url().await, live.url.clone()]);
    cfg.disable_health_check = true; // the dead worker stays "healthy": only retries can save us
    let gw = gateway(cfg).await;
    // The dead worker's model cannot be discovered; register it explicitly through the API.
    let dead = dead_url().await;
    let res = client()
        .post(format!("{}/workers", gw.admin_url()))
        .json(&json!({"url": dead, "model_id": "m"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    for _ in 0..10 {
        let res =
            client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
        assert_eq!(res.status(), 200);
    }
    assert_eq!(live.requests.load(Ordering::SeqCst), 10);
    let metrics = metrics_text(&gw).await;
    assert!(metrics.contains("kvgate_retries_total{endpoint=\"chat_completions\"}"), "{metrics}");
    gw.shutdown().await;
}

#[tokio::test]
async fn status_503_is_retried_on_another_worker_once() {
    let bad = upstream("bad", "m").await;
    bad.status.store(503, Ordering::SeqCst);
    let good = upstream("good", "m").await;
    let mut cfg = config(vec![bad.url.clone(), good.url.clone()]);
    cfg.disable_health_check = true;
    // Without health checks nothing retries a model discovery that timed out at registration.
    cfg.health_check_timeout_secs = 5.0;
    let gw = gateway(cfg).await;
    common::wait_routable(&gw, 2).await;
    for _ in 0..4 {
        let res =
            client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
        assert_eq!(res.status(), 200);
    }
    assert_eq!(good.requests.load(Ordering::SeqCst), 4);
    // Never sent twice to the same worker by a retry: bad saw at most one attempt per request.
    assert!(bad.requests.load(Ordering::SeqCst) <= 4);
    // With retries disabled the worker's 503 reaches the client unchanged.
    let mut cfg = config(vec![bad.url.clone()]);
    cfg.disable_retries = true;
    let gw2 = gateway(cfg).await;
    // Its 503 must be the worker's: the gateway's own (no routable worker yet) is another answer.
    common::wait_routable(&gw2, 1).await;
    let res =
        client().post(format!("{}/v1/chat/completions", gw2.url())).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 503);
    assert!(res.text().await.unwrap().contains("bad says 503"));
    gw.shutdown().await;
    gw2.shutdown().await;
}

#[tokio::test]
async fn circuit_breaker_stops_traffic_to_a_failing_worker() {
    let failing = upstream("failing", "m").await;
    failing.status.store(500, Ordering::SeqCst);
    let good = upstream("good", "m").await;
    let mut cfg = config(vec![failing.url.clone(), good.url.clone()]);
    cfg.disable_health_check = true;
    cfg.cb_failure_threshold = 2;
    cfg.cb_timeout_duration_secs = 60.0;
    let gw = gateway(cfg).await;
    for _ in 0..20 {
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    }
    assert_eq!(failing.requests.load(Ordering::SeqCst), 2, "the circuit opened after two failures");
    let workers: Value =
        client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    let states: Vec<_> =
        workers["workers"].as_array().unwrap().iter().map(|w| w["circuit_state"].clone()).collect();
    assert!(states.contains(&json!("open")), "{workers}");
    gw.shutdown().await;
}

#[tokio::test]
async fn health_transitions_remove_and_restore_a_worker() {
    let a = upstream("a", "m").await;
    let b = upstream("b", "m").await;
    let gw = gateway(config(vec![a.url.clone(), b.url.clone()])).await;
    let client = client();
    b.healthy.store(false, Ordering::SeqCst);
    let gw_url = gw.url();
    let admin = gw.admin_url();
    assert!(
        eventually(5.0, async || {
            let w: Value = client.get(format!("{admin}/workers")).send().await.unwrap().json().await.unwrap();
            w["workers"].as_array().unwrap().iter().any(|w| w["healthy"] == json!(false))
        })
        .await,
        "b is marked unhealthy"
    );
    let before = b.requests.load(Ordering::SeqCst);
    for _ in 0..6 {
        let res = client.post(format!("{gw_url}/v1/chat/completions")).json(&chat("m")).send().await.unwrap();
        assert_eq!(res.status(), 200);
    }
    assert_eq!(b.requests.load(Ordering::SeqCst), before, "an unhealthy worker gets no requests");
    b.healthy.store(true, Ordering::SeqCst);
    assert!(
        eventually(5.0, async || {
            let w: Value = client.get(format!("{admin}/workers")).send().await.unwrap().json().await.unwrap();
            w["workers"].as_array().unwrap().iter().all(|w| w["healthy"] == json!(true))
        })
        .await,
        "b is restored"
    );
    for _ in 0..6 {
        client.post(format!("{gw_url}/v1/chat/completions")).json(&chat("m")).send().await.unwrap();
    }
    assert!(b.requests.load(Ordering::SeqCst) > before);
    // With every worker down, readiness fails and requests get 503.
    a.healthy.store(false, Ordering::SeqCst);
    b.healthy.store(false, Ordering::SeqCst);
    assert!(
        eventually(5.0, async || client.get(format!("{gw_url}/readiness")).send().await.unwrap().status()
            == 503)
        .await
    );
    let res = client.post(format!("{gw_url}/v1/chat/completions")).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 503);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], "no_healthy_worker");
    gw.shutdown().await;
}

#[tokio::test]
async fn workers_added_and_removed_at_runtime() {
    let a = upstream("a", "m").await;
    let b = upstream("b", "m").await;
    let gw = gateway(config(vec![a.url.clone()])).await;
    let client = client();
    let res =
        client.post(format!("{}/workers", gw.admin_url())).json(&json!({"url": b.url})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let added: Value = res.json().await.unwrap();
    assert_eq!(added["worker"]["model_id"], "m", "model discovered from /v1/models");
    let dup =
        client.post(format!("{}/workers", gw.admin_url())).json(&json!({"url": b.url})).send().await.unwrap();
    assert_eq!(dup.status(), 409);
    for _ in 0..4 {
        client.post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    }
    assert_eq!(b.requests.load(Ordering::SeqCst), 2);
    let listed: Value =
        client.get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(listed["workers"].as_array().unwrap().len(), 2);
    for key in ["url", "model_id", "healthy", "in_flight", "circuit_state"] {
        assert!(listed["workers"][0].get(key).is_some(), "{key} in {listed}");
    }

    // Removing a worker never drops its in-flight request.
    b.hold_stream.store(true, Ordering::SeqCst);
    a.hold_stream.store(true, Ordering::SeqCst);
    let mut streams = Vec::new();
    for _ in 0..2 {
        let res = client
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        streams.push(res);
    }
    let encoded: String = b.url.bytes().map(|c| format!("%{c:02X}")).collect();
    let res = client.delete(format!("{}/workers/{encoded}", gw.admin_url())).send().await.unwrap();
    assert_eq!(res.status(), 200);
    b.release.notify_one();
    a.release.notify_one();
    for res in streams {
        let text = tokio::time::timeout(Duration::from_secs(5), res.text()).await.unwrap().unwrap();
        assert!(text.contains("[DONE]"), "{text}");
    }
    let after = b.requests.load(Ordering::SeqCst);
    for _ in 0..4 {
        client.post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    }
    assert_eq!(b.requests.load(Ordering::SeqCst), after, "a removed worker gets no new requests");
    let missing = client.delete(format!("{}/workers/{encoded}", gw.admin_url())).send().await.unwrap();
    assert_eq!(missing.status(), 404);
    // An unencoded URL in the path works too.
    let res = client.delete(format!("{}/workers/{}", gw.admin_url(), a.url)).send().await.unwrap();
    assert_eq!(res.status(), 200);
    gw.shutdown().await;
}

async fn expect_error(res: reqwest::Response, status: u16, code: &str) {
    assert_eq!(res.status(), status);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(body["error"]["type"].is_string());
}

#[tokio::test]
async fn error_bodies_are_openai_style() {
    let m1 = upstream("a", "model-one").await;
    let m2 = upstream("b", "model-two").await;
    let mut cfg = config(vec![m1.url.clone(), m2.url.clone()]);
    cfg.max_payload_size = 1024;
    let gw = gateway(cfg).await;
    let client = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let send =
        |body: &'static str| client.post(&url).header("content-type", "application/json").body(body).send();
    expect_error(send("{not json").await.unwrap(), 400, "invalid_request").await;
    expect_error(send(r#"{"model": 5}"#).await.unwrap(), 400, "invalid_request").await;
    expect_error(send(r#"{"model":"model-one","stream":"yes"}"#).await.unwrap(), 400, "invalid_request")
        .await;
    expect_error(send(r#"{"model":"nope"}"#).await.unwrap(), 404, "model_not_found").await;
    // Several models and no model field: the client must say which.
    expect_error(send(r#"{"messages":[]}"#).await.unwrap(), 400, "invalid_request").await;
    let big = format!(r#"{{"model":"model-one","prompt":"{}"}}"#, "x".repeat(2048));
    expect_error(client.post(&url).body(big).send().await.unwrap(), 413, "payload_too_large").await;
    let ok = send(r#"{"model":"model-two","messages":[{"role":"user","content":"hi"}]}"#).await.unwrap();
    // A request with nothing to generate from is refused, naming what is missing.
    expect_error(send(r#"{"model":"model-two","messages":[]}"#).await.unwrap(), 400, "invalid_request").await;
    assert_eq!(ok.json::<Value>().await.unwrap()["worker"], "b");
    expect_error(client.get(format!("{}/nope", gw.url())).send().await.unwrap(), 404, "not_found").await;
    let models: Value =
        client.get(format!("{}/v1/models", gw.url())).send().await.unwrap().json().await.unwrap();
    let ids: Vec<_> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["model-one", "model-two"]);

    // No workers at all: 503.
    let empty = gateway(config(vec![])).await;
    let res = client.post(format!("{}/v1/completions", empty.url())).json(&chat("m")).send().await.unwrap();
    expect_error(res, 503, "no_healthy_worker").await;
    assert_eq!(client.get(format!("{}/readiness", empty.url())).send().await.unwrap().status(), 503);
    assert_eq!(client.get(format!("{}/health", empty.url())).send().await.unwrap().status(), 200);
    gw.shutdown().await;
    empty.shutdown().await;
}

#[tokio::test]
async fn single_model_pool_takes_missing_or_unknown_model() {
    let up = upstream("a", "only").await;
    let gw = gateway(config(vec![up.url.clone()])).await;
    let messages = json!([{"role": "user", "content": "hi"}]);
    for body in [json!({"messages": messages}), json!({"model": "whatever", "messages": messages})] {
        let res =
            client().post(format!("{}/v1/chat/completions", gw.url())).json(&body).send().await.unwrap();
        assert_eq!(res.status(), 200, "{body}");
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn admin_api_requires_the_key() {
    let up = upstream("a", "m").await;
    let mut cfg = config(vec![up.url.clone()]);
    cfg.admin_api_key = Some("s3cret".into());
    cfg.api_key = Some("worker-key".into());
    let gw = gateway(cfg).await;
    let client = client();
    let workers = format!("{}/workers", gw.admin_url());
    expect_error(client.get(&workers).send().await.unwrap(), 401, "invalid_api_key").await;
    expect_error(client.get(&workers).bearer_auth("wrong").send().await.unwrap(), 401, "invalid_api_key")
        .await;
    expect_error(
        client.post(&workers).json(&json!({"url": "http://127.0.0.1:9"})).send().await.unwrap(),
        401,
        "invalid_api_key",
    )
    .await;
    expect_error(client.delete(format!("{workers}/x")).send().await.unwrap(), 401, "invalid_api_key").await;
    assert_eq!(client.get(&workers).bearer_auth("s3cret").send().await.unwrap().status(), 200);
    // Proxied requests are not admin requests, and carry the worker key upstream.
    let res = client.post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(up.last_auth.lock().unwrap().as_deref(), Some("Bearer worker-key"));
    gw.shutdown().await;
}

#[tokio::test]
async fn upstream_timeout_is_504() {
    let slow = upstream("slow", "m").await;
    slow.delay_ms.store(2000, Ordering::SeqCst);
    let mut cfg = config(vec![slow.url.clone()]);
    cfg.request_timeout_secs = 0.2;
    let gw = gateway(cfg).await;
    let res =
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    expect_error(res, 504, "upstream_timeout").await;
    gw.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_lets_in_flight_requests_finish() {
    let up = upstream("a", "m").await;
    up.delay_ms.store(300, Ordering::SeqCst);
    let gw = gateway(config(vec![up.url.clone()])).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let pending = tokio::spawn(async move { client().post(url).json(&chat("m")).send().await });
    assert!(
        eventually(5.0, async || up.requests.load(Ordering::SeqCst) == 1).await,
        "the request is in flight"
    );
    gw.shutdown().await;
    let res = pending.await.unwrap().unwrap();
    assert_eq!(res.status(), 200);
}

#[tokio::test]
async fn metrics_cover_requests_latency_and_decisions() {
    let up = upstream("a", "m").await;
    let gw = gateway(config(vec![up.url.clone()])).await;
    let client = client();
    client
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat("m"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    client.post(format!("{}/v1/chat/completions", gw.url())).body("{").send().await.unwrap();
    let text = client.get(format!("{}/metrics", gw.url())).send().await.unwrap().text().await.unwrap();
    for needle in [
        format!(
            "kvgate_requests_total{{endpoint=\"chat_completions\",status=\"200\",worker=\"{}\"}} 1",
            up.url
        ),
        "kvgate_requests_total{endpoint=\"chat_completions\",status=\"400\",worker=\"none\"} 1".to_string(),
        "kvgate_request_ttfb_seconds_count{endpoint=\"chat_completions\"} 1".to_string(),
        "kvgate_request_duration_seconds_count{endpoint=\"chat_completions\"} 1".to_string(),
        format!("kvgate_worker_in_flight{{worker=\"{}\"}} 0", up.url),
        format!("kvgate_worker_healthy{{worker=\"{}\"}} 1", up.url),
        format!("kvgate_worker_circuit_state{{worker=\"{}\"}} 0", up.url),
        "kvgate_routing_decisions_total{index=\"none\",model=\"m\",reason=\"round_robin\"} 1".to_string(),
    ] {
        assert!(text.contains(&needle), "missing {needle} in\n{text}");
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn cache_aware_is_the_default_and_keeps_a_conversation_on_one_worker() {
    let ups = [upstream("a", "m").await, upstream("b", "m").await, upstream("c", "m").await];
    let mut cfg = config(ups.iter().map(|u| u.url.clone()).collect());
    cfg.routing = kvgate_policy::PolicyConfig::default();
    cfg.expose_routing_headers = true;
    let gw = gateway(cfg).await;
    let client = client();
    let mut messages =
        vec![json!({"role": "system", "content": "You are a terse assistant who answers in one line."})];
    let mut workers = Vec::new();
    let mut routes = Vec::new();
    for turn in 0..5 {
        messages.push(json!({"role": "user", "content": format!("question number {turn}")}));
        let res = client
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&json!({"model": "m", "messages": messages}))
            .send()
            .await
            .unwrap();
        workers.push(res.headers()["x-kvgate-worker"].to_str().unwrap().to_string());
        routes.push(res.headers()["x-kvgate-route"].to_str().unwrap().to_string());
        messages.push(json!({"role": "assistant", "content": "an answer"}));
    }
    assert!(workers.iter().all(|w| w == &workers[0]), "{workers:?}");
    assert_eq!(routes, ["cache_miss", "cache_hit", "cache_hit", "cache_hit", "cache_hit"]);
    let text = client.get(format!("{}/metrics", gw.url())).send().await.unwrap().text().await.unwrap();
    for needle in [
        "kvgate_routing_decisions_total{index=\"approximate\",model=\"m\",reason=\"cache_hit\"} 4",
        "kvgate_routing_decisions_total{index=\"approximate\",model=\"m\",reason=\"cache_miss\"} 1",
        "kvgate_prefix_match_rate_count{kind=\"best\",model=\"m\"} 5",
        "kvgate_prefix_match_rate_count{kind=\"chosen\",model=\"m\"} 5",
    ] {
        assert!(text.contains(needle), "missing {needle}");
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn over_the_concurrency_limit_is_429_and_slots_are_returned() {
    let up = upstream("a", "m").await;
    up.hold_stream.store(true, Ordering::SeqCst);
    let mut cfg = config(vec![up.url.clone()]);
    cfg.max_concurrent_requests = Some(1);
    let gw = gateway(cfg).await;
    let client = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let held = client
        .post(&url)
        .json(&json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    expect_error(client.post(&url).json(&chat("m")).send().await.unwrap(), 429, "too_many_requests").await;
    up.release.notify_one();
    held.text().await.unwrap();
    // The slot is free again once the streamed body ended.
    assert!(
        eventually(5.0, async || client.post(&url).json(&chat("m")).send().await.unwrap().status() == 200)
            .await
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn every_worker_unreachable_is_502_after_trying_each_once() {
    let mut cfg = config(vec![]);
    cfg.disable_health_check = true;
    let gw = gateway(cfg).await;
    for _ in 0..3 {
        let res = client()
            .post(format!("{}/workers", gw.admin_url()))
            .json(&json!({"url": dead_url().await, "model_id": "m"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
    }
    let res =
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    expect_error(res, 502, "upstream_unreachable").await;
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("kvgate_retries_total{endpoint=\"chat_completions\"} 2"),
        "three workers, two retries"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_worker_that_starts_after_the_gateway_is_learned_and_used() {
    let url = dead_url().await;
    let gw = gateway(config(vec![url.clone()])).await;
    let res =
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 503, "nothing serves yet");
    let late = upstream_on("late", "m", url.trim_start_matches("http://")).await;
    let gw_url = gw.url();
    let admin = gw.admin_url();
    assert!(
        eventually(5.0, async || {
            client()
                .post(format!("{gw_url}/v1/chat/completions"))
                .json(&chat("m"))
                .send()
                .await
                .unwrap()
                .status()
                == 200
        })
        .await,
        "the health loop learns the model and the worker becomes routable"
    );
    assert!(late.requests.load(Ordering::SeqCst) >= 1);
    let workers: Value = client().get(format!("{admin}/workers")).send().await.unwrap().json().await.unwrap();
    assert_eq!(workers["workers"][0]["model_id"], "m");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_ends_the_request() {
    let up = upstream("a", "m").await;
    up.hold_stream.store(true, Ordering::SeqCst);
    let gw = gateway(config(vec![up.url.clone()])).await;
    let gw_url = gw.url();
    let admin = gw.admin_url();
    let in_flight = async || {
        let w: Value = client().get(format!("{admin}/workers")).send().await.unwrap().json().await.unwrap();
        w["workers"][0]["in_flight"].as_u64().unwrap()
    };
    let res = client()
        .post(format!("{gw_url}/v1/chat/completions"))
        .json(&json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let mut stream = res.bytes_stream();
    stream.next().await.unwrap().unwrap();
    assert_eq!(in_flight().await, 1);
    drop(stream); // the client goes away while the upstream is still streaming
    assert!(eventually(5.0, async || in_flight().await == 0).await, "in-flight count returns to 0");
    let metrics = client().get(format!("{gw_url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_request_duration_seconds_count{endpoint=\"chat_completions\"} 1"));
    up.release.notify_one();
    gw.shutdown().await;
}
