//! A large pool's load order, kept by its host: every worker's requests in flight and last load
//! sample in the orders the candidate search reads (least loaded, coldest, least queued, oldest
//! sample), updated when one worker's load changes (a request routed or finished, a load report
//! published) instead of rebuilt for every decision. The search then finds the candidates that
//! can matter by walking the front (or the back) of each order, in time that does not grow with
//! the pool ([`crate::shortlist`]).
//!
//! The keys are those of the one-pass search over an offer: fewest in flight, then lowest KV
//! usage, then least prefill queued; lowest KV usage; least queued. A worker without a usable
//! sample (none, or a non-finite usage) is keyed as the one-pass keys it, usage and queue 0. A
//! sample that has gone stale since it was keyed (time passes, the key does not change) is found
//! through the oldest-sample order instead and keyed again by the search.

use std::collections::BTreeSet;
use std::ops::Bound::{Excluded, Unbounded};

use kvgate_policy::{Candidate, LoadSample, WorkerId, WorkerMap};
use rand::{Rng, RngCore};

/// A float key of a non-negative finite value: its bits order as the value does.
fn float_key(value: f64) -> u64 {
    if value > 0.0 {
        value.to_bits()
    } else {
        0
    }
}

/// The sample a key is taken from: one with a finite KV usage.
fn usable(candidate: &Candidate) -> Option<&LoadSample> {
    candidate.load.as_ref().filter(|load| load.token_usage.is_finite())
}

/// When `candidate`'s usable sample was fetched (the oldest-sample order's key).
fn age(candidate: &Candidate) -> Option<u64> {
    usable(candidate).map(|load| load.fetched_at_ms)
}

/// `(in flight, KV usage, queued)`: the least-loaded order's key.
pub(crate) type LeastKey = (u64, u64, u64);

/// A worker's keys in the least-loaded, coldest (usage, in flight) and least-queued (queued, in
/// flight) orders.
pub(crate) type Keys = (LeastKey, (u64, u64), (u64, u64));

/// The keys of `candidate` in the three load orders, as a search keys it while its sample is fresh.
pub(crate) fn keys(candidate: &Candidate) -> Keys {
    let usage = usable(candidate).map_or(0, |load| float_key(load.token_usage));
    let queued = usable(candidate).map_or(0, |load| load.num_waiting_uncached_tokens);
    let in_flight = candidate.in_flight;
    ((in_flight, usage, queued), (usage, in_flight), (queued, in_flight))
}

/// The keys of a worker whose sample is stale: as if it had none.
pub(crate) fn stale_keys(in_flight: u64) -> Keys {
    ((in_flight, 0, 0), (0, in_flight), (0, in_flight))
}

/// Every worker of a pool in the orders of the candidate search. Not thread-safe by itself: the
/// host keeps it beside what it orders (behind the lock its updates take).
#[derive(Clone, Debug, Default)]
pub struct LoadOrder {
    /// Each worker as last set, and its place in `ids`.
    workers: WorkerMap<(Candidate, usize)>,
    /// Every worker, for draws at random.
    ids: Vec<WorkerId>,
    least: BTreeSet<(LeastKey, WorkerId)>,
    coldest: BTreeSet<((u64, u64), WorkerId)>,
    least_queued: BTreeSet<((u64, u64), WorkerId)>,
    /// Workers with a usable sample, by when it was fetched.
    by_age: BTreeSet<(u64, WorkerId)>,
}

impl LoadOrder {
    /// The order of `candidates` (one entry per worker; a later one replaces an earlier).
    pub fn of(candidates: impl IntoIterator<Item = Candidate>) -> Self {
        let mut order = LoadOrder::default();
        for candidate in candidates {
            order.set(candidate);
        }
        order
    }

    /// The workers in the order.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The worker as last set.
    pub fn get(&self, worker: WorkerId) -> Option<&Candidate> {
        self.workers.get(&worker).map(|(candidate, _)| candidate)
    }

    /// Adds `candidate`'s worker, or moves it to its new keys. Only the orders whose key changed
    /// are touched: a sample stamped again with the same load (the load monitor carries a quiet
    /// engine's sample forward) moves the worker in the oldest-sample order alone.
    pub fn set(&mut self, candidate: Candidate) {
        match self.workers.get(&candidate.id) {
            Some((old, _)) if *old == candidate => (),
            Some(&(old, at)) => {
                self.workers.insert(candidate.id, (candidate, at));
                let ((old_least, old_coldest, old_queued), new) = (keys(&old), keys(&candidate));
                if (old_least, old_coldest, old_queued) != new {
                    let id = candidate.id;
                    self.least.remove(&(old_least, id));
                    self.coldest.remove(&(old_coldest, id));
                    self.least_queued.remove(&(old_queued, id));
                    self.least.insert((new.0, id));
                    self.coldest.insert((new.1, id));
                    self.least_queued.insert((new.2, id));
                }
                let (old_age, new_age) = (age(&old), age(&candidate));
                if old_age != new_age {
                    if let Some(at) = old_age {
                        self.by_age.remove(&(at, old.id));
                    }
                    if let Some(at) = new_age {
                        self.by_age.insert((at, candidate.id));
                    }
                }
            }
            None => {
                self.workers.insert(candidate.id, (candidate, self.ids.len()));
                self.ids.push(candidate.id);
                self.key(&candidate);
            }
        }
    }

    /// A request routed to or finished on `worker` (no change for a worker not in the order).
    pub fn set_in_flight(&mut self, worker: WorkerId, in_flight: u64) {
        if let Some(&(candidate, _)) = self.workers.get(&worker) {
            self.set(Candidate { in_flight, ..candidate });
        }
    }

