//! Measures how many requests/s one canned mock engine answers on loopback (64 clients, 3 s, bounded).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_mock::{spawn_fleet, EngineKind, MockArgs};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let fleet = spawn_fleet(MockArgs { engine: EngineKind::Canned, ..MockArgs::default() }).await?;
    let url = format!("{}/v1/chat/completions", fleet.urls()[0]);
    let prompt = "word ".repeat(1600); // about 8 KB
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "mock-model", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 16}))?;
    let client = reqwest::Client::new();
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(3);
    let clients: Vec<_> = (0..64)
        .map(|_| {
            let (client, url, body, done) = (client.clone(), url.clone(), body.clone(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let response = client
                        .post(&url)
                        .body(body.clone())
                        .header("content-type", "application/json")
                        .send()
                        .await;
                    if let Ok(response) = response {
                        if response.bytes().await.is_ok() {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for client in clients {
        client.await?;
    }
    println!("{:.0} requests/s", done.load(Ordering::Relaxed) as f64 / 3.0);
    fleet.shutdown().await;
    Ok(())
}
