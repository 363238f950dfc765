//! The engines kv_aware predicts cheapest for a prompt none of them holds, named to a large
//! pool's candidate search ([`crate::Policy::favoured`]): the search's load orders see the
//! reported queue, KV usage and requests in flight, not kv_aware's predicted queue (the report's
//! queue plus what was routed there since, drained at the engine's learned rate) nor its learned
//! rates, so the engine kv_aware would choose on the whole pool can be outside a shortlist built
//! from them alone (87% of decisions as good at 10,000 workers with every engine's reports
//! learned).
//!
//! Each engine is keyed, when its report lands or a request is routed to it, by what does not
//! move with the clock or the request: when its predicted prefill queue drains (`drained_s`, on
//! the host's clock in seconds), its predicted cost once drained for a request with nothing to
//! prefill (`idle_s`: decode, KV pressure, the wait for KV, its fixed cost) and what each uncached
//! prompt token adds to that cost (`slope_s`: its own prefill at its rate, the recompute and
//! stall charges, the wait for KV). For a request of `u` uncached tokens its cost at `now` is
//! about `max(drained_s, now) - now + idle_s + u x slope_s`, so the engines are kept in three
//! orders, by `drained_s + idle_s`, by `idle_s` and by `slope_s`, and the cheapest few are found
//! by walking the three fronts until no engine further on can be cheaper (a threshold walk: an
//! engine not reached has each key at least its order's front), at most [`WALK`] steps each; the
//! cheapest drained too, on a fourth order by the slope less the duplicate's charge, and a fifth
//! by `drained_s` whose front says when no engine left has drained (a few drained of 10,000 kept
//! every walk to its last step). The requests arriving behind it and the context's attention (kv_aware's
//! other terms) are left out of the keys.
//!
//! Kept only for a pool decided on shortlists (more than the search's threshold of workers):
//! small pools are decided on whole and pay nothing here.

use std::collections::BTreeMap;

use super::predict::{predict, EngineView, PredictSettings};
use super::rate::EngineRates;
use crate::inflight::RoutedLog;
use crate::{FavouredAsk, LoadSample, WorkerId, WorkerMap};

/// Engines named to the search, by each of its two criteria (cheapest, cheapest drained).
pub(super) const FAVOURED: usize = 12;
/// Steps of the orders' walks for one request, at most, over every group asked about.
const WALK: usize = 128;

/// A non-negative finite time as a key that orders as the time does.
fn time_key(seconds: f64) -> u64 {
    if seconds > 0.0 && seconds.is_finite() {
        seconds.to_bits()
    } else if seconds > 0.0 {
        u64::MAX
    } else {
        0
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Keyed {
    drained_s: f64,
    idle_s: f64,
    slope_s: f64,
    /// `slope_s` less the duplicate's charge (`--kv-aware-prefill-cost-weight` x its prefill),
    /// which a drained engine is not charged while every best holder waits for KV.
    relieved_slope_s: f64,
}

impl Keyed {
    /// The engine's entries in the five orders.
    fn entries(&self, id: WorkerId) -> [(u64, WorkerId); 5] {
        [
            (time_key(self.drained_s + self.idle_s), id),
            (time_key(self.idle_s), id),
            (time_key(self.slope_s), id),
            (time_key(self.relieved_slope_s), id),
            (time_key(self.drained_s), id),
        ]
    }

    /// The predicted cost's order at `now_s` for `uncached` tokens (the cost plus `now_s`).
    fn at(&self, now_s: f64, uncached: f64) -> f64 {
        self.drained_s.max(now_s) + self.idle_s + uncached * self.slope_s
    }

    /// The same, drained and relieved of the duplicate's charge.
    fn relieved(&self, now_s: f64, uncached: f64) -> f64 {
        now_s + self.idle_s + uncached * self.relieved_slope_s
    }
}

/// An engine with its cost by the keys.
type Costed = (f64, WorkerId);

/// The engines' keys and their five orders.
#[derive(Debug, Default)]
pub(super) struct Favoured {
    /// Each engine's latest report.
    reports: WorkerMap<LoadSample>,
    keyed: WorkerMap<Keyed>,
    /// By `drained_s + idle_s`, by `idle_s`, by `slope_s` and by `relieved_slope_s`, each with
    /// the keys (read by the walk without a look-up).
    orders: [BTreeMap<(u64, WorkerId), Keyed>; 5],
    /// Whether the pool is decided on shortlists (the keys are kept only then).
    kept: bool,
    /// The fleet's rates the keys were taken with ([`EngineRates::fleet_rates`]).
    keyed_rates: (f64, f64),
    /// The pool's KV terms over every engine's latest report, for a decision on a shortlist
    /// (whose own candidates, chosen for being cold or idle, would say otherwise).
    pool: PoolSums,
}

/// Sums over the engines' latest reports of what kv_aware's pool-wide KV terms read
/// ([`crate::kv_wait`]): KV in use and requests running (what a request holds), tokens generated
/// (the share freed per second), and the learned finishing rates with their engines' running
/// requests (the share finished per second).
#[derive(Clone, Copy, Debug, Default)]
struct PoolSums {
    used: f64,
    running: f64,
    generated: f64,
    finished: f64,
    finished_running: f64,
}

impl PoolSums {
    /// `sign` (1 or -1) times one engine's part.
    fn add(&mut self, load: &LoadSample, finished: Option<f64>, sign: f64) {
        if load.max_total_num_tokens > 0 && load.token_usage.is_finite() {
            let used = load.token_usage.clamp(0.0, 1.0) * load.max_total_num_tokens as f64;
            self.used += sign * used;
            self.running += sign * load.num_running_reqs as f64;
            if load.gen_throughput.is_finite() {
                self.generated += sign * load.gen_throughput.max(0.0);
            }
        }
        if let Some(rate) = finished.filter(|rate| rate.is_finite() && *rate > 0.0) {
            self.finished += sign * rate;
            self.finished_running += sign * load.num_running_reqs as f64;
        }
    }
}

/// The pool-wide KV terms of a decision on a shortlist: what a running request holds, the share
/// of KV in use freed per second by tokens generated, and by requests finished.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct PoolKv {
    pub per_request: Option<f64>,
    pub generated_share: Option<f64>,
    pub finished_share: Option<f64>,
}

/// What an engine's keys are computed from besides its report.
pub(super) struct Inputs<'a> {
    pub settings: &'a PredictSettings,
    pub rates: &'a EngineRates,
    pub routed: &'a RoutedLog,
}

