//! Test doubles for the gateway's integration tests: small programmable upstream servers on
//! 127.0.0.1 and helpers to start a gateway in front of them.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use tokio::sync::Notify;

pub mod kv_wire;
pub mod mock;
pub mod redis;

// Not every test binary uses every helper (as `dead_code` above).
#[allow(unused_imports)]
pub use mock::{mock_fleet, pd_fleet, pd_mock_config};

pub use kvgate_protocol::exposition;

/// How a test upstream behaves; flip fields at run time.
pub struct Upstream {
    pub name: String,
    pub model: String,
    pub url: String,
    pub addr: SocketAddr,
    pub requests: AtomicUsize,
    pub healthy: AtomicBool,
    /// Status for proxied endpoints (200 unless a test changes it).
    pub status: AtomicU16,
    /// When set, streaming answers pause after the first chunk until `release` is notified.
    pub hold_stream: AtomicBool,
    pub release: Notify,
    /// Last Authorization header seen on a proxied request.
    pub last_auth: std::sync::Mutex<Option<String>>,
    /// Headers of the last proxied request.
    pub last_headers: std::sync::Mutex<axum::http::HeaderMap>,
    /// Delay before answering proxied requests.
    pub delay_ms: AtomicUsize,
    /// Delay before answering `GET /health`.
    pub health_delay_ms: AtomicUsize,
    /// Body of `GET /v1/loads` (SGLang shape); empty means 404.
    pub loads_body: std::sync::Mutex<String>,
    /// Delay before answering `GET /v1/loads`.
    pub loads_delay_ms: AtomicUsize,
    /// Number of `GET /v1/loads` requests seen.
    pub loads_polls: AtomicUsize,
    /// Body of `GET /metrics` (vLLM Prometheus text); empty means 404.
    pub metrics_body: std::sync::Mutex<String>,
    /// Client addresses (one per TCP connection) that carried proxied requests.
    pub peers: std::sync::Mutex<std::collections::HashSet<SocketAddr>>,
    /// Client addresses that carried `GET /health` or `GET /v1/loads`.
    pub background_peers: std::sync::Mutex<std::collections::HashSet<SocketAddr>>,
    /// Bodies of the proxied requests received, in order.
    pub bodies: std::sync::Mutex<Vec<serde_json::Value>>,
    /// When set, streaming answers break (connection error) after the first chunk.
    pub cut_stream: AtomicBool,
    /// Proxied requests whose handler is still running (dropped ones included once dropped).
    pub active: AtomicUsize,
    /// Number of `GET /health` requests seen (the gateway's health loop ticking).
    pub health_checks: AtomicUsize,
}

/// Counts a handler as active until it returns or is dropped (its client went away).
struct Active(Arc<Upstream>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn metrics(State(up): State<Arc<Upstream>>) -> Response {
    let body = up.metrics_body.lock().unwrap().clone();
    if body.is_empty() {
        return StatusCode::NOT_FOUND.into_response();
    }
    body.into_response()
}

/// An SGLang `/v1/loads` body with one rank.
pub fn sglang_loads(token_usage: f64, running: u64, waiting_tokens: u64) -> String {
    serde_json::json!({"timestamp": "0", "dp_rank_count": 1, "loads": [{
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
        "num_waiting_uncached_tokens": waiting_tokens, "num_total_reqs": running,
        "num_used_tokens": 0, "max_total_num_tokens": 100000, "token_usage": token_usage,
        "gen_throughput": 1000.0, "cache_hit_rate": 0.0, "utilization": 0.0, "max_running_requests": 256}]})
    .to_string()
}

async fn loads(State(up): State<Arc<Upstream>>, ConnectInfo(peer): ConnectInfo<SocketAddr>) -> Response {
    up.loads_polls.fetch_add(1, Ordering::SeqCst);
    up.background_peers.lock().unwrap().insert(peer);
    let delay = up.loads_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay as u64)).await;
    }
    let body = up.loads_body.lock().unwrap().clone();
    if body.is_empty() {
        return StatusCode::NOT_FOUND.into_response();
    }
    ([("content-type", "application/json")], body).into_response()
}

