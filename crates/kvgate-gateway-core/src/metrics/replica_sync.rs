//! The replica-sync metric families, registered with the gateway's other metrics.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

#[derive(Clone)]
pub struct ReplicaSyncMetrics {
    /// 1 while this replica is connected to Redis (publishing and subscribed), else 0.
    pub connected: IntGauge,
    /// Peers whose in-flight counts are fresh.
    pub peers: IntGauge,
    pub errors: IntCounterVec,
    pub published: IntCounter,
    pub applied: IntCounter,
}

impl ReplicaSyncMetrics {
    pub fn register(registry: &Registry) -> Self {
        let gauge = |name: &str, help: &str| {
            let gauge = IntGauge::new(name, help).expect("valid metric");
            registry.register(Box::new(gauge.clone())).expect("unique metric");
            gauge
        };
        let counter = |name: &str, help: &str| {
            let counter = IntCounter::new(name, help).expect("valid metric");
            registry.register(Box::new(counter.clone())).expect("unique metric");
            counter
        };
        let errors = IntCounterVec::new(
            Opts::new(
                "kvgate_replica_sync_errors_total",
                "Replica-sync failures by kind (connect, publish, subscription, queue_full: each leaves \
                 routing on local state) and peers' messages dropped (unsigned: not signed with the \
                 secret; decode, stale, replayed, too_many_peers, record_too_large).",
            ),
            &["kind"],
        )
        .expect("valid metric");
        registry.register(Box::new(errors.clone())).expect("unique metric");
        Self {
            connected: gauge(
                "kvgate_replica_sync_connected",
                "1 while the replica-sync connection to Redis is up (publishing and subscribed), else 0.",
            ),
            peers: gauge("kvgate_replica_sync_peers", "Peer replicas whose in-flight counts are fresh."),
            errors,
            published: counter(
                "kvgate_replica_sync_records_published_total",
                "Routing records this replica published to its peers.",
            ),
            applied: counter(
                "kvgate_replica_sync_records_applied_total",
                "Peers' routing records applied to this replica's peer block index.",
            ),
        }
    }
}
