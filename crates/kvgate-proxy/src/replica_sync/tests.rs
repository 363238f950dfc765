//! What a replica accepts from the channel: only messages sealed with the secret, recent, in
//! order, from at most `max_peers` peers, with records and in-flight claims within their caps
//! (a forged record claiming 10^9 in flight moved all traffic off a worker; one record of 2 M
//! hashes took a replica to 320 MB; 55,000 random replica ids cost 60-75% CPU and 200 MB).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::session::{apply, expire, unix_ms, Peers};
use super::wire::{Message, Routed, Seal};
use super::{ReplicaSync, SyncLimits};
use kvgate_fleet::registry::{NewWorker, Registry};
use kvgate_fleet::worker::CircuitSettings;
use kvgate_gateway_core::metrics::Metrics;
use kvgate_protocol::role::WorkerRole;

const SECRET: &[u8] = b"the deployment's shared secret";
const WORKER: &str = "http://127.0.0.1:9";
const INTERVAL: Duration = Duration::from_millis(50);

/// A replica's parts: its registry (one worker of model `m`), metrics and sync side.
struct Replica {
    registry: Registry,
    metrics: Arc<Metrics>,
    sync: ReplicaSync,
}

fn replica() -> Replica {
    let metrics = Arc::new(Metrics::new());
    let circuit =
        CircuitSettings { enabled: false, failure_threshold: 1, open_duration: Duration::from_secs(1) };
    let registry =
        Registry::new(Default::default(), BTreeMap::new(), [None, None], circuit, metrics.clone(), 1000, 10);
    let worker = NewWorker { url: WORKER.into(), model: Some("m".into()), ..NewWorker::default() };
    registry.add(worker, true).unwrap();
    let limits = SyncLimits {
        max_message_bytes: 1 << 20,
        max_hashes_per_record: 8,
        max_peers: 3,
        max_peer_in_flight: 100,
        max_age: Duration::from_secs(10),
    };
    let oversized = metrics.oversized_answers.with_label_values(&["replica_sync"]);
    let sync = ReplicaSync::new(metrics.replica_sync.clone(), oversized, SECRET, limits);
    Replica { registry, metrics, sync }
}

fn message(replica: u64, seq: u64, in_flight: Vec<(&str, u64)>) -> Message {
    Message {
        replica,
        seq,
        sent_at_ms: unix_ms(),
        routed: Vec::new(),
        in_flight: Some(in_flight.into_iter().map(|(url, count)| (url.to_string(), count)).collect()),
    }
}

/// Applies `messages` sealed with `seal`, then a tick; returns the peers' in-flight on WORKER.
fn hear(replica: &Replica, peers: &mut Peers, seal: &Seal, messages: &[Message]) -> Option<u64> {
    for message in messages {
        apply(&replica.registry, &replica.sync, peers, &seal.seal(message));
    }
    expire(&replica.sync, peers, INTERVAL);
    replica.sync.peer_in_flight().get(WORKER).copied()
}

fn errors(replica: &Replica, kind: &str) -> u64 {
    replica.metrics.replica_sync.errors.with_label_values(&[kind]).get()
}

#[test]
fn forged_stale_and_replayed_messages_are_dropped() {
    let replica = replica();
    let mut peers = Peers::default();
    let seal = Seal::new(SECRET);
    let forged = Seal::new(b"not the secret");
    assert_eq!(hear(&replica, &mut peers, &forged, &[message(1, 0, vec![(WORKER, 1_000_000_000)])]), None);
    assert_eq!(errors(&replica, "unsigned"), 1);
    let old = Message { sent_at_ms: unix_ms() - 60_000, ..message(1, 0, vec![(WORKER, 5)]) };
    assert_eq!(hear(&replica, &mut peers, &seal, &[old]), None);
    assert_eq!(errors(&replica, "stale"), 1);
    assert_eq!(hear(&replica, &mut peers, &seal, &[message(1, 4, vec![(WORKER, 5)])]), Some(5));
    // A captured message sent again, or an older one, changes nothing.
    assert_eq!(hear(&replica, &mut peers, &seal, &[message(1, 4, vec![(WORKER, 50)])]), Some(5));
    assert_eq!(hear(&replica, &mut peers, &seal, &[message(1, 3, vec![(WORKER, 50)])]), Some(5));
    assert_eq!(errors(&replica, "replayed"), 2);
    assert_eq!(hear(&replica, &mut peers, &seal, &[message(1, 5, vec![(WORKER, 6)])]), Some(6));
}

#[test]
fn claims_are_clamped_summed_without_overflow_and_peers_are_bounded() {
    let replica = replica();
    let mut peers = Peers::default();
    let seal = Seal::new(SECRET);
    // An authenticated peer claiming 10^9 (or u64::MAX) counts as at most the cap.
    let claims = [
        message(1, 0, vec![(WORKER, 1_000_000_000)]),
        message(2, 0, vec![(WORKER, u64::MAX), ("http://10.0.0.1:1", 7)]),
    ];
    assert_eq!(hear(&replica, &mut peers, &seal, &claims), Some(200));
    assert_eq!(
        replica.sync.peer_in_flight().len(),
        1,
        "claims on workers this replica does not have are not kept"
    );
    // Random replica ids beyond the peer bound are dropped, whatever they say.
    let flood: Vec<_> = (100..1100).map(|id| message(id, 0, vec![(WORKER, 100)])).collect();
    assert_eq!(
        hear(&replica, &mut peers, &seal, &flood),
        Some(300),
        "one more peer fits, the rest are dropped"
    );
    assert_eq!(errors(&replica, "too_many_peers"), 999);
}

#[test]
fn records_over_the_hash_cap_are_dropped_alone() {
    let replica = replica();
    let mut peers = Peers::default();
    let seal = Seal::new(SECRET);
    let record = |hashes: Vec<u64>| Routed {
        model: "m".into(),
        role: WorkerRole::Regular,
        worker: WORKER.into(),
        hashes,
    };
    let message = Message {
        replica: 1,
        seq: 0,
        sent_at_ms: unix_ms(),
        routed: vec![record((0..2_000_000).collect()), record(vec![1, 2, 3])],
        in_flight: None,
    };
    let sealed = seal.seal(&message);
    apply(&replica.registry, &replica.sync, &mut peers, &sealed);
    let oversized = replica.metrics.count_oversized_value("replica_sync");
    assert_eq!(oversized, 1, "18 MB: dropped before its tag is checked");
    let small = Message { routed: vec![record((0..9).collect()), record(vec![1, 2, 3])], ..message };
    apply(&replica.registry, &replica.sync, &mut peers, &seal.seal(&small));
    assert_eq!(errors(&replica, "record_too_large"), 1);
    assert_eq!(replica.sync.metrics.applied.get(), 1, "the record within the cap is applied");
}
