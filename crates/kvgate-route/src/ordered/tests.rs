//! The search on a kept order finds what the one pass over the offer finds: on pools above the
//! shortlist's size with distinct loads, some samples stale, some workers tried or down and a
//! prompt held by a few, both shortlists hold the prompt's holders, the least loaded, the
//! coldest and the least queued (by the keys a stale sample gets: no load), a busiest worker
//! and a stale one; and a policy deciding on the kept order's shortlist picks the worker it
//! picks on the whole pool wherever that worker is on the shortlist.

use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::*;
use crate::order::{keys, Keys, LeastKey};
use crate::shortlist::shortlist;
use crate::{FixedPool, PlanContext, Planning, Pool, Pools, RoutePlan};
use kvgate_index::{PrefixIndex, PrefixMatch, PromptKey, ReadOnlyTree};
use kvgate_policy::{LoadSample, OverloadSettings, PolicyConfig, PolicyKind, RouteRequest, RoutingKey};

const NOW: u64 = 100_000;
const PROMPT: &str = "a long shared prompt that a few workers hold, asked again and again";

/// A pool: its size, its distinct in-flight counts, and which
/// workers are stale, tried, down and holders of the prompt.
#[derive(Clone, Debug)]
struct Case {
    n: u32,
    in_flight: Vec<u64>,
    stale: Vec<u32>,
    tried: Vec<u32>,
    down: Vec<u32>,
    holders: Vec<u32>,
    /// The workers the policy names ([`kvgate_policy::Policy::favoured`]).
    favoured: Vec<u32>,
    kind: PolicyKind,
}

fn a_case() -> impl Strategy<Value = Case> {
    (300u32..460).prop_flat_map(|n| {
        let some = |max: usize| proptest::collection::vec(0..n, 0..=max);
        (
            // Distinct counts: no tie for a policy to break at random.
            Just((0..u64::from(n)).collect::<Vec<u64>>()).prop_shuffle(),
            some(STALE_KEPT),
            some(3),
            some(5),
            some(6),
            some(4),
            prop_oneof![Just(PolicyKind::CacheAware), Just(PolicyKind::KvAware)],
        )
            .prop_map(move |(in_flight, stale, tried, down, holders, mut favoured, kind)| Case {
                n,
                in_flight,
                stale,
                tried,
                down,
                holders,
                favoured: {
                    favoured.sort_unstable();
                    favoured.dedup();
                    favoured
                },
                kind,
            })
    })
}

/// The pool of `case`: distinct usages and queues (a multiplicative walk over the ids), fresh
/// samples but for the stale ones, the tree holding the prompt on the holders; its order kept.
fn pool(case: &Case) -> FixedPool {
    let n = case.n;
    let workers = (0..n)
        .map(|id| Candidate {
            id,
            in_flight: case.in_flight[id as usize],
            load: Some(LoadSample {
                token_usage: 0.05 + 0.9 * f64::from(id * 7919 % n) / f64::from(n),
                num_waiting_uncached_tokens: 10 * u64::from(id * 104_729 % n),
                max_total_num_tokens: 100_000,
                fetched_at_ms: if case.stale.contains(&id) {
                    NOW - 10_000 - u64::from(id)
                } else {
                    NOW - 100
                },
                ..LoadSample::default()
            }),
        })
        .collect();
    let mut pool = FixedPool::new(&PolicyConfig { policy: case.kind, ..PolicyConfig::default() }, workers);
    pool.down = case.down.clone();
    for &holder in &case.holders {
        pool.tree.route(PromptKey::Text(PROMPT), NOW - 500, &mut |_| Some(holder));
    }
    pool.keep_order();
    pool
}

/// Every key of the one pass, with a stale sample keyed as none.
fn key_of(c: &Candidate) -> Keys {
    match fresh_load(c, NOW, 1000) {
        Some(_) => keys(c),
        None => crate::order::stale_keys(c.in_flight),
    }
}

