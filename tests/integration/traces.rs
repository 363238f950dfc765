//! OpenTelemetry traces (`--otlp-traces-endpoint`): an OTLP/HTTP receiver on 127.0.0.1 decodes
//! the protobuf export requests the gateway sends (opentelemetry-proto's messages) and checks the
//! request spans' documented attributes and events; the client's W3C `traceparent` is continued,
//! and the span's own context is what reaches the engine. A collector that fails (answers 500,
//! or is not there) is counted, not silent.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use common::{client, eventually, gateway, kv_events_config, metric, metrics_text};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;

type Received = Arc<Mutex<Vec<Span>>>;

/// An OTLP/HTTP traces receiver: `POST /v1/traces` with a protobuf `ExportTraceServiceRequest`.
async fn receiver() -> (String, Received) {
    let received: Received = Arc::default();
    async fn export(
        State(received): State<Received>,
        body: Bytes,
    ) -> ([(&'static str, &'static str); 1], Vec<u8>) {
        let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export request");
        let spans = request.resource_spans.into_iter().flat_map(|r| r.scope_spans).flat_map(|s| s.spans);
        received.lock().unwrap().extend(spans);
        ([("content-type", "application/x-protobuf")], Vec::new())
    }
    let app = axum::Router::new().route("/v1/traces", post(export)).with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, received)
}

fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

fn text(span: &Span, key: &str) -> String {
    match attribute(&span.attributes, key) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        other => panic!("{key}: {other:?} in {span:#?}"),
    }
}

