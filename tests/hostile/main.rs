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
