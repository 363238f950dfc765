//! The wait for KV: whether an engine can admit a request now, and else how long it waits there
//! for the KV it needs. A request needs KV beyond what is cached (its uncached prompt) and for
//! its decode (its answer's tokens): a sample of a prompt the engine holds costs no prefill but
//! still takes a decode slot and KV. On an engine whose KV is taken, the requests ahead of it
//! (waiting at the engine's last report, and routed there since) are admitted only as running
//! requests finish and free theirs.
//!
//! What the load report gives, per engine: KV in use (`token_usage` x `max_total_num_tokens`),
//! running and waiting requests, and the tokens generated per second. The model:
//! - a request holds about the KV in use over the running requests (over the pool's fresh
//!   reports, so one engine with one long prompt running does not make every request look long):
//!   its cached prompt's share, its uncached prompt and its answer. A request routed or waiting
//!   needs that much, or its uncached prompt when that is larger (the mean already counts a
//!   mean prompt: adding the two would count a prompt twice);
//! - KV is freed about as fast as tokens are generated: each running request frees what it holds
//!   when its last token is out, and holds at least its answer's tokens, so tokens freed per
//!   second are at least the tokens generated per second (the same when the prompt is cached,
//!   more when it is not: a lower bound of the rate, so an upper bound of the wait). The share of
//!   the KV in use freed per second is the pool's (tokens generated over KV in use, over the
//!   fresh reports), and an engine whose KV is taken frees that share of its capacity: its own
//!   throughput says how many requests it runs now, not how fast the ones waiting will get KV
//!   (an engine running two requests, its KV promised to a burst routed since, would look as if
//!   it freed KV a hundred times slower than a busy one, and the busy one would get the burst).
//!   Engines busy with prefill generate almost nothing for a while (prefill goes first), which
//!   says nothing of how fast their requests will finish: the rate is never taken below the
//!   fallback throughput. Where the finishing rates are learned (kv_aware,
//!   [`kv_finished_share`]), the share of the pool's running requests finished per second is
//!   the better estimate (a finished request frees its prompt and its answer: the tokens
//!   generated alone predicted the wait 3-12x too long wherever KV ran short), the tokens
//!   generated its lower bound;
//! - the wait is the KV the requests ahead and this one need beyond the free KV, over that rate.

use crate::inflight::Sent;
use crate::LoadSample;

/// One engine's KV as a request routed there now would find it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvView {
    /// KV capacity in tokens.
    pub capacity: f64,
    /// KV taken: in use at the report, plus what the requests routed since need.
    pub taken: f64,
    /// KV the requests waiting at the report need.
    pub queued: f64,
    /// KV tokens a request holds there (prompt share and answer).
    pub per_request: f64,
    /// KV tokens freed per second (the pool's freed share of the capacity).
    pub freed_per_sec: f64,
}

/// What the pool's fresh reports say of the share of the KV in use freed per second: tokens
/// generated per second over the KV in use (`None` when no report shows both).
pub fn kv_freed_share<'a>(loads: impl IntoIterator<Item = &'a LoadSample>) -> Option<f64> {
    let (mut used, mut generated) = (0.0, 0.0);
    for load in loads {
        if load.max_total_num_tokens > 0 && load.token_usage.is_finite() && load.gen_throughput.is_finite() {
            used += load.token_usage.clamp(0.0, 1.0) * load.max_total_num_tokens as f64;
            generated += load.gen_throughput.max(0.0);
        }
    }
    (used > 0.0 && generated > 0.0).then(|| generated / used)
}

/// The share of its running requests an engine of the pool finishes per second: the requests
/// finished per second over the running ones, summed over `engines` (each its fresh report and
/// its learned finishing rate; `None` when none runs a request or none has a rate). A full
/// engine holds `capacity / per_request` requests, so it frees this share of its capacity a
/// second (Little's law: a request frees all it holds when it finishes).
pub fn kv_finished_share<'a>(
    engines: impl IntoIterator<Item = (&'a LoadSample, Option<f64>)>,
) -> Option<f64> {
    let (mut running, mut finished) = (0.0, 0.0);
    for (load, finished_per_sec) in engines {
        if let Some(rate) = finished_per_sec.filter(|rate| rate.is_finite() && *rate > 0.0) {
            running += load.num_running_reqs as f64;
            finished += rate;
        }
    }
    (running > 0.0 && finished > 0.0).then(|| finished / running)
}