/// What every shortlist of `candidates` (the routable workers not tried) must hold, checked on
/// `found`: for each order the k smallest keys (ties: as many of the tied key as the k smallest
/// take), the holders and those the policy names, a busiest worker, a stale one if any; and only
/// candidates.
#[track_caller]
fn check_holds(candidates: &[Candidate], found: &[Candidate], holders: &[u32], what: &str) {
    let ids: Vec<WorkerId> = found.iter().map(|c| c.id).collect();
    assert!(found.iter().all(|c| candidates.contains(c)), "{what}: only candidates");
    type KeyOf = fn(&Candidate) -> LeastKey;
    let orders: [(usize, KeyOf); 3] = [
        (LEAST_LOADED, |c| key_of(c).0),
        (COLDEST, |c| {
            let (a, b) = key_of(c).1;
            (a, b, 0)
        }),
        (COLDEST, |c| {
            let (a, b) = key_of(c).2;
            (a, b, 0)
        }),
    ];
    for (k, key) in orders {
        let mut all: Vec<_> = candidates.iter().map(key).collect();
        all.sort_unstable();
        let kth = all[k.min(all.len()) - 1];
        let below: Vec<_> = candidates.iter().filter(|c| key(c) < kth).map(|c| c.id).collect();
        assert!(below.iter().all(|id| ids.contains(id)), "{what}: {below:?} below {kth:?} in {ids:?}");
        let at_most = found.iter().filter(|c| key(c) <= kth).count();
        assert!(at_most >= k.min(all.len()), "{what}: {at_most} at or below {kth:?}");
    }
    for holder in holders.iter().filter(|id| candidates.iter().any(|c| c.id == **id)) {
        assert!(ids.contains(holder), "{what}: holder {holder}");
    }
    let busiest = candidates.iter().map(|c| c.in_flight).max();
    assert_eq!(found.iter().map(|c| c.in_flight).max(), busiest, "{what}: the busiest");
    if candidates.iter().any(|c| fresh_load(c, NOW, 1000).is_none()) {
        assert!(found.iter().any(|c| fresh_load(c, NOW, 1000).is_none()), "{what}: a stale one");
    }
}

/// The case's candidates (neither tried nor down) and the pool's match of `PROMPT`.
fn candidates_and_match(pool: &FixedPool, case: &Case) -> (Vec<Candidate>, PrefixMatch) {
    let candidates = pool
        .workers
        .iter()
        .filter(|c| !case.tried.contains(&c.id) && !case.down.contains(&c.id))
        .copied()
        .collect();
    let mut matched = PrefixMatch::default();
    ReadOnlyTree(&pool.tree).route(PromptKey::Text(PROMPT), NOW, &mut |prefix| {
        matched = prefix.clone();
        None
    });
    (candidates, matched)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_kept_order_finds_what_the_one_pass_finds(case in a_case(), seed in 0u64..1000) {
        let pool = pool(&case);
        let (candidates, matched) = candidates_and_match(&pool, &case);
        let mut search = Search::new(Some(&matched), NOW, 1000);
        search.favoured = case.favoured.clone();
        let holders: Vec<u32> = case.holders.iter().chain(&case.favoured).copied().collect();
        let mut rng = SmallRng::seed_from_u64(seed);
        let one_pass = shortlist(candidates.clone(), &search, &mut rng);
        check_holds(&candidates, &one_pass, &holders, "one pass");
        let mut found = None;
        pool.with_order(&mut |kept| {
            found = Some(shortlist_ordered(kept.order, kept.lookup, &case.tried, &search, &mut rng));
        });
        let found = found.expect("the order is kept");
        check_holds(&candidates, &found, &holders, "kept order");
        prop_assert!(found.windows(2).all(|w| w[0].id < w[1].id), "in id order");

        // The policy on the kept order's shortlist (the plan, a dry run) against the policy on
        // every candidate: the same worker wherever the whole pool's choice is on the shortlist.
        let request = RouteRequest { key: RoutingKey::Text(PROMPT), prompt_tokens: 4000, session: None };
        let single = Pools::Single(&pool);
        let mut ctx = PlanContext {
            now_ms: NOW,
            load_poll_interval_ms: 1000,
            overload: OverloadSettings::default(),
            planning: Planning::DryRun,
            rng: &mut rng,
        };
        let Ok(RoutePlan::Single(pick)) = single.plan(&request, &case.tried, None, &mut ctx) else {
            panic!("a plan")
        };
        prop_assert_eq!(pick.pool_size, candidates.len());
        let tree = ReadOnlyTree(&pool.tree);
        let mut select = kvgate_policy::SelectContext {
            now_ms: NOW,
            load_poll_interval_ms: 1000,
            rng: &mut rng,
            prefix_index: Some(&tree),
        };
        let whole = pool
            .policy
            .decide(&request, kvgate_policy::Candidates::new(&candidates).unwrap(), &mut select)
            .unwrap();
        if pick.candidates.iter().any(|c| c.id == whole.worker) {
            prop_assert_eq!(pick.decision.worker, whole.worker, "{:?} against {:?}", pick.decision, whole);
        }
    }
}

