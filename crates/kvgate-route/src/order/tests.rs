//! The kept load order under updates: every order reads as the workers' current keys sorted,
//! whatever sequence of routed, finished, reported and removed came before; the walks take the
//! front of an order, rotate equal keys from the start they are given and skip what they do
//! not accept.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

fn sample(usage: f64, queued: u64, fetched_at_ms: u64) -> LoadSample {
    LoadSample {
        token_usage: usage,
        num_waiting_uncached_tokens: queued,
        fetched_at_ms,
        ..LoadSample::default()
    }
}

fn idle(id: WorkerId) -> Candidate {
    Candidate { id, in_flight: 0, load: None }
}

/// The order as built at once from `workers`, compared field by field with `order`.
#[track_caller]
fn assert_same_as_rebuilt(order: &LoadOrder, workers: &HashMap<WorkerId, Candidate>) {
    let rebuilt = LoadOrder::of(workers.values().copied());
    assert_eq!(order.least, rebuilt.least);
    assert_eq!(order.coldest, rebuilt.coldest);
    assert_eq!(order.least_queued, rebuilt.least_queued);
    assert_eq!(order.by_age, rebuilt.by_age);
    assert_eq!(order.len(), workers.len());
    let mut ids = order.ids.clone();
    ids.sort_unstable();
    let mut expected: Vec<WorkerId> = workers.keys().copied().collect();
    expected.sort_unstable();
    assert_eq!(ids, expected);
    for (at, id) in order.ids.iter().enumerate() {
        assert_eq!(order.workers[id].1, at, "worker {id}'s place");
        // As printed: a NaN sample is the same sample.
        assert_eq!(format!("{:?}", order.get(*id)), format!("{:?}", workers.get(id)));
    }
}

#[derive(Clone, Debug)]
enum Update {
    Set(Candidate),
    InFlight(WorkerId, u64),
    Load(WorkerId, Option<LoadSample>),
    Remove(WorkerId),
}

fn a_sample() -> impl Strategy<Value = Option<LoadSample>> {
    prop_oneof![
        Just(None),
        (0u32..5, 0u64..3, 0u64..4).prop_map(|(usage, queued, at)| Some(sample(
            f64::from(usage) / 4.0,
            queued * 100,
            at * 1000
        ))),
        Just(Some(sample(f64::NAN, 5, 0))),
    ]
}

fn an_update() -> impl Strategy<Value = Update> {
    let id = 0u32..12;
    prop_oneof![
        (id.clone(), 0u64..4, a_sample()).prop_map(|(id, in_flight, load)| Update::Set(Candidate {
            id,
            in_flight,
            load
        })),
        (id.clone(), 0u64..4).prop_map(|(id, n)| Update::InFlight(id, n)),
        (id.clone(), a_sample()).prop_map(|(id, load)| Update::Load(id, load)),
        id.prop_map(Update::Remove),
    ]
}

proptest! {
    /// Updated one worker at a time, the order is the order built at once from the workers as
    /// they now are: requests routed and finished, reports published and forgotten, workers gone.
    #[test]
    fn updates_keep_every_order_sorted_by_the_current_keys(
        updates in proptest::collection::vec(an_update(), 1..60)
    ) {
        let mut order = LoadOrder::default();
        let mut workers: HashMap<WorkerId, Candidate> = HashMap::new();
        for update in updates {
            match update {
                Update::Set(candidate) => {
                    order.set(candidate);
                    workers.insert(candidate.id, candidate);
                }
                Update::InFlight(id, in_flight) => {
                    order.set_in_flight(id, in_flight);
                    if let Some(c) = workers.get_mut(&id) {
                        c.in_flight = in_flight;
                    }
                }
                Update::Load(id, load) => {
                    order.set_load(id, load);
                    if let Some(c) = workers.get_mut(&id) {
                        c.load = load;
                    }
                }
                Update::Remove(id) => {
                    order.remove(id);
                    workers.remove(&id);
                }
            }
            assert_same_as_rebuilt(&order, &workers);
        }
    }
}

