//! Decision latency against fleet size through the routing plan (`Pools::plan` then
//! `RoutePlan::on_routed`, what the gateway and the simulator call), for cache_aware and
//! kv_aware over 10, 100, 1,000 and 10,000 workers: with a warm approximate prefix index (four
//! conversations per worker, three turns each routed before timing) and a fresh load sample per
//! worker, the clock advancing 1 ms per decision and every sample refreshed once a simulated
//! second. Above `SHORTLIST_ABOVE` workers the plan decides on a shortlist; beside each timed
//! plan the policy decides on the whole pool (a dry run, on the read-only tree) for the ratio of
//! the two and for how often the shortlist's choice is as good: the same prefix credited and no
//! more requests in flight (cache_aware), a predicted cost no higher (kv_aware).
//!
//! Prints a table (docs/BENCHMARKS.md, "Fleet size"). Env: `KVGATE_BENCH_FLEETS` (default
//! `10,100,1000,10000`), `KVGATE_BENCH_CALLS` (timed calls per row, default 2000),
//! `KVGATE_BENCH_POLICIES` (default `cache_aware,kv_aware`; also `least_load`, `round_robin`).

// Wall-clock timing belongs to the bench, not to the pure core the clippy.toml guards.
#![allow(clippy::disallowed_types)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_index::{ApproxIndex, IndexKind, IndexView, PrefixIndex, PrefixIndexMode, ReadOnlyTree};
use kvgate_policy::{
    build_policy, Candidate, Candidates, Decision, LoadSample, OverloadSettings, Policy, PolicyConfig,
    PolicyKind, RouteRequest, RoutingKey, SelectContext, WorkerId,
};
use kvgate_route::{IndexMode, Offer, PlanContext, Planning, Pool, Pools, RoutePlan};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const NOW_MS: u64 = 1_000_000;
const CONVERSATIONS_PER_WORKER: usize = 4;

struct Fleet {
    policy: Arc<dyn Policy>,
    tree: ApproxIndex,
    candidates: Vec<Candidate>,
}

enum TreeView<'a> {
    Learning(&'a ApproxIndex),
    ReadOnly(ReadOnlyTree<'a>),
}

impl IndexView for TreeView<'_> {
    fn kind(&self) -> IndexKind {
        IndexKind::Approximate
    }

    fn with<R>(&self, use_index: impl FnOnce(&dyn PrefixIndex) -> R) -> R {
        match self {
            TreeView::Learning(tree) => use_index(*tree),
            TreeView::ReadOnly(tree) => use_index(tree),
        }
    }
}

impl Pool for Fleet {
    type Index<'a> = TreeView<'a>;

    fn policy(&self) -> &dyn Policy {
        &*self.policy
    }

    fn offer(&self, tried: &[WorkerId]) -> Offer {
        let candidates = self.candidates.iter().filter(|c| !tried.contains(&c.id)).copied().collect();
        Offer { candidates, events_flowing: false }
    }

    fn member(&self, worker: WorkerId) -> Option<bool> {
        ((worker as usize) < self.candidates.len()).then_some(true)
    }

    fn index_mode(&self) -> IndexMode {
        IndexMode { mode: PrefixIndexMode::Auto, has_kv_events: false }
    }

    fn prefix_index(
        &self,
        _kind: IndexKind,
        planning: Planning,
        _request: &RouteRequest<'_>,
    ) -> TreeView<'_> {
        match planning {
            Planning::Live => TreeView::Learning(&self.tree),
            Planning::DryRun => TreeView::ReadOnly(ReadOnlyTree(&self.tree)),
        }
    }
}

fn prompt(conversation: usize, turn: usize) -> String {
    let mut text = format!("system prompt {} ", conversation % 16).repeat(40);
    for t in 0..=turn {
        text.push_str(&format!("user {conversation} turn {t}: tell me about topic {} please. ", t * 7));
    }
    text
}

struct Bench {
    fleet: Fleet,
    rng: SmallRng,
    now_ms: u64,
}

