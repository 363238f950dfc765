//! The favoured engines: the cheapest by the keys found by the bounded walk equal the cheapest
//! of every engine by the same cost (property), drained engines named, keys kept only for a
//! pool decided on shortlists, and the pool's KV terms equal to the sums over every report.

use proptest::prelude::*;

use super::*;
use crate::kv_aware::rate::RateSettings;

fn settings() -> PredictSettings {
    PredictSettings {
        kv_pressure_weight: 0.1,
        prefill_cost_weight: 8.0,
        queue_cost_weight: 1.0,
        decode_stall_weight: 0.01,
    }
}

fn rates() -> EngineRates {
    EngineRates::new(RateSettings {
        prefill_tokens_per_sec: 1000.0,
        decode_ms_per_request: 1.0,
        learn: true,
        per_engine: false,
        min_observations: 3,
        smoothing: 0.1,
        grid_step: 1.25,
        prior_observations: 0.0,
        max_ratio: 0.0,
        saturated_intervals: false,
    })
}

fn report(queued: u64, usage: f64, running: u64, at_ms: u64) -> LoadSample {
    LoadSample {
        token_usage: usage,
        num_running_reqs: running,
        num_waiting_uncached_tokens: queued,
        gen_throughput: 500.0,
        max_total_num_tokens: 100_000,
        fetched_at_ms: at_ms,
        ..LoadSample::default()
    }
}

/// Every engine `uncached` gives tokens, walked.
fn ask<'a>(least_uncached: f64, uncached: &'a dyn Fn(WorkerId) -> Option<f64>) -> FavouredAsk<'a> {
    FavouredAsk { least_uncached, uncached, listed: None }
}

/// Engines with the given (queued, usage, running) reports at 10 s, kept (one request routed on
/// a shortlist to engine 0 at 10 s).
fn favoured(engines: &[(u64, f64, u64)], rates: &EngineRates, routed: &mut RoutedLog) -> Favoured {
    let settings = settings();
    let mut favoured = Favoured::default();
    for (id, &(queued, usage, running)) in engines.iter().enumerate() {
        let inputs = Inputs { settings: &settings, rates, routed };
        favoured.report(id as WorkerId, report(queued, usage, running, 10_000), None, &inputs);
    }
    assert!(
        !favoured.kept() && favoured.cheapest(10_000, &[ask(300.0, &|_| Some(300.0))], 4).is_empty(),
        "not kept yet"
    );
    routed.record(0, 10_000, 200.0, 4_000);
    let inputs = Inputs { settings: &settings, rates, routed };
    favoured.routed(0, true, &inputs);
    assert!(favoured.kept());
    favoured
}

proptest! {
    /// The walk's `k` cheapest are the `k` cheapest of all by the keys' cost at `now`.
    #[test]
    fn the_walk_finds_the_cheapest(
        engines in proptest::collection::vec((0u64..5_000, 0.0f64..0.9, 0u64..16), 300..600),
        later_ms in 0u64..6_000,
        uncached in 0.0f64..4_000.0,
    ) {
        let (rates, mut routed) = (rates(), RoutedLog::default());
        let favoured = favoured(&engines, &rates, &mut routed);
        let now_ms = 10_000 + later_ms;
        let now_s = now_ms as f64 / 1000.0;
        let found = favoured.cheapest(now_ms, &[ask(uncached, &|_| Some(uncached))], 8);
        let mut all: Vec<(f64, WorkerId)> =
            favoured.keyed.iter().map(|(&id, k)| (k.at(now_s, uncached), id)).collect();
        all.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let want: Vec<f64> = all.iter().take(8).map(|&(cost, _)| cost).collect();
        let got: Vec<f64> = found.iter().take(8).map(|id| favoured.keyed[id].at(now_s, uncached)).collect();
        prop_assert_eq!(got, want);
        // And the cheapest drained (relieved of the duplicate's charge), after.
        let mut drained: Vec<f64> = favoured
            .keyed
            .values()
            .filter(|k| k.drained_s <= now_s)
            .map(|k| k.relieved(now_s, uncached))
            .collect();
        drained.sort_by(f64::total_cmp);
        drained.truncate(8);
        let named: Vec<f64> = found
            .iter()
            .map(|id| &favoured.keyed[id])
            .filter(|k| k.drained_s <= now_s)
            .map(|k| k.relieved(now_s, uncached))
            .collect();
        prop_assert!(drained.iter().all(|cost| named.contains(cost)), "{drained:?} in {named:?}");
        // Those accepted alone when asked for a few (the odd ids).
        let odd = favoured.cheapest(now_ms, &[ask(uncached, &|id| (id % 2 == 1).then_some(uncached))], 8);
        prop_assert!(odd.iter().all(|id| id % 2 == 1));
    }
}

