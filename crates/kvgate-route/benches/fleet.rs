//! Decision latency against fleet size through the routing plan (`Pools::plan` then
//! `RoutePlan::on_routed`, what the gateway and the simulator call), for cache_aware and
//! kv_aware over 10, 100, 1,000 and 10,000 workers: with a warm approximate prefix index (four
//! conversations per worker, three turns each routed before timing) and a fresh load sample per
//! worker, the clock advancing 1 ms per decision and every sample refreshed once a simulated
//! second. Above `SHORTLIST_ABOVE` workers the plan decides on a shortlist, found on the pool's
//! kept load order (`LoadOrder`, brought up to date when the samples are refreshed, outside the
//! timed calls, when the policy is told of the reports too) on odd calls and by one pass over the offer of every worker on even calls, the
//! two paths side by side on one pool. Beside each timed plan the policy decides on the whole
//! pool (a dry run, on the read-only tree) for the ratio and for how often the shortlist's choice
//! is as good: the same prefix credited and no more requests in flight (cache_aware), a
//! predicted cost no higher (kv_aware).
//!
//! Each plan is timed on the wall clock and on the thread's CPU clock (which preemption on a
//! shared machine does not inflate). Prints a table (docs/BENCHMARKS.md, "Fleet size"). Env: `KVGATE_BENCH_FLEETS` (default
//! `10,100,1000,10000`), `KVGATE_BENCH_CALLS` (timed calls per row, default 2000),
//! `KVGATE_BENCH_POLICIES` (default `cache_aware,kv_aware`; also `least_load`, `round_robin`),
//! `KVGATE_BENCH_KV_LEARN=0` (kv_aware without its rate learner), `KVGATE_BENCH_WHOLE=0` (no
//! whole-pool decision beside each plan: the plans alone, for a profile), `KVGATE_BENCH_OFFER=0`
//! (every timed plan on the kept order, none on the offer), `KVGATE_BENCH_PERF_CTL=FIFO` (writes
//! `enable` and `disable` to a `perf record --control=fifo:FIFO --delay=-1` control fifo around
//! the timed calls, so that the profile leaves out the warm-up).

// Wall-clock timing belongs to the bench, not to the pure core the clippy.toml guards.
#![allow(clippy::disallowed_types)]

#[path = "../../kvgate-policy/benches/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{prompt, request, CONVERSATIONS_PER_WORKER, NOW_MS};
use kvgate_index::{ApproxIndex, ReadOnlyTree};
use kvgate_policy::{Candidates, Decision, OverloadSettings, PolicyKind, SelectContext};
use kvgate_route::{FixedPool, PlanContext, Planning, Pools, RoutePlan};
use kvgate_trace::percentile;
use rand::rngs::SmallRng;

struct Bench {
    fleet: FixedPool,
    rng: SmallRng,
    now_ms: u64,
}

impl Bench {
    fn new(kind: PolicyKind, n_workers: usize) -> (Self, Vec<String>) {
        let (config, policy, candidates, rng) = common::fleet(kind, n_workers);
        let tree = ApproxIndex::new(config.tree_settings());
        let mut fleet = FixedPool::with_tree(policy, candidates, tree);
        fleet.keep_order();
        let mut bench = Bench { fleet, rng, now_ms: NOW_MS };
        let mut prompts = Vec::new();
        for conversation in 0..n_workers * CONVERSATIONS_PER_WORKER {
            for turn in 0..3 {
                bench.tick();
                bench.plan(&prompt(conversation, turn));
            }
            prompts.push(prompt(conversation, 3));
        }
        (bench, prompts)
    }

    /// One millisecond on; the refreshed samples published to the kept order too, and told to
    /// the policy as they land (`Policy::on_load_reports`, as the gateway's load monitor and the
    /// simulator tell it).
    fn tick(&mut self) {
        common::tick(&mut self.now_ms, &mut self.fleet.workers);
        if self.now_ms.is_multiple_of(1000) {
            self.fleet.keep_order();
            let reports: Vec<_> =
                self.fleet.workers.iter().filter_map(|c| c.load.map(|load| (c.id, load))).collect();
            self.fleet.policy.on_load_reports(&reports, self.now_ms, 1000);
        }
    }

    /// A live plan, sent: the decision.
    fn plan(&mut self, text: &str) -> Decision {
        let request = request(text);
        let mut ctx = PlanContext {
            now_ms: self.now_ms,
            load_poll_interval_ms: 1000,
            overload: OverloadSettings::default(),
            planning: Planning::Live,
            rng: &mut self.rng,
        };
        let pools = Pools::Single(&self.fleet);
        let plan = pools.plan(&request, &[], None, &mut ctx).expect("a plan");
        plan.on_routed(&pools);
        let RoutePlan::Single(pick) = plan else { unreachable!("a single pool plans one pick") };
        pick.decision
    }

    /// The policy's decision on the whole pool, recording nothing (read-only tree).
    fn whole(&mut self, text: &str) -> Decision {
        let request = request(text);
        let tree = ReadOnlyTree(&self.fleet.tree);
        let mut ctx = SelectContext {
            now_ms: self.now_ms,
            load_poll_interval_ms: 1000,
            rng: &mut self.rng,
            prefix_index: Some(&tree),
        };
        let candidates = Candidates::new(&self.fleet.workers).expect("a fleet");
        self.fleet.policy.decide(&request, candidates, &mut ctx).expect("a decision")
    }

