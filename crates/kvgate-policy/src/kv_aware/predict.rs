//! kv_aware's prediction of a request's time to first token on one engine: the prefill work
//! queued ahead of it (the engine's last report, plus what was routed there since, minus what
//! the engine has computed since), its own uncached prompt tokens, over the engine's prefill
//! rate, plus decode and KV-pressure terms, and the wait for KV: on an engine whose KV is taken,
//! the request is admitted only once running requests have freed what the requests ahead of it
//! and it need ([`crate::kv_wait`]; no prefill queued says nothing of that wait).

use super::rate::attention_pairs;
use super::Rates;
use crate::inflight::{RoutedLog, WorkerLog};
use crate::{Candidate, LoadSample};

/// The terms of a predicted time to first token, in seconds, and what the request's prefill
/// costs the others on that engine (the rest of kv_aware's cost).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PredictedTtft {
    /// Prefill work queued ahead of the request, over the prefill rate.
    pub queue_s: f64,
    /// The request's own uncached prompt tokens, over the prefill rate, plus their attention
    /// over the context (`Rates::context_ns_per_pair`, 0 until learned).
    pub prefill_s: f64,
    /// Running requests slowing the engine's steps.
    pub decode_s: f64,
    /// KV pressure: admission waits for blocks when the cache is nearly full.
    pub kv_s: f64,
    /// Cost, not time to first token: the request's own prefill delays the requests that will
    /// queue behind it and duplicates a prefix held elsewhere: `prefill_s` x
    /// (`--kv-aware-prefill-cost-weight` + `--kv-aware-queue-cost-weight` x the requests
    /// expected to arrive at the engine before its queue and this prefill are done).
    pub recompute_s: f64,
    /// Cost, not time to first token: the engine's running requests stall while it prefills
    /// (`--kv-aware-decode-stall-weight` x running x `prefill_s`).
    pub stall_s: f64,
    /// On a decision: the predicted time to first token on the runner-up, the candidate with
    /// the lowest cost after the chosen one (none with a single candidate).
    pub runner_up_s: Option<f64>,
    /// The engine's fixed cost of any request (its server, a forward pass's overhead, the hop to
    /// it), learned from measured times to first token (`Rates::base_s`; 0 until learned).
    pub base_s: f64,
    /// The rates the terms were computed at, what a measured time to first token is later
    /// compared with (`EngineRates::observe_answer`).
    pub rates: Rates,
    /// The wait for KV: the KV the requests waiting there, those routed there since its report
    /// and this one need beyond the free KV, over the rate running requests free it
    /// ([`crate::kv_wait::KvView::wait_s`]; 0 when the engine's KV is unknown).
    pub kv_wait_s: f64,
}

impl PredictedTtft {
    /// The term names, in the order of [`PredictedTtft::terms`] (route reasons and metrics).
    pub const TERMS: [&'static str; 10] =
        ["total", "queue", "prefill", "decode", "kv", "recompute", "stall", "cost", "base", "kv_wait"];

    /// The predicted time to first token.
    pub fn total(&self) -> f64 {
        self.queue_s + self.prefill_s + self.decode_s + self.kv_s + self.base_s + self.kv_wait_s
    }

    /// What kv_aware minimises: the predicted time to first token plus the costs to others.
    pub fn cost(&self) -> f64 {
        self.total() + self.recompute_s + self.stall_s
    }

    /// Every term in seconds, named by [`PredictedTtft::TERMS`].
    pub fn terms(&self) -> [f64; 10] {
        [
            self.total(),
            self.queue_s,
            self.prefill_s,
            self.decode_s,
            self.kv_s,
            self.recompute_s,
            self.stall_s,
            self.cost(),
            self.base_s,
            self.kv_wait_s,
        ]
    }
}

/// The constants of the prediction (the rates are per engine: see `EngineRates`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictSettings {
    /// Weight in seconds of the KV-pressure term `k / (1 - k)`.
    pub kv_pressure_weight: f64,
    /// Weight of the request's own prefill time in the recompute cost.
    pub prefill_cost_weight: f64,
    /// Weight of the requests expected to arrive behind it (arrival rate x (queue + prefill)).
    pub queue_cost_weight: f64,
    /// Weight of (running requests x the request's prefill time) in the stall cost.
    pub decode_stall_weight: f64,
}

