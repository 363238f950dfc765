//! The plan on pools of plain values: the overload filter, the worker a request names, the
//! conditional rule's order of the sides, kv_aware's prediction across the pair, and a dry run
//! that records nothing (in the tree or the policy).

use expect_test::{expect, Expect};
use kvgate_index::{PrefixIndex, ReadOnlyTree};
use kvgate_policy::{
    Candidate, LoadSample, OverloadSettings, PolicyConfig, PolicyKind, RouteRequest, RoutingKey, WorkerId,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::{FixedPool, NoPlan, PlanContext, Planning, Pools, RoutePlan};

/// Workers `first..` with `in_flight` requests each, no load sample, under `policy`.
fn fixed_pool(policy: PolicyKind, first: WorkerId, in_flight: &[u64]) -> FixedPool {
    fixed_pool_with(&PolicyConfig { policy, ..PolicyConfig::default() }, first, in_flight)
}

fn fixed_pool_with(config: &PolicyConfig, first: WorkerId, in_flight: &[u64]) -> FixedPool {
    let workers = in_flight
        .iter()
        .enumerate()
        .map(|(i, &in_flight)| Candidate { id: first + i as u32, in_flight, load: None })
        .collect();
    FixedPool::new(config, workers)
}

/// Fresh samples: (waiting requests, of 1,000 uncached tokens each; running requests).
fn with_loads(mut pool: FixedPool, loads: &[(u64, u64)]) -> FixedPool {
    for (worker, &(waiting, running)) in pool.workers.iter_mut().zip(loads) {
        worker.load = Some(LoadSample {
            num_waiting_reqs: waiting,
            num_running_reqs: running,
            num_waiting_uncached_tokens: waiting * 1000,
            max_total_num_tokens: 1_000_000,
            fetched_at_ms: NOW,
            ..LoadSample::default()
        });
    }
    pool
}

const NOW: u64 = 10_000;

fn context<'r>(rng: &'r mut SmallRng, overload: OverloadSettings, planning: Planning) -> PlanContext<'r> {
    PlanContext { now_ms: NOW, load_poll_interval_ms: 1000, overload, planning, rng }
}

/// The plan, one line: its path, each side's worker and reason, and the rule's clause.
fn describe<I>(plan: &Result<RoutePlan<'_, I>, NoPlan>) -> String {
    let plan = match plan {
        Ok(plan) => plan,
        Err(no_plan) => return format!("no plan: {no_plan}"),
    };
    let kind = match plan {
        RoutePlan::Single(_) => "single",
        RoutePlan::Pair { .. } => "pair",
        RoutePlan::InPlace { .. } => "in_place",
    };
    let mut line = kind.to_string();
    for (side, pick) in plan.picks() {
        let left_out = match pick.left_out {
            0 => String::new(),
            n => format!(" ({n} left out)"),
        };
        line.push_str(&format!(
            " {}={}:{}{left_out}",
            side.as_str(),
            pick.decision.worker,
            pick.decision.reason
        ));
    }
    if let Some(pd) = plan.pd() {
        line.push_str(&format!(" why={}", pd.why.as_str()));
    }
    line
}

fn request(text: &str, prompt_tokens: u64) -> RouteRequest<'_> {
    RouteRequest { key: RoutingKey::Text(text), prompt_tokens, session: Some("s") }
}

/// One request to plan: its prompt and length, the workers tried already, the worker it names,
/// and the overload bounds.
#[derive(Clone, Copy)]
struct Ask<'a> {
    text: &'a str,
    tokens: u64,
    tried: &'a [WorkerId],
    target: Option<WorkerId>,
    overload: OverloadSettings,
}

/// A first attempt of a prompt `text` of `tokens` tokens, naming no worker, no overload bounds.
fn ask(text: &str, tokens: u64) -> Ask<'_> {
    Ask { text, tokens, tried: &[], target: None, overload: OFF }
}

/// `check(pools, ask, expected)`: the live plan, described.
fn check(pools: &Pools<'_, FixedPool>, ask: Ask<'_>, expected: Expect) {
    let mut rng = SmallRng::seed_from_u64(1);
    let mut ctx = context(&mut rng, ask.overload, Planning::Live);
    let plan = pools.plan(&request(ask.text, ask.tokens), ask.tried, ask.target, &mut ctx);
    expected.assert_eq(&describe(&plan));
}

const OFF: OverloadSettings = OverloadSettings { waiting_requests: None, token_usage: None, shed: false };
const WAITING_8: OverloadSettings =
    OverloadSettings { waiting_requests: Some(8), token_usage: None, shed: false };