impl Favoured {
    /// Whether the keys are kept (the pool is decided on shortlists).
    pub(super) fn kept(&self) -> bool {
        self.kept
    }

    /// The pool's KV terms over every engine's latest report (`None` while the keys are not kept).
    pub(super) fn pool_kv(&self) -> Option<PoolKv> {
        self.kept.then(|| self.pool_terms())
    }

    fn pool_terms(&self) -> PoolKv {
        let p = &self.pool;
        PoolKv {
            per_request: (p.running > 0.5 && p.used > 0.0).then(|| p.used / p.running),
            generated_share: (p.used > 0.0 && p.generated > 0.0).then(|| p.generated / p.used),
            finished_share: (p.finished_running > 0.5 && p.finished > 0.0)
                .then(|| p.finished / p.finished_running),
        }
    }

    /// `worker`'s latest report, `finished` its learned finishing rate before the report was
    /// observed; its keys taken again when they are kept.
    pub(super) fn report(
        &mut self,
        worker: WorkerId,
        load: LoadSample,
        finished: Option<f64>,
        inputs: &Inputs<'_>,
    ) {
        if let Some(old) = self.reports.insert(worker, load) {
            self.pool.add(&old, finished, -1.0);
        }
        self.pool.add(&load, inputs.rates.finished_per_sec_of(worker), 1.0);
        if self.kept {
            self.rekey(worker, inputs);
        }
    }

    /// A request was routed to `worker`, `shortlisted` or not: its keys taken again (every
    /// engine's when the pool has just become one decided on shortlists, or the fleet's rates
    /// moved).
    pub(super) fn routed(&mut self, worker: WorkerId, shortlisted: bool, inputs: &Inputs<'_>) {
        if !shortlisted {
            if self.kept {
                *self = Favoured { reports: std::mem::take(&mut self.reports), ..Favoured::default() };
            }
            return;
        }
        if !self.kept || inputs.rates.fleet_rates() != self.keyed_rates {
            self.kept = true;
            self.rekey_all(inputs);
        } else {
            self.rekey(worker, inputs);
        }
    }

    /// Every engine keyed again if the fleet's rates moved since the keys were taken (while they
    /// are kept): called where the rates learn from reports and answers, so that the request
    /// sent next does not re-key 10,000 engines on its own decision's path.
    pub(super) fn rates_learned(&mut self, inputs: &Inputs<'_>) {
        if self.kept && inputs.rates.fleet_rates() != self.keyed_rates {
            self.rekey_all(inputs);
        }
    }

    /// Every engine with a report keyed again, and the pool's sums taken again.
    fn rekey_all(&mut self, inputs: &Inputs<'_>) {
        self.keyed_rates = inputs.rates.fleet_rates();
        self.keyed.clear();
        self.orders.iter_mut().for_each(BTreeMap::clear);
        self.pool = PoolSums::default();
        let workers: Vec<WorkerId> = self.reports.keys().copied().collect();
        for worker in workers {
            let finished = inputs.rates.finished_per_sec_of(worker);
            if let Some(load) = self.reports.get(&worker) {
                self.pool.add(load, finished, 1.0);
            }
            self.rekey(worker, inputs);
        }
    }

