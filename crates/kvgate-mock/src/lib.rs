//! kvgate-mock: a fleet of simulated SGLang/vLLM engines on loopback HTTP, each driven in real time by the `kvgate-engine` model.
//!
//! Every worker serves `GET /health`, `GET /v1/models`, `POST /v1/chat/completions`,
//! `POST /v1/completions`, `POST /generate` (SGLang native), `GET /v1/loads` (SGLang's load
//! report), `GET /metrics` (vLLM metric names) and `POST /flush_cache`, and optionally
//! publishes KV events over ZMQ in vLLM's wire format. Generation is streamed (SSE, one chunk
//! per token, a final usage chunk, `data: [DONE]`) or returned whole, with OpenAI-shaped usage
//! including `prompt_tokens_details.cached_tokens`.
//!
//! Prompts are tokenized with the engines' tokenizer (one word = one token, see
//! `kvgate_engine::tokenize`); chat messages are rendered with `kvgate_engine::render_chat`.
//! The output length is `max_tokens` (or `max_completion_tokens`, `max_new_tokens`, else
//! `--default-max-tokens`) when `"ignore_eos": true` or `--force-max-tokens`, otherwise the
//! smaller of that and a length of 8..=64 derived from the prompt. The text is deterministic
//! words.
//!
//! `--engine canned` answers at once (after `--gen-ms`) with prebuilt bodies and no model, for
//! gateway overhead benchmarks. Fault flags inject 500s, cut connections, added latency and a
//! health endpoint that turns 503.

mod args;
mod canned;
mod driver;
mod generation;
mod kv_publisher;
mod metrics;
mod openai;
mod server;
mod sglang;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub use args::{EngineKind, MockArgs};

use driver::{EngineClock, EngineHandle};
use kv_publisher::KvPublisher;
use server::{AppState, ServeOptions};

/// How long `MockFleet::shutdown` waits for open connections before dropping them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A running fleet of simulated engines. Dropping it stops the servers without waiting.
pub struct MockFleet {
    urls: Vec<String>,
    kv_event_endpoints: Vec<String>,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    background: Vec<JoinHandle<()>>,
    engines: Vec<EngineHandle>,
}

impl MockFleet {
    /// Base URLs of the workers, `http://host:port`, in worker order.
    pub fn urls(&self) -> Vec<String> {
        self.urls.clone()
    }

    /// ZMQ endpoints (`tcp://host:port`) of the workers' KV event publishers, in worker order;
    /// empty unless `--kv-events-base-port` was given.
    pub fn kv_event_endpoints(&self) -> Vec<String> {
        self.kv_event_endpoints.clone()
    }

    /// Stops accepting connections, ends open generation streams, and waits (briefly) for
    /// the servers to finish.
    pub async fn shutdown(mut self) {
        self.signal_stop();
        for server in std::mem::take(&mut self.servers) {
            let abort = server.abort_handle();
            if tokio::time::timeout(SHUTDOWN_GRACE, server).await.is_err() {
                abort.abort();
            }
        }
        for task in std::mem::take(&mut self.background) {
            task.abort();
        }
    }

    fn signal_stop(&self) {
        let _ = self.shutdown.send(true);
        for engine in &self.engines {
            engine.close();
        }
    }
}

impl Drop for MockFleet {
    fn drop(&mut self) {
        self.signal_stop();
        for task in self.servers.iter().chain(&self.background) {
            task.abort();
        }
    }
}

/// Binds `args.count` workers (and their KV event publishers) and starts serving.
pub async fn spawn_fleet(args: MockArgs) -> anyhow::Result<MockFleet> {
    args.validate().map_err(|problems| anyhow::anyhow!("invalid mock options:\n{problems}"))?;
    let config = args.engine_config();
    let (shutdown, shutdown_rx) = watch::channel(false);
    let mut fleet = MockFleet {
        urls: Vec::new(),
        kv_event_endpoints: Vec::new(),
        shutdown,
        servers: Vec::new(),
        background: Vec::new(),
        engines: Vec::new(),
    };
    for worker_idx in 0..args.count {
        let offset = |base: u16| {
            if base == 0 {
                0
            } else {
                base + worker_idx as u16
            }
        };
        let port = offset(args.base_port);
        let listener = TcpListener::bind((args.host.as_str(), port))
            .await
            .with_context(|| format!("binding mock engine {worker_idx} on {}:{port}", args.host))?;
        let address = listener.local_addr()?;
        let engine = match args.engine {
            EngineKind::Canned => None,
            EngineKind::Realistic => {
                let clock = EngineClock::new(args.time_scale);
                let kv_events = match args.kv_events_base_port {
                    Some(base) => {
                        let publisher = KvPublisher::bind(&args.host, offset(base)).await?;
                        fleet.kv_event_endpoints.push(publisher.endpoint().to_string());
                        let (sender, receiver) = mpsc::unbounded_channel();
                        let topic = args.kv_events_topic.clone();
                        fleet.background.push(publisher.spawn(topic, clock, receiver));
                        Some(sender)
                    }
                    None => None,
                };
                let (engine, driver) = EngineHandle::spawn(config.clone(), clock, kv_events);
                fleet.background.push(driver);
                fleet.engines.push(engine.clone());
                Some(engine)
            }
        };
        let options = ServeOptions::from_args(&args, worker_idx);
        let state = Arc::new(AppState::new(args.model.clone(), worker_idx, engine, options));
        let app = server::router(state, args.engine);
        let mut stop = shutdown_rx.clone();
        fleet.servers.push(tokio::spawn(async move {
            let stopped = async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            };
            if let Err(error) = axum::serve(listener, app).with_graceful_shutdown(stopped).await {
                tracing::error!(%error, worker_idx, "mock engine server failed");
            }
        }));
        fleet.urls.push(format!("http://{address}"));
    }
    Ok(fleet)
}

/// Spawns the fleet, prints its URLs (one per line), and serves until ctrl-c.
pub async fn run_fleet(args: MockArgs) -> anyhow::Result<()> {
    let fleet = spawn_fleet(args).await?;
    for (worker_idx, url) in fleet.urls().iter().enumerate() {
        println!("mock engine {worker_idx}: {url}");
    }
    for (worker_idx, endpoint) in fleet.kv_event_endpoints().iter().enumerate() {
        println!("mock engine {worker_idx} KV events: {endpoint}");
    }
    tokio::signal::ctrl_c().await.context("waiting for ctrl-c")?;
    fleet.shutdown().await;
    Ok(())
}
