//! An engine restart as a KV event subscriber sees it: the fleet comes back on the same ports at once and its sequence starts again at 0.

mod common;

use std::time::Duration;

use common::kv::{dealer, delimited_batches, recv_batch, replay};
use common::REQUEST_TIMEOUT;
use futures_util::StreamExt;
use kvgate_mock::{spawn_fleet, MockArgs, MockFleet};
use serde_json::json;
use tokio::time::timeout;
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

/// How long a SUB may take to (re)connect: its reconnect backoff starts at 100 ms.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The port of `http://host:port` or `tcp://host:port`.
fn port(url: &str) -> u16 {
    url.rsplit(':').next().and_then(|port| port.parse().ok()).unwrap_or_else(|| panic!("no port in {url}"))
}

struct Subscriber {
    socket: SubSocket,
    monitor: futures_util::stream::BoxStream<'static, SocketEvent>,
}

impl Subscriber {
    /// Waits until the SUB reports a (re)connection. `recv` is polled meanwhile: the SUB only
    /// notices a closed connection, and starts reconnecting, while it is read.
    async fn connected(&mut self) {
        let wait = async {
            loop {
                tokio::select! {
                    event = self.monitor.next() => {
                        if let SocketEvent::Connected(..) = event.expect("the monitor stays open") {
                            return;
                        }
                    }
                    message = self.socket.recv() => {
                        if let Ok(message) = message {
                            panic!("nothing is published while reconnecting: {message:?}");
                        }
                    }
                }
            }
        };
        timeout(CONNECT_TIMEOUT, wait).await.expect("the subscriber (re)connects within 10 s");
    }
}

async fn flush(client: &reqwest::Client, fleet: &MockFleet) {
    let response = client.post(format!("{}/flush_cache", fleet.urls()[0])).send().await;
    assert_eq!(response.expect("/flush_cache is answered").status(), 200);
}

/// Publishes one batch (a flush) on a fleet the subscriber has just (re)connected to and returns
/// the seq the subscriber receives. The subscription can still be on its way to the new
/// publisher (ZMQ's slow joiner), which loses the batch; then the fleet is restarted once more
/// and tried again (at most 3 times), so the batch caught is always the engine's first.
async fn first_batch(
    mut fleet: MockFleet,
    args: &MockArgs,
    client: &reqwest::Client,
    subscriber: &mut Subscriber,
) -> (MockFleet, u64) {
    for _ in 0..3 {
        flush(client, &fleet).await;
        if let Ok(message) = timeout(Duration::from_secs(1), subscriber.socket.recv()).await {
            let frames = message.expect("a SUB message").into_vec();
            return (fleet, common::kv::RawBatch::from_frames(frames).seq);
        }
        fleet.shutdown().await;
        fleet = spawn_fleet(args.clone()).await.expect("the fleet restarts on the same ports");
        subscriber.connected().await;
    }
    panic!("the subscriber never caught a restarted engine's first batch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_comes_back_on_the_same_ports_numbering_from_zero() {
    let mut args = MockArgs {
        time_scale: 50.0,
        kv_events_base_port: Some(0),
        kv_events_replay_base_port: Some(0),
        ..MockArgs::default()
    };
    let fleet = spawn_fleet(args.clone()).await.unwrap();
    // Every later start binds the ports this one got.
    let (urls, endpoints, replay_endpoints) =
        (fleet.urls(), fleet.kv_event_endpoints(), fleet.kv_event_replay_endpoints());
    args.base_port = port(&urls[0]);
    args.kv_events_base_port = Some(port(&endpoints[0]));
    args.kv_events_replay_base_port = Some(port(&replay_endpoints[0]));
    // No idle HTTP connections to carry over a restart.
    let client =
        reqwest::Client::builder().timeout(REQUEST_TIMEOUT).pool_max_idle_per_host(0).build().unwrap();

    let mut socket = SubSocket::new();
    let monitor = socket.monitor().boxed();
    socket.subscribe("").await.unwrap();
    timeout(CONNECT_TIMEOUT, socket.connect(&endpoints[0])).await.expect("connected within 10 s").unwrap();
    let mut subscriber = Subscriber { socket, monitor };
    subscriber.connected().await;
    let (fleet, seq) = first_batch(fleet, &args, &client, &mut subscriber).await;
    assert_eq!(seq, 0);
    let body = json!({"prompt": "a b c d e f g h i j k l m n o p q", "max_tokens": 1});
    let response = client.post(format!("{}/v1/completions", urls[0])).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(recv_batch(&mut subscriber.socket).await.seq, 1, "the prompt's block stored");
    flush(&client, &fleet).await;
    assert_eq!(recv_batch(&mut subscriber.socket).await.seq, 2);

    // Restart: every port is free again once shutdown returns.
    fleet.shutdown().await;
    let fleet = spawn_fleet(args.clone()).await.expect("the same ports can be bound again at once");
    assert_eq!(fleet.urls(), urls);
    assert_eq!(fleet.kv_event_endpoints(), endpoints);
    assert_eq!(fleet.kv_event_replay_endpoints(), replay_endpoints);
    subscriber.connected().await;
    let (fleet, seq) = first_batch(fleet, &args, &client, &mut subscriber).await;
    assert_eq!(seq, 0, "the sequence went back to 0");
    // The replay socket on the same port serves the new engine's buffer only.
    let mut dealer = dealer(&replay_endpoints[0]).await;
    let replayed = delimited_batches(&replay(&mut dealer, &[b"", &0u64.to_be_bytes()]).await);
    assert_eq!(replayed.iter().map(|batch| batch.seq).collect::<Vec<_>>(), [0]);
    fleet.shutdown().await;
}