#[test]
fn the_overload_filter_leaves_out_busy_workers_before_any_policy() {
    let pool = with_loads(fixed_pool(PolicyKind::RoundRobin, 0, &[0, 0, 0]), &[(9, 0), (8, 0), (2, 0)]);
    let single = Pools::Single(&pool);
    check(&single, ask("hi", 10), expect!["single regular=0:round_robin"]);
    check(
        &single,
        Ask { overload: WAITING_8, ..ask("hi", 10) },
        expect!["single regular=2:round_robin (2 left out)"],
    );
    check(
        &single,
        Ask { tried: &[2], overload: WAITING_8, ..ask("hi", 10) },
        expect!["single regular=1:round_robin (1 left out)"],
    );
    let shed = OverloadSettings { shed: true, ..WAITING_8 };
    check(
        &single,
        Ask { tried: &[2], overload: shed, ..ask("hi", 10) },
        expect!["no plan: every worker of the regular side is overloaded"],
    );
    check(
        &single,
        Ask { tried: &[0, 1, 2], ..ask("hi", 10) },
        expect!["no plan: no routable worker is left on the regular side"],
    );
}

#[test]
fn a_named_worker_is_taken_where_it_serves() {
    let mut prefill = fixed_pool(PolicyKind::LeastLoad, 0, &[0, 0]);
    let decode = fixed_pool(PolicyKind::LeastLoad, 10, &[3, 1]);
    let rule = PolicyConfig { pd_conditional: true, ..PolicyConfig::default() }.pd_rule();
    let pair = Pools::Pair { prefill: &prefill, decode: &decode, rule };
    let short = ask("hi", 10);
    check(&pair, short, expect!["in_place decode=11:least_load why=short_uncached"]);
    check(
        &pair,
        Ask { target: Some(10), ..short },
        expect!["in_place decode=10:target_worker why=short_uncached"],
    );
    // Naming a prefill worker makes a pair of it, whatever the rule.
    check(
        &pair,
        Ask { target: Some(1), ..short },
        expect!["pair prefill=1:target_worker decode=11:least_load why=always"],
    );
    check(
        &pair,
        Ask { tried: &[1], target: Some(1), ..short },
        expect!["no plan: the target worker 1 is not available"],
    );
    prefill.down.push(1);
    let pair = Pools::Pair { prefill: &prefill, decode: &decode, rule };
    check(&pair, Ask { target: Some(1), ..short }, expect!["no plan: the target worker 1 is not available"]);
}

#[test]
fn the_conditional_rule_chooses_the_decode_engine_first() {
    let prefill = fixed_pool(PolicyKind::LeastLoad, 0, &[2, 0]);
    let decode = fixed_pool(PolicyKind::LeastLoad, 10, &[0, 5]);
    let rule = PolicyConfig { pd_conditional: true, ..PolicyConfig::default() }.pd_rule();
    let conditional = Pools::Pair { prefill: &prefill, decode: &decode, rule };
    check(&conditional, ask("hi", 100), expect!["in_place decode=10:least_load why=short_uncached"]);
    check(
        &conditional,
        ask("hi", 30_000),
        expect!["pair prefill=1:least_load decode=10:least_load why=long_uncached"],
    );
    let always = Pools::Pair { prefill: &prefill, decode: &decode, rule: None };
    check(&always, ask("hi", 100), expect!["pair prefill=1:least_load decode=10:least_load why=always"]);
    check(
        &always,
        Ask { tried: &[10, 11], ..ask("hi", 100) },
        expect!["no plan: no routable worker is left on the decode side"],
    );
    assert!(conditional.untried_left(&[0, 1]), "in place needs the decode side only");
    assert!(!always.untried_left(&[0, 1]));
}

#[test]
fn with_kv_aware_on_both_sides_the_prediction_across_the_pair_decides() {
    // The decode engines run many requests, which a long prefill in place would stall.
    let stall = PolicyConfig {
        policy: PolicyKind::KvAware,
        kv_aware_decode_stall_weight: 0.01,
        ..PolicyConfig::default()
    };
    let prefill = with_loads(fixed_pool_with(&stall, 0, &[0, 0]), &[(2, 4), (0, 4)]);
    let decode = with_loads(fixed_pool_with(&stall, 10, &[0, 0]), &[(0, 120), (1, 120)]);
    let rule = PolicyConfig { pd_conditional: true, ..PolicyConfig::default() }.pd_rule();
    let pair = Pools::Pair { prefill: &prefill, decode: &decode, rule };
    check(&pair, ask("long", 30_000), expect!["pair prefill=1:kv_aware decode=10:kv_aware why=pair_sooner"]);
    // A prefill side with 5 s of work queued on each engine: in place costs less.
    let busy = with_loads(fixed_pool_with(&stall, 0, &[0, 0]), &[(40, 4), (40, 4)]);
    let pair = Pools::Pair { prefill: &busy, decode: &decode, rule };
    check(&pair, ask("long", 30_000), expect!["in_place decode=10:kv_aware why=in_place_sooner"]);
}