    /// A load report published for `worker`, or its sample forgotten (no change for a worker
    /// not in the order).
    pub fn set_load(&mut self, worker: WorkerId, load: Option<LoadSample>) {
        if let Some(&(candidate, _)) = self.workers.get(&worker) {
            self.set(Candidate { load, ..candidate });
        }
    }

    /// `worker` left the pool.
    pub fn remove(&mut self, worker: WorkerId) {
        let Some((old, at)) = self.workers.remove(&worker) else { return };
        self.unkey(&old);
        self.ids.swap_remove(at);
        if let Some(&moved) = self.ids.get(at) {
            if let Some(entry) = self.workers.get_mut(&moved) {
                entry.1 = at;
            }
        }
    }

    fn key(&mut self, candidate: &Candidate) {
        let (least, coldest, queued) = keys(candidate);
        self.least.insert((least, candidate.id));
        self.coldest.insert((coldest, candidate.id));
        self.least_queued.insert((queued, candidate.id));
        if let Some(at) = age(candidate) {
            self.by_age.insert((at, candidate.id));
        }
    }

    fn unkey(&mut self, candidate: &Candidate) {
        let (least, coldest, queued) = keys(candidate);
        self.least.remove(&(least, candidate.id));
        self.coldest.remove(&(coldest, candidate.id));
        self.least_queued.remove(&(queued, candidate.id));
        if let Some(at) = age(candidate) {
            self.by_age.remove(&(at, candidate.id));
        }
    }

    /// A worker drawn at random (`None` for an empty order).
    pub(crate) fn random(&self, rng: &mut dyn RngCore) -> Option<WorkerId> {
        (!self.ids.is_empty()).then(|| self.ids[rng.random_range(0..self.ids.len())])
    }

    /// Up to `k` accepted workers of the least-loaded order, from its front.
    pub(crate) fn least_loaded(
        &self,
        k: usize,
        start: WorkerId,
        accept: &mut dyn FnMut(WorkerId) -> bool,
    ) -> Vec<(LeastKey, WorkerId)> {
        smallest(&self.least, k, start, accept)
    }

    /// Up to `k` accepted workers of the least-loaded order, from its front, looking at no more
    /// than `limit` workers: `None` when the limit was reached first (with fewer than `k` found
    /// and the order not walked to its end).
    pub(crate) fn least_loaded_within(
        &self,
        k: usize,
        start: WorkerId,
        limit: usize,
        accept: &mut dyn FnMut(WorkerId) -> bool,
    ) -> Option<Vec<(LeastKey, WorkerId)>> {
        smallest_within(&self.least, k, start, limit, accept)
    }

    /// Up to `k` accepted workers of the lowest KV usage.
    pub(crate) fn coldest(
        &self,
        k: usize,
        start: WorkerId,
        accept: &mut dyn FnMut(WorkerId) -> bool,
    ) -> Vec<((u64, u64), WorkerId)> {
        smallest(&self.coldest, k, start, accept)
    }

    /// Up to `k` accepted workers of the least prefill queued.
    pub(crate) fn least_queued(
        &self,
        k: usize,
        start: WorkerId,
        accept: &mut dyn FnMut(WorkerId) -> bool,
    ) -> Vec<((u64, u64), WorkerId)> {
        smallest(&self.least_queued, k, start, accept)
    }

    /// The accepted worker with the most requests in flight.
    pub(crate) fn busiest(&self, accept: &mut dyn FnMut(WorkerId) -> bool) -> Option<WorkerId> {
        self.least.iter().rev().map(|&(_, id)| id).find(|&id| accept(id))
    }

    /// The workers whose usable sample was fetched before `before_ms`, oldest first.
    pub(crate) fn fetched_before(&self, before_ms: u64) -> impl Iterator<Item = WorkerId> + '_ {
        self.by_age.range(..(before_ms, WorkerId::MIN)).map(|&(_, id)| id)
    }
}

/// Up to `k` accepted entries of `set` from its front. Within a group of equal keys the walk
/// starts at the worker id `start` and wraps around, so that a decision's random `start`
/// rotates equal workers (10,000 idle engines are not always the same first 16).
fn smallest<K: Ord + Copy>(
    set: &BTreeSet<(K, WorkerId)>,
    k: usize,
    start: WorkerId,
    accept: &mut dyn FnMut(WorkerId) -> bool,
) -> Vec<(K, WorkerId)> {
    smallest_within(set, k, start, usize::MAX, accept).unwrap_or_default()
}

/// [`smallest`], looking at no more than `limit` entries: `None` when the limit was reached
/// with fewer than `k` found and entries left.
fn smallest_within<K: Ord + Copy>(
    set: &BTreeSet<(K, WorkerId)>,
    k: usize,
    start: WorkerId,
    limit: usize,
    accept: &mut dyn FnMut(WorkerId) -> bool,
) -> Option<Vec<(K, WorkerId)>> {
    let mut found = Vec::with_capacity(k);
    let mut looked = 0;
    let mut group = set.first().map(|&(key, _)| key);
    while let Some(key) = group {
        if found.len() >= k {
            break;
        }
        let from_start = set.range((key, start)..=(key, WorkerId::MAX));
        let wrapped = set.range((key, WorkerId::MIN)..(key, start));
        for &(key, id) in from_start.chain(wrapped) {
            if looked == limit {
                return None;
            }
            looked += 1;
            if accept(id) {
                found.push((key, id));
                if found.len() == k {
                    return Some(found);
                }
            }
        }
        group = set.range((Excluded((key, WorkerId::MAX)), Unbounded)).next().map(|&(key, _)| key);
    }
    Some(found)
}

#[cfg(test)]
mod tests;
