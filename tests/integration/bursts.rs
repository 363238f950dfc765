//! A burst of requests as RL rollouts send them (docs/SCENARIOS.md S10: a step's prompts each
//! sampled n times at once) through a gateway tokenizing for the exact index on one thread: every
//! request waits for its tokens and is routed on the exact index, none on its text because the
//! tokenizer's queue filled (its old size, 64, took a third of this burst), none lost or refused.

use crate::common;

use common::{client, eventually, gateway, metric, metrics_text, wait_kv_events_flowing};
use futures_util::future::join_all;
use kvgate_mock::{spawn_fleet, MockArgs};
use serde_json::json;

const MODEL: &str = "mock-model";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_rollout_samples_is_routed_on_the_exact_index() {
    let mut args = MockArgs { count: 4, time_scale: 50.0, ..MockArgs::default() };
    args.kv_events_base_port = Some(0);
    args.kv_events_replay_base_port = Some(0);
    let fleet = spawn_fleet(args).await.expect("the mock fleet starts");
    let mut cfg = common::kv_events_config(&fleet);
    cfg.alignment_probe = false;
    cfg.tokenizer_threads = Some(1);
    let gw = gateway(cfg).await;
    wait_kv_events_flowing(&gw).await;
    // 16 prompts of 2,000 words (about 17 KB each: tokenized on the pool, not inline), each
    // sampled 12 times, all sent at once.
    let (prompts, samples) = (16, 12);
    let url = format!("{}/v1/completions", gw.url());
    let sends = (0..prompts * samples).map(|i| {
        let prompt = (0..2000).map(|w| format!("p{}w{w}", i % prompts)).collect::<Vec<_>>().join(" ");
        let (client, url) = (client(), url.clone());
        async move {
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
            let res = client.post(url).json(&body).send().await.expect("answered");
            let status = res.status();
            res.bytes().await.expect("the whole answer");
            status
        }
    });
    let statuses = join_all(sends).await;
    assert!(statuses.iter().all(|s| s.is_success()), "every request served: {statuses:?}");
    let sent = (prompts * samples) as f64;
    let exact = "kvgate_routing_decisions_total{index=\"exact\"}";
    let mut text = String::new();
    let counted = eventually(10.0, async || {
        text = metrics_text(&gw).await;
        metric(&text, "kvgate_routing_decisions_total") >= sent
    })
    .await;
    assert!(counted, "every request's decision counted:\n{text}");
    assert_eq!(metric(&text, "kvgate_tokenize_limited_total"), 0.0, "{text}");
    assert_eq!(metric(&text, exact), sent, "every request routed on the exact index:\n{text}");
    gw.shutdown().await;
    fleet.shutdown().await;
}