proptest! {
    /// Asked about groups (the prompt's holders level by level, each with what its level does
    /// not hold; a few listed, the rest walked), the `k` cheapest over the groups are the `k`
    /// cheapest of every engine costed with its group's uncached tokens, and the drained too.
    #[test]
    fn the_walks_by_group_find_the_cheapest_of_all(
        engines in proptest::collection::vec((0u64..5_000, 0.0f64..0.9, 0u64..16), 300..600),
        later_ms in 0u64..6_000,
        levels in proptest::collection::vec(0.0f64..4_000.0, 1..5),
        listed_every in 2usize..5,
    ) {
        let (rates, mut routed) = (rates(), RoutedLog::default());
        let favoured = favoured(&engines, &rates, &mut routed);
        let now_ms = 10_000 + later_ms;
        let now_s = now_ms as f64 / 1000.0;
        // Engine `id` is in group `id % (groups + 1)`, the last remainder in none (each group a
        // fifth of the pool or more, as the levels of a widely held prompt walked, not listed);
        // every `listed_every`-th group is listed.
        let group_of = |id: WorkerId| Some(id as usize % (levels.len() + 1)).filter(|&g| g < levels.len());
        let n = engines.len() as WorkerId;
        let members: Vec<Vec<WorkerId>> =
            (0..levels.len()).map(|g| (0..n).filter(|&id| group_of(id) == Some(g)).collect()).collect();
        let uncached: Vec<Box<dyn Fn(WorkerId) -> Option<f64>>> = (0..levels.len())
            .map(|g| {
                let (tokens, group_of) = (levels[g], group_of);
                Box::new(move |id| (group_of(id) == Some(g)).then_some(tokens)) as Box<dyn Fn(_) -> _>
            })
            .collect();
        let mut order: Vec<usize> = (0..levels.len()).collect();
        order.sort_by(|&a, &b| levels[a].total_cmp(&levels[b]));
        let asks: Vec<FavouredAsk<'_>> = order
            .iter()
            .map(|&g| FavouredAsk {
                least_uncached: levels[g],
                uncached: &*uncached[g],
                listed: (g % listed_every == 1).then_some(&members[g][..]),
            })
            .collect();
        // Not cut short (a pool of 300-600 engines in groups of a fifth each can take more
        // than the decision's steps): the walks by group are exact by their bounds alone.
        let found = favoured.cheapest_within(now_ms, &asks, 8, usize::MAX);
        let tokens = |id: WorkerId| group_of(id).map(|g| levels[g]);
        let mut all: Vec<f64> = favoured
            .keyed
            .iter()
            .filter_map(|(&id, k)| tokens(id).map(|t| k.at(now_s, t)))
            .collect();
        all.sort_by(f64::total_cmp);
        all.truncate(8);
        let got: Vec<f64> =
            found.iter().take(all.len()).map(|id| favoured.keyed[id].at(now_s, tokens(*id).unwrap())).collect();
        prop_assert_eq!(got, all);
        let mut drained: Vec<f64> = favoured
            .keyed
            .iter()
            .filter(|(_, k)| k.drained_s <= now_s)
            .filter_map(|(&id, k)| tokens(id).map(|t| k.relieved(now_s, t)))
            .collect();
        drained.sort_by(f64::total_cmp);
        drained.truncate(8);
        let named: Vec<f64> = found
            .iter()
            .filter(|id| favoured.keyed[id].drained_s <= now_s)
            .map(|id| favoured.keyed[id].relieved(now_s, tokens(*id).unwrap()))
            .collect();
        prop_assert!(drained.iter().all(|cost| named.contains(cost)), "{drained:?} in {named:?}");
        prop_assert!(found.iter().all(|&id| group_of(id).is_some()), "only the groups' engines");
    }
}

#[test]
fn a_drained_engine_is_named_and_the_pool_terms_are_the_reports_sums() {
    // Engine 1 has 4 s of prefill queued, engine 2 none; both colder than the rest.
    let mut engines = vec![(0, 0.5, 4); 300];
    engines[1] = (4_000, 0.05, 0);
    engines[2] = (0, 0.06, 0);
    let (rates, mut routed) = (rates(), RoutedLog::default());
    let favoured = favoured(&engines, &rates, &mut routed);
    let found = favoured.cheapest(10_000, &[ask(300.0, &|_| Some(300.0))], 1);
    assert!(found.contains(&2), "{found:?}");
    let pool = favoured.pool_kv().expect("kept");
    let used: f64 = engines.iter().map(|&(_, usage, _)| usage * 100_000.0).sum();
    let running: f64 = engines.iter().map(|&(_, _, running)| running as f64).sum();
    assert!((pool.per_request.unwrap() - used / running).abs() < 1e-6);
    assert!((pool.generated_share.unwrap() - 500.0 * 300.0 / used).abs() < 1e-9);
    assert_eq!(pool.finished_share, None, "no finishing rate learned");
}

#[test]
fn a_pool_decided_on_whole_keeps_no_keys() {
    let (rates, mut routed) = (rates(), RoutedLog::default());
    let mut favoured = favoured(&[(0, 0.1, 1); 300], &rates, &mut routed);
    let settings = settings();
    let inputs = Inputs { settings: &settings, rates: &rates, routed: &routed };
    favoured.routed(3, false, &inputs);
    assert!(!favoured.kept() && favoured.pool_kv().is_none());
    assert!(favoured.cheapest(10_000, &[ask(300.0, &|_| Some(300.0))], 4).is_empty());
}