async fn answer(
    State(up): State<Arc<Upstream>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    up.requests.fetch_add(1, Ordering::SeqCst);
    up.active.fetch_add(1, Ordering::SeqCst);
    let _active = Active(up.clone());
    up.peers.lock().unwrap().insert(peer);
    *up.last_auth.lock().unwrap() =
        headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
    *up.last_headers.lock().unwrap() = headers.clone();
    let delay = up.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay as u64)).await;
    }
    let status = StatusCode::from_u16(up.status.load(Ordering::SeqCst)).unwrap();
    if status != StatusCode::OK {
        return (status, format!(r#"{{"error":{{"message":"{} says {}"}}}}"#, up.name, status.as_u16()))
            .into_response();
    }
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    up.bodies.lock().unwrap().push(request.clone());
    if request["stream"].as_bool() == Some(true) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
        let up2 = up.clone();
        tokio::spawn(async move {
            let chunk =
                |i: usize| Bytes::from(format!("data: {{\"worker\":\"{}\",\"i\":{i}}}\n\n", up2.name));
            let _ = tx.send(Ok(chunk(0))).await;
            if up2.cut_stream.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = tx.send(Err(std::io::Error::other("engine died"))).await;
                return;
            }
            if up2.hold_stream.load(Ordering::SeqCst) {
                up2.release.notified().await;
            }
            for i in 1..3 {
                let _ = tx.send(Ok(chunk(i))).await;
            }
            let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        });
        let stream =
            futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let mut echo =
        serde_json::json!({"worker": up.name, "model": request["model"], "object": "chat.completion"});
    if request["kv_transfer_params"]["do_remote_decode"] == true {
        // A vLLM prefill engine: says where its KV waits.
        echo["kv_transfer_params"] = serde_json::json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": up.name, "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
            "remote_port": up.addr.port(), "remote_request_id": format!("{}-{}", up.name, up.requests.load(Ordering::SeqCst))});
    }
    ([("content-type", "application/json")], echo.to_string()).into_response()
}

async fn health(State(up): State<Arc<Upstream>>, ConnectInfo(peer): ConnectInfo<SocketAddr>) -> StatusCode {
    up.health_checks.fetch_add(1, Ordering::SeqCst);
    up.background_peers.lock().unwrap().insert(peer);
    let delay = up.health_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay as u64)).await;
    }
    if up.healthy.load(Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn models(State(up): State<Arc<Upstream>>) -> Response {
    let body = serde_json::json!({"object": "list", "data": [{"id": up.model, "object": "model"}]});
    ([("content-type", "application/json")], body.to_string()).into_response()
}

/// Start an upstream named `name` serving `model` on a free loopback port.
pub async fn upstream(name: &str, model: &str) -> Arc<Upstream> {
    upstream_on(name, model, "127.0.0.1:0").await
}

/// Start an upstream on a given loopback address.
pub async fn upstream_on(name: &str, model: &str, addr: &str) -> Arc<Upstream> {
    if let Ok(held) = addr.parse::<SocketAddr>() {
        // A dead URL's port comes back to life here.
        DEAD_PORTS.lock().unwrap_or_else(|p| p.into_inner()).remove(&held);
    }
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let up = Arc::new(Upstream {
        name: name.to_string(),
        model: model.to_string(),
        url: format!("http://{addr}"),
        addr,
        requests: AtomicUsize::new(0),
        healthy: AtomicBool::new(true),
        status: AtomicU16::new(200),
        hold_stream: AtomicBool::new(false),
        release: Notify::new(),
        last_auth: std::sync::Mutex::new(None),
        last_headers: std::sync::Mutex::new(Default::default()),
        delay_ms: AtomicUsize::new(0),
        health_delay_ms: AtomicUsize::new(0),
        loads_body: std::sync::Mutex::new(sglang_loads(0.0, 0, 0)),
        loads_delay_ms: AtomicUsize::new(0),
        loads_polls: AtomicUsize::new(0),
        metrics_body: std::sync::Mutex::new(String::new()),
        peers: std::sync::Mutex::new(Default::default()),
        background_peers: std::sync::Mutex::new(Default::default()),
        bodies: std::sync::Mutex::new(Vec::new()),
        cut_stream: AtomicBool::new(false),
        active: AtomicUsize::new(0),
        health_checks: AtomicUsize::new(0),
    });
    let app = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/loads", get(loads))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(answer))
        .route("/v1/completions", post(answer))
        .route("/generate", post(answer))
        .route("/v1/embeddings", post(answer))
        .with_state(up.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await;
    });
    up
}

