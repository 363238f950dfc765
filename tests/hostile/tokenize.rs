//! Conversations that would stall the I/O threads: two clients sending 10,000-message chats
//! made a tiny chat on the same gateway take 14.9 s instead of 2.5 ms, because tokenizing ran
//! inline on the I/O threads. Now it runs on the tokenizer threads, a conversation is tokenized
//! up to `--max-tokenize-chars` characters, and a small request is served beside them (its latency
//! is printed and recorded in docs/RELIABILITY.md, not asserted: timings flake on shared machines).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvgate_policy::{PolicyKind, PrefixIndexMode};
use serde_json::json;

use crate::common::{client, config, dead_url, eventually, gateway, metric, metrics_text, upstream};

/// A chat of `messages` turns of about 60 characters each.
fn conversation(messages: usize) -> Bytes {
    let messages: Vec<_> = (0..messages)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("message {i}: the quick brown fox jumps over the lazy dog")})
        })
        .collect();
    Bytes::from(serde_json::to_vec(&json!({"model": "tiny-chatml", "messages": messages})).unwrap())
}

/// Median and worst latency of `count` small chats, one after another.
async fn small_requests(url: &str, count: usize) -> (Duration, Duration) {
    let mut latencies = Vec::with_capacity(count);
    for i in 0..count {
        let body =
            json!({"model": "tiny-chatml", "messages": [{"role": "user", "content": format!("hi {i}")}]});
        let started = Instant::now();
        let res = client().post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
        assert_eq!(res.status(), 200);
        res.bytes().await.unwrap();
        latencies.push(started.elapsed());
    }
    latencies.sort();
    (latencies[count / 2], latencies[count - 1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_chat_is_served_beside_ten_thousand_message_chats() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/kvgate-tokenizer/testdata/tiny-chatml");
    let worker = upstream("w", "tiny-chatml").await;
    let mut cfg = config(vec![worker.url.clone()]);
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.routing.prefix_index = PrefixIndexMode::Exact;
    // A worker with KV events (never connected: the index stays empty) makes requests tokenized.
    cfg.kv_events_endpoints = vec![dead_url().await.replace("http://", "tcp://")];
    cfg.tokenizer_path = Some(root);
    cfg.io_threads = Some(1); // the attack and the small requests share the one I/O thread
    cfg.tokenizer_threads = Some(1);
    cfg.max_tokenize_chars = 64 * 1024;
    let gw = gateway(cfg).await;
    let url = gw.url();
    let (baseline, _) = small_requests(&url, 15).await;

    let big = conversation(10_000);
    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = Vec::new();
    for _ in 0..3 {
        let (url, big, stop) = (url.clone(), big.clone(), stop.clone());
        attackers.push(tokio::spawn(async move {
            let mut sent = 0;
            while !stop.load(Ordering::Relaxed) && sent < 50 {
                let res = client()
                    .post(format!("{url}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body(big.clone())
                    .send()
                    .await
                    .unwrap();
                assert_eq!(res.status(), 200);
                res.bytes().await.unwrap();
                sent += 1;
            }
            sent
        }));
    }
    // Wait until the attack is under way: a big conversation went through to the worker.
    let before = worker.requests.load(Ordering::SeqCst);
    let under_way = eventually(60.0, async || worker.requests.load(Ordering::SeqCst) > before).await;
    assert!(under_way, "a big conversation is served within 60 s");
    let (under_attack, worst) = small_requests(&url, 15).await;
    stop.store(true, Ordering::Relaxed);
    let mut big_sent = 0;
    for attacker in attackers {
        big_sent += attacker.await.unwrap();
    }
    eprintln!("small chat: median {baseline:?} alone, {under_attack:?} (worst {worst:?}) beside {big_sent} 10,000-message chats");
    // The latency itself is a measurement, not an assertion (timed assertions flake on a loaded
    // machine): the figures printed above are recorded in docs/RELIABILITY.md. What is asserted
    // is that every small chat was served during the attack (`small_requests` checks each
    // status) while the big ones went through, cut to prefixes.
    assert!(big_sent >= 1, "the attack was under way while the small chats were served");
    let prefixes = "kvgate_tokenize_limited_total{endpoint=\"chat_completions\",reason=\"prefix\"}";
    assert!(
        metric(&metrics_text(&gw).await, prefixes) >= 1.0,
        "the big conversations were tokenized as prefixes"
    );
    gw.shutdown().await;
}
