//! kvgate-proxy: the gateway's request path, on `kvgate-admission`, `kvgate-observe` and
//! `kvgate-fleet`.
//!
//! `state`: `AppState`, assembled once from the configuration, which the request path and the
//! admin endpoints read (the subsystems never do). `proxy`: each request planned then executed
//! (the routing plan, one retry loop, prefill-decode pairs, stream migration), `body` the response
//! body that ends the request, `cors` the browser-facing headers, and `replica_sync` the routing
//! records shared with the other gateway replicas through Redis.

pub mod body;
pub mod cors;
pub mod proxy;
pub mod replica_sync;
pub mod state;
