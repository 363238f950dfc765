//! Approximate routing across gateway replicas through Redis (`--replica-sync-redis-url`): each
//! replica publishes a compact record of every request it routes on its approximate index
//! (model, the prompt's chained block hashes, the worker) and its in-flight count per worker;
//! it applies its peers' records to its model pools' peer block index and adds their in-flight
//! counts to its candidates'. Redis is optional and never on the request path: the request path
//! only queues a record (dropped when the queue is full), and a lost Redis leaves each replica
//! routing on its own state, with a warning and `kvgate_replica_sync_connected 0`, until it
//! reconnects (with backoff).

mod session;
#[cfg(test)]
mod tests;
mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::mpsc;

pub use session::{run, SyncSettings};
pub use wire::Routed;
use wire::Seal;

use kvgate_gateway_core::metrics::ReplicaSyncMetrics;

/// Routing records waiting to be published; beyond this they are dropped (and counted).
const QUEUE: usize = 4096;

/// What a replica accepts from its peers (`--replica-sync-max-*`).
#[derive(Clone, Debug)]
pub struct SyncLimits {
    /// Largest message read (larger ones are dropped before their tag is checked).
    pub max_message_bytes: usize,
    /// Most block hashes in one routing record (this replica's own are cut to it; a peer's
    /// longer record is dropped alone).
    pub max_hashes_per_record: usize,
    /// Most peers tracked at once; messages of further replica ids are dropped.
    pub max_peers: usize,
    /// Most requests one peer may claim in flight on one worker (larger claims are clamped).
    pub max_peer_in_flight: u64,
    /// Oldest message accepted (and the largest clock difference tolerated).
    pub max_age: Duration,
}

/// A replica's side of the synchronisation, shared by the request path and the sync task.
pub struct ReplicaSync {
    /// This replica's random id (its own messages come back on the channel and are skipped).
    pub replica: u64,
    seal: Seal,
    limits: SyncLimits,
    outgoing: mpsc::Sender<Routed>,
    receiver: Mutex<Option<mpsc::Receiver<Routed>>>,
    /// The peers' requests in flight per worker URL (summed over fresh peers).
    peer_in_flight: ArcSwap<HashMap<String, u64>>,
    metrics: ReplicaSyncMetrics,
    /// `kvgate_oversized_answers_total{source="replica_sync"}`.
    oversized: prometheus::IntCounter,
}

impl ReplicaSync {
    /// `secret` signs this replica's messages and authenticates its peers'; `oversized` counts
    /// messages past `limits.max_message_bytes`.
    pub fn new(
        metrics: ReplicaSyncMetrics,
        oversized: prometheus::IntCounter,
        secret: &[u8],
        limits: SyncLimits,
    ) -> Self {
        let (outgoing, receiver) = mpsc::channel(QUEUE);
        Self {
            replica: rand::random(),
            seal: Seal::new(secret),
            limits,
            outgoing,
            receiver: Mutex::new(Some(receiver)),
            peer_in_flight: ArcSwap::from_pointee(HashMap::new()),
            metrics,
            oversized,
        }
    }

    /// Queues a routing record for the peers (never waits; a full queue drops it). Its hashes
    /// are cut to `--replica-sync-max-hashes-per-record` (the prompt's first blocks).
    pub fn publish(&self, mut routed: Routed) {
        routed.hashes.truncate(self.limits.max_hashes_per_record);
        if self.outgoing.try_send(routed).is_err() {
            self.metrics.errors.with_label_values(&["queue_full"]).inc();
        }
    }

    /// The peers' in-flight requests per worker URL.
    pub fn peer_in_flight(&self) -> Arc<HashMap<String, u64>> {
        self.peer_in_flight.load_full()
    }

    fn set_peer_in_flight(&self, counts: HashMap<String, u64>) {
        self.peer_in_flight.store(Arc::new(counts));
    }

    /// The queue's receiving end, for the one sync task.
    fn take_receiver(&self) -> Option<mpsc::Receiver<Routed>> {
        self.receiver.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}
