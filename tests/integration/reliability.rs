//! Reliability and hostile input through the gateway, against loopback upstreams: routing loops,
//! admission (queue, rate limit), slow workers, circuit recovery by probing, slow and malformed
//! clients, credentials in worker URLs. Every wait is bounded.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn add_worker(gw: &kvgate_gateway::GatewayHandle, body: Value) -> (u16, Value) {
    let res = client().post(format!("{}/workers", gw.admin_url())).json(&body).send().await.unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn routing_loops_are_refused() {
    let gw1 = gateway(config(Vec::new())).await;
    // Its own address, however spelled, is not a worker.
    let port = gw1.addr.port();
    for url in [gw1.url(), format!("http://localhost:{port}"), format!("HTTP://127.0.0.1:{port}/")] {
        let (status, body) = add_worker(&gw1, json!({"url": url, "model_id": "m"})).await;
        assert_eq!(status, 400, "{url}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("own address"), "{body}");
    }
    // A loop through another gateway: the request comes back and is refused with 508.
    let gw2 = gateway(config(Vec::new())).await;
    assert_eq!(add_worker(&gw2, json!({"url": gw1.url(), "model_id": "m"})).await.0, 201);
    assert_eq!(add_worker(&gw1, json!({"url": gw2.url(), "model_id": "m"})).await.0, 201);
    let started = Instant::now();
    let res =
        client().post(format!("{}/v1/chat/completions", gw1.url())).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 508);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], "loop_detected", "{body}");
    assert!(started.elapsed() < Duration::from_secs(5), "refused at once, no descriptor storm");
    gw1.shutdown().await;
    gw2.shutdown().await;
}

