//! A wedged engine: one that sends the response head and one event, then a byte a second, then
//! nothing, without ending the body, held its stream open past 57 s and both admission slots
//! with it (everyone else got 429), although `--request-timeout-secs 5`: that deadline and
//! `--ttfb-timeout-secs` bound only the response head. Now every chunk of an answer must come
//! within `--body-stall-timeout-secs` of the one before (then the stream is cut: ended with the
//! error event) and a stream may be given a total deadline (`--stream-deadline-secs`); either
//! way its slot is freed.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use serde_json::{json, Value};

use crate::common::{client, config, gateway};

/// How the wedged engine's stream goes on after its first event.
#[derive(Clone, Copy)]
enum After {
    /// `bytes` single bytes a second apart, then silence (the body never ends).
    TrickleThenSilence { bytes: usize },
    /// A comment line every 200 ms, for ever.
    Forever,
}

/// An engine that answers streamed chats as `after` says and whole ones at once.
async fn wedged_engine(after: After) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let answer = move |body: Bytes| async move {
        let request: Value = serde_json::from_slice(&body).unwrap_or_default();
        if request["stream"] != true {
            return axum::Json(json!({"id": "w", "object": "chat.completion", "model": "m", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}))
            .into_response();
        }
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        tokio::spawn(async move {
            let first = json!({"id": "w", "object": "chat.completion.chunk", "model": "m",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hello"}, "finish_reason": null}]});
            let _ = tx.send(Ok(Bytes::from(format!("data: {first}\n\n")))).await;
            match after {
                After::TrickleThenSilence { bytes } => {
                    for _ in 0..bytes {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        if tx.send(Ok(Bytes::from_static(b":"))).await.is_err() {
                            return;
                        }
                    }
                    // Silence, with the body held open until the gateway lets go.
                    tx.closed().await;
                }
                After::Forever => loop {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if tx.send(Ok(Bytes::from_static(b": still here\n\n"))).await.is_err() {
                        return;
                    }
                },
            }
        });
        let stream =
            futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
        ([("content-type", "text/event-stream")], Body::from_stream(stream)).into_response()
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

fn chat(stream: bool) -> Value {
    json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
}

/// Sends a streamed chat and reads it to its end (or its cut); returns what arrived and when.
async fn read_stream(url: String) -> (u16, String, Duration) {
    let started = Instant::now();
    let response = client().post(url).json(&chat(true)).send().await.unwrap();
    read_body(response, started).await
}

async fn read_body(mut response: reqwest::Response, started: Instant) -> (u16, String, Duration) {
    let status = response.status().as_u16();
    let mut text = String::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    (status, text, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_is_cut_within_the_stall_timeout_and_frees_its_slot() {
    let engine = wedged_engine(After::TrickleThenSilence { bytes: 3 }).await;
    let mut cfg = config(vec![engine]);
    cfg.max_concurrent_requests = Some(1);
    cfg.request_timeout_secs = 5.0;
    cfg.body_stall_timeout_secs = 2.0;
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let started = Instant::now();
    let head = client().post(&url).json(&chat(true)).send().await.unwrap();
    assert_eq!(head.status(), 200);
    let stalled = tokio::spawn(read_body(head, started));
    // While it is held, the one slot is taken.
    let refused = client().post(&url).json(&chat(false)).send().await.unwrap();
    assert_eq!(refused.status(), 429, "the stalled stream holds the slot");
    let (status, text, took) = tokio::time::timeout(Duration::from_secs(30), stalled)
        .await
        .expect("the stalled stream ends: it was held open past 30 s")
        .unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("\"hello\""), "{text}");
    assert!(text.contains("upstream_stream_broken") && text.contains("stalled"), "the error event: {text}");
    assert!(!text.contains("[DONE]"), "{text}");
    // A byte a second keeps it alive (3 s), then 2 s of silence cut it.
    assert!(took >= Duration::from_secs(4) && took < Duration::from_secs(15), "{took:?}");
    // The slot is free again.
    let freed = crate::common::eventually(5.0, async || {
        client().post(&url).json(&chat(false)).send().await.unwrap().status() == 200
    })
    .await;
    assert!(freed, "the slot is given back when the stream is cut");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_its_deadline_is_ended_with_the_error_event() {
    let engine = wedged_engine(After::Forever).await;
    let mut cfg = config(vec![engine]);
    cfg.max_concurrent_requests = Some(1);
    cfg.stream_deadline_secs = Some(2.0);
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let (status, text, took) = tokio::time::timeout(Duration::from_secs(30), read_stream(url.clone()))
        .await
        .expect("the stream ends");
    assert_eq!(status, 200);
    assert!(text.contains("upstream_stream_broken") && text.contains("--stream-deadline-secs"), "{text}");
    assert!(took < Duration::from_secs(15), "{took:?}");
    let freed = crate::common::eventually(5.0, async || {
        client().post(&url).json(&chat(false)).send().await.unwrap().status() == 200
    })
    .await;
    assert!(freed);
    gw.shutdown().await;
}

/// SMG's meaning of the option: a client's upload that stalls is refused, long before the whole
/// body's deadline (`--body-read-timeout-secs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_stalls_gets_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = wedged_engine(After::Forever).await;
    let mut cfg = config(vec![engine]);
    cfg.body_stall_timeout_secs = 1.0;
    cfg.body_read_timeout_secs = 60.0;
    let gw = gateway(cfg).await;
    let mut stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"";
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut answer = vec![0u8; 4096];
    let read =
        tokio::time::timeout(Duration::from_secs(30), stream.read(&mut answer)).await.expect("answered");
    let answer = String::from_utf8_lossy(&answer[..read.unwrap()]).to_string();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("--body-stall-timeout-secs"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
    gw.shutdown().await;
}
