//! `/v1/loads` and `/metrics` follow a running request, a queued one, and a client disconnect.

mod common;

use std::time::Duration;

use common::{spawn, words, Harness};
use kvgate_protocol::exposition::Selector;
use serde_json::{json, Value};

/// Polls `/v1/loads` (at most 100 times, 20 ms apart) until `accept` holds; returns that load.
async fn wait_for_load(harness: &Harness, accept: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..100 {
        last = harness.loads().await;
        if accept(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("load never matched; last: {last}");
}

/// The mock's series `name` of its model, read as the gateway reads an engine's `/metrics`.
fn metric(text: &str, name: &str) -> f64 {
    let selector = format!(r#"{name}{{model_name="mock-model"}}"#);
    let series = Selector::parse(&selector).unwrap();
    series.first(text).unwrap_or_else(|| panic!("{selector} missing in {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_and_metrics_reflect_running_and_waiting_requests() {
    // 400 prompt tokens at 100 tokens/s: 4 s of prefill; one request runs at a time.
    let harness = spawn(|args| {
        args.engine_flags.prefill_tokens_per_sec = Some(100.0);
        args.engine_flags.max_running_requests = Some(1);
    })
    .await;
    let idle = harness.loads().await;
    assert_eq!(idle["num_running_reqs"], 0);
    assert_eq!(idle["max_total_num_tokens"], 262_144);
    assert_eq!(idle["max_running_requests"], 1);

    let send = |start: usize| {
        let client = harness.client.clone();
        let url = format!("{}/v1/completions", harness.url);
        tokio::spawn(async move {
            let body = json!({"prompt": words(start, 400), "max_tokens": 4, "stream": true});
            let response = client.post(url).json(&body).send().await.unwrap();
            response.text().await
        })
    };
    let first = send(0);
    let second = send(1_000);
    let busy =
        wait_for_load(&harness, |load| load["num_running_reqs"] == 1 && load["num_waiting_reqs"] == 1).await;
    assert_eq!(busy["num_total_reqs"], 2);
    // The queued prompt's 400 tokens, and what is left of the running one's prefill.
    let pending = busy["num_waiting_uncached_tokens"].as_u64().unwrap();
    assert!((400..=800).contains(&pending), "{pending}");
    // 400 + 4 tokens in 16-token blocks: 26 blocks of 16384.
    assert_eq!(busy["num_used_tokens"], 26 * 16);
    let usage = busy["token_usage"].as_f64().unwrap();
    assert!((usage - 26.0 / 16_384.0).abs() < 1e-9, "{usage}");
    assert_eq!(busy["utilization"], 1.0);
    let timestamp = harness.get("/v1/loads").await.json::<Value>().await.unwrap()["timestamp"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(timestamp.ends_with('Z') && timestamp.contains('T'), "{timestamp}");

    let metrics = harness.get("/metrics").await.text().await.unwrap();
    assert_eq!(metric(&metrics, "vllm:num_requests_running"), 1.0);
    assert_eq!(metric(&metrics, "vllm:num_requests_waiting"), 1.0);
    assert!(metric(&metrics, "vllm:kv_cache_usage_perc") > 0.0);
    assert!(metrics.contains("# TYPE vllm:prefix_cache_hits_total counter"));
    assert!(metrics.contains("# HELP vllm:prefix_cache_queries_total "));
    // vLLM states its KV capacity as blocks x block size in cache_config_info.
    let blocks = 262_144 / 16;
    assert!(
        metrics.contains("block_size=\"16\"") && metrics.contains(&format!("num_gpu_blocks=\"{blocks}\"")),
        "{metrics}"
    );

    // Client disconnects cancel both requests and release their blocks.
    first.abort();
    second.abort();
    let drained =
        wait_for_load(&harness, |load| load["num_running_reqs"] == 0 && load["num_waiting_reqs"] == 0).await;
    assert_eq!(drained["token_usage"], 0.0);
    let metrics = harness.get("/metrics").await.text().await.unwrap();
    assert_eq!(metric(&metrics, "vllm:num_requests_running"), 0.0);
    harness.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_counters_and_flush() {
    let harness = spawn(|args| args.time_scale = 50.0).await;
    let body = json!({"prompt": words(0, 64), "max_tokens": 2});
    for _ in 0..2 {
        harness.post_json("/v1/completions", &body).await;
    }
    let load = harness.loads().await;
    // The second request is served all but its last block (16 tokens) from cache.
    assert!((load["cache_hit_rate"].as_f64().unwrap() - 48.0 / 128.0).abs() < 1e-9);
    let metrics = harness.get("/metrics").await.text().await.unwrap();
    assert_eq!(metric(&metrics, "vllm:prefix_cache_queries_total"), 128.0);
    assert_eq!(metric(&metrics, "vllm:prefix_cache_hits_total"), 48.0);

    let flushed = harness.client.post(format!("{}/flush_cache", harness.url)).send().await;
    assert_eq!(flushed.unwrap().status(), 200);
    let again = harness.post_json("/v1/completions", &body).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    harness.fleet.shutdown().await;
}
