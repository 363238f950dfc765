//! Approximate routing across gateway replicas through Redis (`--replica-sync-redis-url`): each
//! replica publishes a compact record of every request it routes on its approximate index
//! (model, the prompt's chained block hashes, the worker) and its in-flight count per worker;
//! it applies its peers' records to its model pools' peer block index and adds their in-flight
//! counts to its candidates'. Redis is optional and never on the request path: the request path
//! only queues a record (dropped when the queue is full), and a lost Redis leaves each replica
//! routing on its own state, with a warning and `kvgate_replica_sync_connected 0`, until it
//! reconnects (with backoff).

mod session;
mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tokio::sync::mpsc;

pub use session::{run, SyncSettings};
pub use wire::Routed;

use crate::metrics::ReplicaSyncMetrics;

/// Routing records waiting to be published; beyond this they are dropped (and counted).
const QUEUE: usize = 4096;

/// A replica's side of the synchronisation, shared by the request path and the sync task.
pub struct ReplicaSync {
    /// This replica's random id (its own messages come back on the channel and are skipped).
    pub replica: u64,
    outgoing: mpsc::Sender<Routed>,
    receiver: Mutex<Option<mpsc::Receiver<Routed>>>,
    /// The peers' requests in flight per worker URL (summed over fresh peers).
    peer_in_flight: ArcSwap<HashMap<String, u64>>,
    metrics: ReplicaSyncMetrics,
}

impl ReplicaSync {
    pub fn new(metrics: ReplicaSyncMetrics) -> Self {
        let (outgoing, receiver) = mpsc::channel(QUEUE);
        Self {
            replica: rand::random(),
            outgoing,
            receiver: Mutex::new(Some(receiver)),
            peer_in_flight: ArcSwap::from_pointee(HashMap::new()),
            metrics,
        }
    }

    /// Queues a routing record for the peers (never waits; a full queue drops it).
    pub fn publish(&self, routed: Routed) {
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