#[test]
fn a_request_routed_moves_its_worker_back_and_one_finished_moves_it_forward() {
    let mut order = LoadOrder::of((0..5).map(|id| Candidate { in_flight: u64::from(id), ..idle(id) }));
    let least = |order: &LoadOrder| -> Vec<WorkerId> {
        order.least_loaded(3, 0, &mut |_| true).into_iter().map(|(_, id)| id).collect()
    };
    assert_eq!(least(&order), [0, 1, 2]);
    order.set_in_flight(0, 9);
    assert_eq!(least(&order), [1, 2, 3]);
    assert_eq!(order.busiest(&mut |_| true), Some(0));
    order.set_in_flight(4, 0);
    assert_eq!(least(&order), [4, 1, 2]);
    order.set_in_flight(0, 1);
    assert_eq!(least(&order), [4, 0, 1], "ties on in flight: lower id first from start 0");
    order.remove(4);
    assert_eq!(least(&order), [0, 1, 2]);
    order.set_in_flight(77, 0);
    assert_eq!(order.len(), 4, "a worker not in the order is not added by a count");
}

#[test]
fn a_report_moves_its_worker_in_the_kv_orders_and_by_age() {
    let mut order = LoadOrder::of((0..4).map(idle));
    for id in 0..4 {
        order.set_load(id, Some(sample(0.5 - f64::from(id) / 10.0, 1000 - u64::from(id), 5_000)));
    }
    let ids = |found: Vec<((u64, u64), WorkerId)>| -> Vec<WorkerId> {
        found.into_iter().map(|(_, id)| id).collect()
    };
    assert_eq!(ids(order.coldest(2, 0, &mut |_| true)), [3, 2]);
    assert_eq!(ids(order.least_queued(2, 0, &mut |_| true)), [3, 2]);
    order.set_load(0, Some(sample(0.05, 10, 9_000)));
    assert_eq!(ids(order.coldest(2, 0, &mut |_| true)), [0, 3]);
    assert_eq!(ids(order.least_queued(2, 0, &mut |_| true)), [0, 3]);
    assert_eq!(order.fetched_before(6_000).collect::<Vec<_>>(), [1, 2, 3]);
    order.set_load(2, None);
    assert_eq!(order.fetched_before(10_000).collect::<Vec<_>>(), [1, 3, 0], "no sample: not by age");
    assert_eq!(ids(order.coldest(1, 0, &mut |_| true)), [2], "no sample is keyed as usage 0");
}

#[test]
fn equal_keys_rotate_from_the_start_and_skip_what_is_not_accepted() {
    let order = LoadOrder::of((0..100).map(idle));
    let least = |start: WorkerId, accept: &mut dyn FnMut(WorkerId) -> bool| -> Vec<WorkerId> {
        order.least_loaded(4, start, accept).into_iter().map(|(_, id)| id).collect()
    };
    assert_eq!(least(50, &mut |_| true), [50, 51, 52, 53]);
    assert_eq!(least(98, &mut |_| true), [98, 99, 0, 1]);
    assert_eq!(least(10, &mut |id| id % 2 == 1), [11, 13, 15, 17]);
    assert_eq!(least(0, &mut |id| id == 42), [42], "fewer than k accepted: all of them");
    let mut order = order;
    order.set_in_flight(7, 3);
    assert_eq!(order.busiest(&mut |_| true), Some(7));
    assert_eq!(order.busiest(&mut |id| id != 7), Some(99));
}

#[test]
fn draws_at_random_cover_the_order() {
    use rand::SeedableRng;
    let order = LoadOrder::of((0..10).map(idle));
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    let mut drawn: Vec<WorkerId> = (0..200).filter_map(|_| order.random(&mut rng)).collect();
    drawn.sort_unstable();
    drawn.dedup();
    assert_eq!(drawn, (0..10).collect::<Vec<_>>());
    assert_eq!(LoadOrder::default().random(&mut rng), None);
}
