//! Decision latency against fleet size: `Policy::decide` then `Policy::on_routed` (a live
//! decision) of cache_aware and kv_aware over 10,
//! 100 and 1,000 candidates, with a warm approximate prefix index (every worker holds some
//! conversations) and a fresh load sample per worker. The clock advances 1 ms per decision
//! (1,000 requests a second) and every worker's sample is refreshed once a simulated second,
//! as the load monitor does, so the policies' per-worker logs of what was routed since the
//! last sample stay as long as in the gateway. Criterion measures the mean; a per-call
//! p50/p99 table (the numbers in docs/BENCHMARKS.md, "Fleet size") is printed after it.
//!
//! Env: `KVGATE_BENCH_FLEETS` (default `10,100,1000`).

// Wall-clock timing belongs to the bench harness, not to the pure core the clippy.toml guards.
#![allow(clippy::disallowed_types)]

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{prompt, request, tick, CONVERSATIONS_PER_WORKER, NOW_MS};
use criterion::{BenchmarkId, Criterion};
use kvgate_index::ApproxIndex;
use kvgate_policy::{Candidate, Candidates, Policy, PolicyKind, Routed, SelectContext};
use kvgate_trace::percentile;
use rand::rngs::SmallRng;

/// A policy over `n_workers` workers with a warm index, and the prompts to route.
struct Fleet {
    policy: std::sync::Arc<dyn Policy>,
    index: ApproxIndex,
    candidates: Vec<Candidate>,
    prompts: Vec<String>,
    rng: SmallRng,
    now_ms: u64,
}

impl Fleet {
    fn new(kind: PolicyKind, n_workers: usize) -> Self {
        let (config, policy, candidates, rng) = common::fleet(kind, n_workers);
        let index = ApproxIndex::new(config.tree_settings());
        let mut fleet = Fleet { policy, index, candidates, prompts: Vec::new(), rng, now_ms: NOW_MS };
        for conversation in 0..n_workers * CONVERSATIONS_PER_WORKER {
            for turn in 0..3 {
                fleet.decide(&prompt(conversation, turn));
            }
            fleet.prompts.push(prompt(conversation, 3));
        }
        fleet
    }

    fn decide(&mut self, text: &str) -> u32 {
        tick(&mut self.now_ms, &mut self.candidates);
        let request = request(text);
        let mut ctx = SelectContext {
            now_ms: self.now_ms,
            load_poll_interval_ms: 1000,
            rng: &mut self.rng,
            prefix_index: Some(&self.index),
        };
        let candidates = Candidates::new(&self.candidates).unwrap();
        let decision = self.policy.decide(&request, candidates, &mut ctx).expect("a non-empty fleet");
        self.policy.on_routed(&Routed {
            request: &request,
            candidates,
            decision: &decision,
            now_ms: self.now_ms,
            load_poll_interval_ms: 1000,
        });
        decision.worker
    }
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    let fleets: Vec<usize> = std::env::var("KVGATE_BENCH_FLEETS")
        .unwrap_or_else(|_| "10,100,1000".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    let mut table = Vec::new();
    for kind in [PolicyKind::CacheAware, PolicyKind::KvAware] {
        let mut group = c.benchmark_group(format!("select/{}", kind.as_str()));
        for &n_workers in &fleets {
            let mut fleet = Fleet::new(kind, n_workers);
            let mut next = 0;
            group.bench_function(BenchmarkId::from_parameter(n_workers), |b| {
                b.iter(|| {
                    let text = fleet.prompts[next % fleet.prompts.len()].clone();
                    next += 1;
                    black_box(fleet.decide(&text))
                })
            });
            // Five rounds of 1,000 calls: p99 over all of them, and the best round's p99 (a
            // shared, loaded machine preempts a thread for milliseconds now and then).
            let mut times = Vec::with_capacity(5000);
            let mut round_p99 = Vec::new();
            for round in 0..5 {
                let mut round_times = Vec::with_capacity(1000);
                for call in 0..1000 {
                    let text = fleet.prompts[(round * 1000 + call) % fleet.prompts.len()].clone();
                    let started = Instant::now();
                    black_box(fleet.decide(&text));
                    round_times.push(started.elapsed());
                }
                round_times.sort();
                round_p99.push(percentile(&round_times, 99.0));
                times.extend(round_times);
            }
            times.sort();
            let best_round = round_p99.into_iter().min().expect("five rounds");
            table.push((kind, n_workers, percentile(&times, 50.0), percentile(&times, 99.0), best_round));
        }
        group.finish();
    }
    c.final_summary();
    println!(
        "\n| policy | workers | select p50 | select p99 | p99 of the best round |\n|---|---:|---:|---:|---:|"
    );
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    for (kind, n_workers, p50, p99, best) in table {
        println!(
            "| {} | {n_workers} | {:.1} µs | {:.1} µs | {:.1} µs |",
            kind.as_str(),
            micros(p50),
            micros(p99),
            micros(best)
        );
    }
}
