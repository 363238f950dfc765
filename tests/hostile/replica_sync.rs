//! A publisher on the replica-sync channel that is no replica: a forged record claiming 10^9
//! requests in flight on one worker moved all traffic off it, an 18 MB record took a replica to
//! 320 MB, 55,000 messages with random replica ids cost 60-75% CPU. Now every message must carry
//! the HMAC of the deployment's secret; the rest is dropped unread (and counted), and oversized
//! messages are not even checked.

use kvgate_gateway::GatewayHandle;

use crate::common::redis::{publish, Redis};
use crate::common::{config, gateway, upstream, wait_metric};

const CHANNEL: &str = "kvgate:replica-sync";

/// The unsigned MessagePack message of the wire format before signing: `[replica, routed,
/// in_flight]`, claiming `count` requests in flight on `worker`.
fn forged(replica: u64, worker: &str, count: u64) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_str, write_uint};
    let mut message = Vec::new();
    write_array_len(&mut message, 3).unwrap();
    write_uint(&mut message, replica).unwrap();
    write_array_len(&mut message, 0).unwrap();
    write_array_len(&mut message, 1).unwrap();
    write_array_len(&mut message, 2).unwrap();
    write_str(&mut message, worker).unwrap();
    write_uint(&mut message, count).unwrap();
    message
}

async fn wait_peers(replicas: &[&GatewayHandle]) {
    for gw in replicas {
        assert_eq!(
            wait_metric(gw, "kvgate_replica_sync_peers", 1.0).await,
            1.0,
            "the replicas hear each other"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_flooding_and_oversized_sync_messages_change_nothing() {
    let Some(redis) = Redis::start() else { return };
    let worker = upstream("w", "m").await;
    let mut cfg = config(vec![worker.url.clone()]);
    cfg.replica_sync_redis_url = Some(redis.url());
    cfg.replica_sync_secret = Some("hostile-neighbours-test-secret".into());
    cfg.replica_sync_interval_ms = 50;
    let (a, b) = (gateway(cfg.clone()).await, gateway(cfg).await);
    wait_peers(&[&a, &b]).await;
    // One forged claim, then 2,000 more from random replica ids, then one of 18 MB.
    let mut payloads = vec![forged(7, &worker.url, 1_000_000_000)];
    payloads.extend((0..2000u64).map(|i| forged(1000 + i, &worker.url, 1_000_000_000)));
    payloads.push(vec![0x90; 18 << 20]);
    let reached = publish(redis.port, CHANNEL, &payloads).await;
    assert!(reached.iter().all(|&subscribers| subscribers == 2), "both replicas received every message");
    for gw in [&a, &b] {
        let unsigned = "kvgate_replica_sync_errors_total{kind=\"unsigned\"}";
        assert_eq!(wait_metric(gw, unsigned, 2001.0).await, 2001.0);
        let oversized = "kvgate_oversized_answers_total{source=\"replica_sync\"}";
        assert_eq!(wait_metric(gw, oversized, 1.0).await, 1.0);
        let claimed = gw.peer_in_flight();
        assert_eq!(claimed.get(&worker.url), None, "no request counts in flight on the worker: {claimed:?}");
        // Still exactly one peer (a flood of replica ids added none).
        assert_eq!(wait_metric(gw, "kvgate_replica_sync_peers", 1.0).await, 1.0, "still one peer");
    }
    a.shutdown().await;
    b.shutdown().await;
}