fn number(span: &Span, key: &str) -> f64 {
    match attribute(&span.attributes, key) {
        Some(any_value::Value::DoubleValue(v)) => *v,
        Some(any_value::Value::IntValue(v)) => *v as f64,
        other => panic!("{key}: {other:?} in {span:#?}"),
    }
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_spans_reach_an_otlp_receiver_with_the_route_and_traceparent_reaches_the_engine() {
    let (otlp, received) = receiver().await;

    // kv_aware on simulated engines: the decision's reason, index and predicted terms.
    let mock = common::kv_events_fleet(2).await;
    let mut cfg = kv_events_config(&mock);
    cfg.routing.policy = kvgate_policy::PolicyKind::KvAware;
    cfg.otlp_traces_endpoint = Some(otlp.clone());
    let gw = gateway(cfg).await;
    assert!(eventually(10.0, async || common::workers(&gw).await.iter().all(common::healthy)).await);
    // The span names the exact index only once every worker's events flow.
    common::wait_kv_events_flowing(&gw).await;
    for n in 0..3 {
        let body = json!({"model": "mock-model", "max_tokens": 2, "stream": n == 2,
            "messages": [{"role": "user", "content": format!("hello number {n}")}]});
        let res =
            client().post(format!("{}/v1/chat/completions", gw.url())).json(&body).send().await.unwrap();
        assert_eq!(res.status(), 200);
        res.bytes().await.unwrap();
    }
    assert!(
        eventually(10.0, async || received.lock().unwrap().len() >= 3).await,
        "three spans exported within 10 s"
    );
    for span in received.lock().unwrap().iter() {
        assert_eq!(span.name, "POST /v1/chat/completions");
        assert_eq!(span.kind, 2, "a server span");
        assert!(text(span, "kvgate.route.reason").starts_with("kv_aware"), "{span:#?}");
        assert_eq!(text(span, "kvgate.route.prefix_index"), "exact");
        assert!(mock.urls().contains(&text(span, "kvgate.worker")));
        assert!(
            number(span, "kvgate.predicted_ttft_ms.total")
                >= number(span, "kvgate.predicted_ttft_ms.prefill")
        );
        assert!(number(span, "kvgate.ttfb_ms") > 0.0);
        assert_eq!(number(span, "http.response.status_code"), 200.0);
        assert_eq!(number(span, "kvgate.attempt"), 1.0);
        assert!(span.events.iter().any(|event| event.name == "route"), "{span:#?}");
    }
    gw.shutdown().await;
    received.lock().unwrap().clear();

    // A worker answering 503, then a healthy one: one span with both attempts; the engine that
    // answered got the span's own context, a child of the client's.
    let failing = common::upstream("failing", "m").await;
    failing.status.store(503, std::sync::atomic::Ordering::SeqCst);
    let healthy = common::upstream("healthy", "m").await;
    let mut cfg = common::config(vec![failing.url.clone(), healthy.url.clone()]);
    cfg.otlp_traces_endpoint = Some(otlp);
    let gw = gateway(cfg).await;
    assert!(eventually(10.0, async || common::workers(&gw).await.iter().all(common::routable)).await);
    for _ in 0..2 {
        // Round robin: one of the two starts on the failing worker.
        let res = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
            .json(&common::chat("m"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        res.bytes().await.unwrap();
    }
    let sent = healthy
        .last_headers
        .lock()
        .unwrap()
        .get("traceparent")
        .expect("the engine got a traceparent")
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        eventually(10.0, async || received.lock().unwrap().len() >= 2).await,
        "two spans exported within 10 s"
    );
    let spans = received.lock().unwrap().clone();
    for span in &spans {
        assert_eq!(hex(&span.trace_id), CLIENT_TRACE, "the client's trace continues");
        assert_eq!(hex(&span.parent_span_id), CLIENT_SPAN, "a child of the client's span");
    }
    let retried = spans
        .iter()
        .find(|span| span.events.iter().any(|e| e.name == "attempt_failed"))
        .expect("a retried request");
    assert_eq!(number(retried, "kvgate.retries"), 1.0);
    assert_eq!(number(retried, "kvgate.attempt"), 2.0);
    assert_eq!(text(retried, "kvgate.worker"), healthy.url);
    assert_eq!(retried.events.iter().filter(|e| e.name == "route").count(), 2);
    let ids: Vec<String> =
        spans.iter().map(|span| format!("00-{CLIENT_TRACE}-{}-01", hex(&span.span_id))).collect();
    assert!(ids.contains(&sent), "the engine's traceparent {sent} is a gateway span's context: {ids:?}");
    gw.shutdown().await;
}

/// A collector that takes every export request and answers 500; returns its URL and the
/// requests it got.
async fn failing_receiver() -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |_: Bytes| async move {
            counted.fetch_add(1, Ordering::SeqCst);
            axum::http::StatusCode::INTERNAL_SERVER_ERROR
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, hits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_a_collector_refuses_or_never_gets_are_counted_with_their_spans() {
    let (refusing, hits) = failing_receiver().await;
    let closed = format!("{}/v1/traces", common::dead_url().await);
    for (endpoint, what) in [(refusing, "a collector answering 500"), (closed, "a closed port")] {
        let worker = common::upstream("worker", "m").await;
        let mut cfg = common::config(vec![worker.url.clone()]);
        cfg.otlp_traces_endpoint = Some(endpoint);
        let gw = gateway(cfg).await;
        let routable =
            eventually(10.0, async || common::workers(&gw).await.iter().all(common::routable)).await;
        assert!(routable, "{what}: the worker is routable");
        for _ in 0..3 {
            let res = client()
                .post(format!("{}/v1/chat/completions", gw.url()))
                .json(&common::chat("m"))
                .send()
                .await;
            let res = res.unwrap();
            assert_eq!(res.status(), 200, "{what}: tracing never fails a request");
            res.bytes().await.unwrap();
        }
        let failed = r#"kvgate_otlp_spans_dropped_total{reason="export_failed"}"#;
        let mut text = String::new();
        let counted = eventually(20.0, async || {
            text = metrics_text(&gw).await;
            metric(&text, "kvgate_otlp_export_failures_total") >= 1.0 && metric(&text, failed) >= 3.0
        })
        .await;
        assert!(counted, "{what}: the failed exports and their 3 spans are counted:\n{text}");
        assert_eq!(metric(&text, "kvgate_otlp_spans_exported_total"), 0.0, "{what}");
        assert_eq!(metric(&text, r#"kvgate_otlp_spans_dropped_total{reason="queue_full"}"#), 0.0, "{what}");
        gw.shutdown().await;
    }
    assert!(hits.load(Ordering::SeqCst) >= 1, "the refusing collector was asked");
}
