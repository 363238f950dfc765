//! The gateway and the simulator plan alike: one recorded stream of requests, load samples,
//! request ends and maintenance ticks drives `kvgate_route`'s plan on the gateway's pools
//! (`choose::PoolView` over a registry of workers that are never contacted) and on the
//! simulator's (`kvgate_sim::SimPool`), with the same clock, RNG seed and overload bounds: every
//! policy, a regular fleet and a disaggregated one, give the same decision sequence. The index
//! is the approximate tree on both sides (the exact index is fed by KV events, which differ by
//! host: a socket or the simulated engines).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use clap::ValueEnum;
use kvgate_index::Namespace;
use kvgate_policy::{
    Decision, LoadSample, OverloadSettings, PdChoice, PdWhy, PolicyConfig, PolicyKind, PrefixIndexMode,
    RouteRequest, RoutingKey,
};
use kvgate_route::{PlanContext, Planning, Pool, Pools, Side};
use kvgate_sim::SimPool;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::super::choose::PoolView;
use crate::body::InFlight;
use crate::state::AppState;
use kvgate_fleet::registry::{ModelPool, NewWorker};
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::config::GatewayConfig;
use kvgate_protocol::role::WorkerRole;

const POLL_MS: u64 = 500;
const BLOCK: u32 = 16;

/// One step of the recorded stream.
struct Step {
    now_ms: u64,
    /// A load sample per worker of each pool (in pool order), published before the request.
    loads: Option<Vec<LoadSample>>,
    /// Requests (by step index) that end before this one is planned.
    ends: Vec<usize>,
    prompt: Vec<u32>,
    session: String,
}

/// `steps` requests: conversations sharing a system prompt, each turn the previous one plus a
/// new message, a few at a time in flight; load samples every few steps.
fn stream(steps: usize, workers: usize, seed: u64) -> Vec<Step> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let system: Vec<u32> = (0..3 * BLOCK).collect();
    let mut conversations: Vec<Vec<u32>> = (0..6).map(|_| system.clone()).collect();
    let mut open: VecDeque<(usize, usize)> = VecDeque::new();
    let mut now_ms = 1_000;
    (0..steps)
        .map(|i| {
            now_ms += rng.random_range(0..300);
            let conversation = rng.random_range(0..conversations.len());
            let turn = rng.random_range(1..6) * BLOCK as usize;
            let next = 100_000 * (i as u32 + 1);
            conversations[conversation].extend(next..next + turn as u32);
            let loads = (i % 4 == 0).then(|| {
                (0..workers)
                    .map(|_| {
                        let waiting = rng.random_range(0..6u64);
                        LoadSample {
                            token_usage: rng.random_range(0.0..0.95),
                            num_running_reqs: rng.random_range(0..30),
                            num_waiting_reqs: waiting,
                            num_waiting_uncached_tokens: waiting * rng.random_range(0..3_000),
                            gen_throughput: rng.random_range(200.0..2_000.0),
                            max_total_num_tokens: 400_000,
                            fetched_at_ms: now_ms,
                        }
                    })
                    .collect()
            });
            open.push_back((i, i + rng.random_range(1..8)));
            let mut ends = Vec::new();
            open.retain(|&(request, until)| {
                let ended = until <= i && request < i;
                if ended {
                    ends.push(request);
                }
                !ended
            });
            Step {
                now_ms,
                loads,
                ends,
                prompt: conversations[conversation].clone(),
                session: format!("conversation-{conversation}"),
            }
        })
        .collect()
}

/// A gateway state with `sides` pools of model `m` (a regular pool, or a prefill and a decode
/// pool) of `n` workers each, on loopback ports nothing listens on (never contacted).
fn gateway(routing: &PolicyConfig, sides: &[(WorkerRole, usize)]) -> (AppState, Vec<Arc<Worker>>) {
    let config = GatewayConfig {
        routing: routing.clone(),
        pd_disaggregation: sides.len() == 2,
        load_monitor_interval_ms: POLL_MS,
        ..GatewayConfig::default()
    };
    let state = AppState::new(config).expect("a gateway state");
    let mut workers = Vec::new();
    for &(role, n) in sides {
        for _ in 0..n {
            let url = format!("http://127.0.0.1:{}", 1 + workers.len());
            let new = NewWorker {
                url,
                model: Some("m".into()),
                role,
                bootstrap_port: None,
                kv_events: None,
                policy: None,
                dp_rank: None,
            };
            workers.push(state.registry.add(new, true).expect("a worker"));
        }
    }
    (state, workers)
}

