//! kv_aware learns the engine it has (issue 39 item 4): a `kvgate mock` engine eight times
//! slower than kv_aware's configured prefill rate, streamed token-id prompts of varied lengths
//! one at a time; after [`LEARN`] answers the predicted time to first token
//! (`x-kvgate-predicted-ttft`'s total) is within 20% of the one the client measures in the
//! median (and 6 of 8 answers within 30%), where the first prediction was off by more than half. Each answer takes 0.3-1 s, so that the machine's
//! other work (tests run in parallel) stays small beside it. Bounded: 32 requests of at most ~1 s.

use crate::common;

use std::time::{Duration, Instant};

use common::{client, config, gateway, mock_fleet};
use kvgate_policy::{PolicyConfig, PolicyKind};
use serde_json::json;

/// Answers the fit learns from before its predictions are checked (`rate/ttft.rs`).
const LEARN: usize = 24;
const CHECKED: usize = 8;

/// The predicted total, in seconds, from the header.
fn predicted_total(header: &str) -> f64 {
    header
        .split("; ")
        .find_map(|term| term.strip_prefix("total="))
        .and_then(|ms| ms.trim_end_matches("ms").parse::<f64>().ok())
        .map(|ms| ms / 1e3)
        .unwrap_or_else(|| panic!("a total term in {header}"))
}

#[tokio::test]
async fn predicted_ttft_converges_to_the_engines_within_twenty_percent() {
    // 1,000 prompt tokens/s; kv_aware starts at 8,000.
    let fleet = mock_fleet(|args| {
        args.count = 1;
        args.engine_flags.prefill_tokens_per_sec = Some(1_000.0);
    })
    .await;
    let routing = PolicyConfig { policy: PolicyKind::KvAware, ..PolicyConfig::default() };
    let mut cfg = config(fleet.urls());
    cfg.routing = routing;
    cfg.expose_routing_headers = true;
    // One load report (at the start): the rates come from the answers alone, as behind vLLM,
    // whose reports say no prefill queued; and no stale report's queue (one taken mid-prefill)
    // is carried into the next request's prediction.
    cfg.load_monitor_interval_ms = 600_000;
    let gw = gateway(cfg).await;
    let url = format!("{}/v1/completions", gw.url());
    let mut ratios = Vec::new();
    for i in 0..LEARN + CHECKED {
        // Distinct tokens (nothing cached), 300 to 999 of them.
        let len = 300 + (i * 97) % 700;
        let tokens: Vec<u32> = (0..len as u32).map(|t| 10_000 + (i as u32) * 1_000 + t).collect();
        let body = json!({"model": "mock-model", "prompt": tokens, "max_tokens": 2, "stream": true});
        let sent = Instant::now();
        let mut res = client().post(&url).json(&body).timeout(Duration::from_secs(20)).send().await.unwrap();
        assert_eq!(res.status(), 200);
        let header = res.headers()["x-kvgate-predicted-ttft"].to_str().unwrap().to_string();
        let predicted = predicted_total(&header);
        res.chunk().await.unwrap().expect("a first chunk");
        let measured = sent.elapsed().as_secs_f64();
        while res.chunk().await.unwrap().is_some() {}
        ratios.push(predicted / measured);
    }
    assert!(ratios[0] < 0.5, "the configured rate predicts too fast at first: {ratios:?}");
    let checked = &ratios[LEARN..];
    let within = checked.iter().filter(|r| (*r - 1.0).abs() <= 0.3).count();
    assert!(within * 4 >= CHECKED * 3, "predicted / measured after {LEARN} answers: {checked:?}");
    let mut sorted = checked.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = (sorted[CHECKED / 2 - 1] + sorted[CHECKED / 2]) / 2.0;
    assert!((median - 1.0).abs() <= 0.2, "median predicted / measured {median}: {checked:?}");
    gw.shutdown().await;
}
