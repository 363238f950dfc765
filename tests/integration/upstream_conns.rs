//! The gateway's keep-alive connections to workers: reused across requests, replaced when the
//! worker closed them while idle, and sent to the worker URL's path prefix.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn sequential_requests_reuse_one_upstream_connection() {
    let up = upstream("a", "m").await;
    // No health probe in flight to take the connection when a request comes (they share it).
    let mut cfg = config(vec![up.url.clone()]);
    cfg.disable_health_check = true;
    let gw = gateway(cfg).await;
    let client = client();
    for i in 0..20 {
        let mut body = chat("m");
        body["stream"] = serde_json::json!(i % 4 == 0);
        let res = client.post(format!("{}/v1/chat/completions", gw.url())).json(&body).send().await.unwrap();
        assert_eq!(res.status(), 200);
        res.bytes().await.unwrap();
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 20);
    assert_eq!(up.peers.lock().unwrap().len(), 1, "every request should ride the same kept-alive connection");
    gw.shutdown().await;
}

#[tokio::test]
async fn health_probes_load_polls_and_requests_share_the_workers_connection() {
    // One keep-alive connection serves a worker's proxied requests and the gateway's own GETs
    // (a 10,000-worker fleet otherwise needs two descriptors a worker), whether client
    // connections are served on the shared runtime (0) or on I/O threads (2: a thread takes the
    // shared runtime's idle connection when it has none of its own). Registration's probes,
    // before the worker has connections of its own, go over one that is not kept.
    for io_threads in [0, 2] {
        let up = upstream("a", "m").await;
        let kv_aware = kvgate_policy::PolicyConfig {
            policy: kvgate_policy::PolicyKind::KvAware,
            ..kvgate_policy::PolicyConfig::default()
        };
        let mut cfg = config(vec![up.url.clone()]);
        cfg.routing = kv_aware;
        cfg.load_monitor_interval_ms = 50;
        cfg.io_threads = Some(io_threads);
        let gw = gateway(cfg).await;
        let registration: Vec<_> = up.background_peers.lock().unwrap().drain().collect();
        assert!(registration.len() <= 1, "{registration:?}");
        let polled = async || {
            up.loads_polls.load(Ordering::SeqCst) >= 2 && up.health_checks.load(Ordering::SeqCst) >= 2
        };
        assert!(eventually(5.0, polled).await);
        for _ in 0..5 {
            let url = format!("{}/v1/chat/completions", gw.url());
            let res = client().post(url).json(&chat("m")).send().await.unwrap();
            assert_eq!(res.status(), 200);
            res.bytes().await.unwrap();
        }
        // The connection that carried the requests carries the next probes and polls (most
        // recently used first); one the gateway's GETs open while another is busy is a second,
        // at most.
        let shared = async || {
            let background = up.background_peers.lock().unwrap().clone();
            up.peers.lock().unwrap().iter().any(|peer| background.contains(peer))
        };
        assert!(eventually(5.0, shared).await, "{io_threads}: {:?} {:?}", up.peers, up.background_peers);
        let all: std::collections::HashSet<_> =
            up.peers.lock().unwrap().union(&up.background_peers.lock().unwrap()).copied().collect();
        assert!(all.len() <= 2, "{io_threads}: {all:?}");
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn concurrent_requests_open_connections_then_reuse_them() {
    let up = upstream("a", "m").await;
    up.delay_ms.store(20, Ordering::SeqCst);
    let gw = gateway(config(vec![up.url.clone()])).await;
    let client = client();
    for _wave in 0..3 {
        let sends = (0..8).map(|_| {
            let (client, url) = (client.clone(), format!("{}/v1/chat/completions", gw.url()));
            async move { client.post(url).json(&chat("m")).send().await.unwrap().status() }
        });
        for status in futures_util::future::join_all(sends).await {
            assert_eq!(status, 200);
        }
    }
    let peers = up.peers.lock().unwrap().len();
    // Eight requests and a health probe (the gateway's own GETs share the connections) at most.
    assert!((1..=9).contains(&peers), "24 requests, at most 8 at a time, used {peers} connections");
    gw.shutdown().await;
}

#[tokio::test]
async fn both_serving_modes_proxy_and_reuse_their_upstream_connections() {
    // 0: client connections on the shared runtime; 3: three I/O threads, each with its own pool
    // shard, so up to one set of upstream connections per thread.
    for io_threads in [0, 3] {
        let up = upstream("a", "m").await;
        up.delay_ms.store(5, Ordering::SeqCst);
        let mut cfg = config(vec![up.url.clone()]);
        cfg.io_threads = Some(io_threads);
        let gw = gateway(cfg).await;
        let sends = (0..6).map(|_| {
            let url = format!("{}/v1/chat/completions", gw.url());
            async move {
                // One client (one kept-alive connection) per task, five requests each.
                let client = client();
                for _ in 0..5 {
                    let res = client.post(&url).json(&chat("m")).send().await.unwrap();
                    assert_eq!(res.status(), 200);
                    res.bytes().await.unwrap();
                }
            }
        });
        futures_util::future::join_all(sends).await;
        assert_eq!(up.requests.load(Ordering::SeqCst), 30, "io_threads {io_threads}");
        // The gateway's own health probes share the worker's connections: one in flight when
        // the six requests come holds a seventh, which carries requests afterwards.
        let peers = up.peers.lock().unwrap().len();
        assert!(
            (1..=7).contains(&peers),
            "io_threads {io_threads}: 30 requests, 6 at a time (and a probe), {peers} connections"
        );
        gw.shutdown().await;
    }
}

/// A raw HTTP/1.1 worker that answers one request per connection, keep-alive style (no
/// `Connection: close`), then closes the connection: what an engine's keep-alive timeout does.
struct OneShotWorker {
    url: String,
    connections: AtomicUsize,
    request_lines: Mutex<Vec<String>>,
    /// Connections it has closed.
    closed: AtomicUsize,
}

/// Read one HTTP/1.1 request (head and content-length body); returns the head.
async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<String> {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&data[..head_end]).to_string();
    let length: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while data.len() < head_end + length {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    }
    Some(head)
}

async fn one_shot_worker() -> Arc<OneShotWorker> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker = Arc::new(OneShotWorker {
        url: format!("http://{}", listener.local_addr().unwrap()),
        connections: AtomicUsize::new(0),
        request_lines: Mutex::new(Vec::new()),
        closed: AtomicUsize::new(0),
    });
    let state = worker.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            state.connections.fetch_add(1, Ordering::SeqCst);
            let state = state.clone();
            tokio::spawn(async move {
                let Some(head) = read_request(&mut stream).await else { return };
                state.request_lines.lock().unwrap().push(head.lines().next().unwrap_or("").to_string());
                let body = r#"{"object":"chat.completion"}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                // Dropping the stream closes the connection the gateway keeps in its pool.
                drop(stream);
                state.closed.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    worker
}

async fn gateway_for(worker_url: &str) -> kvgate_gateway::GatewayHandle {
    let mut config = config(vec![]);
    config.disable_health_check = true;
    let gw = gateway(config).await;
    let res = client()
        .post(format!("{}/workers", gw.admin_url()))
        .json(&serde_json::json!({"url": worker_url, "model_id": "m"}))
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success(), "{}", res.text().await.unwrap());
    gw
}

#[tokio::test]
async fn a_pooled_connection_the_worker_closed_is_replaced_without_error() {
    let worker = one_shot_worker().await;
    let gw = gateway_for(&worker.url).await;
    let client = client();
    for sent in 1..=5 {
        let res =
            client.post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
        assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
        res.bytes().await.unwrap();
        // The worker closes the connection the gateway just pooled.
        let closed = eventually(5.0, async || worker.closed.load(Ordering::SeqCst) == sent).await;
        assert!(closed, "the worker closed its connection {sent}");
    }
    assert_eq!(worker.connections.load(Ordering::SeqCst), 5);
    assert_eq!(worker.request_lines.lock().unwrap().len(), 5, "each request was sent exactly once");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_worker_url_path_prefix_is_kept() {
    let worker = one_shot_worker().await;
    let gw = gateway_for(&format!("{}/engine/a/", worker.url)).await;
    let res = client()
        .post(format!("{}/v1/completions?x=1", gw.url()))
        .json(&serde_json::json!({"model": "m", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        worker.request_lines.lock().unwrap().as_slice(),
        ["POST /engine/a/v1/completions?x=1 HTTP/1.1"]
    );
    gw.shutdown().await;
}

/// Large bodies both ways: the request connection is driven by the request's own task, so flow
/// control (a full socket buffer, a slow reader) must keep it moving in both directions.
#[tokio::test]
async fn large_request_and_answer_bodies_pass_through_whole() {
    use axum::routing::post;
    const ANSWER_BYTES: usize = 4 << 20;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(AtomicUsize::new(0));
    let seen_by_worker = seen.clone();
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            post(move |body: bytes::Bytes| {
                let seen = seen_by_worker.clone();
                async move {
                    seen.store(body.len(), Ordering::SeqCst);
                    vec![b'x'; ANSWER_BYTES]
                }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::disable());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let gw = gateway_for(&url).await;
    let prompt = "y".repeat(3 << 20);
    let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    for _ in 0..2 {
        let res =
            client().post(format!("{}/v1/completions", gw.url())).body(body.clone()).send().await.unwrap();
        assert_eq!(res.status(), 200);
        let answer = res.bytes().await.unwrap();
        assert_eq!(answer.len(), ANSWER_BYTES);
        assert_eq!(seen.load(Ordering::SeqCst), body.len());
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_worker_that_dies_mid_stream_ends_the_client_response() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                if read_request(&mut stream).await.is_none() {
                    return;
                }
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                let chunk = "data: {\"i\":0}\n\n";
                let first = format!("{head}{:x}\r\n{chunk}\r\n", chunk.len());
                let _ = stream.write_all(first.as_bytes()).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                // The engine dies: the connection goes away in the middle of the chunked stream.
            });
        }
    });
    let gw = gateway_for(&url).await;
    let res = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&serde_json::json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let read_all = tokio::time::timeout(Duration::from_secs(5), res.bytes()).await;
    let read_all = read_all.expect("the client's response ends when the worker's does");
    assert!(read_all.is_err(), "a truncated stream must not look complete to the client");
    let admin = gw.admin_url();
    let idle = eventually(5.0, async || {
        let workers: serde_json::Value =
            client().get(format!("{admin}/workers")).send().await.unwrap().json().await.unwrap();
        workers["workers"][0]["in_flight"].as_u64() == Some(0)
    })
    .await;
    assert!(idle, "the request ended in the gateway too");
    gw.shutdown().await;
}
