//! The engines kv_aware predicts cheapest for a prompt none of them holds, named to a large
//! pool's candidate search ([`crate::Policy::favoured`]): the search's load orders see the
//! reported queue, KV usage and requests in flight, not kv_aware's predicted queue (the report's
//! queue plus what was routed there since, drained at the engine's learned rate) nor its learned
//! rates, so the engine kv_aware would choose on the whole pool can be outside a shortlist built
//! from them alone (87% of decisions as good at 10,000 workers with every engine's reports
//! learned).
//!
//! Each engine is keyed, when its report lands or a request is routed to it, by two times that do
//! not move with the clock: when its predicted prefill queue drains (`drained_s`, on the host's
//! clock in seconds), and its predicted cost once drained for a prompt of the pool's usual length
//! that it does not hold (`idle_s`: its own prefill at its rates, decode, KV pressure, stall). Its
//! cost at `now` is then about `max(drained_s, now) - now + idle_s`, so the engines are kept in
//! two orders, by `drained_s + idle_s` and by `idle_s`, and the cheapest few are found by walking
//! both fronts until no engine further on can be cheaper (a threshold walk: an engine not reached
//! has both keys at least the fronts'), at most [`WALK`] steps each.
//!
//! Kept only for a pool decided on shortlists (more than the search's threshold of workers):
//! small pools are decided on whole and pay nothing here.

use std::collections::{BTreeSet, HashMap};

use super::predict::{predict, EngineView, PredictSettings};
use super::rate::EngineRates;
use crate::inflight::RoutedLog;
use crate::{LoadSample, WorkerId};

/// Engines named to the search, by each of its two criteria (cheapest, cheapest drained).
pub(super) const FAVOURED: usize = 12;
/// Steps of each order's walk, at most.
const WALK: usize = 128;
/// The usual prompt length is followed as a moving average of this weight per request; the
/// keys are taken again when it has moved by more than [`REKEY_RATIO`] since they were taken.
const PROMPT_SMOOTHING: f64 = 0.01;
const REKEY_RATIO: f64 = 1.5;

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
}

impl Keyed {
    fn by_drained(&self, id: WorkerId) -> (u64, WorkerId) {
        (time_key(self.drained_s + self.idle_s), id)
    }

    fn by_idle(&self, id: WorkerId) -> (u64, WorkerId) {
        (time_key(self.idle_s), id)
    }

    /// The predicted cost's order at `now_s` (the cost plus `now_s`).
    fn at(&self, now_s: f64) -> f64 {
        self.drained_s.max(now_s) + self.idle_s
    }
}

/// The engines' keys and their two orders.
#[derive(Debug, Default)]
pub(super) struct Favoured {
    /// Each engine's latest report.
    reports: HashMap<WorkerId, LoadSample>,
    keyed: HashMap<WorkerId, Keyed>,
    by_drained: BTreeSet<(u64, WorkerId)>,
    by_idle: BTreeSet<(u64, WorkerId)>,
    /// Whether the pool is decided on shortlists (the keys are kept only then).
    kept: bool,
    /// The usual prompt's tokens (a moving average), and the value the keys were taken with.
    prompt_tokens: f64,
    keyed_prompt: f64,
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
        let p = &self.pool;
        self.kept.then(|| PoolKv {
            per_request: (p.running > 0.5 && p.used > 0.0).then(|| p.used / p.running),
            generated_share: (p.used > 0.0 && p.generated > 0.0).then(|| p.generated / p.used),
            finished_share: (p.finished_running > 0.5 && p.finished > 0.0)
                .then(|| p.finished / p.finished_running),
        })
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

    /// A request of `prompt_tokens` was routed to `worker` on a pool of `pool_size` routable
    /// workers, `shortlisted` or not: its keys taken again (every engine's when the pool has
    /// just become one decided on shortlists, or the fleet's rates or the usual prompt moved).
    pub(super) fn routed(&mut self, worker: WorkerId, prompt_tokens: f64, shortlisted: bool, inputs: &Inputs<'_>) {
        self.prompt_tokens = match self.prompt_tokens > 0.0 {
            true => self.prompt_tokens + PROMPT_SMOOTHING * (prompt_tokens - self.prompt_tokens),
            false => prompt_tokens,
        };
        if !shortlisted {
            if self.kept {
                *self = Favoured { reports: std::mem::take(&mut self.reports), ..Favoured::default() };
            }
            return;
        }
        let moved = |now: f64, then: f64| now > then * REKEY_RATIO || now * REKEY_RATIO < then;
        let rates = inputs.rates.fleet_rates();
        if !self.kept
            || rates != self.keyed_rates
            || moved(self.prompt_tokens.max(1.0), self.keyed_prompt.max(1.0))
        {
            self.kept = true;
            self.rekey_all(inputs);
        } else {
            self.rekey(worker, inputs);
        }
    }

    /// Every engine with a report keyed again.
    fn rekey_all(&mut self, inputs: &Inputs<'_>) {
        self.keyed_prompt = self.prompt_tokens;
        self.keyed_rates = inputs.rates.fleet_rates();
        self.keyed.clear();
        self.by_drained.clear();
        self.by_idle.clear();
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
        if let Some(old) = self.keyed.remove(&worker) {
            self.by_drained.remove(&old.by_drained(worker));
            self.by_idle.remove(&old.by_idle(worker));
        }
        let Some(load) = self.reports.get(&worker).filter(|load| load.token_usage.is_finite()) else {
            return;
        };
        let keyed = keys(worker, load, self.keyed_prompt, inputs);
        self.by_drained.insert(keyed.by_drained(worker));
        self.by_idle.insert(keyed.by_idle(worker));
        self.keyed.insert(worker, keyed);
    }

