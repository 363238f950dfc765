//! kvgate-mock: a fleet of simulated SGLang/vLLM engines on loopback HTTP, each driven in real time by the `kvgate-engine` model.
//!
//! Every worker serves `GET /health`, `GET /v1/models`, `POST /v1/chat/completions`,
//! `POST /v1/completions`, `POST /generate` (SGLang native), `GET /v1/loads` (SGLang's load
//! report), `GET /metrics` (vLLM metric names) and `POST /flush_cache`, and optionally
//! publishes KV events over ZMQ in vLLM's wire format (positional or map msgpack, with vLLM's
//! ROUTER replay socket and a lost-message fault hook). Generation is streamed (SSE, one chunk
//! per token, a final usage chunk, `data: [DONE]`) or returned whole, with OpenAI-shaped usage
//! including `prompt_tokens_details.cached_tokens`.
//!
//! Prompts are tokenized with the engines' tokenizer (one word = one token, see
//! `kvgate_engine::tokenize`); chat messages are rendered with `kvgate_protocol::render_chat`.
//! The output length is `max_tokens` (or `max_completion_tokens`, `max_new_tokens`, else
//! `--default-max-tokens`) when `"ignore_eos": true` or `--force-max-tokens`, otherwise the
//! smaller of that and a length of 8..=64 derived from the prompt. The text is deterministic
//! words.
//!
//! A chat request with `continue_final_message` (and `add_generation_prompt: false`, as vLLM
//! requires) continues its final assistant message: the prompt is the earlier messages rendered
//! plus that message's words, and the text goes on exactly where the same request's answer was
//! at that many words (the seed is the earlier messages' prompt), as a greedy model continues
//! its own output; `chat_answer_text` gives that answer's text for a check.
//!
//! `--engine canned` answers at once (after `--gen-ms`) with prebuilt bodies and no model, for
//! gateway overhead benchmarks. Fault flags inject 500s, cut connections (`--cut-stream-rate`,
//! or every stream after `--cut-after-tokens` tokens: an engine that dies mid-stream), added
//! latency and a health endpoint that turns 503; `MockFleet::shutdown` kills a fleet outright
//! (its open streams cut, its port closed). KV event faults: lost batches
//! (`--kv-events-drop-every`, `MockFleet::drop_kv_event_batches`), stores stating another block
//! size (`--kv-events-block-size-override`), and `MockFleet::restart_engine`, an engine restarted
//! without replay (its cache empty, nothing published until its next step).
//!
//! # Prefill/decode disaggregation
//! `--role prefill` or `--role decode` makes every engine of the fleet one side of a PD pair
//! (`--role regular`, the default, ignores PD fields). A request without PD fields is served as
//! a regular one on any role; one meant for the other side is a 400. Both protocols work on
//! `/v1/completions`, `/v1/chat/completions` and `/generate`:
//! - **SGLang** (the body has `bootstrap_room`, a u64 as a number or a string of digits): the
//!   gateway sends the same body to a prefill and a decode engine, with `bootstrap_host` and
//!   `bootstrap_port` naming the prefill's bootstrap server. The prefill engine answers as
//!   usual (streamed or not) with one output token; the decode engine answers the whole request.
//! - **vLLM** (the body has `kv_transfer_params`): step 1 (`do_remote_decode: true`) goes to a
//!   prefill engine, which answers the usual completion plus a top-level `kv_transfer_params`
//!   (`do_remote_prefill: true`, `remote_engine_id`, `remote_block_ids`, `remote_host`,
//!   `remote_port` = its bootstrap port, `remote_request_id`, `tp_size`); step 2 sends the
//!   original request with exactly that object to a decode engine.
//!
//! A prefill engine runs the prompt with one output token and keeps its KV held (counted in
//! `token_usage`, never evicted) until a decode engine pulls it, or for `--kv-hold-timeout-secs`.
//! Its bootstrap server (`--bootstrap-base-port`, `MockFleet::bootstrap_ports`) serves the pull:
//! `GET /kv/{room}` waits for the room's prefill, sleeps the transfer time (prompt tokens x
//! `--kv-bytes-per-token` / `--kv-transfer-gbps`), frees the KV and answers; a room whose
//! prefill failed (an injected 500 included), expired or was pulled answers 410 at once, an
//! unknown one 404 after the hold timeout. A decode engine pulls before sending any byte, then
//! decodes with the whole prompt already computed (no prefill, the first token from its first
//! decode step); any pull failure, or no KV within the hold timeout, is a 502 with an
//! OpenAI-style `kv_transfer_error`. Model-time durations are divided by `--time-scale` like
//! every other delay; `--fail-rate` and `--cut-stream-rate` apply on both sides.
//!
//! # Soak request ids
//! A generation request carrying an `x-soak-id: ID` header is counted by the worker that
//! receives it: how many times ID reached a generation handler, and how many of those were
//! answered with a 2xx status. `MockFleet::soak_ids` sums the counts over the fleet's workers
//! (`MockFleet::soak_id_log` gives a handle that outlives the fleet). `kvgate soak` uses them to
//! find requests the gateway sent twice. Requests without the header cost one header lookup.