impl Bench {
    fn new(kind: PolicyKind, n_workers: usize) -> (Self, Vec<String>) {
        let config = PolicyConfig { policy: kind, ..PolicyConfig::default() };
        let policy = build_policy(&config);
        for worker in 0..n_workers {
            policy.add_worker(worker as u32, &format!("http://127.0.0.1:{}", 20000 + worker));
        }
        let mut rng = SmallRng::seed_from_u64(7);
        let candidates = (0..n_workers)
            .map(|worker| Candidate {
                id: worker as u32,
                in_flight: rng.random_range(0..4),
                load: Some(LoadSample {
                    token_usage: rng.random_range(0.1..0.6),
                    num_running_reqs: rng.random_range(0..8),
                    num_waiting_reqs: 0,
                    num_waiting_uncached_tokens: rng.random_range(0..2000),
                    gen_throughput: 1000.0,
                    max_total_num_tokens: 100_000,
                    fetched_at_ms: NOW_MS - 200,
                }),
            })
            .collect();
        let tree = ApproxIndex::new(config.tree_settings());
        let mut bench = Bench { fleet: Fleet { policy, tree, candidates }, rng, now_ms: NOW_MS };
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

    fn tick(&mut self) {
        self.now_ms += 1;
        if self.now_ms.is_multiple_of(1000) {
            for load in self.fleet.candidates.iter_mut().filter_map(|c| c.load.as_mut()) {
                load.fetched_at_ms = self.now_ms;
            }
        }
    }

    fn request(text: &str) -> RouteRequest<'_> {
        RouteRequest { key: RoutingKey::Text(text), prompt_tokens: text.len() as u64 / 4, session: None }
    }

    /// A live plan, sent: the decision.
    fn plan(&mut self, text: &str) -> Decision {
        let request = Self::request(text);
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
        let request = Self::request(text);
        let tree = ReadOnlyTree(&self.fleet.tree);
        let mut ctx = SelectContext {
            now_ms: self.now_ms,
            load_poll_interval_ms: 1000,
            rng: &mut self.rng,
            prefix_index: Some(&tree),
        };
        let candidates = Candidates::new(&self.fleet.candidates).expect("a fleet");
        self.fleet.policy.decide(&request, candidates, &mut ctx).expect("a decision")
    }

    /// Whether `chosen` is as good as `whole` by the policy's own terms.
    fn as_good(&self, kind: PolicyKind, chosen: &Decision, whole: &Decision) -> bool {
        let in_flight = |d: &Decision| self.fleet.candidates[d.worker as usize].in_flight;
        match kind {
            PolicyKind::KvAware => {
                let cost = |d: &Decision| d.predicted.map_or(f64::INFINITY, |p| p.cost());
                cost(chosen) <= cost(whole) * (1.0 + 1e-9)
            }
            _ => {
                let rate = |d: &Decision| d.matches.map_or(0.0, |m| m.chosen_match_rate);
                rate(chosen) >= rate(whole)
                    && (rate(chosen) > rate(whole) || in_flight(chosen) <= in_flight(whole))
            }
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p / 100.0).round() as usize]
}

fn main() {
    let fleets: Vec<usize> = std::env::var("KVGATE_BENCH_FLEETS")
        .unwrap_or_else(|_| "10,100,1000,10000".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    let calls: usize = std::env::var("KVGATE_BENCH_CALLS").ok().and_then(|n| n.parse().ok()).unwrap_or(2000);
    println!(
        "| policy | workers | plan p50 | plan p99 | whole-pool decide p50 | p99 | plan / whole p50 | as good |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|"
    );
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let policies = std::env::var("KVGATE_BENCH_POLICIES").unwrap_or_else(|_| "cache_aware,kv_aware".into());
    let kinds = [PolicyKind::CacheAware, PolicyKind::KvAware, PolicyKind::LeastLoad, PolicyKind::RoundRobin];
    for kind in kinds.into_iter().filter(|kind| policies.split(',').any(|name| name.trim() == kind.as_str()))
    {
        for &n_workers in &fleets {
            let (mut bench, prompts) = Bench::new(kind, n_workers);
            let (mut planned, mut whole, mut as_good) = (Vec::new(), Vec::new(), 0);
            for call in 0..calls {
                let text = &prompts[call * 7919 % prompts.len()];
                // The whole pool first, on the state the plan then decides on.
                bench.tick();
                let started = Instant::now();
                let on_whole = black_box(bench.whole(text));
                whole.push(started.elapsed());
                let started = Instant::now();
                let chosen = black_box(bench.plan(text));
                planned.push(started.elapsed());
                as_good += usize::from(bench.as_good(kind, &chosen, &on_whole));
            }
            planned.sort();
            whole.sort();
            // A policy that decides on the whole pool anyway has no shortlist to judge.
            let as_good = match bench.fleet.policy.shortlists() {
                true => format!("{:.1} %", 100.0 * as_good as f64 / calls as f64),
                false => "-".to_string(),
            };
            println!(
                "| {} | {n_workers} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.2} | {as_good} |",
                kind.as_str(),
                micros(percentile(&planned, 50.0)),
                micros(percentile(&planned, 99.0)),
                micros(percentile(&whole, 50.0)),
                micros(percentile(&whole, 99.0)),
                micros(percentile(&planned, 50.0)) / micros(percentile(&whole, 50.0)),
            );
        }
    }
}
