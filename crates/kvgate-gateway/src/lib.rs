//! kvgate-gateway: the HTTP gateway. It proxies OpenAI-compatible requests to engine workers
//! chosen by a `kvgate-policy` policy, and owns everything with I/O around that choice: the worker
//! registry, health checks, retries, circuit breakers and metrics.

// The leaf types, the configuration and the plumbing are `kvgate-gateway-core`'s; the workers,
// the registry and the loops that keep it current are `kvgate-fleet`'s; the closed loop, the KV
// map, the fleet view and the alignment probe are `kvgate-observe`'s; admission is
// `kvgate-admission`'s. The modules here by
// layer, bottom first: each uses only its own layer and those below it (`layers.rs` checks it,
// see ARCHITECTURE.md).
// Request parts.
mod body;
// A subsystem, built from the narrow parts it needs.
mod replica_sync;
// The assembled state.
mod state;
// The request path.
mod cors;
mod proxy;
// The edge: admin endpoints, the accept loop, start and stop.
mod admin;
mod browser_guard;
mod listen;
mod metrics_listener;
mod server;

#[cfg(test)]
mod layers;

pub use kvgate_fleet::worker::CircuitState;
pub use kvgate_gateway_core::config::{ClassSettings, PriorityClass, TenantLimits, TenantsConfig};
pub use kvgate_gateway_core::config::{GatewayConfig, GatewayConfigBuilder};
pub use kvgate_gateway_core::config::{KvEventsSource, RankEndpoints, NO_ENDPOINT};
pub use kvgate_gateway_core::error::ApiError;
pub use kvgate_gateway_core::tenant::ForwardPriority;
pub use kvgate_gateway_core::worker_url::normalize_url;
pub use kvgate_protocol::Endpoint;
pub use kvgate_protocol::{PdProtocol, WorkerRole};
pub use server::{router, run, shutdown_signal, start, GatewayHandle, StartError};
pub use state::{AppState, SharedState};
