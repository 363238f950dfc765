//! A large pool's load order in the gateway (`kvgate_fleet::pool_order`): kept equal to what the
//! offer of every worker says through requests begun and ended, load samples published and
//! forgotten, workers turning unhealthy and healthy again, removed and added; and the plan on it
//! (the candidate search on the kept order) choosing the worker the policy chooses on the whole
//! pool wherever that worker is on the shortlist (`kvgate_route`'s property, here on the
//! gateway's pools). Workers are on loopback ports nothing listens on (never contacted).

use std::collections::HashSet;
use std::sync::Arc;

use kvgate_index::{Namespace, ReadOnlyTree};
use kvgate_policy::{
    Candidates, LoadSample, OverloadSettings, PolicyConfig, PolicyKind, RouteRequest, RoutingKey,
    SelectContext, WorkerId,
};
use kvgate_route::{PlanContext, Planning, Pool, Pools, RoutePlan, SHORTLIST_ABOVE};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::super::choose::PoolView;
use crate::body::InFlight;
use crate::state::AppState;
use kvgate_fleet::registry::{ModelPool, NewWorker};
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::config::GatewayConfig;

const POLL_MS: u64 = 1_000;
const WORKERS: usize = 320;

fn gateway(kind: PolicyKind) -> AppState {
    let routing = PolicyConfig { policy: kind, ..PolicyConfig::default() };
    let config = GatewayConfig { routing, load_monitor_interval_ms: POLL_MS, ..GatewayConfig::default() };
    AppState::new(config).expect("a gateway state")
}

fn add(state: &AppState, port: usize) -> Arc<Worker> {
    let new = NewWorker {
        url: format!("http://127.0.0.1:{port}"),
        model: Some("m".into()),
        ..NewWorker::default()
    };
    state.registry.add(new, true).expect("a worker")
}

fn pool(state: &AppState) -> Arc<ModelPool> {
    let snapshot = state.registry.snapshot();
    snapshot.pool_for(Some("m")).and_then(|pools| pools.regular.clone()).expect("the pool")
}

/// A sample whose usage and queue are distinct for distinct `rank`s.
fn sample(rank: usize, now_ms: u64) -> LoadSample {
    LoadSample {
        token_usage: 0.05 + 0.9 * rank as f64 / (4 * WORKERS) as f64,
        num_running_reqs: 3,
        num_waiting_reqs: 1,
        num_waiting_uncached_tokens: 100 + 37 * rank as u64,
        gen_throughput: 900.0,
        max_total_num_tokens: 400_000,
        fetched_at_ms: now_ms,
    }
}

fn publish(state: &AppState, arrived: &[(WorkerId, LoadSample)]) {
    let registered: HashSet<WorkerId> = state.registry.snapshot().workers.iter().map(|w| w.id).collect();
    state.loads.publish(arrived, &registered);
}

fn context(now_ms: u64, planning: Planning, rng: &mut SmallRng) -> PlanContext<'_> {
    PlanContext {
        now_ms,
        load_poll_interval_ms: POLL_MS,
        overload: OverloadSettings::default(),
        planning,
        rng,
    }
}

/// The pool keeps an order, and it holds every routable worker as the offer gives it.
fn assert_order_is_the_offer(state: &AppState, what: &str) {
    let pool = pool(state);
    let view = PoolView { state, pool: &pool, namespace: Namespace::BASE };
    let offer = view.offer(&[]);
    let mut seen = None;
    let kept = view.with_order(&mut |kept| {
        let held: Vec<_> = offer.candidates.iter().map(|c| kept.order.get(c.id).copied()).collect();
        let looked_up: Vec<_> = offer.candidates.iter().map(|c| (kept.lookup)(c.id)).collect();
        seen = Some((kept.routable, kept.order.len(), held, looked_up));
    });
    assert!(kept, "{what}: the pool keeps an order");
    let (routable, len, held, looked_up) = seen.expect("searched");
    let expected: Vec<_> = offer.candidates.iter().copied().map(Some).collect();
    assert_eq!((routable, len), (offer.candidates.len(), offer.candidates.len()), "{what}");
    assert_eq!(held, expected, "{what}: the order's workers");
    assert_eq!(looked_up, expected, "{what}: the lookup");
}

