//! Publishes an engine's KV events over ZMQ PUB in the chosen engine version's wire format (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`), keeping them for replay and dropping some on request (fault injection).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use kvgate_engine::{KvEvent, KvEventBatch};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::args::KvEventEncoding;
use crate::driver::EngineClock;
use crate::error::MockError;
use crate::kv_replay::ReplayBuffer;
use crate::kv_wire::encode;
use crate::shutdown::stopped;

/// Fault injection: lost messages (batches that are numbered and buffered but not sent on PUB),
/// and stores that state another block size than the engine's.
#[derive(Debug, Default)]
pub(crate) struct KvEventFaults {
    /// Every K-th batch (seq K-1, 2K-1, ...) is dropped.
    drop_every: Option<u64>,
    /// The next this many batches are dropped.
    drop_next: AtomicUsize,
    /// `--kv-events-block-size-override`: the block size every store states.
    block_size_override: Option<u32>,
}

impl KvEventFaults {
    pub(crate) fn new(drop_every: Option<u64>, block_size_override: Option<u32>) -> Self {
        Self {
            drop_every: drop_every.filter(|&every| every > 0),
            drop_next: AtomicUsize::new(0),
            block_size_override,
        }
    }

    /// The batch as published: its stores stating the overriding block size, if any.
    fn restate(&self, mut batch: KvEventBatch) -> KvEventBatch {
        if let Some(size) = self.block_size_override {
            for event in &mut batch.events {
                // Offload placeholders (no tokens, size 0) stay as they are.
                if let KvEvent::BlockStored { block_size, .. } = event {
                    if *block_size > 0 {
                        *block_size = size;
                    }
                }
            }
        }
        batch
    }

    /// Drops the next `n` batches (on top of any still pending).
    pub(crate) fn drop_next(&self, n: usize) {
        let _ = self
            .drop_next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |pending| Some(pending.saturating_add(n)));
    }

    /// Whether the batch numbered `seq` is to be lost (consumes one pending `drop_next`).
    fn take_drop(&self, seq: u64) -> bool {
        let pending = self
            .drop_next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |pending| pending.checked_sub(1));
        pending.is_ok() || self.drop_every.is_some_and(|every| seq % every == every - 1)
    }
}

/// What a publisher does with each batch besides sending it.
pub(crate) struct PublishOptions {
    pub(crate) topic: String,
    pub(crate) encoding: KvEventEncoding,
    /// Where every batch is kept for replay (`None`: replay is off).
    pub(crate) buffer: Option<Arc<ReplayBuffer>>,
    pub(crate) faults: Arc<KvEventFaults>,
}

/// A bound PUB socket and the endpoint subscribers connect to.
pub(crate) struct KvPublisher {
    socket: PubSocket,
    endpoint: String,
}

impl KvPublisher {
    /// Binds a PUB socket on `host:port` (port 0 picks a free one).
    pub(crate) async fn bind(host: &str, port: u16) -> Result<Self, MockError> {
        let mut socket = PubSocket::new();
        let endpoint = socket
            .bind(&format!("tcp://{host}:{port}"))
            .await
            .map_err(|e| MockError::bind(format!("the KV event publisher on {host}:{port}"), e))?;
        Ok(Self { socket, endpoint: endpoint.to_string() })
    }

    /// `tcp://host:port` of the bound socket.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Publishes every batch received on `batches` until `stop` turns true (or the channel
    /// closes), then closes the socket (the port is free again when the task ends).
    pub(crate) fn spawn(
        mut self,
        options: PublishOptions,
        clock: EngineClock,
        mut batches: mpsc::UnboundedReceiver<KvEventBatch>,
        mut stop: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        tokio::spawn(async move {
            let topic = Bytes::from(options.topic.clone().into_bytes());
            loop {
                let batch = tokio::select! {
                    biased;
                    () = stopped(&mut stop) => break,
                    batch = batches.recv() => match batch {
                        Some(batch) => batch,
                        None => break,
                    },
                };
                let batch = options.faults.restate(batch);
                let timestamp_secs = clock.unix_secs_at(batch.timestamp_us);
                let payload = Bytes::from(encode(&batch, timestamp_secs, 0, options.encoding));
                if let Some(buffer) = &options.buffer {
                    buffer.push(batch.seq, payload.clone());
                }
                if options.faults.take_drop(batch.seq) {
                    tracing::debug!(seq = batch.seq, endpoint = %self.endpoint, "KV event batch dropped (fault injection)");
                    continue;
                }
                let mut message = ZmqMessage::from(topic.clone());
                message.push_back(Bytes::copy_from_slice(&batch.seq.to_be_bytes()));
                message.push_back(payload);
                if let Err(error) = self.socket.send(message).await {
                    tracing::warn!(%error, endpoint = %self.endpoint, "KV event publish failed");
                }
            }
            for error in self.socket.close().await {
                tracing::warn!(%error, "closing the KV event publisher");
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_the_next_n_then_every_kth() {
        let faults = KvEventFaults::new(Some(3), None);
        faults.drop_next(2);
        let dropped: Vec<u64> = (0..9).filter(|&seq| faults.take_drop(seq)).collect();
        assert_eq!(dropped, [0, 1, 2, 5, 8]);
        let never = KvEventFaults::new(None, None);
        assert!((0..100).all(|seq| !never.take_drop(seq)));
        never.drop_next(usize::MAX);
        never.drop_next(1);
        assert!(never.take_drop(0));
    }
}
