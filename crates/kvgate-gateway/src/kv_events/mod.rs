//! KV events: each worker that publishes them gets one subscription per data-parallel rank,
//! feeding its model's exact block index (`kvgate-index`), with replay at start, after gaps and
//! after engine restarts. Where a worker's events come from is configuration data
//! (`config::KvEventsSource`).

mod sequence;
mod subscriber;

use std::sync::Arc;

use crate::metrics::KvEventsMetrics;
use crate::registry::Registry;
use crate::worker::Worker;

/// What the subscriptions are built from: the registry (to find a worker's exact index once its
/// model is known), their metrics, and the topic they subscribe to.
#[derive(Clone)]
pub struct KvEvents {
    pub registry: Arc<Registry>,
    pub metrics: KvEventsMetrics,
    /// `--kv-events-topic`.
    pub topic: String,
}

impl KvEvents {
    /// Starts the worker's subscriptions (nothing without a KV events source); the worker keeps
    /// their handles and stops them when it is removed.
    pub fn subscribe(&self, worker: &Arc<Worker>) {
        let Some(source) = &worker.kv_events else { return };
        let tasks = source
            .ranks
            .iter()
            .enumerate()
            .map(|(rank, endpoints)| {
                let subscription = subscriber::RankSubscription {
                    registry: self.registry.clone(),
                    metrics: self.metrics.clone(),
                    worker: worker.clone(),
                    rank: rank as u32,
                    endpoints: endpoints.clone(),
                    topic: self.topic.clone(),
                };
                tokio::spawn(subscription.run()).abort_handle()
            })
            .collect();
        worker.set_kv_tasks(tasks);
    }
}
