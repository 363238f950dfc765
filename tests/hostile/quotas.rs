//! A tenant's `tokens_per_minute` on streams, and usage reports the gateway charges. With
//! `tokens_per_minute: 1000`, 20 streamed requests without `max_tokens` were all served (about
//! 4,100 tokens) while non-streamed ones stopped after 5: admission charged the prompt plus
//! `max_tokens` (0 when absent) and corrected the charge from a usage chunk the gateway asked for
//! only when it routed on the exact index, never when the client set `stream_options` itself.
//! And one absurd usage report (`completion_tokens` 2^32-1) locked its tenant out for 60 days
//! (`Retry-After: 5153901`). Now the gateway always learns the usage it charges (it asks the
//! engine for the usage chunk and leaves it out of what a client that did not ask sees), charges
//! an open-ended request its tenant's typical output up front, and bounds every report by what
//! the request could have used (its prompt, its `max_tokens`, else the model's context).
//!
//! Engine behaviour followed: vLLM's OpenAI server sends the usage chunk (`"choices": []`) right
//! before `data: [DONE]` only with `stream_options.include_usage` (`vllm/entrypoints/openai/
//! chat_completion/serving.py`, `should_include_usage`), as `kvgate mock` does; `GET /v1/models`
//! reports `max_model_len` (vLLM's and SGLang's `ModelCard`).

use std::net::SocketAddr;

use axum::routing::{get, post};
use axum::Router;
use kvgate_gateway::GatewayHandle;
use serde_json::{json, Value};

use crate::common::{client, config, gateway, mock_fleet};

fn tenants(value: Value) -> kvgate_gateway::TenantsConfig {
    serde_json::from_value(value).unwrap()
}

async fn post_as(gw: &GatewayHandle, tenant: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("x-kvgate-tenant", tenant)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn streamed(stream_options: Option<Value>) -> Value {
    let mut body = json!({"model": "mock-model", "stream": true,
        "messages": [{"role": "user", "content": "tell me a long story"}]});
    if let Some(options) = stream_options {
        body["stream_options"] = options;
    }
    body
}

/// The SSE events of a whole stream, `[DONE]` included.
fn events(text: &str) -> Vec<String> {
    text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_string).collect()
}