/// Prefill tokens queued on `candidate` at `now_ms`: a fluid queue that starts from the engine's
/// last report (`load`, stamped when its poll was sent) or empty, gains every uncached prompt
/// routed there since, and drains at the prefill rate.
pub fn queued_tokens(
    candidate: &Candidate,
    load: Option<&LoadSample>,
    routed: &RoutedLog,
    now_ms: u64,
    rate: f64,
) -> f64 {
    queued_tokens_in(routed.of(candidate.id), load, now_ms, rate)
}

/// [`queued_tokens`] on the engine's part of the log, looked up by the caller.
pub(crate) fn queued_tokens_in(
    routed: WorkerLog<'_>,
    load: Option<&LoadSample>,
    now_ms: u64,
    rate: f64,
) -> f64 {
    let (mut queue, mut at_ms) = match load {
        Some(load) => (load.num_waiting_uncached_tokens as f64, load.fetched_at_ms),
        None => (0.0, 0),
    };
    let per_ms = rate / 1000.0;
    let since = at_ms;
    for (routed_at, tokens) in routed.entries().filter(|&(t, _)| t >= since) {
        queue = (queue - per_ms * routed_at.saturating_sub(at_ms) as f64).max(0.0) + tokens;
        at_ms = routed_at;
    }
    (queue - per_ms * now_ms.saturating_sub(at_ms) as f64).max(0.0)
}

/// What the prediction knows of one engine for one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineView {
    pub rates: Rates,
    /// Prefill tokens queued ahead of the request.
    pub queued: f64,
    /// The request's uncached prompt tokens there.
    pub uncached: f64,
    /// The tokens before them its prefill attends to (its matched prefix there).
    pub context: f64,
    /// Requests running there.
    pub running: u64,
    /// KV usage, when the snapshot is usable.
    pub kv_usage: Option<f64>,
    /// Requests per second arriving at an engine of the pool (the pool's rate over its size).
    pub arrivals_per_sec: f64,
    /// Seconds the request would wait there for KV (see [`PredictedTtft::kv_wait_s`]).
    pub kv_wait_s: f64,
}

