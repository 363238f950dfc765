//! `least_load`: route to the worker with the least expected wait,
//! `(queued uncached tokens + in-flight prompt tokens) / throughput + w * k / (1 - k)`,
//! where k is the KV usage (clamped below 1) and throughput the engine's reported generation
//! throughput (or a default). Between load samples, the prompt tokens routed since the sample are
//! added (in-flight correction); without a fresh sample, in-flight requests count as the mean
//! prompt size each.

use std::sync::Mutex;

use crate::inflight::{fresh_load, RoutedLog};
use crate::pick::pick_min_by;
use crate::{
    Candidate, Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, Routed, SelectContext, WorkerId,
};

/// The knobs of the expected-wait estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeastLoadSettings {
    pub kv_pressure_weight: f64,
    pub mean_prefill_tokens: f64,
    pub default_throughput: f64,
}

pub struct LeastLoadPolicy {
    settings: LeastLoadSettings,
    routed: Mutex<RoutedLog>,
}

/// Expected waits closer than this many seconds are a tie.
const WAIT_TIE_SECS: f64 = 1e-4;

impl LeastLoadPolicy {
    pub fn new(settings: LeastLoadSettings) -> Self {
        Self { settings, routed: Mutex::new(RoutedLog::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RoutedLog> {
        self.routed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Expected wait in seconds on `candidate`.
    pub fn expected_wait(&self, candidate: &Candidate, routed: &RoutedLog, ctx: &SelectContext<'_>) -> f64 {
        let s = &self.settings;
        match fresh_load(candidate, ctx.now_ms, ctx.load_poll_interval_ms) {
            Some(load) => {
                let since = routed.since(candidate.id, load.fetched_at_ms);
                let tokens = load.num_waiting_uncached_tokens as f64 + since;
                let throughput =
                    if load.gen_throughput > 0.0 { load.gen_throughput } else { s.default_throughput };
                let mut k = load.token_usage;
                if load.max_total_num_tokens > 0 {
                    k += since / load.max_total_num_tokens as f64;
                }
                let k = k.clamp(0.0, 0.99);
                tokens / throughput + s.kv_pressure_weight * k / (1.0 - k)
            }
            None => candidate.in_flight as f64 * s.mean_prefill_tokens / s.default_throughput,
        }
    }
}

impl Policy for LeastLoadPolicy {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn needs_loads(&self) -> bool {
        true
    }

    fn decide(
        &self,
        _request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let routed = self.lock();
        let waits: Vec<(i64, u64)> = candidates
            .iter()
            .map(|c| ((self.expected_wait(c, &routed, ctx) / WAIT_TIE_SECS) as i64, c.in_flight))
            .collect();
        let index = pick_min_by(0..candidates.len(), |i| waits[i], ctx.rng).expect("not empty");
        Ok(Decision::plain(candidates[index].id, Reason::LeastLoad))
    }

    /// The request's prompt tokens (or the mean prompt when unknown) count as queued on its
    /// worker until the next load sample.
    fn on_routed(&self, routed: &Routed<'_>) {
        let tokens = match routed.request.prompt_tokens {
            0 => self.settings.mean_prefill_tokens,
            known => known as f64,
        };
        let keep_ms = routed.load_poll_interval_ms.saturating_mul(4);
        self.lock().record(routed.decision.worker, routed.now_ms, tokens, keep_ms);
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.lock().forget(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, ctx_rng, route};
    use crate::LoadSample;

    const SETTINGS: LeastLoadSettings = LeastLoadSettings {
        kv_pressure_weight: 0.15,
        mean_prefill_tokens: 1024.0,
        default_throughput: 2000.0,
    };

    fn sample(waiting_tokens: u64, usage: f64) -> Option<LoadSample> {
        Some(LoadSample {
            num_waiting_uncached_tokens: waiting_tokens,
            token_usage: usage,
            max_total_num_tokens: 100_000,
            fetched_at_ms: 1000,
            ..LoadSample::default()
        })
    }

    #[test]
    fn prefers_the_idle_engine() {
        let policy = LeastLoadPolicy::new(SETTINGS);
        let mut pool = candidates(&[0, 0, 0]);
        pool[0].load = sample(8000, 0.2);
        pool[1].load = sample(0, 0.1);
        pool[2].load = sample(0, 0.8);
        let mut rng = ctx_rng(1);
        let mut ctx =
            SelectContext { now_ms: 1000, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let d = route(&policy, &RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx);
        assert_eq!((d.worker, d.reason), (1, Reason::LeastLoad));
    }

    #[test]
    fn inflight_correction_spreads_a_burst_between_samples() {
        let policy = LeastLoadPolicy::new(SETTINGS);
        let mut pool = candidates(&[0, 0]);
        pool[0].load = sample(0, 0.1);
        pool[1].load = sample(0, 0.1);
        let mut rng = ctx_rng(2);
        let mut ctx =
            SelectContext { now_ms: 1500, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let request = RouteRequest { key: crate::RoutingKey::None, prompt_tokens: 4000, session: None };
        let mut counts = [0; 2];
        for _ in 0..10 {
            counts[route(&policy, &request, Candidates::new(&pool).unwrap(), &mut ctx).worker as usize] += 1;
        }
        assert_eq!(counts, [5, 5], "the same stale sample, yet the burst alternates");
    }

    #[test]
    fn without_samples_in_flight_counts_decide() {
        let policy = LeastLoadPolicy::new(SETTINGS);
        let pool = candidates(&[7, 2, 9]);
        let mut rng = ctx_rng(3);
        let mut ctx =
            SelectContext { now_ms: 0, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        assert_eq!(route(&policy, &RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx).worker, 1);
    }
}
