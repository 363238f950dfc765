//! KV events: each worker that publishes them gets one subscription per data-parallel rank,
//! feeding its model's exact block index (`kvgate-index`), with replay at start, after gaps and
//! after engine restarts.

mod sequence;
mod source;
mod subscriber;

use std::sync::Arc;

pub use source::{KvEventsSource, RankEndpoints, NO_ENDPOINT};

use crate::state::SharedState;
use crate::worker::Worker;

/// Starts the worker's subscriptions (nothing without a KV events source); the worker keeps
/// their handles and stops them when it is removed.
pub(crate) fn subscribe(state: &SharedState, worker: &Arc<Worker>) {
    let Some(source) = &worker.kv_events else { return };
    let tasks = source
        .ranks
        .iter()
        .enumerate()
        .map(|(rank, endpoints)| {
            let subscription = subscriber::RankSubscription {
                state: state.clone(),
                worker: worker.clone(),
                rank: rank as u32,
                endpoints: endpoints.clone(),
                topic: state.config.kv_events_topic.clone(),
            };
            tokio::spawn(subscription.run()).abort_handle()
        })
        .collect();
    worker.set_kv_tasks(tasks);
}
