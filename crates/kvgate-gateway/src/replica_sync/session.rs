//! The sync task: connect to Redis (a connection to publish on, one subscribed to the channel),
//! publish queued routing records in batches and this replica's in-flight counts every interval,
//! apply the peers' messages; when Redis is lost, warn, drop the peers' in-flight counts (the
//! replica routes on its own) and reconnect with backoff.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};

use super::wire::{Message, Routed};
use super::ReplicaSync;
use crate::registry::Registry;

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

/// The peers' last in-flight counts, by replica id, with when they arrived.
#[derive(Default)]
struct Peers {
    in_flight: HashMap<u64, (Instant, Vec<(String, u64)>)>,
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
    let mut backoff = FIRST_BACKOFF;
    loop {
        let started = Instant::now();
        match session(&registry, &settings, &sync, &client, &mut outgoing, &mut shutdown).await {
            Ended::Shutdown => return,
            Ended::Lost { kind, error } => {
                sync.metrics.connected.set(0);
                sync.metrics.peers.set(0);
                sync.metrics.errors.with_label_values(&[kind]).inc();
                sync.set_peer_in_flight(HashMap::new());
                tracing::warn!(%error, kind, retry_in_ms = backoff.as_millis() as u64,
                    "replica sync: Redis lost; routing on this replica's own state until it is back");
            }
        }
        if started.elapsed() > MAX_BACKOFF {
            backoff = FIRST_BACKOFF; // the session had been up: start over
        }
        let wait = tokio::time::sleep(backoff);
        tokio::pin!(wait);
        loop {
            tokio::select! {
                _ = &mut wait => break,
                _ = shutdown.changed() => return,
                // Records routed while disconnected are dropped, not queued for later.
                Some(_) = outgoing.recv() => sync.metrics.errors.with_label_values(&["queue_full"]).inc(),
            }
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

async fn session(
    registry: &Registry,
    settings: &SyncSettings,
    sync: &ReplicaSync,
    client: &redis::Client,
    outgoing: &mut mpsc::Receiver<Routed>,
    shutdown: &mut watch::Receiver<bool>,
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
                apply(registry, sync, &mut peers, received.get_payload_bytes(), interval);
                continue;
            }
            Some(first) = outgoing.recv() => {
                let mut routed = vec![first];
                while routed.len() < BATCH {
                    match outgoing.try_recv() {
                        Ok(next) => routed.push(next),
                        Err(_) => break,
                    }
                }
                Message { replica: sync.replica, routed, in_flight: None }
            }
            _ = tick.tick() => {
                expire(sync, &mut peers, interval);
                Message { replica: sync.replica, routed: Vec::new(), in_flight: Some(own_in_flight(registry)) }
            }
        };
        let records = message.routed.len() as u64;
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(channel).arg(message.encode());
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

/// Applies a peer's message: its routing records to the pools' peer block indexes, its
/// in-flight counts to the peers' total.
fn apply(registry: &Registry, sync: &ReplicaSync, peers: &mut Peers, payload: &[u8], interval: Duration) {
    let message = match Message::decode(payload) {
        Ok(message) => message,
        Err(error) => {
            sync.metrics.errors.with_label_values(&["decode"]).inc();
            tracing::debug!(%error, "replica sync: message ignored");
            return;
        }
    };
    if message.replica == sync.replica {
        return;
    }
    if !message.routed.is_empty() {
        let snapshot = registry.snapshot();
        for routed in &message.routed {
            let Some(pool) = snapshot.models.get(&routed.model).and_then(|pools| pools.get(routed.role))
            else {
                continue;
            };
            let Some(worker) = pool.workers.iter().find(|w| w.url == routed.worker) else { continue };
            pool.prefix.peers.record(&routed.hashes, worker.id);
            sync.metrics.applied.inc();
        }
    }
    if let Some(in_flight) = message.in_flight {
        peers.in_flight.insert(message.replica, (Instant::now(), in_flight));
        expire(sync, peers, interval);
    }
}

/// Drops peers not heard from within five intervals and publishes the peers' total.
fn expire(sync: &ReplicaSync, peers: &mut Peers, interval: Duration) {
    let now = Instant::now();
    peers.in_flight.retain(|_, (at, _)| now.duration_since(*at) <= interval * 5);
    let mut total: HashMap<String, u64> = HashMap::new();
    for (_, counts) in peers.in_flight.values() {
        for (url, count) in counts {
            *total.entry(url.clone()).or_default() += count;
        }
    }
    sync.metrics.peers.set(peers.in_flight.len() as i64);
    sync.set_peer_in_flight(total);
}
