//! One data-parallel rank's KV-event subscription: a ZMQ SUB socket on the engine's publisher,
//! the replay socket asked for history at start, after a gap and after a restart, and the
//! cache's writer into the model's exact index.
//!
//! The index never keeps what it cannot vouch for: a gap that replay cannot fill, a sequence
//! that goes backwards (engine restart), a reconnection and a malformed batch all clear the
//! cache's blocks first.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvgate_index::{BlockIndex, CacheBlocks, CacheId};
use kvgate_kv_events::{decode_message, decode_replay_reply, replay_request, EventBatch, ReplayReply};
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use super::sequence::{apply_batch, Sequence, Verdict};
use crate::config::RankEndpoints;
use crate::metrics::KvEventsMetrics;
use crate::registry::Registry;
use crate::worker::Worker;

/// How long one replay (request to end marker) may take.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Most batches one replay may return (vLLM keeps 10,000 by default).
const REPLAY_MAX_BATCHES: usize = 1_000_000;
/// Connection attempts back off up to this.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// At most one warning per subscription this often; the rest are counted.
const LOG_EVERY: Duration = Duration::from_secs(10);

pub(crate) struct RankSubscription {
    pub(crate) registry: Arc<Registry>,
    pub(crate) metrics: KvEventsMetrics,
    pub(crate) worker: Arc<Worker>,
    pub(crate) rank: u32,
    pub(crate) endpoints: RankEndpoints,
    pub(crate) topic: String,
}

/// The state of a running subscription.
struct Live {
    cache: CacheBlocks,
    sequence: Sequence,
    warned_at: Option<Instant>,
    suppressed: u64,
}

