//! Kubernetes service discovery against a mocked API server on 127.0.0.1: Ready pods join and
//! receive requests, pods that turn not Ready or are deleted leave without dropping a request
//! in flight on them, and a broken watch re-lists without losing workers.

#[path = "../common/mod.rs"]
mod common;
mod kube_api;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::*;
use kube_api::{pod, KubeApi};
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use serde_json::{json, Value};

fn discovery_config(api: &KubeApi, name: &str) -> GatewayConfig {
    GatewayConfig {
        service_discovery: true,
        selector: vec!["app=engine".into()],
        service_discovery_namespace: Some("ns".into()),
        service_discovery_kubeconfig: Some(kube_api::kubeconfig(api, name)),
        ..config(Vec::new())
    }
}

async fn worker_urls(gw: &GatewayHandle) -> Vec<String> {
    let body: Value =
        client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    let mut urls: Vec<String> =
        body["workers"].as_array().unwrap().iter().map(|w| w["url"].as_str().unwrap().to_string()).collect();
    urls.sort();
    urls
}

async fn has_workers(gw: &GatewayHandle, expected: &[&Arc<Upstream>]) -> bool {
    let mut want: Vec<String> = expected.iter().map(|u| u.url.clone()).collect();
    want.sort();
    worker_urls(gw).await == want
}

async fn send(gw: &GatewayHandle) -> reqwest::StatusCode {
    client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap().status()
}

