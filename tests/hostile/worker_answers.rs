//! Workers whose health, model and load endpoints answer without end: the gateway reads at most
//! `--max-probe-answer-bytes` of each answer, counts it, and keeps no more in memory (before the
//! bound, a `/v1/models` answer took the gateway from 27 MB to 4.1 GB).

use std::sync::atomic::Ordering;

use kvgate_policy::PolicyKind;
use serde_json::json;

use crate::common::{client, config, gateway, healthy, json_answer, wait_metric, workers};
use crate::flood::flood;

/// What the hostile worker would send (bounded so the test is); the gateway stops far earlier.
const FLOOD: usize = 256 << 20;
const BOUND: usize = 64 << 10;
/// The bound plus loopback socket buffers: what a worker can push before the gateway drops it.
const SENT_AT_MOST: usize = 32 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_model_and_health_answers_are_cut_at_the_bound() {
    let hostile = flood("m", &["/v1/models", "/health"], false, FLOOD).await;
    let mut cfg = config(Vec::new());
    cfg.max_probe_answer_bytes = BOUND;
    let gw = gateway(cfg).await;
    let res =
        client().post(format!("{}/workers", gw.admin_url())).json(&json!({"url": hostile.url})).send().await;
    assert_eq!(res.unwrap().status(), 201, "registered; its model is retried by the health loop");
    assert!(wait_metric(&gw, "kvgate_oversized_answers_total{source=\"models\"}", 2.0).await >= 2.0);
    assert!(wait_metric(&gw, "kvgate_oversized_answers_total{source=\"health\"}", 2.0).await >= 2.0);
    let worker = workers(&gw).await[0].clone();
    assert!(
        worker["model_id"].is_null() && !healthy(&worker),
        "nothing learned from an oversized answer: {worker}"
    );
    let sent = hostile.sent.load(Ordering::Relaxed);
    assert!(sent < SENT_AT_MOST, "the worker pushed {sent} bytes: the gateway kept reading");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_load_answers_are_cut_at_the_bound() {
    let hostile = flood("m", &["/v1/loads", "/metrics"], false, FLOOD).await;
    let mut cfg = config(vec![hostile.url.clone()]);
    cfg.max_probe_answer_bytes = BOUND;
    cfg.routing.policy = PolicyKind::LeastLoad; // a policy that reads loads: the monitor polls
    cfg.load_monitor_interval_ms = 50;
    let gw = gateway(cfg).await;
    assert!(wait_metric(&gw, "kvgate_oversized_answers_total{source=\"loads\"}", 4.0).await >= 4.0);
    let sent = hostile.sent.load(Ordering::Relaxed);
    assert!(sent < SENT_AT_MOST * 4, "the worker pushed {sent} bytes: the gateway kept reading");
    let loads = json_answer(client().get(format!("{}/get_loads", gw.url()))).await;
    assert_eq!(loads["loads"], json!([]), "no sample from an oversized answer");
    // The worker stays routable: its loads are unknown, not its health.
    let res = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&crate::common::chat("m"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_prefill_answer_is_cut_at_the_bound() {
    for protocol in [kvgate_gateway::PdProtocol::Vllm, kvgate_gateway::PdProtocol::Sglang] {
        let prefill = flood("m", &[], true, FLOOD).await;
        let decode = crate::common::upstream("decode", "m").await;
        let mut cfg = config(Vec::new());
        cfg.pd_disaggregation = true;
        cfg.pd_protocol = protocol;
        cfg.prefill = vec![prefill.url.clone()];
        cfg.decode = vec![decode.url.clone()];
        cfg.max_prefill_answer_bytes = BOUND;
        let gw = gateway(cfg).await;
        let res = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&crate::common::chat("m"))
            .send()
            .await
            .unwrap();
        // vLLM: the prefill answer never yields its kv_transfer_params (502, no other prefill
        // worker); SGLang: the decode side's answer is the client's, the prefill one is drained.
        let expected = if protocol == kvgate_gateway::PdProtocol::Vllm { 502 } else { 200 };
        assert_eq!(res.status(), expected, "{protocol:?}");
        let _ = res.bytes().await;
        let oversized = "kvgate_oversized_answers_total{source=\"prefill\"}";
        assert_eq!(wait_metric(&gw, oversized, 1.0).await, 1.0, "{protocol:?}");
        let sent = prefill.sent.load(Ordering::Relaxed);
        assert!(sent < SENT_AT_MOST, "{protocol:?}: the prefill worker pushed {sent} bytes");
        gw.shutdown().await;
    }
}
