//! A KV event publisher that claims more than its engine can hold: one event of a million
//! blocks was accepted whole (RSS 33 to 351 MB, kept after the publisher left). Now a message
//! over `--kv-events-max-message-bytes` is dropped undecoded, an event over the cache's bound
//! (`--kv-index-max-blocks-per-worker`, or the engine's capacity times the slack) is refused
//! alone, both are counted, and the subscription goes on.

use kvgate_index::PrefixMatch;
use kvgate_policy::PolicyKind;

use crate::common::kv_wire::{batch, block_stored, Publisher};
use crate::common::{config, eventually, gateway, metric, metrics_text, upstream, wait_metric};

/// A BlockStored event of `blocks` one-token blocks (block size 1 keeps the message small).
fn huge_event(blocks: u64) -> Vec<u8> {
    let hashes: Vec<u64> = (0..blocks).map(|i| (1 << 40) + i).collect();
    let tokens: Vec<u32> = (0..blocks as u32).collect();
    batch(&[block_stored(&hashes, None, &tokens, 1)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_past_the_engine_capacity_is_refused_alone() {
    let worker = upstream("w", "m").await;
    let mut publisher = Publisher::bind().await;
    let mut cfg = config(vec![worker.url.clone()]);
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.kv_events_endpoints = vec![publisher.endpoint.clone()];
    cfg.mock_tokenizer = true;
    cfg.kv_events_max_message_bytes = 8 << 20;
    cfg.kv_index_max_blocks_per_worker = 1000;
    let gw = gateway(cfg).await;
    publisher
        .wait_subscribed(async || metric(&metrics_text(&gw).await, "kvgate_kv_events_batches_total") > 0.0)
        .await;
    // A million blocks, about 14 MB: dropped before decoding.
    publisher.publish(huge_event(1_000_000)).await;
    assert_eq!(wait_metric(&gw, "kvgate_oversized_answers_total{source=\"kv_events\"}", 1.0).await, 1.0);
    // 500,000 blocks in a message under the size bound: decoded, refused by the block bound.
    publisher.publish(huge_event(500_000)).await;
    let refused = "kvgate_kv_events_refused_total{reason=\"over_capacity\"}";
    assert_eq!(wait_metric(&gw, refused, 1.0).await, 1.0);
    // The next events within the bound are applied: the subscription survived.
    publisher.publish(batch(&[block_stored(&[1, 2], None, &[7, 8, 9, 10], 2)])).await;
    let index = gw.exact_index("m").unwrap();
    let id = gw.worker_id(&worker.url).unwrap();
    let applied = eventually(5.0, async || {
        let mut matched = PrefixMatch::default();
        index.overlap(&[7, 8, 9, 10], kvgate_index::Namespace::BASE, &mut matched);
        matched.best() == 4
    })
    .await;
    assert!(applied, "a batch after the refused ones is applied");
    assert!(index.worker_blocks(id) <= 1000, "the cache holds at most its bound");
    gw.shutdown().await;
}