    /// `worker` left the pool; `finished` its learned finishing rate.
    pub(super) fn forget(&mut self, worker: WorkerId, finished: Option<f64>) {
        if let Some(old) = self.reports.remove(&worker) {
            self.pool.add(&old, finished, -1.0);
        }
        if let Some(old) = self.keyed.remove(&worker) {
            self.by_drained.remove(&old.by_drained(worker));
            self.by_idle.remove(&old.by_idle(worker));
        }
    }

    /// Up to `k` engines `accept`ed cheapest at `now_ms` by their keys, cheapest first, then up
    /// to `k` more cheapest among those whose queue has drained (none while the keys are not
    /// kept).
    pub(super) fn cheapest(&self, now_ms: u64, k: usize, accept: &dyn Fn(WorkerId) -> bool) -> Vec<WorkerId> {
        if !self.kept || k == 0 {
            return Vec::new();
        }
        let now_s = now_ms as f64 / 1000.0;
        let (mut drained, mut idle) = (self.by_drained.iter(), self.by_idle.iter());
        // The cheapest found so far, cheapest first, and every engine reached.
        let mut top: Vec<(f64, WorkerId)> = Vec::with_capacity(k + 1);
        let mut seen: Vec<WorkerId> = Vec::with_capacity(2 * WALK);
        for _ in 0..WALK {
            let (a, b) = (drained.next(), idle.next());
            if a.is_none() && b.is_none() {
                break;
            }
            for &(_, id) in a.into_iter().chain(b) {
                let Some(keyed) = self.keyed.get(&id).filter(|_| !seen.contains(&id) && accept(id)) else {
                    continue;
                };
                seen.push(id);
                let cost = keyed.at(now_s);
                if top.len() < k || cost < top[k - 1].0 {
                    let at = top.partition_point(|&(c, _)| c <= cost);
                    top.insert(at, (cost, id));
                    top.truncate(k);
                }
            }
            // An engine not reached has `drained + idle` at least the one front and `idle` at
            // least the other: its cost is at least the larger bound.
            let front = |entry: Option<&(u64, WorkerId)>| entry.and_then(|(_, id)| self.keyed.get(id));
            let bound = match (front(a), front(b)) {
                (Some(a), Some(b)) => (a.drained_s + a.idle_s).max(now_s + b.idle_s),
                _ => f64::INFINITY,
            };
            if top.len() == k && top[k - 1].0 <= bound {
                break;
            }
        }
        let mut cheapest: Vec<WorkerId> = top.into_iter().map(|(_, id)| id).collect();
        // And the cheapest of those drained now: with no prefill queued ahead, an engine is not
        // charged the duplicate's cost of a prefix every holder waits for KV to serve
        // (`relieve_waiting_holders`), so one a little costlier by the keys can be far cheaper.
        let drained = self
            .by_idle
            .iter()
            .take(WALK)
            .map(|&(_, id)| id)
            .filter(|&id| accept(id) && self.keyed.get(&id).is_some_and(|keyed| keyed.drained_s <= now_s))
            .filter(|id| !cheapest.contains(id))
            .take(k)
            .collect::<Vec<_>>();
        cheapest.extend(drained);
        cheapest
    }
}

/// `worker`'s keys: when its predicted queue drains and its cost once drained for a prompt of
/// `prompt_tokens` it does not hold, as kv_aware predicts them ([`predict`]; requests running:
/// the report's, or those routed there since when more; KV usage: the report's plus what those
/// take).
fn keys(worker: WorkerId, load: &LoadSample, prompt_tokens: f64, inputs: &Inputs<'_>) -> Keyed {
    let rates = inputs.rates.rates(worker);
    let per_ms = rates.prefill_tokens_per_sec.max(1e-9) / 1000.0;
    let (mut queue, mut at_ms) = (load.num_waiting_uncached_tokens as f64, load.fetched_at_ms);
    for (routed_at, tokens) in inputs.routed.entries(worker).filter(|&(t, _)| t >= load.fetched_at_ms) {
        queue = (queue - per_ms * routed_at.saturating_sub(at_ms) as f64).max(0.0) + tokens;
        at_ms = routed_at;
    }
    let drained_s = (at_ms as f64 + queue / per_ms) / 1000.0;
    let since = inputs.routed.sent_since(worker, load.fetched_at_ms);
    let running = load.num_running_reqs.max(since.requests as u64);
    let mut usage = load.token_usage;
    if load.max_total_num_tokens > 0 {
        usage += since.tokens / load.max_total_num_tokens as f64;
    }
    let view = EngineView {
        rates,
        queued: 0.0,
        uncached: prompt_tokens,
        context: 0.0,
        running,
        kv_usage: Some(usage.clamp(0.0, 1.0)),
        arrivals_per_sec: 0.0,
        kv_wait_s: 0.0,
    };
    Keyed { drained_s, idle_s: predict(inputs.settings, &view).cost() }
}

#[cfg(test)]
mod tests;
