//! The gateway in process against real servers on 127.0.0.1 (loopback upstreams, `kvgate mock`
//! engines, ZMQ publishers, a Redis): one test binary for the area, so the workspace's test build
//! links the gateway once for all of these instead of once per file (rust-analyzer's
//! `slow-tests` shape). Each module is one subject; shared support is in `tests/common`.
//! Run one subject with `cargo test --test integration kv_events::`.

#[path = "../common/mod.rs"]
mod common;

mod alignment;
mod attempts;
mod bursts;
mod closed_loop;
mod dashboard;
mod dp_aware;
mod dry_runs;
mod e2e;
mod embed;
mod fleet;
mod gateway;
mod grafana;
mod kv_aware_learning;
mod kv_events;
mod listener;
mod load_monitor;
mod pd;
mod pd_conditional;
mod pd_fallback;
mod policies;
mod reliability;
mod replica_sync;
mod replicas;
mod tenants;
mod traces;
mod upstream_conns;