/// What the pool's fresh reports say a running request holds: their KV in use over their
/// running requests (`None` when no report shows a running request).
pub fn kv_per_request<'a>(loads: impl IntoIterator<Item = &'a LoadSample>) -> Option<f64> {
    let (mut used, mut running) = (0.0, 0u64);
    for load in loads {
        if load.max_total_num_tokens > 0 && load.token_usage.is_finite() {
            used += load.token_usage.clamp(0.0, 1.0) * load.max_total_num_tokens as f64;
            running += load.num_running_reqs;
        }
    }
    (running > 0 && used > 0.0).then(|| used / running as f64)
}

/// Whether the requests waiting on the engine of `load` wait for KV rather than for prefill: they
/// need more than the free KV, each what the engine's running requests hold on average (its KV in
/// use over its running requests). Its queued prefill then drains only as running requests
/// finish, not at the prefill rate. `false` when the report does not say (no capacity, nothing
/// waiting or running).
pub fn waits_for_kv(load: &LoadSample) -> bool {
    if load.max_total_num_tokens == 0 || !load.token_usage.is_finite() || load.num_waiting_reqs == 0 {
        return false;
    }
    let own = LoadSample { gen_throughput: 0.0, ..*load };
    let Some(per_request) = kv_per_request([&own]) else { return false };
    KvView::of(load, Sent::default(), per_request, None, 1.0).is_some_and(|view| !view.admits(0.0))
}

impl KvView {
    /// The engine's KV from its fresh report `load`, what was routed there since (`since`, its
    /// tokens already the uncached estimate), `per_request` (see [`kv_per_request`]), the pool's
    /// `freed_share` (see [`kv_freed_share`]) and `fallback_freed_per_sec`, the least rate (and
    /// the rate when the pool gives none). `None` when the report does not give the capacity.
    pub fn of(
        load: &LoadSample,
        since: Sent,
        per_request: f64,
        freed_share: Option<f64>,
        fallback_freed_per_sec: f64,
    ) -> Option<Self> {
        if load.max_total_num_tokens == 0 || !load.token_usage.is_finite() {
            return None;
        }
        let capacity = load.max_total_num_tokens as f64;
        let per_request = per_request.max(1.0);
        let in_use = load.token_usage.clamp(0.0, 1.0) * capacity;
        let freed_per_sec =
            freed_share.map_or(fallback_freed_per_sec, |share| share * capacity).max(fallback_freed_per_sec);
        Some(Self {
            capacity,
            taken: in_use + since.tokens.max(since.requests * per_request),
            queued: load.num_waiting_reqs as f64 * per_request,
            per_request,
            freed_per_sec: freed_per_sec.max(1e-9),
        })
    }

    /// The KV a request with `uncached` prompt tokens there needs: what a request holds, or its
    /// uncached prompt when larger.
    pub fn need(&self, uncached: f64) -> f64 {
        uncached.max(self.per_request)
    }

    /// KV tokens that must be freed before a request needing `need` is admitted (0: it fits now).
    pub fn shortfall(&self, need: f64) -> f64 {
        (self.taken + self.queued + need - self.capacity).max(0.0)
    }

    /// Whether a request needing `need` is admitted now (nothing ahead of it waits for KV, and
    /// its own fits).
    pub fn admits(&self, need: f64) -> bool {
        self.shortfall(need) <= 0.0
    }

