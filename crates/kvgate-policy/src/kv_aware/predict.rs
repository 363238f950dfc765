//! kv_aware's prediction of a request's time to first token on one engine: the prefill work
//! queued ahead of it (the engine's last report, plus what was routed there since, minus what
//! the engine has computed since), its own uncached prompt tokens, over the engine's prefill
//! rate, plus decode and KV-pressure terms.

use crate::inflight::RoutedLog;
use crate::{Candidate, LoadSample};

/// The terms of a predicted time to first token, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PredictedTtft {
    /// Prefill work queued ahead of the request, over the prefill rate.
    pub queue_s: f64,
    /// The request's own uncached prompt tokens, over the prefill rate.
    pub prefill_s: f64,
    /// Running requests slowing the engine's steps.
    pub decode_s: f64,
    /// KV pressure: admission waits for blocks when the cache is nearly full.
    pub kv_s: f64,
}

impl PredictedTtft {
    pub fn total(&self) -> f64 {
        self.queue_s + self.prefill_s + self.decode_s + self.kv_s
    }
}

/// The constants of the prediction (the prefill rate is per engine: see `PrefillRates`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictSettings {
    /// Seconds each running request adds to the wait (its share of the engine's steps).
    pub decode_secs_per_request: f64,
    /// Weight in seconds of the KV-pressure term `k / (1 - k)`.
    pub kv_pressure_weight: f64,
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
    let (mut queue, mut at_ms) = match load {
        Some(load) => (load.num_waiting_uncached_tokens as f64, load.fetched_at_ms),
        None => (0.0, 0),
    };
    let per_ms = rate / 1000.0;
    let since = at_ms;
    for (routed_at, tokens) in routed.entries(candidate.id).filter(|&(t, _)| t >= since) {
        queue = (queue - per_ms * routed_at.saturating_sub(at_ms) as f64).max(0.0) + tokens;
        at_ms = routed_at;
    }
    (queue - per_ms * now_ms.saturating_sub(at_ms) as f64).max(0.0)
}

/// The predicted time to first token of a request with `uncached` prompt tokens on an engine that
/// prefills `rate` tokens per second.
pub fn predict(
    settings: &PredictSettings,
    rate: f64,
    queued: f64,
    uncached: f64,
    running: u64,
    kv_usage: Option<f64>,
) -> PredictedTtft {
    let k = kv_usage.unwrap_or(0.0).clamp(0.0, 0.99);
    PredictedTtft {
        queue_s: queued / rate,
        prefill_s: uncached / rate,
        decode_s: settings.decode_secs_per_request * running as f64,
        kv_s: settings.kv_pressure_weight * k / (1.0 - k),
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
    fn terms_add_up() {
        let settings = PredictSettings { decode_secs_per_request: 0.001, kv_pressure_weight: 0.1 };
        let p = predict(&settings, 1_000.0, 2_000.0, 500.0, 10, Some(0.5));
        assert_eq!((p.queue_s, p.prefill_s, p.decode_s, p.kv_s), (2.0, 0.5, 0.01, 0.1));
        assert!((p.total() - 2.61).abs() < 1e-12);
        let clamped = predict(&settings, 1_000.0, 0.0, 0.0, 0, Some(2.0)).kv_s;
        assert!((clamped - 9.9).abs() < 1e-9, "KV usage clamped to 0.99: {clamped}");
    }
}