fn gateway_pools(state: &AppState, sides: &[(WorkerRole, usize)]) -> Vec<Arc<ModelPool>> {
    let snapshot = state.registry.snapshot();
    let pools = snapshot.pool_for(Some("m")).expect("the model's pools");
    sides.iter().map(|&(role, _)| pools.get(role).expect("a pool of the role").clone()).collect()
}

/// A plan, host-independent: per pick its side, its pool-local worker, its decision (worker
/// made pool-local too) and the workers the overload protection left out, and the PD verdict.
type Described = (Vec<(Side, usize, Decision, usize)>, Option<PdChoice>);

fn describe<I>(plan: &kvgate_route::RoutePlan<'_, I>, first_of: impl Fn(Side) -> u32) -> Described {
    let picks = plan
        .picks()
        .map(|(side, pick)| {
            let local = pick.decision.worker - first_of(side);
            (side, local as usize, Decision { worker: local, ..pick.decision }, pick.left_out)
        })
        .collect();
    (picks, plan.pd().copied())
}

/// The decision sequences of the recorded stream on the gateway's pools and on the simulator's.
fn both(
    routing: &PolicyConfig,
    sides: &[(WorkerRole, usize)],
    overload: OverloadSettings,
) -> [Vec<Described>; 2] {
    let n_workers: usize = sides.iter().map(|(_, n)| n).sum();
    let steps = stream(240, n_workers, 7);
    let (state, workers) = gateway(routing, sides);
    let pools = gateway_pools(&state, sides);
    let rule = routing.pd_rule();
    let firsts: Vec<u32> =
        sides.iter().scan(0, |first, (_, n)| Some(std::mem::replace(first, *first + *n as u32))).collect();
    let first_of = |side: Side| match side {
        Side::Decode => firsts[1],
        Side::Regular | Side::Prefill => 0,
    };
    let mut sims: Vec<SimPool> =
        sides.iter().zip(&firsts).map(|(&(_, n), &first)| SimPool::new(routing, first as usize, n)).collect();
    // The hash policies place workers by name: the simulator's get the gateway's (their URLs).
    for (sim, &first) in sims.iter().zip(&firsts) {
        for worker in 0..sim.n_workers() {
            sim.name_worker(worker, &workers[first as usize + worker].url);
        }
    }
    let registered: HashSet<u32> = workers.iter().map(|w| w.id).collect();
    let mut held: Vec<Vec<InFlight>> = Vec::new();
    let mut sent: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut live_rng = [SmallRng::seed_from_u64(11), SmallRng::seed_from_u64(11)];
    let mut decisions = [Vec::new(), Vec::new()];
    let mut last_maintained = 0;
    for (i, step) in steps.iter().enumerate() {
        if step.now_ms / 1000 > last_maintained {
            last_maintained = step.now_ms / 1000;
            for pool in &pools {
                pool.policy.maintain(step.now_ms);
                pool.prefix.tree.maintain(step.now_ms);
            }
            for sim in &sims {
                sim.maintain(step.now_ms * 1000);
            }
        }
        if let Some(loads) = &step.loads {
            // The load monitor polls only when a policy or the overload protection reads loads.
            if pools.iter().any(|pool| pool.policy.needs_loads()) || overload.enabled() {
                let arrived: Vec<(u32, LoadSample)> =
                    workers.iter().map(|w| w.id).zip(loads.iter().copied()).collect();
                state.loads.publish(&arrived, &registered);
                state.registry.snapshot().tell_load_reports(&arrived, step.now_ms, POLL_MS);
            }
            for (pool, sim) in sims.iter_mut().enumerate() {
                for worker in 0..sim.n_workers() {
                    let sample = loads[firsts[pool] as usize + worker];
                    sim.record_load(worker, sample, overload.enabled(), POLL_MS);
                }
            }
        }
        for &ended in &step.ends {
            held[ended].clear();
            for &(pool, worker) in &sent[ended] {
                sims[pool].ended(worker, ended as u64);
            }
        }
        let request = RouteRequest {
            key: RoutingKey::Tokens(&step.prompt),
            prompt_tokens: step.prompt.len() as u64,
            session: Some(&step.session),
        };
        let context = |rng| PlanContext {
            now_ms: step.now_ms,
            load_poll_interval_ms: POLL_MS,
            overload,
            planning: Planning::Live,
            rng,
        };
        // The gateway's pools.
        let views: Vec<PoolView<'_>> =
            pools.iter().map(|pool| PoolView { state: &state, pool, namespace: Namespace::BASE }).collect();
        let gateway_pools = match &views[..] {
            [prefill, decode] => Pools::Pair { prefill, decode, rule },
            _ => Pools::Single(&views[0]),
        };
        let [gateway_rng, sim_rng] = &mut live_rng;
        let plan =
            gateway_pools.plan(&request, &[], None, &mut context(gateway_rng)).expect("a gateway plan");
        plan.on_routed(&gateway_pools);
        let mut guards = Vec::new();
        for (side, pick) in plan.picks() {
            let pool = if side == Side::Decode { 1 } else { 0 };
            let worker =
                views[pool].pool.workers.iter().find(|w| w.id == pick.decision.worker).expect("a worker");
            guards.push(InFlight::begin(worker.clone(), None));
        }
        decisions[0].push(describe(&plan, first_of));
        drop(plan);
        held.push(guards);
        // The simulator's pools.
        let sim_pools = match &sims[..] {
            [prefill, decode] => Pools::Pair { prefill, decode, rule },
            _ => Pools::Single(&sims[0]),
        };
        let plan = sim_pools.plan(&request, &[], None, &mut context(sim_rng)).expect("a simulator plan");
        plan.on_routed(&sim_pools);
        let picks: Vec<(usize, usize)> = plan
            .picks()
            .map(|(side, pick)| (if side == Side::Decode { 1 } else { 0 }, pick.decision.worker as usize))
            .collect();
        decisions[1].push(describe(&plan, |_| 0));
        drop(plan);
        for &(pool, worker) in &picks {
            sims[pool].routed(worker, i as u64, &step.prompt);
        }
        sent.push(picks);
        assert!(sims.iter().all(|sim| sim.policy().name() == pools[0].policy.name()));
    }
    decisions
}

