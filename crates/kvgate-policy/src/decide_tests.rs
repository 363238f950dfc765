//! Deciding is not recording, over every policy: any number of dry runs (decisions on a read-only
//! index, never routed) between live decisions changes no live decision. The same seed, the same
//! stream of requests, load samples and candidates, with and without dry runs interleaved: the
//! live decisions are identical, `Decision` for `Decision` (worker, reason, matches,
//! prediction).

use clap::ValueEnum;
use kvgate_index::{ApproxIndex, ReadOnlyTree};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::{
    build_policy, AssignmentMode, Candidate, Candidates, Decision, LoadSample, MissStrategy, PolicyConfig,
    PolicyKind, RouteRequest, Routed, RoutingKey, SelectContext,
};

const WORKERS: u32 = 4;
const POLL_MS: u64 = 500;

/// Every policy, with options that give its state a part in its decisions (few sessions kept,
/// boundaries placed often, rates learned per engine), and a few variants.
fn configs() -> Vec<PolicyConfig> {
    let stateful = |policy| PolicyConfig {
        policy,
        max_sessions: 4,
        max_idle_secs: 2.0,
        bucket_adjust_interval_secs: 0.5,
        kv_aware_learn_prefill_rate: true,
        kv_aware_per_engine_rates: true,
        kv_aware_rate_min_observations: 1,
        max_tree_size: 400,
        eviction_interval: 1.0,
        ..PolicyConfig::default()
    };
    let mut configs: Vec<PolicyConfig> =
        PolicyKind::value_variants().iter().map(|&kind| stateful(kind)).collect();
    configs.push(PolicyConfig { router_temperature: 0.2, ..stateful(PolicyKind::KvAware) });
    configs.push(PolicyConfig { assignment_mode: AssignmentMode::Random, ..stateful(PolicyKind::Manual) });
    configs.push(PolicyConfig {
        cache_miss_strategy: MissStrategy::SmallestTree,
        ..stateful(PolicyKind::CacheAware)
    });
    configs
}

/// One request: which prompt (`None`: no prompt), its session and its length in tokens.
#[derive(Clone, Debug)]
struct Request {
    prompt: Option<u8>,
    session: u8,
    tokens: u64,
}

/// What happens between two live decisions.
#[derive(Clone, Debug)]
struct Step {
    advance_ms: u64,
    /// Fresh load samples for every worker (waiting uncached tokens, KV usage, running), or none.
    loads: Option<Vec<(u64, f64, u64)>>,
    in_flight: Vec<u64>,
    /// A worker that is not a candidate this time.
    absent: Option<u32>,
    live: Request,
    dry: Vec<Request>,
}

fn request() -> impl Strategy<Value = Request> {
    (proptest::option::weighted(0.8, 0u8..6), 0u8..12, 0u64..6_000)
        .prop_map(|(prompt, session, tokens)| Request { prompt, session, tokens })
}

fn step() -> impl Strategy<Value = Step> {
    let sample = (0u64..20_000, 0.0..1.0f64, 0u64..40);
    (
        0u64..900,
        proptest::option::of(proptest::collection::vec(sample, WORKERS as usize)),
        proptest::collection::vec(0u64..6, WORKERS as usize),
        proptest::option::weighted(0.2, 0..WORKERS),
        request(),
        proptest::collection::vec(request(), 0..4),
    )
        .prop_map(|(advance_ms, loads, in_flight, absent, live, dry)| Step {
            advance_ms,
            loads,
            in_flight,
            absent,
            live,
            dry,
        })
}

fn prompt_text(prompt: u8) -> String {
    // Prompts share a system prompt, and pairs of them a document.
    format!(
        "<system>be brief</system> <doc>{}</doc> question {prompt}",
        "lorem ".repeat(usize::from(prompt / 2) * 20 + 10)
    )
}

fn route_request<'a>(request: &Request, prompts: &'a [String], session: &'a str) -> RouteRequest<'a> {
    let key = request.prompt.map_or(RoutingKey::None, |p| RoutingKey::Text(&prompts[usize::from(p)]));
    RouteRequest { key, prompt_tokens: request.tokens, session: Some(session) }
}