/// The ports [`dead_url`] handed out, each held by a socket bound without listening (and without
/// `SO_REUSEADDR`): a connection there is refused, and no bind of this process or another is
/// given the port while it is held, so two calls never return one address (a second
/// registration of it would be refused as already registered) and no other test's server comes
/// to answer there. [`upstream_on`] lets one go to serve on it.
static DEAD_PORTS: std::sync::Mutex<std::collections::BTreeMap<SocketAddr, tokio::net::TcpSocket>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// A loopback URL where nothing listens, distinct from every other this process was given.
pub async fn dead_url() -> String {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let addr = socket.local_addr().unwrap();
    DEAD_PORTS.lock().unwrap_or_else(|p| p.into_inner()).insert(addr, socket);
    format!("http://{addr}")
}

/// A gateway config on a free port with fast health checks.
pub fn config(worker_urls: Vec<String>) -> GatewayConfig {
    GatewayConfig {
        port: 0,
        worker_urls,
        health_check_interval_secs: 0.1,
        health_check_timeout_secs: 1.0,
        health_failure_threshold: 2,
        health_success_threshold: 1,
        retry_initial_backoff_ms: 1,
        retry_max_backoff_ms: 5,
        shutdown_grace_period_secs: 5.0,
        routing: kvgate_policy::PolicyConfig {
            policy: kvgate_policy::PolicyKind::RoundRobin,
            ..Default::default()
        },
        ..GatewayConfig::default()
    }
}