/// The two sequences are equal; else the first step where they part.
fn assert_same(gateway: &[Described], simulator: &[Described], what: &str) {
    assert_eq!(gateway.len(), simulator.len(), "{what}");
    if let Some(step) = (0..gateway.len()).find(|&i| gateway[i] != simulator[i]) {
        panic!(
            "{what}: step {step} differs\ngateway:   {:?}\nsimulator: {:?}",
            gateway[step], simulator[step]
        );
    }
}

fn routing(policy: PolicyKind) -> PolicyConfig {
    PolicyConfig {
        policy,
        prefix_index: PrefixIndexMode::Approximate,
        block_size: BLOCK as usize,
        max_sessions: 4,
        bucket_adjust_interval_secs: 2.0,
        ..PolicyConfig::default()
    }
}

#[tokio::test]
async fn the_gateway_and_the_simulator_make_the_same_decisions_on_one_stream() {
    let overload = OverloadSettings { waiting_requests: Some(4), token_usage: Some(0.9), shed: false };
    for &policy in PolicyKind::value_variants() {
        for overload in [OverloadSettings::default(), overload] {
            let [gateway, simulator] = both(&routing(policy), &[(WorkerRole::Regular, 4)], overload);
            assert_same(&gateway, &simulator, &format!("{} with {overload:?}", policy.as_str()));
            let left_out =
                gateway.iter().flat_map(|(picks, _)| picks.iter().map(|pick| pick.3)).sum::<usize>();
            assert_eq!(left_out > 0, overload.enabled(), "{}: the overload filter acted", policy.as_str());
        }
    }
}

#[tokio::test]
async fn a_disaggregated_fleet_is_planned_alike_on_both_hosts() {
    let sides = [(WorkerRole::Prefill, 3), (WorkerRole::Decode, 2)];
    for policy in [PolicyKind::KvAware, PolicyKind::CacheAware, PolicyKind::LeastLoad] {
        for conditional in [false, true] {
            let config = PolicyConfig {
                pd_conditional: conditional,
                pd_max_local_prefill_tokens: 64,
                pd_max_local_prefill_fraction: 0.2,
                ..routing(policy)
            };
            let [gateway, simulator] = both(&config, &sides, OverloadSettings::default());
            assert_same(&gateway, &simulator, &format!("{} conditional={conditional}", policy.as_str()));
            let verdicts: Vec<PdChoice> = gateway.iter().filter_map(|(_, pd)| *pd).collect();
            assert_eq!(verdicts.len(), gateway.len());
            // The rule decided every request (kv_aware on both sides: by the prediction).
            let predicted = conditional && policy == PolicyKind::KvAware;
            for pd in &verdicts {
                assert_eq!(pd.why != PdWhy::Always, conditional, "{}", pd.describe());
                assert_eq!(pd.inputs.predicted.is_some(), predicted, "{}", pd.describe());
            }
        }
    }
}