/// 300 tokens per answer, whatever the request asks.
async fn long_answers() -> kvgate_mock::MockFleet {
    mock_fleet(|args| {
        args.time_scale = 50.0;
        args.default_max_tokens = 300;
        args.force_max_tokens = true;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_refused_once_over_tokens_per_minute_whatever_their_stream_options() {
    let fleet = long_answers().await;
    let mut cfg = config(fleet.urls());
    cfg.tenants = tenants(json!({"defaults": {"tokens_per_minute": 1000}}));
    let gw = gateway(cfg).await;
    let variants = [
        ("no stream_options", None),
        ("include_usage false", Some(json!({"include_usage": false}))),
        ("stream_options without include_usage", Some(json!({}))),
        ("include_usage true", Some(json!({"include_usage": true}))),
    ];
    for (what, options) in variants {
        let tenant = what.replace(' ', "-");
        let asked = options.as_ref().is_some_and(|o| o["include_usage"] == true);
        let mut served = 0;
        let mut refused = None;
        for _ in 0..20 {
            let response = post_as(&gw, &tenant, &streamed(options.clone())).await;
            if response.status() != 200 {
                refused = Some(response);
                break;
            }
            let text = response.text().await.unwrap();
            let events = events(&text);
            assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{what}: {text}");
            let usage_chunks = events.iter().filter(|e| e.contains("\"usage\"")).count();
            assert_eq!(usage_chunks, usize::from(asked), "{what}: the usage chunk only when asked: {text}");
            served += 1;
        }
        // 300 output tokens each within 1,000 a minute: the fourth overdraws, the fifth waits.
        assert!(served <= 4, "{what}: {served} streams of 300 tokens served within 1,000 tokens a minute");
        let refused = refused.unwrap_or_else(|| panic!("{what}: never refused"));
        assert_eq!(refused.status(), 429, "{what}");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(body["error"]["code"], "tokens_per_minute_exceeded", "{what}: {body}");
    }
    // A tenant sending open-ended streams at once is charged each one's typical output up front
    // (learned from the answers above), so a burst is cut at the quota, not after it.
    let burst: Vec<_> = (0..8)
        .map(|_| {
            let url = format!("{}/v1/chat/completions", gw.url());
            tokio::spawn(async move {
                let response = client()
                    .post(url)
                    .header("x-kvgate-tenant", "burst")
                    .json(&streamed(None))
                    .send()
                    .await
                    .unwrap();
                let status = response.status().as_u16();
                let _ = response.text().await;
                status
            })
        })
        .collect();
    let mut admitted = 0;
    for task in burst {
        if task.await.unwrap() == 200 {
            admitted += 1;
        }
    }
    assert!(
        (1..=4).contains(&admitted),
        "{admitted} of 8 open-ended streams admitted at once within 1,000 tokens"
    );
    gw.shutdown().await;
    fleet.shutdown().await;
}
/// An engine that reports `completion_tokens` of 2^32-1 for every answer, whole or streamed,
/// and a context of 2,048 tokens on `/v1/models`.
async fn absurd_usage_engine() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let usage = json!({"prompt_tokens": 4294967295u64, "completion_tokens": 4294967295u64,
        "total_tokens": 4294967295u64});
    let answer = move |body: axum::body::Bytes| {
        let usage = usage.clone();
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or_default();
            if request["stream"] == true {
                let chunk = json!({"id": "x", "object": "chat.completion.chunk", "model": "m",
                    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]});
                let last = json!({"id": "x", "object": "chat.completion.chunk", "model": "m",
                    "choices": [], "usage": usage});
                let text = format!("data: {chunk}\n\ndata: {last}\n\ndata: [DONE]\n\n");
                return ([("content-type", "text/event-stream")], text).into_response();
            }
            axum::Json(json!({"id": "x", "object": "chat.completion", "model": "m", "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}))
            .into_response()
        }
    };
    use axum::response::IntoResponse;
    let models = || async {
        axum::Json(json!({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 2048}]}))
    };
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(answer));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_usage_report_is_bounded_by_what_the_request_could_use() {
    let engine = absurd_usage_engine().await;
    let mut cfg = config(vec![engine]);
    cfg.tenants = tenants(json!({"defaults": {"tokens_per_minute": 1000}}));
    let gw = gateway(cfg).await;
    let ask = |stream: bool, max_tokens: Option<u64>| {
        let mut body =
            json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
        if let Some(max) = max_tokens {
            body["max_tokens"] = json!(max);
        }
        body
    };
    for stream in [false, true] {
        // With max_tokens 8, the report counts at most the prompt's bytes and 8 tokens: the
        // tenant goes on.
        let tenant = format!("bounded-{stream}");
        for _ in 0..3 {
            let response = post_as(&gw, &tenant, &ask(stream, Some(8))).await;
            assert_eq!(response.status(), 200, "stream {stream}");
            let _ = response.text().await;
        }
        // Without it, at most the model's context (2,048 tokens): a wait of about two minutes,
        // never 60 days.
        let tenant = format!("open-{stream}");
        let response = post_as(&gw, &tenant, &ask(stream, None)).await;
        assert_eq!(response.status(), 200);
        let _ = response.text().await;
        let refused = post_as(&gw, &tenant, &ask(stream, None)).await;
        assert_eq!(refused.status(), 429, "stream {stream}");
        let wait: u64 = refused.headers()["retry-after"].to_str().unwrap().parse().unwrap();
        assert!(wait <= 180, "stream {stream}: Retry-After {wait} s after one report");
    }
    gw.shutdown().await;
}