#[test]
fn a_dry_run_records_nothing_and_a_sent_plan_is_recorded() {
    let prompt = request("a long system prompt, then a question", 10);
    let plan_as = |pools: &Pools<'_, FixedPool>, planning| {
        let mut rng = SmallRng::seed_from_u64(1);
        describe(&pools.plan(&prompt, &[], None, &mut context(&mut rng, OFF, planning)))
    };
    // The tree learns a live decision, never a dry run's.
    let pool = fixed_pool(PolicyKind::CacheAware, 0, &[3, 0, 3]);
    let cache_aware = Pools::Single(&pool);
    for _ in 0..5 {
        assert_eq!(plan_as(&cache_aware, Planning::DryRun), "single regular=1:cache_miss");
    }
    assert_eq!((0..3).map(|w| pool.tree.tenant_size(w)).sum::<usize>(), 0, "the tree learned nothing");
    assert_eq!(plan_as(&cache_aware, Planning::Live), "single regular=1:cache_miss");
    assert_eq!(pool.tree.tenant_size(1), prompt_len(&prompt));
    assert_eq!(plan_as(&cache_aware, Planning::DryRun), "single regular=1:cache_hit");
    // The policy records a plan when it is sent, not when it is made.
    let pool = fixed_pool(PolicyKind::RoundRobin, 0, &[0, 0, 0]);
    let round_robin = Pools::Single(&pool);
    let mut rng = SmallRng::seed_from_u64(1);
    let live =
        round_robin.plan(&prompt, &[], None, &mut context(&mut rng, OFF, Planning::Live)).expect("a plan");
    assert_eq!(plan_as(&round_robin, Planning::DryRun), "single regular=0:round_robin", "not sent yet");
    live.on_routed(&round_robin);
    assert_eq!(plan_as(&round_robin, Planning::DryRun), "single regular=1:round_robin");
}

fn prompt_len(request: &RouteRequest<'_>) -> usize {
    match request.key {
        RoutingKey::Text(text) => text.len(),
        _ => 0,
    }
}

/// A pool above the shortlist's size, 600 workers with mixed fresh loads and in-flight counts,
/// its tree warm with two conversations per worker: for each later turn, the live plan (on a
/// shortlist) chooses as well as the policy on the whole pool: cache_aware the same credited
/// prefix and no more in flight, kv_aware no higher predicted cost; on the offer's one pass and
/// on a kept load order alike. And the plan says what pool it shortlisted.
#[test]
fn a_large_pool_is_decided_on_a_shortlist_as_well_as_on_the_whole_pool() {
    use kvgate_policy::{Candidates, SelectContext};
    let kept_or_not = [false, true].into_iter();
    for (kind, keep_order) in
        kept_or_not.flat_map(|keep| [(PolicyKind::CacheAware, keep), (PolicyKind::KvAware, keep)])
    {
        let n = 600;
        let in_flight: Vec<u64> = (0..n).map(|i| (i * 7 % 5) as u64).collect();
        let loads: Vec<(u64, u64)> = (0..n).map(|i| ((i * 3 % 4) as u64, (i % 6) as u64)).collect();
        let mut pool = with_loads(fixed_pool(kind, 0, &in_flight), &loads);
        if keep_order {
            pool.keep_order();
        }
        let turn =
            |c: usize, t: usize| format!("{} conversation {c} turn {t} ", "shared system prompt ".repeat(8));
        let single = Pools::Single(&pool);
        let mut rng = SmallRng::seed_from_u64(5);
        for c in 0..2 * n {
            let text = turn(c, 0);
            let mut ctx = context(&mut rng, OFF, Planning::Live);
            let plan = single.plan(&request(&text, 200), &[], None, &mut ctx).expect("a plan");
            plan.on_routed(&single);
        }
        for c in (0..2 * n).step_by(13) {
            let text = format!("{}and more", turn(c, 0));
            let request = request(&text, 220);
            let tree = ReadOnlyTree(&pool.tree);
            let mut ctx = SelectContext {
                now_ms: NOW,
                load_poll_interval_ms: 1000,
                rng: &mut rng,
                prefix_index: Some(&tree),
            };
            let whole =
                pool.policy.decide(&request, Candidates::new(&pool.workers).unwrap(), &mut ctx).unwrap();
            let mut ctx = context(&mut rng, OFF, Planning::DryRun);
            let Ok(RoutePlan::Single(pick)) = single.plan(&request, &[], None, &mut ctx) else {
                panic!("a plan")
            };
            assert!(
                pick.candidates.len() < 80 && pick.pool_size == n,
                "{}: {}",
                kind.as_str(),
                pick.candidates.len()
            );
            let chosen = &pick.decision;
            if kind == PolicyKind::KvAware {
                let cost = |d: &kvgate_policy::Decision| d.predicted.expect("predicted").cost();
                assert!(cost(chosen) <= cost(&whole) * (1.0 + 1e-9), "{c}: {chosen:?} vs {whole:?}");
            } else {
                let rate = |d: &kvgate_policy::Decision| d.matches.expect("matched").chosen_match_rate;
                let in_flight = |d: &kvgate_policy::Decision| in_flight[d.worker as usize];
                assert_eq!(rate(chosen), rate(&whole), "{c}: {chosen:?} vs {whole:?}");
                assert!(in_flight(chosen) <= in_flight(&whole), "{c}: {chosen:?} vs {whole:?}");
                assert_eq!(chosen.reason, whole.reason);
            }
        }
    }
}

mod dry_runs;
