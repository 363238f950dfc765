//! kvgate-gateway-core: the gateway's bottom layers, which every other gateway crate builds on.
//!
//! Leaf types (`auth`, `backoff`, `clock`, `error`, `tenant`, `worker_url`), the configuration
//! (`config`: `GatewayConfig`, every `kvgate launch` option) and the plumbing: the Prometheus
//! families (`metrics`), the routing decision log (`decisions`), OpenTelemetry traces (`otel`),
//! TLS (`tls`), the proxy's per-worker connections (`conn`) and the background loops' client
//! (`upstream`). Nothing here knows a worker registry, a policy's pool or a request path.

pub mod auth;
pub mod backoff;
pub mod clock;
pub mod config;
pub mod conn;
pub mod decisions;
pub mod error;
pub mod metrics;
pub mod otel;
pub mod own_address;
pub mod tenant;
pub mod tls;
pub mod upstream;
pub mod worker_url;