#[tokio::test]
async fn ready_pods_join_and_leave_without_dropping_requests_in_flight() {
    let api = kube_api::start().await;
    let (a, b) = (upstream("a", "m").await, upstream("b", "m").await);
    let labels = json!({"app": "engine"});
    api.put(pod("a", labels.clone(), a.addr.port(), true));
    api.put(pod("b", labels.clone(), b.addr.port(), false));
    api.put(pod("other", json!({"app": "database"}), b.addr.port(), true));
    let gw = gateway(discovery_config(&api, "join")).await;

    assert!(eventually(10.0, async || has_workers(&gw, &[&a]).await).await, "the Ready pod joins");
    assert_eq!(send(&gw).await, 200);
    assert_eq!(a.requests.load(Ordering::SeqCst), 1);

    api.put(pod("b", labels.clone(), b.addr.port(), true));
    assert!(eventually(10.0, async || has_workers(&gw, &[&a, &b]).await).await, "b joins once Ready");
    for _ in 0..4 {
        assert_eq!(send(&gw).await, 200);
    }
    assert!(b.requests.load(Ordering::SeqCst) >= 1, "the new worker receives requests");

    // A request in flight on b when its pod turns not Ready still completes.
    a.delay_ms.store(0, Ordering::SeqCst);
    b.delay_ms.store(1500, Ordering::SeqCst);
    let before = b.requests.load(Ordering::SeqCst);
    let gw_url = gw.url();
    let mut in_flight = Vec::new();
    for _ in 0..2 {
        let url = gw_url.clone();
        in_flight.push(tokio::spawn(async move {
            client().post(format!("{url}/v1/chat/completions")).json(&chat("m")).send().await.unwrap()
        }));
    }
    assert!(eventually(5.0, async || b.active.load(Ordering::SeqCst) == 1).await, "one request waits on b");
    api.put(pod("b", labels.clone(), b.addr.port(), false));
    assert!(eventually(5.0, async || has_workers(&gw, &[&a]).await).await, "b leaves when not Ready");
    assert_eq!(b.active.load(Ordering::SeqCst), 1, "b's request is still running");
    for request in in_flight {
        let response = request.await.unwrap();
        assert_eq!(response.status(), 200);
        response.text().await.expect("the whole answer arrives");
    }
    assert_eq!(b.requests.load(Ordering::SeqCst), before + 1);
    for _ in 0..3 {
        assert_eq!(send(&gw).await, 200);
    }
    assert_eq!(b.requests.load(Ordering::SeqCst), before + 1, "a worker that left gets no requests");

    // Deleted pods leave; the metrics count joins and leaves.
    api.put(pod("b", labels.clone(), b.addr.port(), true));
    assert!(eventually(10.0, async || has_workers(&gw, &[&a, &b]).await).await);
    api.delete("a");
    assert!(eventually(5.0, async || has_workers(&gw, &[&b]).await).await, "a leaves when deleted");
    // A join or leave is counted just after the registry changed: wait for the count too.
    let counted = eventually(5.0, async || {
        metric(&metrics_text(&gw).await, "kvgate_discovery_events_total{event=\"joined\"}") >= 3.0
            && metric(&metrics_text(&gw).await, "kvgate_discovery_events_total{event=\"left\"}") >= 2.0
    });
    assert!(counted.await, "three joins and two leaves counted");
    assert_eq!(metric(&metrics_text(&gw).await, "kvgate_discovery_events_total{event=\"joined\"}"), 3.0);
    assert_eq!(metric(&metrics_text(&gw).await, "kvgate_discovery_events_total{event=\"left\"}"), 2.0);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_broken_watch_relists_without_losing_workers() {
    let api = kube_api::start().await;
    let ups = [upstream("a", "m").await, upstream("b", "m").await, upstream("c", "m").await];
    let labels = json!({"app": "engine"});
    for (name, up) in ["a", "b", "c"].iter().zip(&ups) {
        api.put(pod(name, labels.clone(), up.addr.port(), true));
    }
    let gw = gateway(discovery_config(&api, "relist")).await;
    assert!(eventually(10.0, async || has_workers(&gw, &[&ups[0], &ups[1], &ups[2]]).await).await);
    assert!(eventually(5.0, async || api.watches.load(Ordering::SeqCst) >= 1).await, "the watch is open");
    let lists = api.lists.load(Ordering::SeqCst);

    // The watch breaks and its version expires; meanwhile c is deleted and the event is lost.
    api.delete_silently("c");
    api.break_watches();
    assert!(
        eventually(10.0, async || api.lists.load(Ordering::SeqCst) > lists).await,
        "the watcher re-lists after 410 Gone"
    );
    assert!(
        eventually(5.0, async || has_workers(&gw, &[&ups[0], &ups[1]]).await).await,
        "the re-list settles: c leaves"
    );
    let left = eventually(5.0, async || {
        metric(&metrics_text(&gw).await, "kvgate_discovery_events_total{event=\"left\"}") >= 1.0
    });
    assert!(left.await, "c's leave counted");
    assert_eq!(
        metric(&metrics_text(&gw).await, "kvgate_discovery_events_total{event=\"left\"}"),
        1.0,
        "only c left"
    );
    assert_eq!(
        metric(&metrics_text(&gw).await, "kvgate_discovery_events_total{event=\"joined\"}"),
        3.0,
        "none re-joined"
    );
    assert!(metric(&metrics_text(&gw).await, "kvgate_discovery_events_total{event=\"relist\"}") >= 2.0);

    // The new watch delivers later changes.
    let d = upstream("d", "m").await;
    api.put(pod("d", labels.clone(), d.addr.port(), true));
    assert!(eventually(10.0, async || has_workers(&gw, &[&ups[0], &ups[1], &d]).await).await);
    for _ in 0..6 {
        assert_eq!(send(&gw).await, 200);
    }
    assert_eq!(d.requests.load(Ordering::SeqCst), 2, "round robin over the three workers");
    gw.shutdown().await;
}

#[tokio::test]
async fn pd_selectors_register_prefill_and_decode_pods() {
    let api = kube_api::start().await;
    let (prefill, decode) = (upstream("p", "m").await, upstream("d", "m").await);
    let mut prefill_pod =
        pod("p", json!({"app": "engine", "component": "prefill"}), prefill.addr.port(), true);
    prefill_pod["metadata"]["annotations"]["sglang.ai/bootstrap-port"] = json!("8998");
    api.put(prefill_pod);
    api.put(pod("d", json!({"app": "engine", "component": "decode"}), decode.addr.port(), true));
    let config = GatewayConfig {
        pd_disaggregation: true,
        selector: Vec::new(),
        prefill_selector: vec!["app=engine".into(), "component=prefill".into()],
        decode_selector: vec!["app=engine".into(), "component=decode".into()],
        ..discovery_config(&api, "pd")
    };
    let gw = gateway(config).await;
    assert!(eventually(10.0, async || has_workers(&gw, &[&prefill, &decode]).await).await);
    let body: Value =
        client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    let roles: Vec<(String, Value)> = body["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["worker_type"].as_str().unwrap_or("?").to_string(), w["bootstrap_port"].clone()))
        .collect();
    assert!(roles.contains(&("prefill".into(), json!(8998))), "{body}");
    assert!(roles.iter().any(|(role, _)| role == "decode"), "{body}");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_missing_kubeconfig_is_a_clear_start_error() {
    let config = GatewayConfig {
        service_discovery: true,
        selector: vec!["app=engine".into()],
        service_discovery_kubeconfig: Some("/nonexistent/kvgate.kubeconfig".into()),
        ..config(Vec::new())
    };
    let error = kvgate_gateway::start(config).await.err().expect("start fails").to_string();
    assert!(error.contains("/nonexistent/kvgate.kubeconfig"), "{error}");
}