/// The predicted time to first token of a request on an engine, and its costs to the others.
pub fn predict(settings: &PredictSettings, view: &EngineView) -> PredictedTtft {
    let EngineView { rates, queued, uncached, context, running, kv_usage, arrivals_per_sec, kv_wait_s } =
        *view;
    let k = kv_usage.unwrap_or(0.0).clamp(0.0, 0.99);
    let rate = rates.prefill_tokens_per_sec;
    let attention_s = rates.context_ns_per_pair * 1e-9 * attention_pairs(uncached, context);
    let (queue_s, prefill_s) = (queued / rate, uncached / rate + attention_s);
    let behind = arrivals_per_sec * (queue_s + prefill_s);
    PredictedTtft {
        queue_s,
        prefill_s,
        decode_s: rates.decode_ms_per_request / 1000.0 * running as f64,
        kv_s: settings.kv_pressure_weight * k / (1.0 - k),
        recompute_s: prefill_s * (settings.prefill_cost_weight + settings.queue_cost_weight * behind),
        stall_s: settings.decode_stall_weight * running as f64 * prefill_s,
        runner_up_s: None,
        base_s: rates.base_s,
        rates,
        kv_wait_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate() -> Candidate {
        Candidate { id: 1, in_flight: 0, load: None }
    }

    #[test]
    fn the_queue_drains_at_the_prefill_rate_between_arrivals() {
        let mut routed = RoutedLog::default();
        // 1,000 tokens/s = 1 token/ms.
        routed.record(1, 1_000, 500.0, 10_000);
        routed.record(1, 1_200, 300.0, 10_000);
        let queued = |now| queued_tokens(&candidate(), None, &routed, now, 1_000.0);
        assert_eq!(queued(1_200), 300.0 + 300.0, "500 drained 200 by the second arrival");
        assert_eq!(queued(1_500), 300.0);
        assert_eq!(queued(3_000), 0.0, "never below empty");
        let sample =
            LoadSample { num_waiting_uncached_tokens: 1_000, fetched_at_ms: 1_100, ..LoadSample::default() };
        // The report includes the first arrival; only the second is added, after 100 ms of drain.
        let from_report = queued_tokens(&candidate(), Some(&sample), &routed, 1_200, 1_000.0);
        assert_eq!(from_report, 900.0 + 300.0);
    }

    #[test]
    fn a_learned_context_cost_is_in_the_prefill() {
        let settings = PredictSettings {
            kv_pressure_weight: 0.0,
            prefill_cost_weight: 0.0,
            queue_cost_weight: 0.0,
            decode_stall_weight: 0.0,
        };
        let rates = Rates { prefill_tokens_per_sec: 1_000.0, context_ns_per_pair: 25.0, ..Rates::default() };
        let view = EngineView {
            rates,
            queued: 0.0,
            uncached: 256.0,
            context: 4_096.0,
            running: 0,
            kv_usage: None,
            arrivals_per_sec: 0.0,
            kv_wait_s: 0.0,
        };
        // 256 new tokens attend to 4,096 cached and on average 128 new: 25 ns a pair.
        let want = 0.256 + 25e-9 * 256.0 * (4_096.0 + 128.0);
        assert!((predict(&settings, &view).prefill_s - want).abs() < 1e-12);
        let unlearned = EngineView { rates: Rates { context_ns_per_pair: 0.0, ..rates }, ..view };
        assert_eq!(predict(&settings, &unlearned).prefill_s, 0.256);
    }

    #[test]
    fn terms_add_up() {
        let settings = PredictSettings {
            kv_pressure_weight: 0.1,
            prefill_cost_weight: 8.0,
            queue_cost_weight: 1.0,
            decode_stall_weight: 0.01,
        };
        let rates = Rates { prefill_tokens_per_sec: 1_000.0, decode_ms_per_request: 1.0, ..Rates::default() };
        let view = EngineView {
            rates,
            queued: 2_000.0,
            uncached: 500.0,
            context: 0.0,
            running: 10,
            kv_usage: Some(0.5),
            arrivals_per_sec: 0.0,
            kv_wait_s: 0.0,
        };
        let p = predict(&settings, &view);
        assert_eq!((p.queue_s, p.prefill_s, p.decode_s, p.kv_s), (2.0, 0.5, 0.01, 0.1));
        assert!((p.total() - 2.61).abs() < 1e-12);
        assert_eq!((p.recompute_s, p.stall_s), (4.0, 0.05));
        assert!((p.cost() - 6.66).abs() < 1e-12);
        // Two requests a second arrive behind its 2.5 s: 5 more requests delayed by its 0.5 s.
        let busy = predict(&settings, &EngineView { arrivals_per_sec: 2.0, ..view });
        assert_eq!(busy.recompute_s, 0.5 * (8.0 + 5.0));
        assert_eq!(p.terms()[0], p.total());
        assert_eq!(p.terms()[7], p.cost());
        let idle = EngineView { queued: 0.0, uncached: 0.0, running: 0, kv_usage: Some(2.0), ..view };
        let with_base = predict(&settings, &EngineView { rates: Rates { base_s: 0.02, ..rates }, ..view });
        assert!((with_base.total() - 2.63).abs() < 1e-12, "the fixed cost is in the total");
        assert!((with_base.cost() - p.cost() - 0.02).abs() < 1e-12 && with_base.terms()[8] == 0.02);
        let waiting = predict(&settings, &EngineView { kv_wait_s: 30.0, ..view });
        assert!((waiting.total() - p.total() - 30.0).abs() < 1e-12, "the wait for KV is in the total");
        assert!((waiting.cost() - p.cost() - 30.0).abs() < 1e-12 && waiting.terms()[9] == 30.0);
        let clamped = predict(&settings, &idle).kv_s;
        assert!((clamped - 9.9).abs() < 1e-9, "KV usage clamped to 0.99: {clamped}");
    }
}
