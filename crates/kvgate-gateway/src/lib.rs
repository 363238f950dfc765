//! kvgate-gateway: the HTTP gateway. It proxies OpenAI-compatible requests to engine workers
//! chosen by a `kvgate-policy` policy; this crate assembles the gateway's crates (the worker
//! registry, health checks, admission, retries, circuit breakers and metrics live below it) and
//! keeps the edge: the listeners, the admin API, start and stop.

// The gateway's layers are crates, bottom first: `kvgate-gateway-core` (leaf types, the
// configuration, the plumbing), `kvgate-fleet` (workers, the registry, the loops that keep it
// current), `kvgate-observe` (the closed loop, the KV map, the fleet view, the alignment probe),
// `kvgate-admission`, `kvgate-proxy` (the assembled state and the request path). Cargo keeps
// their arrows one way. This crate is the edge: the admin endpoints, the accept loop, start and
// stop.
mod admin;
mod browser_guard;
mod inspect;
mod listen;
mod metrics_listener;
mod server;

pub use kvgate_fleet::worker::CircuitState;
pub use kvgate_gateway_core::config::{ClassSettings, PriorityClass, TenantLimits, TenantsConfig};
pub use kvgate_gateway_core::config::{GatewayConfig, GatewayConfigBuilder};
pub use kvgate_gateway_core::config::{KvEventsSource, RankEndpoints, NO_ENDPOINT};
pub use kvgate_gateway_core::error::ApiError;
pub use kvgate_gateway_core::tenant::ForwardPriority;
pub use kvgate_gateway_core::worker_url::normalize_url;
pub use kvgate_protocol::Endpoint;
pub use kvgate_protocol::{PdProtocol, WorkerRole};
pub use server::{run, shutdown_signal, start, GatewayHandle, StartError};