    /// Whether `chosen` is as good as `whole` by the policy's own terms.
    fn as_good(&self, kind: PolicyKind, chosen: &Decision, whole: &Decision) -> bool {
        let in_flight = |d: &Decision| self.fleet.workers[d.worker as usize].in_flight;
        match kind {
            PolicyKind::KvAware => {
                let cost = |d: &Decision| d.predicted.map_or(f64::INFINITY, |p| p.cost());
                // kv_aware's own tie: costs closer than 0.1 ms are equal to it (broken by
                // requests in flight, then at random).
                cost(chosen) <= cost(whole) + 1e-4
            }
            _ => {
                let rate = |d: &Decision| d.matches.map_or(0.0, |m| m.chosen_match_rate);
                rate(chosen) >= rate(whole)
                    && (rate(chosen) > rate(whole) || in_flight(chosen) <= in_flight(whole))
            }
        }
    }
}

/// This thread's CPU time: what a decision costs without the time the thread was preempted
/// (the machine is shared, so wall-clock p99 is mostly preemption).
fn thread_cpu() -> Duration {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `clock_gettime` writes one `timespec` through a pointer to a live, properly aligned
    // local of that type, and reads nothing else; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    assert_eq!(rc, 0, "the thread's CPU clock");
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

fn main() {
    let fleets: Vec<usize> = std::env::var("KVGATE_BENCH_FLEETS")
        .unwrap_or_else(|_| "10,100,1000,10000".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    let skip_whole = std::env::var("KVGATE_BENCH_WHOLE").is_ok_and(|v| v == "0");
    let skip_offer = std::env::var("KVGATE_BENCH_OFFER").is_ok_and(|v| v == "0");
    let perf_ctl = std::env::var("KVGATE_BENCH_PERF_CTL").ok();
    let perf = |command: &str| {
        if let Some(path) = &perf_ctl {
            std::fs::write(path, format!("{command}\n")).expect("perf's control fifo");
        }
    };
    let calls: usize = std::env::var("KVGATE_BENCH_CALLS").ok().and_then(|n| n.parse().ok()).unwrap_or(2000);
    println!(
        "| policy | workers | kept order p50 | p99 | CPU p50 | CPU p99 | offer p50 | p99 | CPU p50 | CPU p99 | whole-pool decide p50 | p99 | as good (order) | as good (offer) |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let policies = std::env::var("KVGATE_BENCH_POLICIES").unwrap_or_else(|_| "cache_aware,kv_aware".into());
    let kinds = [PolicyKind::CacheAware, PolicyKind::KvAware, PolicyKind::LeastLoad, PolicyKind::RoundRobin];
    for kind in kinds.into_iter().filter(|kind| policies.split(',').any(|name| name.trim() == kind.as_str()))
    {
        for &n_workers in &fleets {
            let (mut bench, prompts) = Bench::new(kind, n_workers);
            let (mut on_order, mut on_offer, mut whole) = (Vec::new(), Vec::new(), Vec::new());
            let (mut good_order, mut good_offer) = (0, 0);
            let (mut cpu_order, mut cpu_offer) = (Vec::new(), Vec::new());
            perf("enable");
            for call in 0..calls {
                let text = &prompts[call * 7919 % prompts.len()];
                // The whole pool first, on the state the plan then decides on.
                bench.tick();
                let started = Instant::now();
                let on_whole = (!skip_whole).then(|| black_box(bench.whole(text)));
                whole.extend(on_whole.as_ref().map(|_| started.elapsed()));
                let read_order = skip_offer || call % 2 == 1;
                bench.fleet.read_order = read_order;
                let (started, cpu_started) = (Instant::now(), thread_cpu());
                let chosen = black_box(bench.plan(text));
                let (wall, cpu) = (started.elapsed(), thread_cpu().saturating_sub(cpu_started));
                let good = on_whole
                    .as_ref()
                    .map_or(0, |on_whole| usize::from(bench.as_good(kind, &chosen, on_whole)));
                match read_order {
                    true => (on_order.push(wall), cpu_order.push(cpu), good_order += good),
                    false => (on_offer.push(wall), cpu_offer.push(cpu), good_offer += good),
                };
            }
            perf("disable");
            for times in [&mut on_order, &mut on_offer, &mut whole, &mut cpu_order, &mut cpu_offer] {
                times.sort();
            }
            let whole_micros = |p: f64| match skip_whole {
                true => "-".to_string(),
                false => format!("{:.1} µs", micros(percentile(&whole, p))),
            };
            // A policy that decides on the whole pool anyway has no shortlist to judge.
            let share = |good: usize, of: &[Duration]| match bench.fleet.policy.shortlists() && !skip_whole {
                true => format!("{:.1} %", 100.0 * good as f64 / of.len().max(1) as f64),
                false => "-".to_string(),
            };
            println!(
                "| {} | {n_workers} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {} | {} | {} | {} |",
                kind.as_str(),
                micros(percentile(&on_order, 50.0)),
                micros(percentile(&on_order, 99.0)),
                micros(percentile(&cpu_order, 50.0)),
                micros(percentile(&cpu_order, 99.0)),
                micros(percentile(&on_offer, 50.0)),
                micros(percentile(&on_offer, 99.0)),
                micros(percentile(&cpu_offer, 50.0)),
                micros(percentile(&cpu_offer, 99.0)),
                whole_micros(50.0),
                whole_micros(99.0),
                share(good_order, &on_order),
                share(good_offer, &on_offer),
            );
        }
    }
}
