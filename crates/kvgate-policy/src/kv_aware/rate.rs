//! Learning the engines' prefill rate from their load reports: between two reports during which
//! an engine was busy (prefill queued at both), it computed what was queued at the first, plus
//! what was routed to it since, minus what is queued at the second. Each engine's observations
//! feed its own running estimate; predictions use one fleet-wide rate, the mean of the
//! estimates, on a coarse grid (steps of 25% from the configured rate) that moves only when the
//! mean is well past the middle of a step.
//!
//! Why one rate and a grid (measured on S4, docs/BENCHMARKS.md): per-engine rates let a few
//! percent of estimation noise decide between equal engines, and an engine predicted slow gets
//! fewer prompts, is never busy, and never corrects its estimate; e2e p99 doubled. A uniform
//! rate scales every candidate's prediction alike, so it corrects a badly configured rate
//! without steering between engines.
//!
//! Only prompts this host routed are counted as arrivals, so with several gateway replicas in
//! front of one fleet the estimate is low (the others' prompts are computed too): leave learning
//! off there, or configure the rate.

use std::collections::HashMap;

use crate::inflight::RoutedLog;
use crate::{LoadSample, WorkerId};

/// Weight of a new observation in the running estimate.
const SMOOTHING: f64 = 0.2;
/// Reports closer than this are too noisy to learn from.
const MIN_INTERVAL_MS: u64 = 200;
/// The estimate stays within this factor of the configured rate either way.
const MAX_FACTOR: f64 = 10.0;
/// The grid of rates predicted with: the configured rate times powers of this.
const STEP: f64 = 1.25;
/// How far past the middle of a step (in steps) the estimate must go to move the rate used.
const HYSTERESIS: f64 = 0.25;

/// The grid rate to use given the one in use and the current estimate.
fn snap(used: f64, estimate: f64, configured: f64) -> f64 {
    let steps = |rate: f64| (rate / configured).ln() / STEP.ln();
    let (current, wanted) = (steps(used), steps(estimate));
    if (wanted - current).abs() <= 0.5 + HYSTERESIS {
        return used;
    }
    configured * STEP.powf(wanted.round())
}

#[derive(Clone, Copy, Debug)]
struct Learned {
    /// The last report seen: when its poll was sent, and the prefill it said was queued.
    at_ms: u64,
    queued: f64,
    /// The engine's running estimate.
    rate: f64,
}

/// The prefill rate to predict with: the configured one until reports teach otherwise.
#[derive(Debug)]
pub struct PrefillRates {
    configured: f64,
    learn: bool,
    engines: HashMap<WorkerId, Learned>,
    /// Sum of the engines' estimates.
    sum: f64,
    /// The grid rate predicted with.
    used: f64,
}

impl PrefillRates {
    pub fn new(configured: f64, learn: bool) -> Self {
        Self { configured, learn, engines: HashMap::new(), sum: 0.0, used: configured }
    }

    /// The rate to predict with (the same for every engine).
    pub fn rate(&self) -> f64 {
        self.used
    }

    fn update_used(&mut self) {
        if !self.engines.is_empty() {
            self.used = snap(self.used, self.sum / self.engines.len() as f64, self.configured);
        }
    }

    /// Takes `worker`'s report into account (once per report).
    pub fn observe(&mut self, worker: WorkerId, report: &LoadSample, routed: &RoutedLog) {
        if !self.learn {
            return;
        }
        let queued = report.num_waiting_uncached_tokens as f64;
        let configured = self.configured;
        let entry = self.engines.entry(worker).or_insert_with(|| {
            self.sum += configured;
            Learned { at_ms: report.fetched_at_ms, queued, rate: configured }
        });
        if report.fetched_at_ms <= entry.at_ms {
            self.update_used();
            return;
        }
        let interval_ms = report.fetched_at_ms - entry.at_ms;
        if interval_ms >= MIN_INTERVAL_MS && entry.queued > 0.0 && queued > 0.0 {
            let arrived: f64 = routed
                .entries(worker)
                .filter(|&(at, _)| at >= entry.at_ms && at < report.fetched_at_ms)
                .map(|(_, tokens)| tokens)
                .sum();
            let computed = entry.queued + arrived - queued;
            if computed > 0.0 {
                let observed = computed * 1000.0 / interval_ms as f64;
                let rate = entry.rate * (1.0 - SMOOTHING) + observed * SMOOTHING;
                let rate = rate.clamp(configured / MAX_FACTOR, configured * MAX_FACTOR);
                self.sum += rate - entry.rate;
                entry.rate = rate;
            }
        }
        entry.at_ms = report.fetched_at_ms;
        entry.queued = queued;
        self.update_used();
    }

    pub fn forget(&mut self, worker: WorkerId) {
        if let Some(learned) = self.engines.remove(&worker) {
            self.sum -= learned.rate;
            self.update_used();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(at_ms: u64, queued: u64) -> LoadSample {
        LoadSample { fetched_at_ms: at_ms, num_waiting_uncached_tokens: queued, ..LoadSample::default() }
    }

    #[test]
    fn a_busy_engine_teaches_its_rate() {
        let mut routed = RoutedLog::default();
        let mut rates = PrefillRates::new(8_000.0, true);
        // 10,000 tokens arrive every 500 ms and the queue stays at 50,000: the engine computes
        // 20,000 tokens/s.
        rates.observe(1, &report(0, 50_000), &routed);
        for step in 1..=40u64 {
            routed.record(1, step * 500 - 250, 10_000.0, 1_000_000);
            rates.observe(1, &report(step * 500, 50_000), &routed);
        }
        let estimate = rates.engines[&1].rate;
        assert!((estimate - 20_000.0).abs() < 500.0, "{estimate}");
        // On the grid: 8,000 x 1.25^4 = 19,531.
        assert_eq!(rates.rate(), 8_000.0 * STEP.powi(4));
        // A second engine, never busy, counts at the configured rate: the mean moves down.
        rates.observe(2, &report(20_000, 0), &routed);
        assert_eq!(rates.rate(), 8_000.0 * STEP.powi(3), "mean {}", rates.sum / 2.0);
        rates.forget(2);
        assert_eq!(rates.rate(), 8_000.0 * STEP.powi(4));
    }

    #[test]
    fn noise_around_the_configured_rate_keeps_it_exactly() {
        for estimate in [6_900.0, 7_300.0, 8_000.0, 8_700.0, 9_300.0] {
            assert_eq!(snap(8_000.0, estimate, 8_000.0), 8_000.0, "{estimate}");
        }
        // Well past the middle of the step: one step up, and it stays there when the estimate
        // wavers back below the middle.
        let up = snap(8_000.0, 10_200.0, 8_000.0);
        assert_eq!(up, 10_000.0);
        assert_eq!(snap(up, 8_800.0, 8_000.0), 10_000.0);
        assert_eq!(snap(up, 7_000.0, 8_000.0), 8_000.0 * STEP.powi(-1));
    }

    #[test]
    fn an_idle_engine_or_learning_off_teaches_nothing() {
        let routed = RoutedLog::default();
        let mut rates = PrefillRates::new(8_000.0, true);
        rates.observe(1, &report(0, 0), &routed);
        rates.observe(1, &report(1_000, 0), &routed);
        assert_eq!(rates.rate(), 8_000.0);
        let mut off = PrefillRates::new(8_000.0, false);
        off.observe(1, &report(0, 40_000), &routed);
        off.observe(1, &report(1_000, 1_000), &routed);
        assert_eq!(off.rate(), 8_000.0);
    }
}
