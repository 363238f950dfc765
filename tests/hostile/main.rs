//! Hostile neighbours, each attack reproduced on loopback and shown refused or bounded: workers
//! and KV publishers that answer without end, replicas that forge or flood the sync channel,
//! worker URLs that spell this gateway's own address, clients whose conversations would stall
//! the I/O threads; and the second round's (issue 40): a client's KV-transfer fields, a web page
//! driving the admin API, quotas on streams, wedged engines, the gateway's header namespace,
//! absurd usage reports, and a stream that survives its engine. docs/RELIABILITY.md ("Hostile
//! neighbours") lists each attack, its bound and its test here. Every loop is bounded in count
//! and time.

mod admin;
#[path = "../common/mod.rs"]
mod common;
mod credentials;
mod flood;
mod kv_events;
mod loops;
mod migration;
mod namespace;
mod pd_fields;
mod quotas;
mod replica_sync;
mod rss;
mod series;
mod stalls;
mod tokenize;
mod worker_answers;

use kvgate_gateway::GatewayHandle;

/// The gateway's `/metrics` text.
pub async fn metrics(gw: &GatewayHandle) -> String {
    common::client().get(format!("{}/metrics", gw.url())).send().await.unwrap().text().await.unwrap()
}

/// The sum of the metric lines starting with `series` (0 when absent).
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(series))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls the metrics until `series` reaches `at_least` (10 s at most); returns its value.
pub async fn wait_metric(gw: &GatewayHandle, series: &str, at_least: f64) -> f64 {
    let mut value = 0.0;
    common::eventually(10.0, async || {
        value = metric(&metrics(gw).await, series);
        value >= at_least
    })
    .await;
    value
}
