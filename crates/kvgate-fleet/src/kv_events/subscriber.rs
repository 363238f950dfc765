//! One data-parallel rank's KV-event subscription: a ZMQ SUB socket on the engine's publisher,
//! the replay socket asked for history at start, after a gap and after a restart, feeding the
//! rank's `Feed` (`kvgate-kv-events`: the sequence logic and the cache's writer into the model's
//! exact index). This file only moves frames and counts what the feed did.
//!
//! The index never keeps what it cannot vouch for: a gap that replay cannot fill, a sequence
//! that goes backwards (engine restart) and a reconnection clear the cache's blocks first. One
//! bad event is refused alone, and a message that cannot be decoded is skipped: neither clears.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvgate_index::{BlockIndex, CacheBlocks, CacheId};
use kvgate_kv_events::{replay_request, Feed, FeedCounts, Live as Received, Recovery, Refusal, Replayed};
use prometheus::IntCounterVec;
use tokio::sync::watch;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use super::KvEventLimits;
use crate::load_snapshot::LoadSnapshot;
use crate::registry::Registry;
use crate::worker::Worker;
use kvgate_gateway_core::backoff::Backoff;
use kvgate_gateway_core::config::RankEndpoints;
use kvgate_gateway_core::metrics::KvEventsMetrics;

/// How long one replay (request to end marker) may take.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Most batches one replay may return (vLLM keeps 10,000 by default).
const REPLAY_MAX_BATCHES: usize = 1_000_000;
/// Connection attempts back off from the first delay up to the ceiling (with jitter, so the
/// subscriptions of a fleet's engines do not reconnect in lockstep), at the first connection and
/// after every disconnection alike: the ZMQ library's own reconnection (doubling up to 30 s) is
/// never used. vLLM binds its publisher as it starts serving, so a ceiling of a second
/// resubscribes within about a second of an engine restart; an attempt on a closed port costs
/// next to nothing.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// A publisher that has not answered for this long is reported at `warn` (then every
/// [`UNREACHABLE_EVERY`] while it stays so): engines take tens of seconds to start.
const UNREACHABLE_AFTER: Duration = Duration::from_secs(30);
const UNREACHABLE_EVERY: Duration = Duration::from_secs(300);
/// At most one warning per subscription this often; the rest are counted.
const LOG_EVERY: Duration = Duration::from_secs(10);

pub struct RankSubscription {
    pub registry: Arc<Registry>,
    pub loads: Arc<LoadSnapshot>,
    pub metrics: KvEventsMetrics,
    pub oversized: IntCounterVec,
    pub limits: KvEventLimits,
    pub worker: Arc<Worker>,
    pub rank: u32,
    pub endpoints: RankEndpoints,
    pub topic: String,
}

/// The state of a running subscription.
struct Live {
    feed: Feed,
    /// The cache's removed blocks as last added to the worker's count.
    removed: u64,
    warned_at: Option<Instant>,
    suppressed: u64,
}

impl RankSubscription {
    pub async fn run(self) {
        self.zero_series();
        let Some(index) = self.wait_for_index().await else { return };
        let cache = CacheBlocks::new(index, CacheId { worker: self.worker.id, rank: self.rank });
        let mut live = Live { feed: Feed::new(cache), removed: 0, warned_at: None, suppressed: 0 };
        let mut resyncs = self.worker.index_health.resync_requests();
        resyncs.borrow_and_update();
        let mut first = true;
        loop {
            let mut socket = self.connect().await;
            if !first {
                // Whatever happened while we were away, the engine's cache may differ from what
                // we held: start over from its replay buffer.
                tracing::info!(worker = %self.worker.url, rank = self.rank, "KV event publisher reconnected");
                live.feed.reset();
            }
            first = false;
            self.resync(&mut live).await;
            self.set_live(true);
            self.receive(&mut live, &mut socket, &mut resyncs).await;
            tracing::info!(worker = %self.worker.url, rank = self.rank, "KV event publisher disconnected");
            self.set_live(false);
            // Dropping the socket ends the ZMQ library's own reconnection; `connect` reconnects
            // on kvgate's backoff instead.
            drop(socket);
        }
    }

