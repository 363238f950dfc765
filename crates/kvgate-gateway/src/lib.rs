//! kvgate-gateway: the HTTP gateway. It proxies OpenAI-compatible requests to engine workers
//! chosen by a `kvgate-policy` policy, and owns everything with I/O around that choice: the worker
//! registry, health checks, retries, circuit breakers and metrics.

mod admin;
mod admission;
mod body;
mod config;
mod conn;
mod discovery;
mod error;
mod health;
mod kv_events;
mod listen;
mod loads;
mod metrics;
mod monitor;
mod proxy;
mod registry;
mod replica_sync;
mod request;
mod role;
mod server;
mod state;
mod tls;
mod tokenize;
mod upstream;
#[allow(dead_code)] // wired into the proxy by the closed loop
mod usage;
mod worker;

pub use config::{GatewayConfig, GatewayConfigBuilder};
pub use error::ApiError;
pub use kv_events::{KvEventsSource, RankEndpoints, NO_ENDPOINT};
pub use loads::{parse_sglang, parse_vllm};
pub use proxy::Endpoint;
pub use request::render_chat;
pub use role::{PdProtocol, WorkerRole};
pub use server::{router, run, shutdown_signal, start, GatewayHandle, StartError};
pub use state::{AppState, SharedState};
pub use worker::{normalize_url, CircuitState};
