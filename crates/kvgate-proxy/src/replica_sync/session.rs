//! The sync task: connect to Redis (a connection to publish on, one subscribed to the channel),
//! publish queued routing records in batches and this replica's in-flight counts every interval,
//! apply the peers' messages; when Redis is lost, warn, drop the peers' in-flight counts (the
//! replica routes on its own) and reconnect with backoff (`kvgate_gateway_core::backoff`, with jitter).
//!
//! A peer's message is applied only when its tag verifies with the shared secret, it is recent
//! (`--replica-sync-max-age-ms`) and numbered after the last one of its sender; at most
//! `--replica-sync-max-peers` senders are tracked, their in-flight claims are clamped per worker
//! and summed with saturating arithmetic, and only registered workers' counts are kept.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};

use super::wire::{Message, OpenError, Routed};
use super::ReplicaSync;
use kvgate_fleet::registry::Registry;
use kvgate_gateway_core::backoff::Backoff;

/// Most routing records in one published message.
const BATCH: usize = 256;
/// Bounds on one Redis operation (connect, publish).
const OPERATION_TIMEOUT: Duration = Duration::from_secs(2);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Why a session ended.
enum Ended {
    Shutdown,
    /// Redis was lost (`kind` is the error metric's label).
    Lost {
        kind: &'static str,
        error: String,
    },
}

/// What this replica knows of one peer.
pub(super) struct Peer {
    /// The last message number applied (later ones only).
    last_seq: u64,
    heard_at: Instant,
    /// Its last in-flight counts (registered workers only, clamped), with when they arrived.
    in_flight: Option<(Instant, Vec<(String, u64)>)>,
}

/// The peers heard from, by replica id (at most `--replica-sync-max-peers`).
#[derive(Default)]
pub(super) struct Peers {
    peers: HashMap<u64, Peer>,
}

/// Milliseconds since the Unix epoch (the replicas' shared clock for a message's age).
pub(super) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis() as u64)
}

/// The sync task's options (`--replica-sync-*`).
#[derive(Clone, Debug)]
pub struct SyncSettings {
    pub redis_url: String,
    /// The pub/sub channel every replica of the fleet publishes on.
    pub channel: String,
    /// How often this replica's in-flight counts are published.
    pub interval_ms: u64,
}

/// Runs the replica's synchronisation until shutdown: `sync` is the request path's side,
/// `registry` the pools whose peer block indexes the peers' records feed.
pub async fn run(
    sync: Arc<ReplicaSync>,
    registry: Arc<Registry>,
    settings: SyncSettings,
    mut shutdown: watch::Receiver<bool>,
) {
    let url = settings.redis_url.clone();
    let Some(mut outgoing) = sync.take_receiver() else { return };
    let client = match redis::Client::open(url.as_str()) {
        Ok(client) => client,
        Err(error) => {
            tracing::error!(%error, "replica sync disabled: invalid --replica-sync-redis-url");
            return;
        }
    };
    let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
    // Numbered across reconnections: peers drop anything numbered at or below what they heard.
    let mut next_seq = 0u64;
    loop {
        let started = Instant::now();
        let ended =
            session(&registry, &settings, &sync, &client, &mut outgoing, &mut shutdown, &mut next_seq).await;
        if started.elapsed() > MAX_BACKOFF {
            backoff.reset(); // the session had been up: start over
        }
        let delay = backoff.next_delay();
        match ended {
            Ended::Shutdown => return,
            Ended::Lost { kind, error } => {
                sync.metrics.connected.set(0);
                sync.metrics.peers.set(0);
                sync.metrics.errors.with_label_values(&[kind]).inc();
                sync.set_peer_in_flight(HashMap::new());
                tracing::warn!(%error, kind, retry_in_ms = delay.as_millis() as u64,
                    "replica sync: Redis lost; routing on this replica's own state until it is back");
            }
        }
        let wait = tokio::time::sleep(delay);
        tokio::pin!(wait);
        loop {
            tokio::select! {
                _ = &mut wait => break,
                _ = shutdown.changed() => return,
                // Records routed while disconnected are dropped, not queued for later.
                Some(_) = outgoing.recv() => sync.metrics.errors.with_label_values(&["queue_full"]).inc(),
            }
        }
    }
}

async fn session(
    registry: &Registry,
    settings: &SyncSettings,
    sync: &ReplicaSync,
    client: &redis::Client,
    outgoing: &mut mpsc::Receiver<Routed>,
    shutdown: &mut watch::Receiver<bool>,
    next_seq: &mut u64,
) -> Ended {
    let lost = |kind, error: String| Ended::Lost { kind, error };
    let channel = settings.channel.as_str();
    let connect = async {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(OPERATION_TIMEOUT))
            .set_response_timeout(Some(OPERATION_TIMEOUT));
        let publisher = client.get_multiplexed_async_connection_with_config(&config).await?;
        let mut subscriber = client.get_async_pubsub().await?;
        subscriber.subscribe(channel).await?;
        Ok::<_, redis::RedisError>((publisher, subscriber))
    };
    let (mut publisher, subscriber) = match tokio::time::timeout(OPERATION_TIMEOUT, connect).await {
        Ok(Ok(connections)) => connections,
        Ok(Err(error)) => return lost("connect", error.to_string()),
        Err(_) => return lost("connect", "timed out".into()),
    };
    let mut messages = subscriber.into_on_message();
    sync.metrics.connected.set(1);
    tracing::info!(channel, replica = format!("{:016x}", sync.replica), "replica sync: connected to Redis");
    let interval = Duration::from_millis(settings.interval_ms.max(1));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut peers = Peers::default();
    loop {
        let message = tokio::select! {
            _ = shutdown.changed() => return Ended::Shutdown,
            received = messages.next() => {
                let Some(received) = received else {
                    return lost("subscription", "the subscription connection closed".into());
                };
                apply(registry, sync, &mut peers, received.get_payload_bytes());
                continue;
            }
            Some(first) = outgoing.recv() => {
                // Records up to BATCH, and up to half the largest message peers read.
                let budget = sync.limits.max_message_bytes / 2;
                let mut size = record_size(&first);
                let mut routed = vec![first];
                while routed.len() < BATCH && size < budget {
                    match outgoing.try_recv() {
                        Ok(next) => {
                            size += record_size(&next);
                            routed.push(next);
                        }
                        Err(_) => break,
                    }
                }
                Message { routed, ..Message::default() }
            }
            _ = tick.tick() => {
                expire(sync, &mut peers, interval);
                Message { in_flight: Some(own_in_flight(registry)), ..Message::default() }
            }
        };
        let message = Message { replica: sync.replica, seq: *next_seq, sent_at_ms: unix_ms(), ..message };
        *next_seq += 1;
        let records = message.routed.len() as u64;
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(channel).arg(sync.seal.seal(&message));
        match tokio::time::timeout(OPERATION_TIMEOUT, publish.exec_async(&mut publisher)).await {
            Ok(Ok(())) => sync.metrics.published.inc_by(records),
            Ok(Err(error)) => return lost("publish", error.to_string()),
            Err(_) => return lost("publish", "timed out".into()),
        }
    }
}

