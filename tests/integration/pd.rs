//! Prefill/decode disaggregation through the gateway, against loopback test upstreams playing
//! prefill and decode engines: the SGLang bootstrap fields, vLLM's two steps, retries as a new
//! pair, a decode stream breaking, per-side policies and load snapshots, per-role metrics.

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvgate_gateway::{GatewayConfig, PdProtocol};
use kvgate_policy::{PolicyConfig, PolicyKind};
use serde_json::{json, Value};

/// A PD gateway config: `prefill` (URL, bootstrap port) and `decode` URLs.
pub(crate) fn pd_config(
    prefill: &[(&Arc<Upstream>, Option<u16>)],
    decode: &[&Arc<Upstream>],
    protocol: PdProtocol,
) -> GatewayConfig {
    let mut cfg = config(Vec::new());
    cfg.pd_disaggregation = true;
    cfg.pd_protocol = protocol;
    cfg.expose_routing_headers = true;
    for (up, port) in prefill {
        cfg.prefill.push(up.url.clone());
        if let Some(port) = port {
            cfg.prefill.push(port.to_string());
        }
    }
    cfg.decode = decode.iter().map(|up| up.url.clone()).collect();
    cfg
}

pub(crate) async fn post(gw: &kvgate_gateway::GatewayHandle, body: &Value) -> reqwest::Response {
    client().post(format!("{}/v1/chat/completions", gw.url())).json(body).send().await.unwrap()
}

pub(crate) fn last_body(up: &Upstream) -> Value {
    up.bodies.lock().unwrap().last().cloned().expect("the upstream saw a request")
}

