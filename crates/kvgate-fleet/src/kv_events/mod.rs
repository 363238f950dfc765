//! KV events: each worker that publishes them gets one subscription per data-parallel rank,
//! feeding its model's exact block index (`kvgate-index`), with replay at start, after gaps and
//! after engine restarts. Where a worker's events come from is configuration data
//! (`config::KvEventsSource`).

mod subscriber;

use std::sync::Arc;

use prometheus::IntCounterVec;

use crate::load_snapshot::LoadSnapshot;
use crate::registry::Registry;
use crate::worker::Worker;
use kvgate_gateway_core::metrics::KvEventsMetrics;

/// What the subscriptions are built from: the registry (to find a worker's exact index once its
/// model is known), the load snapshot (an engine's reported KV capacity bounds its blocks),
/// their metrics, the topic they subscribe to and their bounds.
#[derive(Clone)]
pub struct KvEvents {
    pub registry: Arc<Registry>,
    pub loads: Arc<LoadSnapshot>,
    pub metrics: KvEventsMetrics,
    /// `kvgate_oversized_answers_total{source}`.
    pub oversized: IntCounterVec,
    /// `--kv-events-topic`.
    pub topic: String,
    pub limits: KvEventLimits,
}

/// What one engine may send and have indexed.
#[derive(Clone, Copy, Debug)]
pub struct KvEventLimits {
    /// `--kv-events-max-message-bytes`: a larger message (live or replayed) is dropped.
    pub max_message_bytes: usize,
    /// `--kv-index-max-blocks-per-worker`: blocks held per cache when the engine reports no
    /// capacity.
    pub max_blocks_per_worker: usize,
    /// `--kv-index-capacity-slack`: the engine's reported capacity times this, in blocks.
    pub capacity_slack: f64,
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
                    loads: self.loads.clone(),
                    metrics: self.metrics.clone(),
                    oversized: self.oversized.clone(),
                    limits: self.limits,
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
