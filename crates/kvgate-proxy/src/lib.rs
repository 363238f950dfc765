//! kvgate-proxy: the gateway's request path, on `kvgate-admission`, `kvgate-observe` and
//! `kvgate-fleet`.
//!
//! `state`: `AppState`, assembled once from the configuration, which the request path and the
//! admin endpoints read (the subsystems never do). [`handle`] and [`serve`]: each request
//! planned then executed (the routing plan, one retry loop, prefill-decode pairs, stream
//! migration); [`route_only`]: the dry run of `POST /v1/route` (the private module `proxy`
//! holds them). `body`: the response body that ends the request; `cors`: the browser-facing
//! headers; `replica_sync`: the routing records shared with the other gateway replicas through
//! Redis.

pub mod body;
pub mod cors;
mod proxy;
pub mod replica_sync;
pub mod state;

pub use proxy::{handle, route_only, serve};
