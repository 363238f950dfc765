//! End-to-end routing quality over HTTP: the gateway in front of simulated engines (kvgate-mock),
//! comparing what the engines themselves report (cached prompt tokens, KV usage).

use crate::common;

use std::time::Duration;

use common::{client, config, gateway, metrics_text};
use kvgate_mock::{spawn_fleet, MockArgs};
use kvgate_policy::{PolicyConfig, PolicyKind};
use serde_json::{json, Value};

/// Run `conversations` multi-turn chats through a gateway with `routing`; return the fraction of
/// prompt tokens the engines served from cache, and the decision reasons seen.
async fn run_conversations(routing: PolicyConfig, conversations: usize, turns: usize) -> (f64, Vec<String>) {
    let fleet = spawn_fleet(MockArgs { count: 4, time_scale: 50.0, ..MockArgs::default() }).await.unwrap();
    let mut cfg = config(fleet.urls());
    cfg.routing = routing;
    cfg.expose_routing_headers = true;
    let gw = gateway(cfg).await;
    let client = client();
    let (mut prompt, mut cached) = (0u64, 0u64);
    let mut reasons = Vec::new();
    for turn in 0..turns {
        for conversation in 0..conversations {
            // Each conversation has its own long system prompt; turns extend the history.
            let system: String = (0..300).map(|i| format!("c{conversation}w{i} ")).collect();
            let mut messages = vec![json!({"role": "system", "content": system})];
            for t in 0..=turn {
                messages.push(json!({"role": "user", "content": format!("question {t} of conversation {conversation}")}));
                if t < turn {
                    messages.push(json!({"role": "assistant", "content": format!("answer {t}")}));
                }
            }
            let res = client
                .post(format!("{}/v1/chat/completions", gw.url()))
                .json(&json!({"model": "mock-model", "messages": messages, "max_tokens": 2}))
                .timeout(Duration::from_secs(20))
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 200);
            reasons.push(res.headers()["x-kvgate-route"].to_str().unwrap().to_string());
            let body: Value = res.json().await.unwrap();
            prompt += body["usage"]["prompt_tokens"].as_u64().unwrap();
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        }
    }
    gw.shutdown().await;
    fleet.shutdown().await;
    (cached as f64 / prompt as f64, reasons)
}

#[tokio::test]
async fn cache_aware_serves_more_prompt_tokens_from_cache_than_round_robin() {
    let (cache_aware, reasons) = run_conversations(PolicyConfig::default(), 7, 4).await;
    let round_robin =
        run_conversations(PolicyConfig { policy: PolicyKind::RoundRobin, ..PolicyConfig::default() }, 7, 4)
            .await
            .0;
    // With 7 conversations (coprime with the 4 engines, so round_robin rotates them) and 4 turns, cache_aware misses only each conversation's first turn.
    assert!(cache_aware > 0.6, "cache_aware hit rate {cache_aware:.2}");
    assert!(cache_aware > round_robin + 0.2, "cache_aware {cache_aware:.2} vs round_robin {round_robin:.2}");
    assert_eq!(reasons.iter().filter(|r| *r == "cache_miss").count(), 7, "{reasons:?}");
}

#[tokio::test]
async fn a_stream_cut_after_bytes_reached_the_client_is_not_retried() {
    let fleet =
        spawn_fleet(MockArgs { count: 2, time_scale: 50.0, cut_stream_rate: 1.0, ..MockArgs::default() })
            .await
            .unwrap();
    let mut cfg = config(fleet.urls());
    cfg.disable_circuit_breaker = true;
    let gw = gateway(cfg).await;
    let res = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&json!({"model": "mock-model", "stream": true, "max_tokens": 32,
            "messages": [{"role": "user", "content": "tell me a long story"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "headers and first bytes were already sent");
    let body = tokio::time::timeout(Duration::from_secs(10), res.text()).await.unwrap();
    // Either the client sees the cut as an error, or a body without the final [DONE].
    assert!(body.map_or(true, |text| !text.contains("[DONE]")));
    let metrics = metrics_text(&gw).await;
    assert!(
        !metrics.contains("kvgate_retries_total{"),
        "no retry after bytes reached the client:\n{metrics}"
    );
    gw.shutdown().await;
    fleet.shutdown().await;
}