/// The prompt's opening, held by many workers.
const OPENING: &str = "a long shared prompt that a few workers hold";

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// A prompt whose opening is held by a tenth to nine tenths of the pool (and the whole of it
    /// by a few): the kept order's best holders, found level by level and on the least-loaded
    /// order for the widely held opening, are the best by credit then requests in flight, as
    /// sorting every candidate finds them, and as the one pass finds them.
    #[test]
    fn the_best_holders_of_a_widely_held_opening_are_found(
        case in a_case(),
        opening_share in 1u32..10,
        seed in 0u64..1000,
    ) {
        let pool = pool(&case);
        for id in (0..case.n).filter(|id| id * 7919 % case.n % 10 < opening_share) {
            pool.tree.route(PromptKey::Text(OPENING), NOW - 400, &mut |_| Some(id));
        }
        let (candidates, matched) = candidates_and_match(&pool, &case);
        let search = Search::new(Some(&matched), NOW, 1000);
        let mut best: Vec<(std::cmp::Reverse<usize>, u64, WorkerId)> = candidates
            .iter()
            .map(|c| (std::cmp::Reverse(matched.credited(c.id)), c.in_flight, c.id))
            .filter(|&(std::cmp::Reverse(credited), _, _)| credited > 0)
            .collect();
        best.sort_unstable();
        best.truncate(HOLDERS);
        let mut rng = SmallRng::seed_from_u64(seed);
        let one_pass = shortlist(candidates.clone(), &search, &mut rng);
        let mut found = None;
        pool.with_order(&mut |kept| {
            found = Some(shortlist_ordered(kept.order, kept.lookup, &case.tried, &search, &mut rng));
        });
        let found = found.expect("the order is kept");
        for (what, shortlist) in [("one pass", &one_pass), ("kept order", &found)] {
            for &(_, _, id) in &best {
                prop_assert!(shortlist.iter().any(|c| c.id == id), "{}: best holder {} of {:?}", what, id, best);
            }
        }
    }
}

/// A pool of 2,000 whose prompt's opening is held by every other worker: the search looks up
/// far fewer workers than hold it (the widely held opening is walked on the least-loaded order),
/// and keeps the best holders all the same.
#[test]
fn a_widely_held_opening_is_not_looked_at_holder_by_holder() {
    let case = Case {
        n: 2000,
        in_flight: (0..2000).map(|id| (id * 7919) % 2000).collect(),
        stale: Vec::new(),
        tried: Vec::new(),
        down: Vec::new(),
        holders: vec![5, 77],
        favoured: Vec::new(),
        kind: PolicyKind::KvAware,
    };
    let pool = pool(&case);
    for id in (0..case.n).filter(|id| id % 2 == 0) {
        pool.tree.route(PromptKey::Text(OPENING), NOW - 400, &mut |_| Some(id));
    }
    let mut matched = PrefixMatch::default();
    ReadOnlyTree(&pool.tree).route(PromptKey::Text(PROMPT), NOW, &mut |prefix| {
        matched = prefix.clone();
        None
    });
    let search = Search::new(Some(&matched), NOW, 1000);
    assert!(search.credited.len() >= 1000, "{} holders", search.credited.len());
    let looked = std::cell::Cell::new(0);
    let mut found = Vec::new();
    pool.with_order(&mut |kept| {
        let counted = |id: WorkerId| {
            looked.set(looked.get() + 1);
            (kept.lookup)(id)
        };
        found = shortlist_ordered(kept.order, &counted, &[], &search, &mut SmallRng::seed_from_u64(1));
    });
    assert!(looked.get() < 300, "{} workers looked up", looked.get());
    // The best: the two holding the whole prompt, then the opening's holders fewest in flight.
    let mut best: Vec<(u64, WorkerId)> =
        (0..case.n).filter(|id| id % 2 == 0).map(|id| (case.in_flight[id as usize], id)).collect();
    best.sort_unstable();
    let best =
        [5, 77].into_iter().chain(best.into_iter().map(|(_, id)| id).filter(|&id| id != 5 && id != 77));
    for id in best.take(HOLDERS) {
        assert!(found.iter().any(|c| c.id == id), "holder {id}");
    }
}
