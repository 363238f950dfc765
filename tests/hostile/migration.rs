//! A stream survives its engine (`--migrate-streams`): when the engine answering a streamed chat
//! or completion fails after the answer began (its connection breaks, or its body stalls), the
//! gateway sends the request to another engine with the text already streamed as a
//! continuation (a chat's final assistant message with `continue_final_message`; a completion's
//! prompt plus the text) and `max_tokens` less what was generated, and goes on streaming: the
//! same id, no repeated text, one role, one `[DONE]`, the usage of the whole answer. Before,
//! the client got an error event (Dynamo 1.7 and vLLM's production-stack router migrate).
//!
//! Engine behaviour followed: vLLM's chat completions take `continue_final_message` with
//! `add_generation_prompt: false` (`vllm/entrypoints/openai/protocol.py`, refused together),
//! SGLang's take `continue_final_message` (`python/sglang/srt/entrypoints/openai/protocol.py`);
//! `kvgate mock` continues its own answer exactly, so a migrated answer must equal the uncut one.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use kvgate_gateway::GatewayHandle;
use serde_json::{json, Value};

use crate::common::{client, config, gateway, metric, metrics_text, mock_fleet};

/// A single-engine mock fleet, 50x faster than wall time; `cut_after` kills its streams.
async fn engine(cut_after: Option<u32>) -> kvgate_mock::MockFleet {
    mock_fleet(|args| {
        args.time_scale = 50.0;
        args.cut_after_tokens = cut_after;
    })
    .await
}

const QUESTION: &str = "tell me about prefix caches";