impl RankSubscription {
    pub(crate) async fn run(self) {
        let Some(index) = self.wait_for_index().await else { return };
        let mut live = Live {
            cache: CacheBlocks::new(index, CacheId { worker: self.worker.id, rank: self.rank }),
            sequence: Sequence::default(),
            warned_at: None,
            suppressed: 0,
        };
        let mut socket = self.connect().await;
        let mut monitor = socket.monitor();
        self.resync(&mut live).await;
        self.set_live(true);
        let mut monitor_open = true;
        loop {
            tokio::select! {
                message = socket.recv() => match message {
                    Ok(message) => self.on_message(&mut live, message.into_vec()).await,
                    Err(error) => {
                        tracing::debug!(worker = %self.worker.url, rank = self.rank, %error, "KV event receive failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                event = monitor.next(), if monitor_open => match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        tracing::info!(worker = %self.worker.url, rank = self.rank, "KV event publisher disconnected");
                        self.set_live(false);
                    }
                    Some(SocketEvent::Connected(..)) => {
                        // Whatever happened while we were away, the engine's cache may differ
                        // from what we held: start over from its replay buffer.
                        tracing::info!(worker = %self.worker.url, rank = self.rank, "KV event publisher reconnected");
                        live.cache.clear();
                        live.sequence.reset();
                        self.resync(&mut live).await;
                        self.set_live(true);
                    }
                    Some(_) => {}
                    None => monitor_open = false,
                },
            }
        }
    }

    /// The exact index of the worker's model, once its model is known; `None` if the worker
    /// left the registry first.
    async fn wait_for_index(&self) -> Option<Arc<BlockIndex>> {
        loop {
            let snapshot = self.registry.snapshot();
            snapshot.find(&self.worker.url).filter(|w| w.id == self.worker.id)?;
            if let Some(pool) = snapshot.pool_of(&self.worker) {
                return Some(pool.prefix.exact.clone());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A SUB socket connected and subscribed, retrying with backoff until it is.
    async fn connect(&self) -> SubSocket {
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut options = SocketOptions::default();
            options.connect_timeout(Duration::from_secs(2));
            let mut socket = SubSocket::with_options(options);
            let attempt = async {
                socket.connect(&self.endpoints.events).await.map_err(|e| e.to_string())?;
                socket.subscribe(&self.topic).await.map_err(|e| e.to_string())
            };
            match tokio::time::timeout(Duration::from_secs(3), attempt).await {
                Ok(Ok(())) => {
                    tracing::info!(worker = %self.worker.url, rank = self.rank, endpoint = %self.endpoints.events, "subscribed to KV events");
                    return socket;
                }
                Ok(Err(error)) => {
                    tracing::debug!(endpoint = %self.endpoints.events, %error, "KV event connect failed; retrying")
                }
                Err(_) => {
                    tracing::debug!(endpoint = %self.endpoints.events, "KV event connect timed out; retrying")
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn on_message(&self, live: &mut Live, frames: Vec<bytes::Bytes>) {
        let (seq, batch) = match decode_message(&frames) {
            Ok(decoded) => decoded,
            Err(error) => {
                // Its events are lost: what the index holds for this cache can no longer be trusted.
                self.metrics.malformed.with_label_values(&[&self.worker.url]).inc();
                self.warn(live, &format!("malformed KV event message dropped, cache cleared: {error}"));
                live.cache.clear();
                live.sequence.reset();
                return;
            }
        };
        match live.sequence.check(seq, batch.ts) {
            Verdict::Apply => self.apply(live, seq, &batch),
            Verdict::Duplicate => {}
            Verdict::Gap { expected } => {
                let joined = self.endpoints.replay.is_some() && self.replay_from(live, expected).await;
                let recovered = joined
                    && matches!(live.sequence.check(seq, batch.ts), Verdict::Apply | Verdict::Duplicate);
                let recovery = if recovered { "replay" } else { "cleared" };
                self.metrics.gaps.with_label_values(&[&self.worker.url, recovery]).inc();
                self.warn(
                    live,
                    &format!("KV event sequence gap before {seq} (expected {expected}): {recovery}"),
                );
                self.apply_or_start_over(live, seq, &batch);
            }
            Verdict::Restart => {
                self.metrics.restarts.with_label_values(&[&self.worker.url]).inc();
                tracing::info!(worker = %self.worker.url, rank = self.rank, seq, "KV event sequence restarted: engine restart, cache cleared");
                self.start_over(live);
                if self.endpoints.replay.is_some() {
                    self.replay_from(live, 0).await;
                }
                self.apply_or_start_over(live, seq, &batch);
            }
        }
    }

    /// Applies the batch if it is the next one, skips it if it was applied already, and
    /// otherwise (a hole nothing filled) clears the cache and starts over from it.
    fn apply_or_start_over(&self, live: &mut Live, seq: u64, batch: &EventBatch) {
        match live.sequence.check(seq, batch.ts) {
            Verdict::Apply => self.apply(live, seq, batch),
            Verdict::Duplicate => {}
            Verdict::Gap { .. } | Verdict::Restart => {
                self.start_over(live);
                self.apply(live, seq, batch);
            }
        }
    }

    fn set_live(&self, live: bool) {
        self.worker.set_kv_live(self.rank, live);
        let ranks = self.worker.kv_live_ranks() as i64;
        self.metrics.live_ranks.with_label_values(&[&self.worker.url]).set(ranks);
    }

    fn apply(&self, live: &mut Live, seq: u64, batch: &EventBatch) {
        let metrics = &self.metrics;
        let url = self.worker.url.as_str();
        apply_batch(&mut live.cache, batch, &mut |refusal| {
            metrics.refused.with_label_values(&[url, refusal.as_str()]).inc();
        });
        live.sequence.accept(seq, batch.ts);
        metrics.batches.with_label_values(&[url]).inc();
    }

    fn start_over(&self, live: &mut Live) {
        live.cache.clear();
        live.sequence.reset();
    }

    /// At start and after a reconnection: the engine's buffered history, when it has a replay socket.
    async fn resync(&self, live: &mut Live) {
        if self.endpoints.replay.is_some() {
            self.replay_from(live, live.sequence.next()).await;
        }
    }

    /// Applies the replay of every buffered batch from `start` on. True when the replay ran to its
    /// end and joined the applied sequence without a hole.
    async fn replay_from(&self, live: &mut Live, start: u64) -> bool {
        let Some(endpoint) = &self.endpoints.replay else { return false };
        let batches = match tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(endpoint, start)).await {
            Ok(Ok(batches)) => batches,
            Ok(Err(error)) => {
                self.warn(live, &format!("KV event replay from {endpoint} failed: {error}"));
                return false;
            }
            Err(_) => {
                self.warn(live, &format!("KV event replay from {endpoint} timed out"));
                return false;
            }
        };
        let mut joined = true;
        for (seq, batch) in batches {
            // A hole here: the buffer does not reach back far enough (or holds a new engine's
            // batches), so start over from what it does hold.
            joined &= matches!(live.sequence.check(seq, batch.ts), Verdict::Apply | Verdict::Duplicate);
            self.apply_or_start_over(live, seq, &batch);
        }
        joined
    }

    fn warn(&self, live: &mut Live, message: &str) {
        let now = Instant::now();
        if live.warned_at.is_some_and(|at| now.duration_since(at) < LOG_EVERY) {
            live.suppressed += 1;
            return;
        }
        let suppressed = std::mem::take(&mut live.suppressed);
        live.warned_at = Some(now);
        tracing::warn!(worker = %self.worker.url, rank = self.rank, suppressed, "{message}");
    }
}

/// Every buffered batch from `start` on, in the order the replay socket sent them.
async fn fetch_replay(endpoint: &str, start: u64) -> Result<Vec<(u64, EventBatch)>, String> {
    let mut options = SocketOptions::default();
    options.connect_timeout(REPLAY_TIMEOUT);
    let mut dealer = DealerSocket::with_options(options);
    dealer.connect(endpoint).await.map_err(|e| e.to_string())?;
    let request: Vec<bytes::Bytes> = replay_request(start).into_iter().map(bytes::Bytes::from).collect();
    let request = ZmqMessage::try_from(request).map_err(|_| "empty replay request".to_string())?;
    dealer.send(request).await.map_err(|e| e.to_string())?;
    let mut batches = Vec::new();
    loop {
        let reply = dealer.recv().await.map_err(|e| e.to_string())?;
        match decode_replay_reply(&reply.into_vec()).map_err(|e| e.to_string())? {
            ReplayReply::Batch { seq, batch } => batches.push((seq, batch)),
            ReplayReply::End => return Ok(batches),
        }
        if batches.len() > REPLAY_MAX_BATCHES {
            return Err(format!("more than {REPLAY_MAX_BATCHES} batches"));
        }
    }
}