/// The live decisions of `steps` on a fresh policy built from `config`, with each step's dry runs
/// made first when `dry_runs`.
fn live_decisions(config: &PolicyConfig, steps: &[Step], dry_runs: bool) -> Vec<Decision> {
    let policy = build_policy(config);
    for worker in 0..WORKERS {
        policy.add_worker(worker, &format!("http://127.0.0.1:{}", 8000 + worker));
    }
    let tree = ApproxIndex::new(config.tree_settings());
    let prompts: Vec<String> = (0..6).map(prompt_text).collect();
    let sessions: Vec<String> = (0..12).map(|s| format!("session-{s}")).collect();
    let dry_sessions: Vec<String> = (0..12).map(|s| format!("dry-only-{s}")).collect();
    let mut live_rng = SmallRng::seed_from_u64(11);
    let mut dry_rng = SmallRng::seed_from_u64(99);
    let mut loads: Vec<Option<LoadSample>> = vec![None; WORKERS as usize];
    let mut now_ms = 1_000;
    let mut decisions = Vec::new();
    for (n, step) in steps.iter().enumerate() {
        now_ms += step.advance_ms;
        if let Some(samples) = &step.loads {
            for (slot, &(waiting, usage, running)) in loads.iter_mut().zip(samples) {
                *slot = Some(LoadSample {
                    token_usage: usage,
                    num_running_reqs: running,
                    num_waiting_reqs: waiting / 2_000,
                    num_waiting_uncached_tokens: waiting,
                    gen_throughput: 500.0 + running as f64 * 40.0,
                    max_total_num_tokens: 200_000,
                    fetched_at_ms: now_ms,
                });
            }
        }
        let candidates: Vec<Candidate> = (0..WORKERS)
            .filter(|&id| step.absent != Some(id))
            .map(|id| Candidate { id, in_flight: step.in_flight[id as usize], load: loads[id as usize] })
            .collect();
        let candidates = Candidates::new(&candidates).expect("at least three workers");
        policy.maintain(now_ms);
        tree.maintain(now_ms);
        if dry_runs {
            for (d, dry) in step.dry.iter().enumerate() {
                // Half the dry runs ask for a session no live request has (a new one, every time).
                let fresh = format!("dry-{n}-{d}");
                let session = match dry.session % 4 {
                    0 | 2 => sessions[usize::from(dry.session)].as_str(),
                    1 => dry_sessions[usize::from(dry.session)].as_str(),
                    _ => fresh.as_str(),
                };
                let request = route_request(dry, &prompts, session);
                let read_only = ReadOnlyTree(&tree);
                let mut ctx = SelectContext {
                    now_ms,
                    load_poll_interval_ms: POLL_MS,
                    rng: &mut dry_rng,
                    prefix_index: Some(&read_only),
                };
                policy.decide(&request, candidates, &mut ctx).expect("a dry decision");
            }
        }
        let request = route_request(&step.live, &prompts, &sessions[usize::from(step.live.session)]);
        let mut ctx = SelectContext {
            now_ms,
            load_poll_interval_ms: POLL_MS,
            rng: &mut live_rng,
            prefix_index: Some(&tree),
        };
        let decision = policy.decide(&request, candidates, &mut ctx).expect("a live decision");
        policy.on_routed(&Routed {
            request: &request,
            candidates,
            decision: &decision,
            now_ms,
            load_poll_interval_ms: POLL_MS,
        });
        decisions.push(decision);
    }
    decisions
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn dry_runs_between_live_decisions_change_no_live_decision(
        steps in proptest::collection::vec(step(), 1..40),
    ) {
        for config in configs() {
            let without = live_decisions(&config, &steps, false);
            let with = live_decisions(&config, &steps, true);
            prop_assert_eq!(&without, &with, "{} changed by dry runs", config.policy.as_str());
        }
    }
}

/// The property is not vacuous: a dry run that records (a live decision routed in its place)
/// does move later decisions, for every policy that keeps state.
#[test]
fn a_routed_decision_moves_later_ones_where_a_dry_run_does_not() {
    let steps: Vec<Step> = (0..30)
        .map(|i| Step {
            advance_ms: 100,
            loads: (i % 3 == 0).then(|| vec![(4_000 * i, 0.3, 4); WORKERS as usize]),
            in_flight: vec![0; WORKERS as usize],
            absent: None,
            live: Request { prompt: Some((i % 6) as u8), session: (i % 12) as u8, tokens: 3_000 },
            dry: vec![Request { prompt: Some(((i + 1) % 6) as u8), session: 1, tokens: 5_000 }; 3],
        })
        .collect();
    let with_more_live: Vec<Step> = steps
        .iter()
        .flat_map(|step| {
            let extra = Step {
                advance_ms: 0,
                loads: None,
                live: step.dry[0].clone(),
                dry: Vec::new(),
                ..step.clone()
            };
            [extra, step.clone()]
        })
        .collect();
    for kind in [PolicyKind::RoundRobin, PolicyKind::CacheAware, PolicyKind::LeastLoad, PolicyKind::KvAware] {
        let config = PolicyConfig { policy: kind, ..PolicyConfig::default() };
        let plain = live_decisions(&config, &steps, true);
        let interleaved = live_decisions(&config, &with_more_live, false);
        let every_other: Vec<Decision> = interleaved.into_iter().skip(1).step_by(2).collect();
        assert_ne!(
            plain,
            every_other,
            "{}: routing the extra requests changes later decisions",
            kind.as_str()
        );
    }
}