#[tokio::test]
async fn worker_urls_with_credentials_or_bad_ports_are_refused_and_duplicates_are_found() {
    let up = upstream("a", "m").await;
    let gw = gateway(config(Vec::new())).await;
    let port = up.addr.port();
    let (status, body) =
        add_worker(&gw, json!({"url": format!("http://user:hunter2@127.0.0.1:{port}")})).await;
    assert_eq!(status, 400);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("credentials") && !message.contains("hunter2"), "{message}");
    for bad in ["http://127.0.0.1:99999", "http://", "ftp://127.0.0.1:1", "127.0.0.1:1"] {
        assert_eq!(add_worker(&gw, json!({"url": bad})).await.0, 400, "{bad}");
    }
    assert_eq!(add_worker(&gw, json!({"url": format!("http://127.0.0.1:{port}")})).await.0, 201);
    // The same worker, spelled differently, is a duplicate.
    assert_eq!(add_worker(&gw, json!({"url": format!("HTTP://127.0.0.1:{port}/")})).await.0, 409);
    let workers: Value =
        client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(workers["workers"].as_array().unwrap().len(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_bounded_queue_waits_for_a_slot_then_refuses() {
    let up = upstream("a", "m").await;
    up.hold_stream.store(true, Ordering::SeqCst);
    let mut cfg = config(vec![up.url.clone()]);
    cfg.max_concurrent_requests = Some(1);
    cfg.queue_size = 1;
    cfg.queue_timeout_secs = 0.5;
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let mut streaming = chat("m");
    streaming["stream"] = json!(true);
    let held = client().post(&url).json(&streaming).send().await.unwrap();
    assert_eq!(held.status(), 200);
    // The second waits in the queue; the third finds it full.
    let waiting = tokio::spawn({
        let (url, body) = (url.clone(), chat("m"));
        async move { client().post(url).json(&body).send().await.unwrap() }
    });
    assert!(metric_line_appears(&gw, "kvgate_queue_depth 1").await, "the second request is queued");
    let full = client().post(&url).json(&chat("m")).send().await.unwrap();
    assert_eq!(full.status(), 429);
    // Nobody leaves within the queue timeout: 408.
    let timed_out = tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap();
    assert_eq!(timed_out.status(), 408);
    assert_eq!(timed_out.json::<Value>().await.unwrap()["error"]["code"], "queue_timeout");
    // A queued request is admitted as soon as the slot frees.
    let waiting = tokio::spawn({
        let (url, body) = (url.clone(), chat("m"));
        async move { client().post(url).json(&body).send().await.unwrap() }
    });
    assert!(metric_line_appears(&gw, "kvgate_queue_depth 1").await, "the request is queued");
    up.release.notify_one();
    let _ = held.text().await;
    let admitted = tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap();
    assert_eq!(admitted.status(), 200);
    let metrics = metrics_text(&gw).await;
    assert!(metrics.contains(r#"kvgate_admission_rejected_total{reason="queue_full"} 1"#), "{metrics}");
    assert!(metrics.contains(r#"kvgate_admission_rejected_total{reason="queue_timeout"} 1"#));
    gw.shutdown().await;
}

#[tokio::test]
async fn the_rate_limit_refuses_past_its_burst_or_spaces_requests_out() {
    let up = upstream("a", "m").await;
    let mut cfg = config(vec![up.url.clone()]);
    // One request every 5 s, a burst of one (the bucket holds at least one token; the burst of
    // one second's worth is `bucket.rs`'s test, in injected time): the refusal holds however
    // slowly a loaded machine sends the two (at 2/s, three requests took over 0.5 s under CI-like
    // contention and the third was admitted).
    cfg.rate_limit_tokens_per_second = Some(0.2);
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let mut statuses = Vec::new();
    for _ in 0..2 {
        statuses.push(client().post(&url).json(&chat("m")).send().await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 429], "a burst of one, then refused");
    gw.shutdown().await;

    // With a queue, the same burst is spaced out instead.
    let mut cfg = config(vec![up.url.clone()]);
    cfg.rate_limit_tokens_per_second = Some(10.0);
    cfg.queue_size = 100;
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let started = Instant::now();
    let sends: Vec<_> = (0..15)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { client().post(url).json(&chat("m")).send().await.unwrap().status() })
        })
        .collect();
    for send in sends {
        assert_eq!(send.await.unwrap(), 200);
    }
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(400), "15 requests at 10/s after a burst of 10: {elapsed:?}");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_worker_that_sends_no_head_in_time_is_replaced() {
    let slow = upstream("slow", "m").await;
    let fast = upstream("fast", "m").await;
    slow.delay_ms.store(10_000, Ordering::SeqCst);
    let mut cfg = config(vec![slow.url.clone(), fast.url.clone()]);
    cfg.ttfb_timeout_secs = Some(0.3);
    let gw = gateway(cfg).await;
    for _ in 0..4 {
        let started = Instant::now();
        let res =
            client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.json::<Value>().await.unwrap()["worker"], "fast");
        assert!(started.elapsed() < Duration::from_secs(3));
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_half_open_worker_is_probed_back_to_closed() {
    let up = upstream("a", "m").await;
    up.status.store(500, Ordering::SeqCst);
    let mut cfg = config(vec![up.url.clone()]);
    cfg.cb_failure_threshold = 1;
    cfg.cb_timeout_duration_secs = 0.2;
    let gw = gateway(cfg).await;
    let res =
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 500);
    let state = || async {
        let workers: Value =
            client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
        workers["workers"][0]["circuit_state"].as_str().unwrap().to_string()
    };
    assert_eq!(state().await, "open");
    up.status.store(200, Ordering::SeqCst);
    // No request goes to it; the health loop's probe closes the circuit.
    assert!(eventually(5.0, async || state().await == "closed").await);
    assert_eq!(up.requests.load(Ordering::SeqCst), 1);
    gw.shutdown().await;
}

/// Sends raw bytes to the gateway and returns what it answered (until it closes or 5 s).
async fn raw(gw: &kvgate_gateway::GatewayHandle, request: &[u8]) -> String {
    let mut stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let _ = stream.write_all(request).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn hostile_bodies_get_clear_4xx_and_the_gateway_stays_healthy() {
    let up = upstream("a", "m").await;
    let mut cfg = config(vec![up.url.clone()]);
    cfg.body_read_timeout_secs = 0.3;
    cfg.max_payload_size = 64 * 1024;
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let nested = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_object = format!(r#"{{"model": "m", "messages": {}}}"#, "[".repeat(5_000));
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"{\"model\": \"m\", \"messages\": [".to_vec(), 400, "malformed"),
        (b"\xff\xfe\x00garbage".to_vec(), 400, "malformed"),
        (
            b"{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"\xff\"}]}".to_vec(),
            400,
            "malformed",
        ),
        (nested.clone().into_bytes(), 413, "exceeds the limit"),
        (deep_object.into_bytes(), 400, "`messages[0]"),
        (br#"{"model": "m", "messages": {"role": "user"}}"#.to_vec(), 400, "`messages`"),
        (br#"{"model": "m", "messages": []}"#.to_vec(), 400, "non-empty"),
        (br#"{"model": "m"}"#.to_vec(), 400, "messages"),
        (br#"[1, 2, 3]"#.to_vec(), 400, "JSON object"),
        (br#""just a string""#.to_vec(), 400, "JSON object"),
    ];
    for (body, status, says) in cases {
        let res = client()
            .post(&url)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(
            res.status().as_u16(),
            status,
            "{:?}",
            String::from_utf8_lossy(&body[..body.len().min(60)])
        );
        let error: Value = res.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{message}");
    }
    // A body that never finishes: 408 after the body timeout, not a held connection.
    let started = Instant::now();
    let answer = raw(
        &gw,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{\"model\"",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(3));
    // Huge headers are refused by the HTTP layer; the gateway keeps serving.
    let huge =
        format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(1 << 20));
    let answer = raw(&gw, huge.as_bytes()).await;
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 4"), "{answer}");
    // An unknown model with one model served is routed to it (by design); the gateway is healthy.
    let res = client()
        .post(&url)
        .json(&json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(client().get(format!("{}/health", gw.url())).send().await.unwrap().status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn client_api_keys_guard_the_inference_endpoints_and_are_not_forwarded() {
    let up = upstream("a", "m").await;
    let mut cfg = config(vec![up.url.clone()]);
    cfg.client_api_keys = vec!["alpha".into(), "beta".into()];
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let send = |key: Option<&'static str>| {
        let mut request = client().post(&url).json(&chat("m"));
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        request.send()
    };
    for key in [None, Some("gamma"), Some("alph")] {
        let res = send(key).await.unwrap();
        assert_eq!(res.status(), 401, "{key:?}");
        assert_eq!(res.json::<Value>().await.unwrap()["error"]["code"], "invalid_api_key");
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 0);
    assert_eq!(send(Some("beta")).await.unwrap().status(), 200);
    assert_eq!(*up.last_auth.lock().unwrap(), None, "the client's key stays at the gateway");
    // The gateway's own endpoints are not inference endpoints.
    assert_eq!(client().get(format!("{}/health", gw.url())).send().await.unwrap().status(), 200);
    gw.shutdown().await;
}