fn chat(max_tokens: u32, usage: bool) -> Value {
    let mut body = json!({"model": "mock-model", "stream": true, "max_tokens": max_tokens, "ignore_eos": true,
        "messages": [{"role": "user", "content": QUESTION}]});
    if usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// A stream as the client got it: its data payloads in order.
async fn stream(gw: &GatewayHandle, path: &str, body: &Value, target: Option<&str>) -> Vec<String> {
    let mut request = client().post(format!("{}{path}", gw.url())).json(body);
    if let Some(target) = target {
        request = request.header("x-kvgate-target-worker", target);
    }
    let mut response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut text = String::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    text.split("\n\n").filter_map(|event| event.strip_prefix("data: ")).map(str::to_string).collect()
}

fn chunks(events: &[String]) -> Vec<Value> {
    events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect()
}

fn chat_text(chunks: &[Value]) -> String {
    chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect()
}

fn migrations(text: &str, result: &str) -> f64 {
    metric(
        text,
        &format!("kvgate_stream_migrations_total{{endpoint=\"chat_completions\",result=\"{result}\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_stream_cut_mid_answer_goes_on_on_another_engine_without_a_seam() {
    let dying = engine(Some(5)).await;
    let healthy = engine(None).await;
    let mut cfg = config(vec![dying.urls()[0].clone(), healthy.urls()[0].clone()]);
    cfg.routing_key_override = true;
    let gw = gateway(cfg).await;
    let reference = kvgate_mock::chat_answer_text(&[("user", QUESTION)], 16);
    for usage in [true, false] {
        let events = stream(&gw, "/v1/chat/completions", &chat(16, usage), Some(&dying.urls()[0])).await;
        let chunks = chunks(&events);
        assert_eq!(chat_text(&chunks), reference, "usage {usage}: the whole answer, once: {events:?}");
        assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1, "{events:?}");
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        assert!(!events.iter().any(|e| e.contains("\"error\"")), "{events:?}");
        let ids: std::collections::BTreeSet<&str> = chunks.iter().filter_map(|c| c["id"].as_str()).collect();
        assert_eq!(ids.len(), 1, "one response id: {ids:?}");
        let roles = chunks.iter().filter(|c| c["choices"][0]["delta"].get("role").is_some()).count();
        assert_eq!(roles, 1, "one role delta");
        let finishes = chunks.iter().filter(|c| c["choices"][0]["finish_reason"].is_string()).count();
        assert_eq!(finishes, 1);
        let usages: Vec<&Value> =
            chunks.iter().filter_map(|c| c.get("usage").filter(|u| !u.is_null())).collect();
        if usage {
            assert_eq!(usages.len(), 1, "{events:?}");
            // The request's own prompt (as the uncut answer reports it), the answer's 16 tokens.
            let uncut = stream(&gw, "/v1/chat/completions", &chat(16, true), Some(&healthy.urls()[0])).await;
            let uncut_usage = chunks_usage(&uncut);
            assert_eq!(usages[0]["prompt_tokens"], uncut_usage["prompt_tokens"], "{}", usages[0]);
            assert_eq!(usages[0]["completion_tokens"], 16, "{}", usages[0]);
            assert_eq!(usages[0]["total_tokens"], uncut_usage["total_tokens"], "{}", usages[0]);
        } else {
            assert!(usages.is_empty(), "no usage chunk the client did not ask for: {events:?}");
        }
    }
    let text = metrics_text(&gw).await;
    assert_eq!(migrations(&text, "resumed"), 2.0, "{text}");
    gw.shutdown().await;
    dying.shutdown().await;
    healthy.shutdown().await;
}

fn chunks_usage(events: &[String]) -> Value {
    chunks(events).into_iter().find_map(|c| c.get("usage").filter(|u| !u.is_null()).cloned()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_bounded_and_a_stream_that_cannot_be_continued_ends_with_the_error_event() {
    // Every engine dies after 2 tokens: one migration allowed, then the error event.
    let fleets = [engine(Some(2)).await, engine(Some(2)).await, engine(Some(2)).await];
    let mut cfg = config(fleets.iter().map(|f| f.urls()[0].clone()).collect());
    cfg.max_stream_migrations = 1;
    let gw = gateway(cfg).await;
    let events = stream(&gw, "/v1/chat/completions", &chat(16, false), None).await;
    let reference = kvgate_mock::chat_answer_text(&[("user", QUESTION)], 4);
    assert_eq!(
        chat_text(&chunks(&events[..events.len() - 1])),
        reference,
        "2 + 2 tokens, no repeat: {events:?}"
    );
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_stream_broken", "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"));
    // Two choices cannot be continued as one: the error event at once.
    let mut two = chat(16, false);
    two["n"] = json!(2);
    let events = stream(&gw, "/v1/chat/completions", &two, None).await;
    assert!(events.last().unwrap().contains("upstream_stream_broken"), "{events:?}");
    let text = metrics_text(&gw).await;
    assert_eq!(migrations(&text, "resumed"), 1.0, "{text}");
    assert_eq!(migrations(&text, "exhausted"), 1.0, "{text}");
    assert_eq!(migrations(&text, "not_resumable"), 1.0, "{text}");
    gw.shutdown().await;

    // Off: the error event, as before.
    let mut cfg = config(fleets.iter().map(|f| f.urls()[0].clone()).collect());
    cfg.migrate_streams = false;
    let gw = gateway(cfg).await;
    let events = stream(&gw, "/v1/chat/completions", &chat(16, false), None).await;
    assert!(events.last().unwrap().contains("upstream_stream_broken"), "{events:?}");
    assert_eq!(migrations(&metrics_text(&gw).await, "resumed"), 0.0);
    gw.shutdown().await;
    for fleet in fleets {
        fleet.shutdown().await;
    }
}

/// How a completions engine's stream ends.
#[derive(Clone, Copy)]
enum End {
    /// After this many text chunks, a broken connection.
    Dies(usize),
    /// After this many text chunks, silence (the body held open).
    Stalls(usize),
    /// A whole answer of two chunks.
    Whole,
}

/// A completions engine whose streams end as `end` says; every request body is kept.
struct TextEngine {
    url: String,
    bodies: Mutex<Vec<Value>>,
    /// Each request's `x-kvgate-resumed` header.
    resumed: Mutex<Vec<Option<String>>>,
}

async fn text_engine(name: &'static str, end: End) -> Arc<TextEngine> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let engine = Arc::new(TextEngine {
        url: format!("http://{addr}"),
        bodies: Mutex::new(Vec::new()),
        resumed: Mutex::new(Vec::new()),
    });
    let seen = engine.clone();
    let answer = move |headers: axum::http::HeaderMap, body: Bytes| {
        let seen = seen.clone();
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or_default();
            seen.bodies.lock().unwrap().push(request);
            let resumed = headers.get("x-kvgate-resumed").and_then(|v| v.to_str().ok()).map(str::to_string);
            seen.resumed.lock().unwrap().push(resumed);
            let chunk = |text: &str, finish: Value| {
                let chunk = json!({"id": format!("cmpl-{name}"), "object": "text_completion", "created": 1,
                    "model": "m", "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]});
                Ok::<_, std::io::Error>(Bytes::from(format!("data: {chunk}\n\n")))
            };
            let mut items = vec![chunk(" hello", Value::Null), chunk(" world", Value::Null)];
            match end {
                End::Dies(n) | End::Stalls(n) => items.truncate(n),
                End::Whole => {
                    items.push(chunk("", json!("length")));
                    let usage = json!({"id": format!("cmpl-{name}"), "object": "text_completion", "created": 1,
                        "model": "m", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}});
                    items.push(Ok(Bytes::from(format!("data: {usage}\n\n"))));
                    items.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
                }
            }
            // A dying engine's connection breaks a moment after its last bytes, so they reach
            // the gateway first (a reset would discard them); a stalled one never ends.
            use futures_util::StreamExt;
            let ending = futures_util::stream::once(async move {
                match end {
                    End::Dies(_) => {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        Some(Err(std::io::Error::other("engine died")))
                    }
                    End::Stalls(_) => std::future::pending().await,
                    End::Whole => None,
                }
            })
            .filter_map(|item| async move { item });
            let stream = futures_util::stream::iter(items).chain(ending);
            ([("content-type", "text/event-stream")], Body::from_stream(stream)).into_response()
        }
    };
    let models = || async { axum::Json(json!({"object": "list", "data": [{"id": "m", "object": "model"}]})) };
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(answer));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    engine
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_stream_is_resumed_with_its_prompt_plus_the_text_streamed() {
    let dying = text_engine("a", End::Dies(2)).await;
    let healthy = text_engine("b", End::Whole).await;
    let mut cfg = config(vec![dying.url.clone(), healthy.url.clone()]);
    cfg.routing_key_override = true;
    cfg.forward_priority = kvgate_gateway::ForwardPriority::Sglang;
    let gw = gateway(cfg).await;
    let request = json!({"model": "m", "prompt": "Once upon a time", "max_tokens": 10, "stream": true,
        "temperature": 0.7});
    let events = stream(&gw, "/v1/completions", &request, Some(&dying.url)).await;
    let chunks = chunks(&events);
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(
        text, " hello world hello world",
        "the dead engine's text, then the continuation's: {events:?}"
    );
    assert!(chunks.iter().all(|c| c["id"] == "cmpl-a"), "the first engine's id throughout: {events:?}");
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none_or(Value::is_null)),
        "no usage asked for: {events:?}"
    );
    let continued =
        healthy.bodies.lock().unwrap().last().cloned().expect("the continuation reached the engine");
    assert_eq!(continued["prompt"], "Once upon a time hello world", "{continued}");
    assert_eq!(continued["max_tokens"], 8, "{continued}");
    assert_eq!(continued["temperature"], 0.7, "the client's sampling options kept: {continued}");
    assert_eq!(continued["priority"], 0, "the class's priority, as on the first request: {continued}");
    assert_eq!(continued["stream_options"]["include_usage"], true, "{continued}");
    let marks = healthy.resumed.lock().unwrap().clone();
    assert_eq!(marks, [Some("1".to_string())], "a continuation says it is one (the first move)");
    assert_eq!(dying.resumed.lock().unwrap().clone(), [None], "the request itself does not");
    let text = metrics_text(&gw).await;
    let resumed =
        metric(&text, "kvgate_stream_migrations_total{endpoint=\"completions\",result=\"resumed\"}");
    assert_eq!(resumed, 1.0, "{text}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_engine_stalls_moves_on_after_the_stall_timeout() {
    let stalled = text_engine("a", End::Stalls(1)).await;
    let healthy = text_engine("b", End::Whole).await;
    let mut cfg = config(vec![stalled.url.clone(), healthy.url.clone()]);
    cfg.routing_key_override = true;
    cfg.body_stall_timeout_secs = 1.0;
    let gw = gateway(cfg).await;
    let request = json!({"model": "m", "prompt": "Once", "max_tokens": 10, "stream": true});
    let started = std::time::Instant::now();
    let events = stream(&gw, "/v1/completions", &request, Some(&stalled.url)).await;
    let text: String = chunks(&events).iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, " hello hello world", "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(started.elapsed() < std::time::Duration::from_secs(15), "{:?}", started.elapsed());
    let continued = healthy.bodies.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        (continued["prompt"].as_str(), continued["max_tokens"].as_u64()),
        (Some("Once hello"), Some(9))
    );
    gw.shutdown().await;
}
