//! One worker's KV event plumbing: the PUB publisher, the optional replay ROUTER sharing its buffer, and the lost-message fault hook.

use std::sync::Arc;

use kvgate_engine::KvEventBatch;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::args::{worker_port, MockArgs};
use crate::driver::EngineClock;
use crate::error::MockError;
use crate::kv_publisher::{KvEventFaults, KvPublisher, PublishOptions};
use crate::kv_replay::{Framing, ReplayBuffer, ReplayServer};

/// A worker's running KV event sockets.
pub(crate) struct WorkerKvEvents {
    /// Where the engine driver sends its batches.
    pub(crate) batches: mpsc::UnboundedSender<KvEventBatch>,
    pub(crate) endpoint: String,
    pub(crate) replay_endpoint: Option<String>,
    pub(crate) faults: Arc<KvEventFaults>,
    /// The replay buffer, when replay is on.
    pub(crate) buffer: Option<Arc<ReplayBuffer>>,
    /// The publisher's and the replay server's tasks; each closes its socket when `stop` turns true.
    pub(crate) tasks: Vec<JoinHandle<()>>,
}

/// Binds and starts worker `worker_idx`'s KV event sockets; `None` unless
/// `--kv-events-base-port` was given.
pub(crate) async fn start(
    args: &MockArgs,
    worker_idx: usize,
    clock: EngineClock,
    stop: &watch::Receiver<bool>,
) -> Result<Option<WorkerKvEvents>, MockError> {
    let Some(base) = args.kv_events_base_port else { return Ok(None) };
    let publisher = KvPublisher::bind(&args.host, worker_port(base, worker_idx)).await?;
    let replay = match args.kv_events_replay_base_port {
        Some(base) => Some(ReplayServer::bind(&args.host, worker_port(base, worker_idx)).await?),
        None => None,
    };
    let buffer = replay.as_ref().map(|_| Arc::new(ReplayBuffer::new(args.kv_events_buffer_steps)));
    let faults = Arc::new(KvEventFaults::new(args.kv_events_drop_every, args.kv_events_block_size_override));
    let (batches, receiver) = mpsc::unbounded_channel();
    let endpoint = publisher.endpoint().to_string();
    let replay_endpoint = replay.as_ref().map(|replay| replay.endpoint().to_string());
    let mut tasks = Vec::new();
    if let (Some(replay), Some(buffer)) = (replay, &buffer) {
        let framing = Framing {
            format: args.kv_events_encoding.wire_format(),
            topic: bytes::Bytes::from(args.kv_events_topic.clone().into_bytes()),
        };
        tasks.push(replay.spawn(buffer.clone(), framing, stop.clone()));
    }
    let options = PublishOptions {
        topic: args.kv_events_topic.clone(),
        encoding: args.kv_events_encoding,
        buffer: buffer.clone(),
        faults: faults.clone(),
    };
    tasks.push(publisher.spawn(options, clock, receiver, stop.clone()));
    Ok(Some(WorkerKvEvents { batches, endpoint, replay_endpoint, faults, buffer, tasks }))
}
