//! kvgate-observe: what the gateway knows of how well it routes, on `kvgate-fleet`.
//!
//! The closed loop (`accuracy`: the exact index's prediction against the engine's cached tokens),
//! the KV map (`kv_map`: the hottest prefixes, each tenant's share of the KV cache, the census and
//! its history), the fleet view (`fleet_view`: `GET /v1/fleet` and its dashboard) and the alignment
//! probe and repair (`alignment`). Each is built from the narrow parts it reads (the registry, the
//! load snapshot, the metrics, the clock), never from the gateway's assembled state.

pub mod accuracy;
pub mod alignment;
pub mod fleet_view;
pub mod kv_map;
