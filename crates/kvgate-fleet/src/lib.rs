//! kvgate-fleet: the gateway's view of its engines, on `kvgate-gateway-core`.
//!
//! The workers (`worker`: health counters, in-flight count, circuit breaker; `index_health`: a
//! worker's alignment state), the registry of pools (`registry`) with each pool's tokenization
//! (`tokenize`), a large pool's load order (`pool_order`), the engines' last loads (`load_snapshot`), and the loops that keep them current:
//! health checks (`health`), the load monitor (`monitor`), the schedule both poll on
//! (`poll_schedule`), the KV-event subscriptions
//! (`kv_events`) and registration (`registration`; Kubernetes discovery, `kvgate-discovery`, goes
//! through it). Nothing here knows a request path or the gateway's assembled state.

pub mod health;
pub mod index_health;
pub mod kv_events;
pub mod load_snapshot;
pub mod monitor;
pub mod poll_schedule;
pub mod pool_order;
pub mod registration;
pub mod registry;
pub mod tokenize;
pub mod worker;
