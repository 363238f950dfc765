//! What a running gateway shows the program that embeds it beyond HTTP: a few narrow reads for
//! tests and tools (what the exact index holds, checked against the engines' caches; the peers'
//! requests in flight; the metrics without a connection; the idle upstream connections a
//! file-descriptor check accounts for).
//! The assembled state itself stays the gateway's own; workers' status is `GET /workers`.

use std::collections::HashMap;
use std::sync::Arc;

use kvgate_index::BlockIndex;

use crate::server::GatewayHandle;

impl GatewayHandle {
    /// The exact KV index of `model`'s regular pool, fed by its engines' KV events: which blocks
    /// the gateway believes each worker holds, by worker id (`worker_id`). `None` before the
    /// model has a regular pool.
    pub fn exact_index(&self, model: &str) -> Option<Arc<BlockIndex>> {
        let snapshot = self.state.registry.snapshot();
        let pool = snapshot.models.get(model)?.regular.clone()?;
        Some(pool.prefix.exact.clone())
    }

    /// The id the worker named `url` has in this gateway's indexes (`GET /workers` shows it too),
    /// while it is registered.
    pub fn worker_id(&self, url: &str) -> Option<u32> {
        self.state.registry.snapshot().find(url).map(|worker| worker.id)
    }

    /// The requests the other gateway replicas report in flight, by worker URL (empty without
    /// `--replica-sync-redis-url`).
    pub fn peer_in_flight(&self) -> Arc<HashMap<String, u64>> {
        self.state.replica_sync.as_ref().map(|sync| sync.peer_in_flight()).unwrap_or_default()
    }

    /// The Prometheus text `GET /metrics` answers, read without a connection (a count of
    /// client connections read over one would count itself).
    pub fn render_metrics(&self) -> String {
        self.state.metrics.render()
    }

    /// Keep-alive connections to the workers lying idle in their pools, summed over the workers.
    pub fn idle_upstream_connections(&self) -> usize {
        self.state.registry.snapshot().workers.iter().map(|worker| worker.conns.idle_count()).sum()
    }
}