mod api_error;
mod args;
mod canned;
mod canned_bodies;
mod driver;
mod error;
mod generation;
mod kv_events;
mod kv_publisher;
mod kv_replay;
mod kv_wire;
mod metrics;
mod openai;
mod pd;
mod server;
mod sglang;
mod shutdown;
mod soak_counting;
mod soak_ids;
mod state;

use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use args::{EngineKind, KvEventEncoding, MockArgs};
pub use error::MockError;
pub use generation::{chat_answer, chat_answer_text};
pub use pd::WorkerRole;
pub use soak_ids::{SoakIdLog, SoakIdSeen, SOAK_ID_HEADER};

use args::worker_port;
use driver::{EngineClock, EngineHandle};
use kv_publisher::KvEventFaults;
use pd::{KvRooms, PdContext, PdTiming, PrefillSide};
use state::{AppState, ServeOptions};

/// How long `MockFleet::shutdown` waits for open connections before dropping them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A running fleet of simulated engines. Dropping it stops the servers without waiting.
pub struct MockFleet {
    urls: Vec<String>,
    kv_event_endpoints: Vec<String>,
    kv_event_replay_endpoints: Vec<String>,
    role: WorkerRole,
    /// Prefill role: each worker's bootstrap (KV transfer) port.
    bootstrap_ports: Vec<u16>,
    /// Each worker's lost-message fault hook, in worker order (empty without KV events).
    kv_event_faults: Vec<Arc<KvEventFaults>>,
    /// Each worker's KV event replay buffer, in worker order (empty without KV events; `None`
    /// without replay).
    kv_replay_buffers: Vec<Option<Arc<kv_replay::ReplayBuffer>>>,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    /// Tasks that own a ZMQ socket and close it once `shutdown` turns true.
    sockets: Vec<JoinHandle<()>>,
    background: Vec<JoinHandle<()>>,
    engines: Vec<EngineHandle>,
    /// Each worker's `x-soak-id` counts.
    soak_ids: SoakIdLog,
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

    /// ZMQ endpoints (`tcp://host:port`) of the workers' KV event replay (ROUTER) sockets, in
    /// worker order; empty unless `--kv-events-replay-base-port` was given.
    pub fn kv_event_replay_endpoints(&self) -> Vec<String> {
        self.kv_event_replay_endpoints.clone()
    }

    /// The prefill/decode role of every worker of the fleet.
    pub fn role(&self) -> WorkerRole {
        self.role
    }

    /// The ports of the workers' KV bootstrap servers (SGLang's `bootstrap_port`, vLLM's
    /// `remote_port`), on the fleet's host, in worker order; empty unless the role is prefill.
    pub fn bootstrap_ports(&self) -> Vec<u16> {
        self.bootstrap_ports.clone()
    }

    /// Leading tokens of `prompt` whose KV blocks worker `worker_idx`'s prefix cache holds now
    /// (the engine's ground truth, for checking an index fed by its KV events); 0 for a canned
    /// engine or an unknown worker.
    pub fn cached_prefix_tokens(&self, worker_idx: usize, prompt: &[u32]) -> usize {
        self.engines.get(worker_idx).map_or(0, |engine| engine.cached_prefix_tokens(prompt))
    }

    /// Blocks worker `worker_idx`'s prefix cache holds now (0 for a canned engine or an unknown
    /// worker).
    pub fn cached_blocks(&self, worker_idx: usize) -> usize {
        self.engines.get(worker_idx).map_or(0, |engine| engine.cached_blocks())
    }

