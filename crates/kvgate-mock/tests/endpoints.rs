//! The generation endpoints of a realistic mock engine, streaming and whole: shapes, token counts, max_tokens, prefix caching, errors.

mod common;

use common::{spawn, words, Harness};
use serde_json::{json, Value};

/// A fast engine: model time runs 50x faster than wall time.
async fn fast_engine() -> Harness {
    spawn(|args| args.time_scale = 50.0).await
}

fn usage_counts(usage: &Value) -> (u64, u64, u64) {
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt + completion);
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    (prompt, completion, cached)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_models() {
    let harness = fast_engine().await;
    assert_eq!(harness.get("/health").await.status(), 200);
    let models: Value = harness.get("/v1/models").await.json().await.unwrap();
    assert_eq!(
        models,
        json!({"object": "list", "data": [{"id": "mock-model", "object": "model",
            "owned_by": "kvgate-mock", "created": 0, "root": "mock-model", "parent": null}]})
    );
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_whole_and_streamed() {
    let harness = fast_engine().await;
    let body = json!({"model": "mock-model", "max_tokens": 12, "ignore_eos": true,
        "messages": [{"role": "user", "content": words(0, 40)}]});
    let whole = harness.post_json("/v1/chat/completions", &body).await;
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["model"], "mock-model");
    let (prompt, completion, _) = usage_counts(&whole["usage"]);
    // "<|user|> w0 ... w39 <|assistant|>"
    assert_eq!((prompt, completion), (42, 12));
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content.split(' ').count(), 12);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");

    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    // Without stream_options.include_usage, no usage chunk (as vLLM).
    let events = harness.post_sse("/v1/chat/completions", &streaming).await;
    assert_eq!(events.len(), 12 + 1 + 1, "tokens, the finish chunk, [DONE]");
    streaming["stream_options"] = json!({"include_usage": true});
    let events = harness.post_sse("/v1/chat/completions", &streaming).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|event| serde_json::from_str(event).unwrap()).collect();
    // One chunk per token, a finish chunk, a usage chunk.
    assert_eq!(chunks.len(), 12 + 2);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String =
        chunks[..12].iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
    assert_eq!(streamed, content, "the same prompt generates the same text");
    assert_eq!(chunks[12]["choices"][0]["finish_reason"], "length");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let (_, completion, cached) = usage_counts(&chunks[13]["usage"]);
    assert_eq!(completion, 12);
    assert_eq!(cached, 32, "the repeated prompt's 2 full blocks hit the prefix cache");
    assert_eq!(chunks[13]["choices"], json!([]), "the usage chunk has no choices");
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_completion_whole_and_streamed() {
    let harness = fast_engine().await;
    let body = json!({"prompt": words(0, 40), "max_tokens": 5, "ignore_eos": true});
    let whole = harness.post_json("/v1/completions", &body).await;
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(usage_counts(&whole["usage"]), (40, 5, 0));
    assert_eq!(whole["choices"][0]["text"].as_str().unwrap().split(' ').count(), 5);

    let body = json!({"prompt": [1, 2, 3, 4], "max_tokens": 3, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true}});
    let events = harness.post_sse("/v1/completions", &body).await;
    assert_eq!(events.len(), 3 + 2 + 1);
    let usage: Value = serde_json::from_str(&events[4]).unwrap();
    assert_eq!(usage_counts(&usage["usage"]), (4, 3, 0));
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_generate_whole_and_streamed() {
    let harness = fast_engine().await;
    let prompt = words(100, 64);
    let body = json!({"text": prompt, "sampling_params": {"max_new_tokens": 6, "ignore_eos": true}});
    let whole = harness.post_json("/generate", &body).await;
    let meta = &whole["meta_info"];
    assert_eq!(meta["prompt_tokens"], 64);
    assert_eq!(meta["completion_tokens"], 6);
    assert_eq!(meta["cached_tokens"], 0);
    assert_eq!(meta["finish_reason"], json!({"type": "length", "length": 6}));
    let text = whole["text"].as_str().unwrap().to_string();

    // The same prompt as token ids: 48 of 64 tokens come from the prefix cache (the last block is
    // recomputed with the last token).
    let ids = kvgate_engine::tokenize(&prompt);
    let body = json!({"input_ids": ids, "stream": true,
        "sampling_params": {"max_new_tokens": 6, "ignore_eos": true}});
    let events = harness.post_sse("/generate", &body).await;
    assert_eq!(events.len(), 6 + 1 + 1);
    assert_eq!(events[7], "[DONE]");
    let last: Value = serde_json::from_str(&events[6]).unwrap();
    assert_eq!(last["text"].as_str().unwrap(), text, "cumulative text");
    assert_eq!(last["meta_info"]["cached_tokens"], 48);
    let third: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(third["meta_info"]["completion_tokens"], 3);
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_length_honours_max_tokens() {
    let harness = fast_engine().await;
    let completion_tokens = |body: Value| {
        let harness = &harness;
        async move {
            let whole = harness.post_json("/v1/completions", &body).await;
            whole["usage"]["completion_tokens"].as_u64().unwrap()
        }
    };
    // Without ignore_eos: a natural length of 8..=64, capped by max_tokens.
    for start in 0..5 {
        let natural = completion_tokens(json!({"prompt": words(start * 10, 10),
            "max_tokens": 1000}))
        .await;
        assert!((8..=64).contains(&natural), "{natural}");
        let capped = completion_tokens(json!({"prompt": words(start * 10, 10),
            "max_tokens": 4}))
        .await;
        assert_eq!(capped, 4);
    }
    // max_completion_tokens on chat, and the default when nothing is given (16).
    let chat = harness
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 70, "ignore_eos": true}),
        )
        .await;
    assert_eq!(chat["usage"]["completion_tokens"], 70);
    let default = completion_tokens(json!({"prompt": "a b", "ignore_eos": true})).await;
    assert_eq!(default, 16);
    harness.fleet.shutdown().await;

    let forced = spawn(|args| {
        args.time_scale = 50.0;
        args.force_max_tokens = true;
    })
    .await;
    let whole = forced.post_json("/v1/completions", &json!({"prompt": "a b", "max_tokens": 90})).await;
    assert_eq!(whole["usage"]["completion_tokens"], 90);
    forced.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_impossible_requests_get_openai_errors() {
    let harness = spawn(|args| {
        args.time_scale = 50.0;
        args.engine_flags.kv_capacity_tokens = Some(256);
    })
    .await;
    for path in ["/v1/chat/completions", "/v1/completions", "/generate"] {
        let response = harness
            .client
            .post(format!("{}{path}", harness.url))
            .header("content-type", "application/json")
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{path}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["type"], "invalid_request_error");
        assert_eq!(error["error"]["code"], 400);
        assert!(error["error"]["message"].as_str().unwrap().contains("JSON"));
    }
    let missing = harness.post("/v1/chat/completions", &json!({"model": "m"})).await;
    assert_eq!(missing.status(), 400);
    let no_prompt = harness.post("/generate", &json!({"sampling_params": {}})).await;
    assert_eq!(no_prompt.status(), 400);
    // 300 prompt tokens cannot fit a 256-token KV cache.
    for stream in [false, true] {
        let too_long =
            harness.post("/v1/completions", &json!({"prompt": words(0, 300), "stream": stream})).await;
        assert_eq!(too_long.status(), 400);
        let error: Value = too_long.json().await.unwrap();
        assert!(error["error"]["message"].as_str().unwrap().contains("KV"));
    }
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_of_several_workers_on_distinct_ports() {
    let harness = spawn(|args| {
        args.count = 3;
        args.time_scale = 50.0;
    })
    .await;
    let urls = harness.fleet.urls();
    assert_eq!(urls.len(), 3);
    for url in &urls {
        let response = harness.client.get(format!("{url}/health")).send().await.unwrap();
        assert_eq!(response.status(), 200);
    }
    let mut unique = urls.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 3);
    harness.fleet.shutdown().await;
}