    /// Hands every message to the feed until the publisher disconnects; on a resync request
    /// (the index repair), drops the cache's holdings and replays them.
    async fn receive(&self, live: &mut Live, socket: &mut SubSocket, resyncs: &mut watch::Receiver<u64>) {
        let mut monitor = socket.monitor();
        loop {
            tokio::select! {
                changed = resyncs.changed() => {
                    if changed.is_err() {
                        // The worker is gone; its task is aborted with it.
                        std::future::pending::<()>().await;
                    }
                    resyncs.borrow_and_update();
                    live.feed.reset();
                    self.resync(live).await;
                    self.count(live);
                    tracing::info!(
                        worker = %self.worker.url,
                        rank = self.rank,
                        blocks = live.feed.cache().len(),
                        replay = self.endpoints.replay.is_some(),
                        "KV holdings dropped and replayed (index repair)"
                    );
                }
                message = socket.recv() => match message {
                    Ok(message) => self.on_message(live, message.into_vec()).await,
                    Err(error) => {
                        tracing::debug!(worker = %self.worker.url, rank = self.rank, %error, "KV event receive failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => return,
                    Some(_) => {}
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
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        let started = Instant::now();
        let mut reported: Option<Instant> = None;
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
            let now = Instant::now();
            let due = match reported {
                None => now.duration_since(started) >= UNREACHABLE_AFTER,
                Some(at) => now.duration_since(at) >= UNREACHABLE_EVERY,
            };
            if due {
                reported = Some(now);
                tracing::warn!(
                    worker = %self.worker.url,
                    rank = self.rank,
                    endpoint = %self.endpoints.events,
                    waited_secs = now.duration_since(started).as_secs(),
                    "KV event publisher does not answer (still trying; the worker is routed on the approximate \
                     tree meanwhile): is the engine up, and does it publish there? vLLM binds its publisher only \
                     for an endpoint `tcp://*:PORT`, `tcp://[::]:PORT` or ipc: with `tcp://127.0.0.1:PORT` in \
                     its --kv-events-config it connects out instead and publishes to nobody"
                );
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    async fn on_message(&self, live: &mut Live, frames: Vec<bytes::Bytes>) {
        let limit = self.limits.max_message_bytes;
        if message_bytes(&frames) > limit {
            // Not decoded: like a lost batch, but no replay can fill it (it would send it again).
            self.oversized.with_label_values(&["kv_events"]).inc();
            self.warn(live, &format!("KV event message over {limit} bytes dropped, cache cleared"));
            live.feed.reset();
            return;
        }
        live.feed.set_max_blocks(self.max_blocks(live));
        match live.feed.on_live(&frames) {
            Received::Applied | Received::Duplicate => {}
            Received::Dropped(error) => {
                self.warn(live, &format!("malformed KV event message dropped: {error}"));
            }
            Received::ReplayFrom(start) => {
                let completed = self.replay(live, start).await;
                match live.feed.end_replay(completed) {
                    Some(Recovery::Replayed) => {
                        self.warn(live, &format!("KV event sequence gap from {start}: recovered by replay"));
                    }
                    Some(Recovery::Cleared) => self.warn(
                        live,
                        &format!("KV event sequence gap from {start}: no replay filled it, cache cleared"),
                    ),
                    None => {
                        tracing::info!(worker = %self.worker.url, rank = self.rank, "KV event sequence restarted: engine restart, cache cleared")
                    }
                }
            }
        }
        self.count(live);
    }

    fn set_live(&self, live: bool) {
        self.worker.set_kv_live(self.rank, live);
        let ranks = self.worker.kv_live_ranks() as i64;
        self.worker.series.write(|url| self.metrics.live_ranks.with_label_values(&[url]).set(ranks));
    }

    /// Most blocks the cache may hold: its engine's reported capacity times the slack, else
    /// `--kv-index-max-blocks-per-worker` (also before the index knows a block size).
    fn max_blocks(&self, live: &Live) -> usize {
        let limits = &self.limits;
        let block_size = live.feed.cache().index().block_size();
        let capacity = self.loads.load().get(&self.worker.id).map(|load| load.max_total_num_tokens);
        match capacity {
            Some(tokens) if tokens > 0 && block_size > 0 => {
                let blocks = (tokens as f64 / block_size as f64 * limits.capacity_slack).ceil();
                (blocks as usize).max(1)
            }
            _ => limits.max_blocks_per_worker,
        }
    }

    /// Every counter of the worker's subscription, at zero until it counts (absent and zero then
    /// read differently: a query for a rate sees 0, not nothing).
    fn zero_series(&self) {
        let metrics = &self.metrics;
        self.worker.series.write(|url| {
            metrics.batches.with_label_values(&[url]);
            metrics.malformed.with_label_values(&[url]);
            metrics.restarts.with_label_values(&[url]);
            for refusal in Refusal::ALL {
                metrics.refused.with_label_values(&[url, refusal.as_str()]);
            }
            for recovery in Recovery::ALL {
                metrics.gaps.with_label_values(&[url, recovery.as_str()]);
            }
        });
        for source in ["kv_events", "kv_replay"] {
            self.oversized.with_label_values(&[source]);
        }
    }

    /// Adds what the feed did since the last call to the metrics.
    fn count(&self, live: &mut Live) {
        let removed = live.feed.cache().removed_blocks();
        self.worker.add_kv_removed_blocks(removed.saturating_sub(live.removed));
        live.removed = removed;
        let FeedCounts { batches, refused, malformed, gaps, restarts } = live.feed.take_counts();
        let metrics = &self.metrics;
        self.worker.series.write(|url| {
            if batches > 0 {
                metrics.batches.with_label_values(&[url]).inc_by(batches);
            }
            for (refusal, n) in refused {
                metrics.refused.with_label_values(&[url, refusal.as_str()]).inc_by(n);
            }
            if malformed > 0 {
                metrics.malformed.with_label_values(&[url]).inc_by(malformed);
            }
            for (recovery, n) in gaps {
                metrics.gaps.with_label_values(&[url, recovery.as_str()]).inc_by(n);
            }
            if restarts > 0 {
                metrics.restarts.with_label_values(&[url]).inc_by(restarts);
            }
        });
    }

    /// At start and after a reconnection: the engine's buffered history, when it has a replay
    /// socket.
    async fn resync(&self, live: &mut Live) {
        if self.endpoints.replay.is_some() {
            let start = live.feed.begin_resync();
            let completed = self.replay(live, start).await;
            live.feed.end_replay(completed);
            self.count(live);
        }
    }

    /// Hands the feed every buffered batch from `start` on; true when the replay ran to its end
    /// marker (false: no replay socket, or it failed or timed out).
    async fn replay(&self, live: &mut Live, start: u64) -> bool {
        let Some(endpoint) = &self.endpoints.replay else { return false };
        let limit = self.limits.max_message_bytes;
        live.feed.set_max_blocks(self.max_blocks(live));
        // Each reply is handed to the feed as it arrives (one batch in memory at a time).
        let mut malformed = None;
        let replay = fetch_replay(endpoint, start, limit, |frames| match live.feed.on_replay(&frames) {
            Ok(Replayed::Batch { .. }) => true,
            Ok(Replayed::End) => false,
            Err(error) => {
                malformed = Some(error);
                false
            }
        });
        let outcome = tokio::time::timeout(REPLAY_TIMEOUT, replay).await;
        if let Some(error) = malformed {
            self.warn(live, &format!("malformed KV event replay reply from {endpoint}: {error}"));
            return false;
        }
        match outcome {
            Ok(Ok(())) => true,
            Ok(Err(ReplayError::Oversized)) => {
                self.oversized.with_label_values(&["kv_replay"]).inc();
                self.warn(
                    live,
                    &format!("KV event replay from {endpoint}: a reply over {limit} bytes; stopped"),
                );
                false
            }
            Ok(Err(ReplayError::Failed(error))) => {
                self.warn(live, &format!("KV event replay from {endpoint} failed: {error}"));
                false
            }
            Err(_) => {
                self.warn(live, &format!("KV event replay from {endpoint} timed out"));
                false
            }
        }
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

/// The bytes of a ZMQ message.
fn message_bytes(frames: &[bytes::Bytes]) -> usize {
    frames.iter().fold(0usize, |sum, frame| sum.saturating_add(frame.len()))
}

enum ReplayError {
    Failed(String),
    /// A reply larger than `--kv-events-max-message-bytes`.
    Oversized,
}

/// Hands every reply of the replay from `start` on to `take`, in the order the replay socket
/// sends them, until `take` says stop (the end marker, or a reply it could not read).
async fn fetch_replay(
    endpoint: &str,
    start: u64,
    limit: usize,
    mut take: impl FnMut(Vec<bytes::Bytes>) -> bool,
) -> Result<(), ReplayError> {
    let failed = |error: String| ReplayError::Failed(error);
    let mut options = SocketOptions::default();
    options.connect_timeout(REPLAY_TIMEOUT);
    let mut dealer = DealerSocket::with_options(options);
    dealer.connect(endpoint).await.map_err(|e| failed(e.to_string()))?;
    let request: Vec<bytes::Bytes> = replay_request(start).into_iter().map(bytes::Bytes::from).collect();
    let request = ZmqMessage::try_from(request).map_err(|_| failed("empty replay request".to_string()))?;
    dealer.send(request).await.map_err(|e| failed(e.to_string()))?;
    let mut replies = 0usize;
    loop {
        let frames = dealer.recv().await.map_err(|e| failed(e.to_string()))?.into_vec();
        if message_bytes(&frames) > limit {
            return Err(ReplayError::Oversized);
        }
        if !take(frames) {
            return Ok(());
        }
        replies += 1;
        if replies > REPLAY_MAX_BATCHES {
            return Err(failed(format!("more than {REPLAY_MAX_BATCHES} batches")));
        }
    }
}