    /// Fault injection: worker `worker_idx`'s next `n` KV event batches are numbered and kept
    /// for replay but not published, so a subscriber sees a sequence gap (a lost message).
    /// Fails when that worker publishes no KV events.
    pub fn drop_kv_event_batches(&self, worker_idx: usize, n: usize) -> Result<(), MockError> {
        let faults = self.kv_event_faults.get(worker_idx).ok_or_else(|| {
            MockError::Fault(format!(
                "mock engine {worker_idx} publishes no KV events ({} do)",
                self.kv_event_faults.len()
            ))
        })?;
        faults.drop_next(n);
        Ok(())
    }

    /// Fault injection: worker `worker_idx`'s engine restarts as a crashed engine process comes
    /// back on the same ports with its publisher's subscribers still connected: its prefix
    /// cache empty, its KV event sequence from 0, its replay buffer empty, the requests it was
    /// serving ended, and no event published until its next step (so an index fed by its
    /// events holds blocks the engine no longer has until then). Fails for an unknown or canned
    /// worker.
    pub fn restart_engine(&self, worker_idx: usize) -> Result<(), MockError> {
        let engine = self.engines.get(worker_idx).ok_or_else(|| {
            MockError::Fault(format!("no simulated engine {worker_idx} ({} run)", self.engines.len()))
        })?;
        if let Some(Some(buffer)) = self.kv_replay_buffers.get(worker_idx) {
            buffer.clear();
        }
        engine.restart();
        Ok(())
    }

    /// How many times each `x-soak-id` value reached the fleet's generation handlers,
    /// and how many of those were answered with a 2xx status, summed over the workers.
    pub fn soak_ids(&self) -> std::collections::HashMap<String, SoakIdSeen> {
        self.soak_ids.snapshot()
    }

    /// A handle on the fleet's soak id counts that stays readable after `shutdown`.
    pub fn soak_id_log(&self) -> SoakIdLog {
        self.soak_ids.clone()
    }

    /// Stops accepting connections, ends open generation streams, and waits (briefly) for
    /// the servers to finish. Every listening port (HTTP, KV events, replay) is closed when
    /// this returns, so a new fleet can bind the same ports at once.
    pub async fn shutdown(mut self) {
        self.signal_stop();
        let servers = std::mem::take(&mut self.servers);
        let sockets = std::mem::take(&mut self.sockets);
        for mut task in servers.into_iter().chain(sockets) {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut task).await.is_err() {
                task.abort();
                let _ = task.await;
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
        for task in self.servers.iter().chain(&self.sockets).chain(&self.background) {
            task.abort();
        }
    }
}

/// Binds `args.count` workers (and their KV event publishers) and starts serving.
pub async fn spawn_fleet(args: MockArgs) -> Result<MockFleet, MockError> {
    args.validate()?;
    let (shutdown, shutdown_rx) = watch::channel(false);
    let mut fleet = MockFleet {
        urls: Vec::new(),
        kv_event_endpoints: Vec::new(),
        kv_event_replay_endpoints: Vec::new(),
        role: args.role,
        bootstrap_ports: Vec::new(),
        kv_event_faults: Vec::new(),
        kv_replay_buffers: Vec::new(),
        shutdown,
        servers: Vec::new(),
        sockets: Vec::new(),
        background: Vec::new(),
        engines: Vec::new(),
        soak_ids: SoakIdLog::default(),
    };
    for worker_idx in 0..args.count {
        let port = worker_port(args.base_port, worker_idx);
        let listener = TcpListener::bind((args.host.as_str(), port))
            .await
            .map_err(|e| MockError::bind(format!("mock engine {worker_idx} on {}:{port}", args.host), e))?;
        let address =
            listener.local_addr().map_err(|e| MockError::bind(format!("mock engine {worker_idx}"), e))?;
        let engine = match args.engine {
            EngineKind::Canned => None,
            EngineKind::Realistic => {
                let clock = EngineClock::new(args.time_scale);
                let kv_events = kv_events::start(&args, worker_idx, clock, &shutdown_rx).await?;
                let batches = kv_events.map(|kv_events| {
                    fleet.kv_event_endpoints.push(kv_events.endpoint);
                    fleet.kv_event_replay_endpoints.extend(kv_events.replay_endpoint);
                    fleet.kv_event_faults.push(kv_events.faults);
                    fleet.kv_replay_buffers.push(kv_events.buffer);
                    fleet.sockets.extend(kv_events.tasks);
                    kv_events.batches
                });
                let (engine, driver) =
                    EngineHandle::spawn(args.engine_config_for(worker_idx), clock, batches);
                fleet.background.push(driver);
                fleet.engines.push(engine.clone());
                Some(engine)
            }
        };
        // Ranks past the first (`--dp-size`): engine models of their own behind the same port.
        let mut ranks: Vec<EngineHandle> = engine.iter().cloned().collect();
        if engine.is_some() {
            for _ in 1..args.dp_size {
                let clock = EngineClock::new(args.time_scale);
                let (rank, driver) = EngineHandle::spawn(args.engine_config_for(worker_idx), clock, None);
                fleet.background.push(driver);
                ranks.push(rank);
            }
        }
        let prefill = match (&engine, args.role) {
            (Some(engine), WorkerRole::Prefill) => {
                let prefill = spawn_bootstrap(&args, worker_idx, engine, &shutdown_rx, &mut fleet).await?;
                Some(prefill)
            }
            _ => None,
        };
        let pd = PdContext::new(args.role, PdTiming::from_args(&args), prefill, shutdown_rx.clone());
        let options = ServeOptions::from_args(&args, worker_idx);
        let state = Arc::new(AppState::new(args.model.clone(), worker_idx, ranks, options, pd));
        fleet.soak_ids.push(state.soak_ids.clone());
        let app = server::router(state, args.engine);
        let mut stop = shutdown_rx.clone();
        fleet.servers.push(tokio::spawn(async move {
            let stopped = async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            };
            // Streamed chunks go out as they are made: with Nagle on, each chunk after the
            // response head waited for the gateway's delayed ACK (a ~40 ms time to first token).
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            if let Err(error) = axum::serve(listener, app).with_graceful_shutdown(stopped).await {
                tracing::error!(%error, worker_idx, "mock engine server failed");
            }
        }));
        fleet.urls.push(format!("http://{address}"));
    }
    Ok(fleet)
}

