//! Shared helpers of the mock fleet's integration tests: spawning on port 0, posting JSON, reading SSE.

#![allow(dead_code)] // each test binary uses a subset

pub mod kv;

use std::time::Duration;

use kvgate_mock::{spawn_fleet, MockArgs, MockFleet};
use serde_json::Value;

/// Every request in these tests gives up after this long.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

pub struct Harness {
    pub fleet: MockFleet,
    pub client: reqwest::Client,
    pub url: String,
}

/// A fleet on 127.0.0.1 with free ports, built from the defaults with `configure` applied.
pub async fn spawn(configure: impl FnOnce(&mut MockArgs)) -> Harness {
    let mut args = MockArgs::default();
    configure(&mut args);
    let fleet = spawn_fleet(args).await.expect("the fleet starts");
    let url = fleet.urls()[0].clone();
    let client = reqwest::Client::builder().timeout(REQUEST_TIMEOUT).build().unwrap();
    Harness { fleet, client, url }
}

impl Harness {
    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .await
            .expect("the request is answered")
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> Value {
        let response = self.post(path, body).await;
        assert_eq!(response.status(), 200, "{path} {body}");
        response.json().await.unwrap()
    }

    /// Posts a streaming request and returns the `data:` payloads in order.
    pub async fn post_sse(&self, path: &str, body: &Value) -> Vec<String> {
        let response = self.post(path, body).await;
        assert_eq!(response.status(), 200);
        let content_type = response.headers()["content-type"].to_str().unwrap().to_string();
        assert!(content_type.starts_with("text/event-stream"), "{content_type}");
        sse_payloads(&response.text().await.unwrap())
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(format!("{}{path}", self.url)).send().await.expect("the request is answered")
    }

    pub async fn loads(&self) -> Value {
        self.get("/v1/loads").await.json::<Value>().await.unwrap()["loads"][0].clone()
    }
}

/// The payloads of `data: ...` lines, each event separated by a blank line.
pub fn sse_payloads(text: &str) -> Vec<String> {
    assert!(text.ends_with("\n\n"), "an SSE body ends with a blank line: {text:?}");
    text.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            event.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {event:?}")).to_string()
        })
        .collect()
}

/// A prompt of `n` distinct words starting at `start`.
pub fn words(start: usize, n: usize) -> String {
    (start..start + n).map(|i| format!("w{i} ")).collect()
}