/// Requests begun and ended, samples published and forgotten, health lost and regained,
/// workers removed and added: the order stays the offer's.
#[test]
fn the_order_follows_every_change_of_the_pool() {
    let state = gateway(PolicyKind::KvAware);
    let mut workers: Vec<Arc<Worker>> = (1..=SHORTLIST_ABOVE).map(|port| add(&state, port)).collect();
    assert!(pool(&state).order.is_none(), "a pool of {SHORTLIST_ABOVE} keeps none");
    workers.extend((SHORTLIST_ABOVE + 1..=WORKERS).map(|port| add(&state, port)));
    assert_order_is_the_offer(&state, "registered");
    let mut rng = SmallRng::seed_from_u64(43);
    let mut held: Vec<InFlight> = Vec::new();
    let mut next_port = WORKERS + 1;
    for step in 0..600u64 {
        let worker = workers[rng.random_range(0..workers.len())].clone();
        match rng.random_range(0..10) {
            0..=2 => held.push(InFlight::begin(worker, None)),
            3..=4 if !held.is_empty() => drop(held.swap_remove(rng.random_range(0..held.len()))),
            5 => publish(&state, &[(worker.id, sample(rng.random_range(0..WORKERS), 1_000 + step))]),
            6 => state.loads.forget(worker.id),
            // Health lost (the health loop forgets the sample), or regained.
            7 if worker.record_health(!worker.is_healthy(), 1, 1) == Some(false) => {
                state.loads.forget(worker.id)
            }
            8 => {
                let routable: HashSet<WorkerId> =
                    workers.iter().filter(|w| w.is_healthy()).map(|w| w.id).step_by(2).collect();
                state.loads.retain(&routable);
            }
            _ if step % 3 == 0 => {
                let removed = state.registry.remove(&worker.url).expect("registered");
                state.loads.forget(removed.id);
                workers.retain(|w| w.id != removed.id);
                workers.push(add(&state, next_port));
                next_port += 1;
            }
            _ => {}
        }
        assert_order_is_the_offer(&state, &format!("step {step}"));
    }
    drop(held);
    assert_order_is_the_offer(&state, "every request ended");
    // Down to half the threshold: the order is dropped, and the workers pay nothing for it.
    for worker in workers.iter().skip(SHORTLIST_ABOVE / 2) {
        state.registry.remove(&worker.url);
    }
    assert!(pool(&state).order.is_none());
    assert!(workers.iter().all(|w| w.order().is_none()));
}

/// On distinct loads and requests in flight, with a prompt held by the workers live plans sent
/// it to: the gateway's plan (a dry run, on the kept order) chooses the worker the policy
/// chooses on every routable worker, wherever that one is on the shortlist.
#[test]
fn the_plan_on_the_kept_order_chooses_what_the_whole_pool_chooses() {
    for kind in [PolicyKind::CacheAware, PolicyKind::KvAware] {
        let state = gateway(kind);
        let workers: Vec<Arc<Worker>> = (1..=WORKERS).map(|port| add(&state, port)).collect();
        let mut rng = SmallRng::seed_from_u64(7);
        let prompts: Vec<Vec<u32>> =
            (0..6u32).map(|p| (0..64).map(|t| p * 1_000 + t + 1).collect::<Vec<u32>>()).collect();
        let mut compared = 0;
        for round in 0..4u64 {
            let now_ms = 10_000 + round * POLL_MS;
            // Distinct requests in flight and samples, reshuffled every round.
            let mut ranks: Vec<usize> = (0..WORKERS).collect();
            ranks.shuffle(&mut rng);
            let held: Vec<InFlight> = workers
                .iter()
                .zip(&ranks)
                .flat_map(|(w, &rank)| (0..rank).map(|_| InFlight::begin(w.clone(), None)))
                .collect();
            let arrived: Vec<(WorkerId, LoadSample)> =
                workers.iter().zip(&ranks).map(|(w, &rank)| (w.id, sample(rank, now_ms))).collect();
            publish(&state, &arrived);
            for down in workers.iter().skip(round as usize * 7).take(3) {
                down.record_health(false, 1, 1);
                state.loads.forget(down.id);
            }
            let pool = pool(&state);
            let view = PoolView { state: &state, pool: &pool, namespace: Namespace::BASE };
            for prompt in &prompts {
                let request = RouteRequest {
                    key: RoutingKey::Tokens(prompt),
                    prompt_tokens: prompt.len() as u64,
                    session: None,
                };
                let single = Pools::Single(&view);
                let dry = single.plan(&request, &[], None, &mut context(now_ms, Planning::DryRun, &mut rng));
                let Ok(RoutePlan::Single(pick)) = dry else { panic!("a plan") };
                let offer = view.offer(&[]);
                assert_eq!(pick.pool_size, offer.candidates.len());
                assert!(pick.candidates.len() < offer.candidates.len(), "shortlisted");
                let tree = ReadOnlyTree(&pool.prefix.tree);
                let mut select = SelectContext {
                    now_ms,
                    load_poll_interval_ms: POLL_MS,
                    rng: &mut rng,
                    prefix_index: Some(&tree),
                };
                let whole = pool
                    .policy
                    .decide(&request, Candidates::new(&offer.candidates).expect("candidates"), &mut select)
                    .expect("a decision");
                if pick.candidates.iter().any(|c| c.id == whole.worker) {
                    assert_eq!(
                        pick.decision.worker, whole.worker,
                        "{kind:?} round {round}: {:?} against {whole:?}",
                        pick.decision
                    );
                    compared += 1;
                }
                // A live plan sent: the tree learns where the prompt went.
                let live = single
                    .plan(&request, &[], None, &mut context(now_ms, Planning::Live, &mut rng))
                    .expect("a plan");
                live.on_routed(&single);
            }
            for down in workers.iter().skip(round as usize * 7).take(3) {
                down.record_health(true, 1, 1);
            }
            drop(held);
        }
        assert!(
            compared >= 12,
            "{kind:?}: the whole pool's choice was on the shortlist {compared} times of 24"
        );
    }
}