    /// Seconds until enough KV is freed for a request needing `need`.
    pub fn wait_s(&self, need: f64) -> f64 {
        self.shortfall(need) / self.freed_per_sec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(usage: f64, running: u64, waiting: u64, gen: f64) -> LoadSample {
        LoadSample {
            token_usage: usage,
            num_running_reqs: running,
            num_waiting_reqs: waiting,
            gen_throughput: gen,
            max_total_num_tokens: 100_000,
            ..LoadSample::default()
        }
    }

    #[test]
    fn a_full_engine_admits_each_waiting_request_as_one_running_request_finishes() {
        let full = load(1.0, 50, 10, 1_000.0);
        let per_request = kv_per_request([&full]).unwrap();
        assert_eq!(per_request, 2_000.0);
        // 1,000 tokens a second generated over 100,000 in use: a hundredth freed each second.
        let share = kv_freed_share([&full]);
        assert_eq!(share, Some(0.01));
        let view = KvView::of(&full, Sent::default(), per_request, share, 500.0).unwrap();
        let need = view.need(0.0);
        assert!(!view.admits(need));
        // Ten ahead and this one: 11 x 2,000 tokens at 1,000 tokens a second.
        assert_eq!(view.wait_s(need), 22.0);
        // Routed since the report: counted in requests, though their prompts are cached.
        let later =
            KvView::of(&full, Sent { requests: 5.0, tokens: 0.0 }, per_request, share, 500.0).unwrap();
        assert_eq!(later.wait_s(need), 32.0);
        // A long uncached prompt needs its own length, not the mean request's on top.
        assert_eq!(view.wait_s(view.need(8_000.0)), 28.0);
    }

    #[test]
    fn an_engine_with_room_admits_until_what_was_routed_since_fills_it() {
        let half = load(0.5, 10, 0, 1_000.0);
        let share = kv_freed_share([&half]);
        let view = KvView::of(&half, Sent::default(), 5_000.0, share, 500.0).unwrap();
        assert!(view.admits(view.need(20_000.0)));
        assert_eq!(view.wait_s(view.need(20_000.0)), 0.0);
        let since = Sent { requests: 9.0, tokens: 10_000.0 };
        let filled = KvView::of(&half, since, 5_000.0, share, 500.0).unwrap();
        // 50,000 in use + 45,000 for the nine routed since (their 10,000 prompt tokens within
        // what nine requests hold): a request of 5,000 waits for 0 tokens; one of 6,000 for
        // 1,000, at a fiftieth of the capacity a second (1,000 generated over 50,000 in use).
        assert!(filled.admits(filled.need(0.0)));
        assert!(!filled.admits(filled.need(6_000.0)));
        assert_eq!(filled.wait_s(filled.need(6_000.0)), 0.5);
        // Without throughput reported anywhere in the pool, the fallback rate.
        let quiet = load(0.5, 10, 0, 0.0);
        assert_eq!(kv_freed_share([&quiet]), None);
        let quiet = KvView::of(&quiet, since, 5_000.0, None, 500.0).unwrap();
        assert_eq!(quiet.wait_s(quiet.need(6_000.0)), 2.0);
        // Nor below it when the pool generates little (its engines busy with prefill).
        let slow = KvView::of(&half, since, 5_000.0, Some(1e-6), 500.0).unwrap();
        assert_eq!(slow.freed_per_sec, 500.0);
    }

    #[test]
    fn an_engine_running_little_frees_kv_as_fast_as_a_busy_one_once_taken() {
        // The idle engine's KV was promised to a burst routed since its report; the busy one is
        // full of its own. The same shortfall waits the same there: the idle engine's two
        // running requests do not say how fast the burst's requests will finish.
        let (idle, busy) = (load(0.05, 2, 0, 150.0), load(0.95, 60, 0, 2_150.0));
        let share = kv_freed_share([&idle, &busy]);
        let burst = Sent { requests: 9.0, tokens: 0.0 };
        let idle = KvView::of(&idle, burst, 10_000.0, share, 500.0).unwrap();
        let busy = KvView::of(&busy, Sent::default(), 10_000.0, share, 500.0).unwrap();
        assert_eq!(idle.shortfall(idle.need(0.0)), busy.shortfall(busy.need(0.0)));
        assert_eq!(idle.wait_s(idle.need(0.0)), busy.wait_s(busy.need(0.0)));
    }

    #[test]
    fn waiting_requests_wait_for_kv_when_what_they_need_exceeds_the_free_kv() {
        // 90,000 in use by 30 running: 3,000 each. Three waiting need 9,000 of the 10,000 free.
        assert!(!waits_for_kv(&load(0.9, 30, 3, 1_000.0)));
        // Four need 12,000.
        assert!(waits_for_kv(&load(0.9, 30, 4, 1_000.0)));
        // Nothing waiting, nothing running, or no capacity: the report does not say.
        assert!(!waits_for_kv(&load(1.0, 30, 0, 1_000.0)));
        assert!(!waits_for_kv(&load(1.0, 0, 5, 1_000.0)));
        assert!(!waits_for_kv(&LoadSample { max_total_num_tokens: 0, ..load(1.0, 30, 5, 1.0) }));
    }

    #[test]
    fn the_pool_says_what_a_request_holds() {
        let (a, b) = (load(0.4, 10, 0, 1.0), load(0.1, 0, 0, 1.0));
        assert_eq!(kv_per_request([&a, &b]), Some(5_000.0));
        assert_eq!(kv_per_request([&b]), None, "no running request: unknown");
        let unknown = LoadSample { max_total_num_tokens: 0, ..a };
        assert_eq!(kv_per_request([&unknown]), None);
        assert!(KvView::of(&unknown, Sent::default(), 1.0, None, 1.0).is_none());
    }
}