#[tokio::test]
async fn sglang_both_sides_see_the_same_room_and_the_decode_answer_streams_back() {
    let p = upstream("p", "m").await;
    let d = upstream("d", "m").await;
    let gw = gateway(pd_config(&[(&p, Some(8998))], &[&d], PdProtocol::Sglang)).await;

    let response = post(&gw, &chat("m")).await;
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    assert_eq!(headers["x-kvgate-worker"], d.url.as_str());
    assert_eq!(headers["x-kvgate-prefill-worker"], p.url.as_str());
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["worker"], "d", "the client gets the decode side's answer");
    let (pb, db) = (last_body(&p), last_body(&d));
    assert_eq!(pb, db, "both sides get the same request");
    assert_eq!(pb["bootstrap_host"], "127.0.0.1");
    assert_eq!(pb["bootstrap_port"], 8998);
    assert!(pb["bootstrap_room"].as_u64().is_some_and(|room| room <= i64::MAX as u64), "{pb}");
    assert_eq!(pb["messages"], chat("m")["messages"], "the request itself is untouched");

    // A second request gets a new room; streaming passes the decode side's events through.
    let mut stream = chat("m");
    stream["stream"] = json!(true);
    let response = post(&gw, &stream).await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    assert!(text.contains(r#""worker":"d""#) && text.ends_with("data: [DONE]\n\n"), "{text}");
    let (pb2, db2) = (last_body(&p), last_body(&d));
    assert_eq!(pb2["bootstrap_room"], db2["bootstrap_room"]);
    assert_ne!(pb2["bootstrap_room"], pb["bootstrap_room"]);

    // Per-role metrics, and roles in GET /workers.
    let text = metrics_text(&gw).await;
    assert!(text.contains(r#"kvgate_pd_requests_total{role="prefill",status="200"} 2"#), "{text}");
    assert!(text.contains(r#"kvgate_pd_requests_total{role="decode",status="200"} 2"#), "{text}");
    assert!(text.contains(
        r#"kvgate_pd_decisions_total{index="none",model="m",path="pair",reason="round_robin",role="prefill"} 2"#
    ));
    let workers: Value =
        client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    let roles: Vec<(&str, &Value)> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["worker_type"].as_str().unwrap(), &w["bootstrap_port"]))
        .collect();
    assert_eq!(roles, [("prefill", &json!(8998)), ("decode", &Value::Null)]);
    gw.shutdown().await;
}

#[tokio::test]
async fn vllm_prefills_one_token_then_hands_its_transfer_params_to_the_decode_side() {
    let p = upstream("p", "m").await;
    let d = upstream("d", "m").await;
    let gw = gateway(pd_config(&[(&p, None)], &[&d], PdProtocol::Vllm)).await;
    let mut body = chat("m");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["max_tokens"] = json!(50);
    let response = post(&gw, &body).await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    assert!(text.contains(r#""worker":"d""#), "{text}");

    let pb = last_body(&p);
    assert_eq!((pb["max_tokens"].clone(), pb["stream"].clone()), (json!(1), json!(false)));
    assert!(pb.get("stream_options").is_none());
    assert_eq!(pb["kv_transfer_params"]["do_remote_decode"], true);
    let db = last_body(&d);
    assert_eq!((db["max_tokens"].clone(), db["stream"].clone()), (json!(50), json!(true)));
    assert_eq!(db["kv_transfer_params"]["remote_engine_id"], "p", "the prefill's answer, passed on");
    assert_eq!(db["kv_transfer_params"]["do_remote_prefill"], true);
    assert_eq!(db["kv_transfer_params"]["remote_request_id"], "p-1");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_failing_prefill_worker_gives_a_new_pair_and_never_leaves_the_decode_side_waiting() {
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        // A pool's workers are in URL order: the failing one is the one round_robin tries first.
        let (first, second) = (upstream("bad", "m").await, upstream("good", "m").await);
        let (bad, good) = if first.url < second.url { (first, second) } else { (second, first) };
        let d = upstream("d", "m").await;
        bad.status.store(503, Ordering::SeqCst);
        // The decode side takes a while (waiting for its KV).
        d.delay_ms.store(if protocol == PdProtocol::Sglang { 1_500 } else { 0 }, Ordering::SeqCst);
        let mut cfg = pd_config(&[(&bad, None), (&good, None)], &[&d], protocol);
        cfg.disable_circuit_breaker = true;
        let gw = gateway(cfg).await;
        if protocol == PdProtocol::Sglang {
            // The first pair's prefill fails at once: the gateway cancels the waiting decode
            // request and answers from a new pair.
            let started = Instant::now();
            let pending = tokio::spawn({
                let url = gw.url();
                async move { client().post(format!("{url}/v1/chat/completions")).json(&chat("m")).send().await }
            });
            assert!(eventually(5.0, async || bad.requests.load(Ordering::SeqCst) >= 1).await);
            assert!(eventually(5.0, async || good.requests.load(Ordering::SeqCst) >= 1).await);
            // The first decode request was dropped when its prefill failed: at most the second
            // one is still waiting.
            assert!(d.active.load(Ordering::SeqCst) <= 1, "the failed pair's decode request was cancelled");
            let response =
                tokio::time::timeout(Duration::from_secs(10), pending).await.unwrap().unwrap().unwrap();
            assert_eq!(response.status(), 200);
            assert_eq!(response.headers()["x-kvgate-prefill-worker"], good.url.as_str());
            assert!(started.elapsed() < Duration::from_secs(10));
            d.delay_ms.store(0, Ordering::SeqCst);
        } else {
            for _ in 0..4 {
                let response = post(&gw, &chat("m")).await;
                assert_eq!(response.status(), 200);
                assert_eq!(response.headers()["x-kvgate-prefill-worker"], good.url.as_str());
            }
        }
        assert!(eventually(5.0, async || d.active.load(Ordering::SeqCst) == 0).await, "{protocol:?}");

        // Every prefill worker failing: a clean error, and no decode request left behind.
        good.status.store(500, Ordering::SeqCst);
        let response = post(&gw, &chat("m")).await;
        assert!(response.status().is_server_error(), "{protocol:?}: {}", response.status());
        let error: Value = response.json().await.unwrap();
        assert!(error["error"]["message"].as_str().is_some(), "{error}");
        assert!(eventually(5.0, async || d.active.load(Ordering::SeqCst) == 0).await, "{protocol:?}");
        let text = metrics_text(&gw).await;
        assert!(text.contains(r#"kvgate_pd_requests_total{role="prefill",status="503"}"#), "{text}");
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn a_failing_decode_worker_is_retried_on_another() {
    let p = upstream("p", "m").await;
    let bad = upstream("bad", "m").await;
    let good = upstream("good", "m").await;
    bad.status.store(502, Ordering::SeqCst);
    let mut cfg = pd_config(&[(&p, None)], &[&bad, &good], PdProtocol::Sglang);
    cfg.disable_circuit_breaker = true;
    let gw = gateway(cfg).await;
    for _ in 0..4 {
        let response = post(&gw, &chat("m")).await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-kvgate-worker"], good.url.as_str());
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_decode_worker_dying_mid_stream_ends_the_stream_with_an_error() {
    let p = upstream("p", "m").await;
    let d = upstream("d", "m").await;
    d.cut_stream.store(true, Ordering::SeqCst);
    let gw = gateway(pd_config(&[(&p, None)], &[&d], PdProtocol::Sglang)).await;
    let mut body = chat("m");
    body["stream"] = json!(true);
    let mut response = post(&gw, &body).await;
    assert_eq!(response.status(), 200);
    let mut received = Vec::new();
    let ended = loop {
        match response.chunk().await {
            Ok(Some(chunk)) => received.extend_from_slice(&chunk),
            Ok(None) => break "clean end",
            Err(_) => break "error",
        }
    };
    let text = String::from_utf8_lossy(&received);
    assert!(text.contains(r#""worker":"d""#), "the first event arrived: {text}");
    assert!(
        text.contains("upstream_stream_broken") && text.contains(&d.url),
        "an error event names the worker: {text}"
    );
    assert!(!text.contains("[DONE]"), "no client takes the answer as complete: {text}");
    assert_eq!(ended, "error", "the connection is cut too, so no HTTP client takes it as complete");
    gw.shutdown().await;
}

#[tokio::test]
async fn each_side_has_its_own_policy_and_the_prefill_overload_trigger_reads_the_prefill_engines() {
    let hot = upstream("hot", "m").await;
    let cold = upstream("cold", "m").await;
    let d1 = upstream("d1", "m").await;
    let d2 = upstream("d2", "m").await;
    *hot.loads_body.lock().unwrap() = sglang_loads(0.95, 4, 0);
    *cold.loads_body.lock().unwrap() = sglang_loads(0.10, 4, 0);
    // The decode engines are both hot: were the prefill side reading them, nothing would move.
    for d in [&d1, &d2] {
        *d.loads_body.lock().unwrap() = sglang_loads(0.97, 4, 0);
    }
    let mut cfg = pd_config(&[(&hot, None), (&cold, None)], &[&d1, &d2], PdProtocol::Sglang);
    cfg.routing = PolicyConfig { overload_token_usage_threshold: 0.9, ..PolicyConfig::default() };
    cfg.prefill_policy = Some(PolicyKind::CacheAware);
    cfg.decode_policy = Some(PolicyKind::RoundRobin);
    // Samples go stale after three intervals and a stale one never drives the KV terms: at 50 ms
    // a loaded machine (CI's 2 cores) let them age past 150 ms before the requests were routed.
    cfg.load_monitor_interval_ms = 1000;
    let gw = gateway(cfg).await;
    let gw_url = gw.url();
    assert!(
        eventually(5.0, async || {
            let body: Value =
                client().get(format!("{gw_url}/get_loads")).send().await.unwrap().json().await.unwrap();
            body["loads"].as_array().is_some_and(|l| l.len() == 4)
        })
        .await
    );
    let mut decode_workers = std::collections::BTreeSet::new();
    for i in 0..4 {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": format!("question {i} {}", "x ".repeat(50))}]});
        let response = post(&gw, &body).await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-kvgate-prefill-worker"], cold.url.as_str());
        assert_eq!(response.headers()["x-kvgate-prefill-route"], "imbalance_overload");
        assert_eq!(response.headers()["x-kvgate-route"], "round_robin");
        decode_workers.insert(response.headers()["x-kvgate-worker"].to_str().unwrap().to_string());
    }
    assert_eq!(decode_workers.len(), 2, "the decode side's round_robin spreads");
    assert_eq!(hot.requests.load(Ordering::SeqCst), 0);
    let text = metrics_text(&gw).await;
    assert!(text.contains(r#"kvgate_pd_decisions_total{index="approximate",model="m",path="pair",reason="imbalance_overload",role="prefill"} 4"#), "{text}");
    assert!(
        text.contains(
            r#"kvgate_pd_decisions_total{index="none",model="m",path="pair",reason="round_robin",role="decode"} 4"#
        ),
        "{text}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn workers_register_with_a_role_at_run_time() {
    let p = upstream("p", "m").await;
    let d = upstream("d", "m").await;
    let mut cfg = config(Vec::new());
    cfg.pd_disaggregation = true;
    let gw = gateway(cfg).await;
    let add = |body: Value| {
        let url = format!("{}/workers", gw.admin_url());
        async move { client().post(url).json(&body).send().await.unwrap() }
    };
    // Only a prefill side: no pair yet.
    let r = add(json!({"url": p.url, "worker_type": "prefill", "bootstrap_port": 9001})).await;
    assert_eq!(r.status(), 201);
    let response = post(&gw, &chat("m")).await;
    assert_eq!(response.status(), 503);
    let error: Value = response.json().await.unwrap();
    assert!(error["error"]["message"].as_str().unwrap().contains("decode workers"), "{error}");
    assert_eq!(add(json!({"url": d.url, "worker_type": "decode"})).await.status(), 201);
    let response = post(&gw, &chat("m")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(last_body(&d)["bootstrap_port"], 9001);
    // A bootstrap port on a decode worker, or an unknown role, is refused.
    let other = upstream("o", "m").await;
    assert_eq!(
        add(json!({"url": other.url, "worker_type": "decode", "bootstrap_port": 1})).await.status(),
        400
    );
    assert_eq!(add(json!({"url": other.url, "worker_type": "router"})).await.status(), 400);
    gw.shutdown().await;

    // A gateway not started for PD refuses roles.
    let gw = gateway(config(Vec::new())).await;
    let response = client()
        .post(format!("{}/workers", gw.admin_url()))
        .json(&json!({"url": other.url, "worker_type": "prefill"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    gw.shutdown().await;
}

// ---- With simulated PD engines (`kvgate mock --role prefill|decode`) ----

#[tokio::test]
async fn simulated_pd_engines_answer_through_the_gateway_in_both_protocols() {
    use kvgate_mock::WorkerRole;
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let prefill = pd_fleet(WorkerRole::Prefill, 2, |_| {}).await;
        let decode = pd_fleet(WorkerRole::Decode, 2, |_| {}).await;
        let gw = gateway(pd_mock_config(&[&prefill], &decode, protocol)).await;
        let body = json!({"model": "mock-model", "max_tokens": 6, "messages": [{"role": "user", "content": "one two three four"}]});
        let response = post(&gw, &body).await;
        assert_eq!(response.status(), 200, "{protocol:?}");
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["usage"]["completion_tokens"], 6, "{protocol:?}: {answer}");
        // Streamed: every token from the decode engine, then [DONE].
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let text = post(&gw, &streamed).await.text().await.unwrap();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{protocol:?}: {text}");
        assert_eq!(text.matches("\"content\":").count(), 6, "{protocol:?}: {text}");
        gw.shutdown().await;
        prefill.shutdown().await;
        decode.shutdown().await;
    }
}

#[tokio::test]
async fn a_failing_simulated_prefill_engine_is_replaced_and_a_dying_decode_ends_the_stream() {
    use kvgate_mock::WorkerRole;
    let failing = pd_fleet(WorkerRole::Prefill, 1, |args| args.fail_rate = 1.0).await;
    let working = pd_fleet(WorkerRole::Prefill, 1, |_| {}).await;
    let decode = pd_fleet(WorkerRole::Decode, 1, |_| {}).await;
    let mut cfg = pd_mock_config(&[&failing, &working], &decode, PdProtocol::Sglang);
    cfg.disable_circuit_breaker = true;
    let gw = gateway(cfg).await;
    let body = json!({"model": "mock-model", "max_tokens": 4, "messages": [{"role": "user", "content": "retry me"}]});
    for _ in 0..4 {
        let started = Instant::now();
        let response = post(&gw, &body).await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-kvgate-prefill-worker"], working.urls()[0].as_str());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the failed pair's decode side did not hold it up"
        );
    }
    gw.shutdown().await;

    let cutting = pd_fleet(WorkerRole::Decode, 1, |args| args.cut_stream_rate = 1.0).await;
    let gw = gateway(pd_mock_config(&[&working], &cutting, PdProtocol::Sglang)).await;
    let mut streamed = json!({"model": "mock-model", "max_tokens": 64, "stream": true, "messages": [{"role": "user", "content": "cut"}]});
    streamed["ignore_eos"] = json!(true);
    let mut response = post(&gw, &streamed).await;
    assert_eq!(response.status(), 200);
    let mut received = Vec::new();
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => received.extend_from_slice(&chunk),
                Ok(None) => return "end",
                Err(_) => return "error",
            }
        }
    })
    .await
    .expect("the stream ends, never hangs");
    let text = String::from_utf8_lossy(&received);
    assert!(text.contains("upstream_stream_broken") && !text.contains("[DONE]"), "{text}");
    assert_eq!(outcome, "error");
    gw.shutdown().await;
    for fleet in [failing, working, decode, cutting] {
        fleet.shutdown().await;
    }
}