pub async fn gateway(config: GatewayConfig) -> GatewayHandle {
    kvgate_gateway::start(config).await.expect("gateway starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

pub fn chat(model: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hello"}]})
}

/// The JSON answer to `request` (an admin or dry-run call the test expects to succeed).
pub async fn json_answer(request: reqwest::RequestBuilder) -> serde_json::Value {
    request.send().await.unwrap().json().await.unwrap()
}

/// The gateway's dry run of `body`: `POST /v1/route` on its admin listener.
pub async fn dry_run(gw: &GatewayHandle, body: &serde_json::Value) -> serde_json::Value {
    json_answer(client().post(format!("{}/v1/route", gw.admin_url())).json(body)).await
}

/// Poll `check` every 20 ms for up to `secs` seconds.
pub async fn eventually(secs: f64, mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(secs);
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// A chat template other than the engines' (`### role: content` lines), in a directory of its
/// own that goes with the value.
pub struct WrongTemplate {
    dir: std::path::PathBuf,
    pub path: std::path::PathBuf,
}

impl WrongTemplate {
    /// Written under the temporary directory as `kvgate-<tag>-<pid>/wrong.jinja`.
    pub fn new(tag: &str) -> WrongTemplate {
        let dir = std::env::temp_dir().join(format!("kvgate-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("wrong.jinja");
        std::fs::write(
            &path,
            "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}### assistant:",
        )
        .unwrap();
        WrongTemplate { dir, path }
    }
}

impl Drop for WrongTemplate {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `/metrics` page served at `base_url` (a gateway's or an engine's).
pub async fn metrics_at(base_url: &str) -> String {
    client().get(format!("{base_url}/metrics")).send().await.unwrap().text().await.unwrap()
}

/// The gateway's `/metrics` page.
pub async fn metrics_text(gw: &GatewayHandle) -> String {
    metrics_at(&gw.url()).await
}

/// The sum of the series `selector` names in a `/metrics` page (`name` or `name{label="value"}`,
/// read by the gateway's own reader, [`exposition`]), 0 when the page has none. A selector that
/// does not parse fails the test.
pub fn metric(text: &str, selector: &str) -> f64 {
    exposition::Selector::parse(selector).unwrap_or_else(|e| panic!("{e}")).sum(text)
}

/// Polls the gateway's `/metrics` (10 s at most) until the series `selector` names sum to
/// `at_least`; returns the last sum.
pub async fn wait_metric(gw: &GatewayHandle, selector: &str, at_least: f64) -> f64 {
    let mut value = 0.0;
    eventually(10.0, async || {
        value = metric(&metrics_text(gw).await, selector);
        value >= at_least
    })
    .await;
    value
}

/// Waits up to 5 s until the gateway's `/metrics` has the sample `sample` (a series and its
/// value, e.g. `kvgate_queue_depth 1`).
pub async fn metric_line_appears(gw: &GatewayHandle, sample: &str) -> bool {
    let wanted = exposition::parse_line(sample).unwrap_or_else(|| panic!("not a sample line: {sample:?}"));
    fn label_set<'a>(sample: &exposition::Sample<'a>) -> Vec<(&'a str, std::borrow::Cow<'a, str>)> {
        let mut labels = sample.labels.clone();
        labels.sort();
        labels
    }
    let same = |seen: &exposition::Sample| {
        seen.name == wanted.name && seen.value == wanted.value && label_set(seen) == label_set(&wanted)
    };
    eventually(5.0, async || exposition::samples(&metrics_text(gw).await).any(|seen| same(&seen))).await
}

/// A cache_aware gateway subscribed to every engine of a `kvgate mock` fleet, its KV events and
/// their replay, tokenizing as the mock engines do.
/// A mock fleet of `count` engines publishing KV events (with replay), 50x faster than wall time.
pub async fn kv_events_fleet(count: usize) -> kvgate_mock::MockFleet {
    mock_fleet(|args| {
        args.count = count;
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
        args.kv_events_replay_base_port = Some(0);
    })
    .await
}

/// The gateway's workers as `GET /workers` lists them (each worker's `id`, `url`, `model_id`,
/// `healthy`, `in_flight`, `circuit_state`, `kv_events`, ...).
pub async fn workers(gw: &GatewayHandle) -> Vec<serde_json::Value> {
    workers_with_key(gw, None).await
}

/// As [`workers`], sending `key` as the admin key the gateway requires.
pub async fn workers_with_key(gw: &GatewayHandle, key: Option<&str>) -> Vec<serde_json::Value> {
    let mut request = client().get(format!("{}/workers", gw.admin_url()));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let answer = json_answer(request).await;
    answer["workers"].as_array().unwrap_or_else(|| panic!("GET /workers lists workers: {answer}")).clone()
}

/// Waits (at most 10 s) until the gateway lists `count` workers, each routable: a probe or a
/// model discovery at registration can outlast its timeout on a loaded machine, and the health
/// loop then makes the worker routable a moment later.
pub async fn wait_routable(gw: &GatewayHandle, count: usize) {
    let mut seen = Vec::new();
    let ready = eventually(10.0, async || {
        seen = workers(gw).await;
        seen.len() == count && seen.iter().all(routable)
    })
    .await;
    assert!(ready, "{count} routable workers within 10 s: {seen:?}");
}

/// Whether a worker of `GET /workers` is healthy.
pub fn healthy(worker: &serde_json::Value) -> bool {
    worker["healthy"] == true
}

/// Whether a worker of `GET /workers` takes requests: healthy, its model known, its circuit
/// not open.
pub fn routable(worker: &serde_json::Value) -> bool {
    healthy(worker) && !worker["model_id"].is_null() && worker["circuit_state"] != "open"
}

/// Whether every rank's KV events of a worker of `GET /workers` flow into the exact index.
pub fn kv_events_flowing(worker: &serde_json::Value) -> bool {
    worker["kv_events"]["flowing"] == true
}

/// Waits up to 10 s until the gateway has workers and every one's KV events flow
/// (subscribed and replayed).
pub async fn wait_kv_events_flowing(gw: &GatewayHandle) {
    let flowing = eventually(10.0, async || {
        let workers = workers(gw).await;
        !workers.is_empty() && workers.iter().all(kv_events_flowing)
    })
    .await;
    assert!(flowing, "every worker's KV events flow within 10 s");
}

pub fn kv_events_config(fleet: &kvgate_mock::MockFleet) -> GatewayConfig {
    let mut cfg = config(fleet.urls());
    cfg.routing.policy = kvgate_policy::PolicyKind::CacheAware;
    cfg.kv_events_endpoints = fleet.kv_event_endpoints();
    cfg.kv_events_replay_endpoints = fleet.kv_event_replay_endpoints();
    cfg.mock_tokenizer = true;
    cfg
}