    /// `worker` keyed again from its report, what was routed there since and its rates.
    pub(super) fn rekey(&mut self, worker: WorkerId, inputs: &Inputs<'_>) {
        self.unkey(worker);
        let Some(load) = self.reports.get(&worker).filter(|load| load.token_usage.is_finite()) else {
            return;
        };
        let keyed = keys(worker, load, inputs, self.pool_terms());
        for (order, entry) in self.orders.iter_mut().zip(keyed.entries(worker)) {
            order.insert(entry, keyed);
        }
        self.keyed.insert(worker, keyed);
    }

    fn unkey(&mut self, worker: WorkerId) {
        if let Some(old) = self.keyed.remove(&worker) {
            for (order, entry) in self.orders.iter_mut().zip(old.entries(worker)) {
                order.remove(&entry);
            }
        }
    }

    /// `worker` left the pool; `finished` its learned finishing rate.
    pub(super) fn forget(&mut self, worker: WorkerId, finished: Option<f64>) {
        if let Some(old) = self.reports.remove(&worker) {
            self.pool.add(&old, finished, -1.0);
        }
        self.unkey(worker);
    }

    /// Up to `k` engines cheapest at `now_ms` by their keys over every group of `asks`, each
    /// engine with the uncached tokens its group gives it, cheapest first, then up to `k` more
    /// cheapest among those whose queue has drained (none while the keys are not kept). With no
    /// prefill queued ahead, an engine is not charged the duplicate's cost of a prefix every
    /// holder waits for KV to serve (`relieve_waiting_holders`), so one a little costlier by the
    /// keys can be far cheaper.
    ///
    /// The groups are taken one after the other, the cheapest so far kept across them: a listed
    /// group is costed engine by engine; any other is a threshold walk of the five orders, bound
    /// by its own fewest uncached tokens, which stops as soon as no engine further on can beat
    /// the `k`-th cheapest found over the groups so far (a group that cannot is left after one
    /// step), at most [`WALK`] steps over every group. Asked with the fewest uncached tokens first (the prompt's
    /// most credited holders), a group that cannot come near them is left at once.
    pub(super) fn cheapest(&self, now_ms: u64, asks: &[FavouredAsk<'_>], k: usize) -> Vec<WorkerId> {
        self.cheapest_within(now_ms, asks, k, WALK)
    }

    /// [`Favoured::cheapest`] with `walk` steps at most.
    fn cheapest_within(&self, now_ms: u64, asks: &[FavouredAsk<'_>], k: usize, walk: usize) -> Vec<WorkerId> {
        if !self.kept || k == 0 {
            return Vec::new();
        }
        let now_s = now_ms as f64 / 1000.0;
        let mut found = Cheapest { k, top: Vec::new(), drained: Vec::new() };
        // The walks' steps, over every group asked.
        let mut steps = walk;
        for ask in asks {
            match ask.listed {
                Some(listed) => {
                    for &id in listed {
                        if let (Some(keyed), Some(tokens)) = (self.keyed.get(&id), (ask.uncached)(id)) {
                            found.offer(id, keyed, now_s, tokens.max(ask.least_uncached.max(0.0)));
                        }
                    }
                }
                None => self.walk(now_s, ask, &mut found, &mut steps),
            }
        }
        let mut cheapest: Vec<WorkerId> = found.top.into_iter().map(|(_, id)| id).collect();
        for (_, id) in found.drained {
            if !cheapest.contains(&id) {
                cheapest.push(id);
            }
        }
        cheapest
    }

    /// The threshold walk of the five orders for the engines of `ask` (see [`Favoured::cheapest`]).
    fn walk(&self, now_s: f64, ask: &FavouredAsk<'_>, found: &mut Cheapest, steps: &mut usize) {
        let least = ask.least_uncached.max(0.0);
        let mut walks = self.orders.each_ref().map(|order| order.iter());
        while *steps > 0 {
            *steps -= 1;
            let fronts = walks.each_mut().map(|walk| walk.next().map(|(&(_, id), keyed)| (id, keyed)));
            // An engine not reached has each key at least its order's front, and a queue's part
            // of at least 0: its cost is at least the bound.
            let [Some((_, a)), Some((_, b)), Some((_, c)), Some((_, d)), Some((_, e))] = fronts else {
                for (id, keyed) in fronts.into_iter().flatten() {
                    if let Some(tokens) = (ask.uncached)(id) {
                        found.offer(id, keyed, now_s, tokens.max(least));
                    }
                }
                break;
            };
            let bound = (a.drained_s + a.idle_s).max(now_s + b.idle_s) + least * c.slope_s;
            // Past the drained order's front, no engine has drained: none left to find there.
            let relieved_bound = match e.drained_s > now_s {
                true => f64::INFINITY,
                false => now_s + b.idle_s + least * d.relieved_slope_s,
            };
            // Fronts at or past the bound already found are no better: the walk ends before
            // looking them up.
            if found.done(bound, relieved_bound) {
                break;
            }
            for (id, keyed) in fronts.into_iter().flatten() {
                if let Some(tokens) = (ask.uncached)(id) {
                    found.offer(id, keyed, now_s, tokens.max(least));
                }
            }
            if found.done(bound, relieved_bound) {
                break;
            }
        }
    }
}

/// The cheapest engines found so far, cheapest first: of all, and of those drained (relieved of
/// the duplicate's charge).
struct Cheapest {
    k: usize,
    top: Vec<Costed>,
    drained: Vec<Costed>,
}

impl Cheapest {
    fn offer(&mut self, id: WorkerId, keyed: &Keyed, now_s: f64, tokens: f64) {
        let k = self.k;
        let keep = |top: &mut Vec<Costed>, cost: f64| {
            if (top.len() < k || cost < top[k - 1].0) && !top.iter().any(|&(_, kept)| kept == id) {
                let at = top.partition_point(|&(c, _)| c <= cost);
                top.insert(at, (cost, id));
                top.truncate(k);
            }
        };
        keep(&mut self.top, keyed.at(now_s, tokens));
        if keyed.drained_s <= now_s {
            keep(&mut self.drained, keyed.relieved(now_s, tokens));
        }
    }

    /// Whether no engine costing at least `bound` (at least `relieved_bound` drained, infinite
    /// when none left is drained) can be among the cheapest.
    fn done(&self, bound: f64, relieved_bound: f64) -> bool {
        let full = |top: &Vec<Costed>, bound: f64| top.len() == self.k && top[self.k - 1].0 <= bound;
        full(&self.top, bound) && (relieved_bound == f64::INFINITY || full(&self.drained, relieved_bound))
    }
}

/// `worker`'s keys: when its predicted queue drains, and its cost once drained (as kv_aware
/// predicts it, [`predict`]; requests running: the report's, or those routed there since when
/// more; KV usage: the report's plus what those take; the wait for KV on the pool's terms `pool`)
/// for a request with nothing to prefill and what each uncached token adds (the wait for KV is
/// not linear in them: its slope over [`SLOPE_TOKENS`]).
fn keys(worker: WorkerId, load: &LoadSample, inputs: &Inputs<'_>, pool: PoolKv) -> Keyed {
    let rates = inputs.rates.rates(worker);
    let per_ms = rates.prefill_tokens_per_sec.max(1e-9) / 1000.0;
    let (mut queue, mut at_ms) = (load.num_waiting_uncached_tokens as f64, load.fetched_at_ms);
    let log = inputs.routed.of(worker);
    for (routed_at, tokens) in log.entries().filter(|&(t, _)| t >= load.fetched_at_ms) {
        queue = (queue - per_ms * routed_at.saturating_sub(at_ms) as f64).max(0.0) + tokens;
        at_ms = routed_at;
    }
    let drained_s = (at_ms as f64 + queue / per_ms) / 1000.0;
    let since = log.sent_since(load.fetched_at_ms);
    let running = load.num_running_reqs.max(since.requests as u64);
    let mut usage = load.token_usage;
    if load.max_total_num_tokens > 0 {
        usage += since.tokens / load.max_total_num_tokens as f64;
    }
    let per_request = pool.per_request.unwrap_or(0.0);
    let freed_share = super::pool_freed_share(pool.generated_share, pool.finished_share);
    let cost = |uncached: f64| {
        let kv_wait_s = super::kv_wait_s(Some(load), since, per_request, freed_share, rates, uncached);
        let view = EngineView {
            rates,
            queued: 0.0,
            uncached,
            context: 0.0,
            running,
            kv_usage: Some(usage.clamp(0.0, 1.0)),
            arrivals_per_sec: 0.0,
            kv_wait_s,
        };
        predict(inputs.settings, &view).cost()
    };
    // Linear in the uncached tokens with no arrivals and no context: the slope from two points.
    let idle_s = cost(0.0);
    let slope_s = ((cost(SLOPE_TOKENS) - idle_s) / SLOPE_TOKENS).max(0.0);
    let charge = inputs.settings.prefill_cost_weight / rates.prefill_tokens_per_sec.max(1e-9);
    Keyed { drained_s, idle_s, slope_s, relieved_slope_s: (slope_s - charge).max(0.0) }
}

/// The uncached tokens the slope of an engine's cost is measured over.
const SLOPE_TOKENS: f64 = 1000.0;

#[cfg(test)]
mod tests;
