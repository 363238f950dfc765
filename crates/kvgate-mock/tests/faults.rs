//! Fault injection (500s, cut connections, added latency, failing health) and the canned engine.

mod common;

use std::time::{Duration, Instant};

use common::{spawn, sse_payloads};
use kvgate_mock::EngineKind;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_rate_answers_500_with_an_openai_error() {
    let harness = spawn(|args| {
        args.time_scale = 50.0;
        args.fail_rate = 1.0;
    })
    .await;
    for path in ["/v1/chat/completions", "/v1/completions", "/generate"] {
        let response = harness.post(path, &json!({"prompt": "a"})).await;
        assert_eq!(response.status(), 500, "{path}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["type"], "server_error");
    }
    assert_eq!(harness.get("/health").await.status(), 200);
    harness.fleet.shutdown().await;

    // A fraction: seeded draws, roughly half of 40.
    let harness = spawn(|args| {
        args.engine = EngineKind::Canned;
        args.fail_rate = 0.5;
        args.seed = 7;
    })
    .await;
    let mut failures = 0;
    for _ in 0..40 {
        let response = harness.post("/v1/completions", &json!({"prompt": "a"})).await;
        failures += usize::from(response.status() == 500);
    }
    assert!((8..=32).contains(&failures), "{failures}");
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_stream_rate_breaks_bodies_midway() {
    for engine in [EngineKind::Realistic, EngineKind::Canned] {
        let harness = spawn(|args| {
            args.engine = engine;
            args.time_scale = 50.0;
            args.cut_stream_rate = 1.0;
        })
        .await;
        for stream in [true, false] {
            let body = json!({"prompt": "a b c", "max_tokens": 8, "ignore_eos": true,
                "stream": stream});
            let response = harness.post("/v1/completions", &body).await;
            assert_eq!(response.status(), 200);
            let text = response.text().await;
            assert!(text.is_err(), "{engine:?} stream={stream}: body completed: {text:?}");
        }
        harness.fleet.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extra_latency_delays_answers() {
    let harness = spawn(|args| {
        args.engine = EngineKind::Canned;
        args.extra_latency_ms = 200;
    })
    .await;
    let started = Instant::now();
    harness.post_json("/v1/completions", &json!({"prompt": "a"})).await;
    assert!(started.elapsed() >= Duration::from_millis(200));
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_unhealthy_after_the_given_time() {
    let started = Instant::now();
    let harness = spawn(|args| {
        args.engine = EngineKind::Canned;
        args.unhealthy_after_secs = Some(1.0);
    })
    .await;
    assert_eq!(harness.get("/health").await.status(), 200);
    // Polled until it turns: never before the given time, and for good.
    loop {
        let status = harness.get("/health").await.status();
        if status == 503 {
            break;
        }
        assert_eq!(status, 200);
        assert!(started.elapsed() < Duration::from_secs(10), "still healthy after 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(harness.get("/health").await.status(), 503);
    // Generation still answers.
    harness.post_json("/v1/completions", &json!({"prompt": "a"})).await;
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canned_engine_answers_fixed_bodies() {
    let harness = spawn(|args| args.engine = EngineKind::Canned).await;
    let chat = harness
        .post_json("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]}))
        .await;
    assert_eq!(chat["choices"][0]["message"]["content"], "ok ok");
    assert_eq!(chat["usage"]["total_tokens"], 10);
    let events = harness.post_sse("/v1/chat/completions", &json!({"messages": [], "stream": true})).await;
    assert_eq!(events.len(), 4);
    assert_eq!(events[3], "[DONE]");
    let generate = harness.post_json("/generate", &json!({"text": "hi"})).await;
    assert_eq!(generate["meta_info"]["completion_tokens"], 2);
    let body =
        harness.post("/v1/completions", &json!({"prompt": "x", "stream": true})).await.text().await.unwrap();
    assert_eq!(sse_payloads(&body).last().unwrap(), "[DONE]");
    let malformed = harness.client.post(format!("{}/generate", harness.url)).body("[").send().await.unwrap();
    assert_eq!(malformed.status(), 400);
    let load = harness.loads().await;
    assert_eq!(load["num_running_reqs"], 0);
    harness.fleet.shutdown().await;
}

/// The text of a chat stream's chunks.
fn streamed_text(text: &str) -> String {
    sse_payloads(text)
        .iter()
        .filter_map(|payload| serde_json::from_str::<Value>(payload).ok())
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_cut_after_some_tokens_is_continued_exactly_with_continue_final_message() {
    let harness = spawn(|args| args.time_scale = 50.0).await;
    let messages = json!([{"role": "user", "content": "tell me about caches"}]);
    let whole = json!({"messages": messages, "max_tokens": 12, "ignore_eos": true, "stream": true});
    let reference = streamed_text(&harness.post("/v1/chat/completions", &whole).await.text().await.unwrap());
    assert_eq!(reference.split(' ').count(), 12);
    let pairs = [("user", "tell me about caches")];
    assert_eq!(reference, kvgate_mock::chat_answer_text(&pairs, 12), "the reference the soak computes");
    // The first 5 words as the final assistant message, 7 tokens more: the rest, exactly.
    let begun: Vec<&str> = reference.split_inclusive(' ').take(5).collect();
    let begun = begun.concat();
    let begun = begun.trim_end();
    let mut continued = json!({"messages": [{"role": "user", "content": "tell me about caches"},
        {"role": "assistant", "content": begun}], "max_tokens": 7, "ignore_eos": true, "stream": true,
        "continue_final_message": true, "add_generation_prompt": false,
        "stream_options": {"include_usage": true}});
    let text = harness.post("/v1/chat/completions", &continued).await.text().await.unwrap();
    assert_eq!(format!("{begun}{}", streamed_text(&text)), reference);
    let usage: Value = serde_json::from_str(sse_payloads(&text).iter().rev().nth(1).unwrap()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 7, "{usage}");
    // vLLM refuses continue_final_message with the generation prompt.
    continued["add_generation_prompt"] = json!(true);
    assert_eq!(harness.post("/v1/chat/completions", &continued).await.status(), 400);
    harness.fleet.shutdown().await;

    // --cut-after-tokens: every stream dies after that many tokens, never completes.
    let harness = spawn(|args| {
        args.time_scale = 50.0;
        args.cut_after_tokens = Some(3);
    })
    .await;
    let response = harness.post("/v1/chat/completions", &whole).await;
    assert_eq!(response.status(), 200);
    let mut body = response;
    let mut received = String::new();
    let broke = loop {
        match body.chunk().await {
            Ok(Some(chunk)) => received.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(None) => break false,
            Err(_) => break true,
        }
    };
    assert!(broke, "the stream was cut: {received}");
    assert_eq!(streamed_text(&received).split(' ').count(), 3, "{received}");
    harness.fleet.shutdown().await;
}