/// Binds worker `worker_idx`'s KV bootstrap server (prefill role) and starts serving it.
async fn spawn_bootstrap(
    args: &MockArgs,
    worker_idx: usize,
    engine: &EngineHandle,
    shutdown_rx: &watch::Receiver<bool>,
    fleet: &mut MockFleet,
) -> Result<PrefillSide, MockError> {
    let port = worker_port(args.bootstrap_base_port.unwrap_or(0), worker_idx);
    let what = format!("mock engine {worker_idx}'s bootstrap server on {}:{port}", args.host);
    let listener =
        TcpListener::bind((args.host.as_str(), port)).await.map_err(|e| MockError::bind(&what, e))?;
    let port = listener.local_addr().map_err(|e| MockError::bind(&what, e))?.port();
    let rooms = Arc::new(KvRooms::new(engine.clone(), PdTiming::from_args(args), shutdown_rx.clone()));
    let app = pd::bootstrap_router(rooms.clone());
    let mut stop = shutdown_rx.clone();
    fleet.servers.push(tokio::spawn(async move {
        let stopped = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        if let Err(error) = axum::serve(listener, app).with_graceful_shutdown(stopped).await {
            tracing::error!(%error, worker_idx, "mock engine bootstrap server failed");
        }
    }));
    fleet.bootstrap_ports.push(port);
    let engine_id = format!("kvgate-mock-prefill-{worker_idx}-{port}");
    Ok(PrefillSide::new(rooms, args.host.clone(), port, engine_id))
}

/// Spawns the fleet, prints its URLs (one per line), and serves until ctrl-c.
pub async fn run_fleet(args: MockArgs) -> Result<(), MockError> {
    let fleet = spawn_fleet(args).await?;
    for (worker_idx, url) in fleet.urls().iter().enumerate() {
        println!("mock engine {worker_idx}: {url}");
    }
    for (worker_idx, endpoint) in fleet.kv_event_endpoints().iter().enumerate() {
        println!("mock engine {worker_idx} KV events: {endpoint}");
    }
    for (worker_idx, endpoint) in fleet.kv_event_replay_endpoints().iter().enumerate() {
        println!("mock engine {worker_idx} KV event replay: {endpoint}");
    }
    if fleet.role() != WorkerRole::Regular {
        println!("mock engines' PD role: {:?}", fleet.role());
    }
    for (worker_idx, port) in fleet.bootstrap_ports().iter().enumerate() {
        println!("mock engine {worker_idx} KV bootstrap port: {port}");
    }
    tokio::signal::ctrl_c().await.map_err(MockError::Signal)?;
    fleet.shutdown().await;
    Ok(())
}