/// This replica's requests in flight per worker URL (workers with none are left out).
fn own_in_flight(registry: &Registry) -> Vec<(String, u64)> {
    let snapshot = registry.snapshot();
    snapshot
        .workers
        .iter()
        .map(|worker| (worker.url.clone(), worker.in_flight()))
        .filter(|(_, count)| *count > 0)
        .collect()
}

/// About the encoded size of a routing record.
fn record_size(routed: &Routed) -> usize {
    routed.model.len() + routed.worker.len() + 9 * routed.hashes.len() + 16
}

/// Applies a peer's message: its routing records to the pools' peer block indexes, its
/// in-flight counts to the peers' table (summed on the next tick). Anything not signed with
/// the secret, stale, replayed, from one peer too many or over a cap is dropped and counted.
pub(super) fn apply(registry: &Registry, sync: &ReplicaSync, peers: &mut Peers, payload: &[u8]) {
    let limits = &sync.limits;
    let drop = |kind: &str| sync.metrics.errors.with_label_values(&[kind]).inc();
    let message = match sync.seal.open(payload, limits.max_message_bytes) {
        Ok(message) => message,
        Err(OpenError::Oversized(_)) => {
            sync.oversized.inc();
            return;
        }
        Err(OpenError::Unsigned) => return drop("unsigned"),
        Err(error @ OpenError::Undecodable(_)) => {
            tracing::debug!(%error, "replica sync: message ignored");
            return drop("decode");
        }
    };
    if message.replica == sync.replica {
        return;
    }
    if unix_ms().abs_diff(message.sent_at_ms) > limits.max_age.as_millis() as u64 {
        return drop("stale");
    }
    let now = Instant::now();
    let full = peers.peers.len() >= limits.max_peers;
    let peer = match peers.peers.entry(message.replica) {
        Entry::Occupied(entry) => {
            let peer = entry.into_mut();
            if message.seq <= peer.last_seq {
                return drop("replayed");
            }
            peer
        }
        Entry::Vacant(entry) => {
            if full {
                return drop("too_many_peers");
            }
            entry.insert(Peer { last_seq: message.seq, heard_at: now, in_flight: None })
        }
    };
    peer.last_seq = message.seq;
    peer.heard_at = now;
    let snapshot = registry.snapshot();
    for routed in &message.routed {
        if routed.hashes.len() > limits.max_hashes_per_record {
            drop("record_too_large");
            continue;
        }
        let Some(pool) = snapshot.models.get(&routed.model).and_then(|pools| pools.get(routed.role)) else {
            continue;
        };
        let Some(worker) = pool.workers.iter().find(|w| w.url == routed.worker) else { continue };
        pool.prefix.peers.record(&routed.hashes, worker.id);
        sync.metrics.applied.inc();
    }
    if let Some(claimed) = message.in_flight {
        let registered: HashSet<&str> = snapshot.workers.iter().map(|w| w.url.as_str()).collect();
        let counts = claimed
            .into_iter()
            .filter(|(url, _)| registered.contains(url.as_str()))
            .map(|(url, count)| (url, count.min(limits.max_peer_in_flight)))
            .collect();
        peer.in_flight = Some((now, counts));
    }
}

/// Drops in-flight counts not refreshed within five intervals (and peers not heard from within
/// the longer of that and the message age limit), and publishes the peers' total.
pub(super) fn expire(sync: &ReplicaSync, peers: &mut Peers, interval: Duration) {
    let now = Instant::now();
    let fresh = interval * 5;
    let remembered = fresh.max(sync.limits.max_age);
    peers.peers.retain(|_, peer| now.duration_since(peer.heard_at) <= remembered);
    let mut total: HashMap<String, u64> = HashMap::new();
    let mut counting = 0;
    for peer in peers.peers.values_mut() {
        if peer.in_flight.as_ref().is_some_and(|(at, _)| now.duration_since(*at) > fresh) {
            peer.in_flight = None;
        }
        let Some((_, counts)) = &peer.in_flight else { continue };
        counting += 1;
        for (url, count) in counts {
            let sum = total.entry(url.clone()).or_default();
            *sum = sum.saturating_add(*count);
        }
    }
    sync.metrics.peers.set(counting);
    sync.set_peer_in_flight(total);
}
