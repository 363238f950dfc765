//! A hostile HTTP server on loopback: a worker whose chosen endpoints answer with an endless
//! body (bounded by `cap` bytes so the test itself is bounded), counting what it sent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;

pub struct Flood {
    pub url: String,
    /// Bytes of flood bodies handed to the connection so far.
    pub sent: Arc<AtomicUsize>,
}

/// A body of `cap` bytes of `filler` in 64 KiB chunks, counted into `sent` as it is pulled.
fn endless(filler: u8, cap: usize, sent: Arc<AtomicUsize>) -> Body {
    let chunk = Bytes::from(vec![filler; 64 * 1024]);
    let chunks = cap / chunk.len();
    let stream = futures_util::stream::iter((0..chunks).map(move |_| {
        sent.fetch_add(chunk.len(), Ordering::Relaxed);
        Ok::<_, std::io::Error>(chunk.clone())
    }));
    Body::from_stream(stream)
}

/// Starts a worker serving `model` whose `flooded` GET paths (and, when `flood_posts`, its
/// proxied endpoints) answer 200 with a `cap`-byte body; other paths answer as a small engine.
pub async fn flood(model: &str, flooded: &[&'static str], flood_posts: bool, cap: usize) -> Flood {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let sent = Arc::new(AtomicUsize::new(0));
    let models = serde_json::json!({"object": "list", "data": [{"id": model}]}).to_string();
    let mut app = Router::new();
    if !flooded.contains(&"/health") {
        app = app.route("/health", get(|| async { "" }));
    }
    if !flooded.contains(&"/v1/models") {
        app = app.route("/v1/models", get(move || async move { models }));
    }
    if !flooded.contains(&"/v1/loads") {
        app = app.route("/v1/loads", get(|| async { crate::common::sglang_loads(0.1, 0, 0) }));
    }
    for path in flooded {
        let sent = sent.clone();
        app = app.route(path, get(move || async move { Response::new(endless(b'x', cap, sent)) }));
    }
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let sent = sent.clone();
        app = app.route(
            path,
            post(move || async move {
                match flood_posts {
                    true => Response::new(endless(b' ', cap, sent)),
                    false => Response::new(Body::from(r#"{"object": "chat.completion", "choices": []}"#)),
                }
            }),
        );
    }
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Flood { url, sent }
}
