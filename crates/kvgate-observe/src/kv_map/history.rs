//! The fleet page's plots: the hit rate (the engines' cached tokens over the prompt tokens of the
//! answers the closed loop read) and the time to first byte (mean and 90th percentile, from the
//! latency histogram) over the last minutes, one point per [`STEP_MS`], from the counters'
//! differences. Bounded: [`POINTS`] points.

use std::collections::VecDeque;

use prometheus::core::Collector;
use prometheus::{HistogramVec, IntCounterVec};
use serde::Serialize;

/// Milliseconds between two points.
pub const STEP_MS: u64 = 5_000;
/// Points kept (ten minutes).
pub const POINTS: usize = 120;

/// One step of the plots.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct HistoryPoint {
    /// The step's end, on the gateway's clock.
    pub at_ms: u64,
    /// Cached over prompt tokens of the answers read in the step (none read: absent).
    pub hit_rate: Option<f64>,
    /// Proxied requests whose first byte came in the step.
    pub requests: u64,
    pub ttft_mean_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
}

/// The counters' totals at one instant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    cached: u64,
    prompt: u64,
    /// The latency histogram summed over endpoints: count, sum (s), cumulative buckets.
    count: u64,
    sum: f64,
    buckets: Vec<(f64, u64)>,
}

impl Totals {
    pub fn read(cached: &IntCounterVec, prompt: &IntCounterVec, ttfb: &HistogramVec) -> Totals {
        let sum_counter = |family: &IntCounterVec| {
            family
                .collect()
                .iter()
                .flat_map(|f| f.get_metric())
                .map(|m| m.get_counter().get_value() as u64)
                .sum()
        };
        let mut totals =
            Totals { cached: sum_counter(cached), prompt: sum_counter(prompt), ..Totals::default() };
        for family in ttfb.collect() {
            for metric in family.get_metric() {
                let histogram = metric.get_histogram();
                totals.count += histogram.get_sample_count();
                totals.sum += histogram.get_sample_sum();
                for (at, bucket) in histogram.get_bucket().iter().enumerate() {
                    if totals.buckets.len() <= at {
                        totals.buckets.push((bucket.upper_bound(), 0));
                    }
                    totals.buckets[at].1 += bucket.cumulative_count();
                }
            }
        }
        // The observations past the last bound.
        totals.buckets.push((f64::INFINITY, totals.count));
        totals
    }
}

/// The points so far and the totals of the last one.
#[derive(Debug, Default)]
pub struct History {
    points: VecDeque<HistoryPoint>,
    last: Option<Totals>,
}

impl History {
    /// Adds the point ending at `at_ms` with the counters' `now` totals (the first call only
    /// starts the series).
    pub fn step(&mut self, at_ms: u64, now: Totals) {
        if let Some(last) = self.last.replace(now.clone()) {
            let prompt = now.prompt.saturating_sub(last.prompt);
            let cached = now.cached.saturating_sub(last.cached);
            let requests = now.count.saturating_sub(last.count);
            let mean = (requests > 0).then(|| (now.sum - last.sum) / requests as f64 * 1e3);
            let point = HistoryPoint {
                at_ms,
                hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
                requests,
                ttft_mean_ms: mean,
                ttft_p90_ms: quantile(&last.buckets, &now.buckets, 0.9).map(|secs| secs * 1e3),
            };
            if self.points.len() == POINTS {
                self.points.pop_front();
            }
            self.points.push_back(point);
        }
    }

    pub fn points(&self) -> Vec<HistoryPoint> {
        self.points.iter().copied().collect()
    }
}

/// The `q` quantile of the observations between two cumulative bucket readings, interpolated
/// linearly inside its bucket (in the histogram's unit); `None` without observations.
fn quantile(before: &[(f64, u64)], after: &[(f64, u64)], q: f64) -> Option<f64> {
    let counts: Vec<(f64, u64)> = after
        .iter()
        .enumerate()
        .map(|(at, &(bound, count))| (bound, count.saturating_sub(before.get(at).map_or(0, |b| b.1))))
        .collect();
    let total = counts.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut lower = (0.0, 0u64);
    for &(bound, cumulative) in &counts {
        if cumulative as f64 >= rank {
            if !bound.is_finite() {
                return Some(lower.0);
            }
            let in_bucket = (cumulative - lower.1) as f64;
            let fraction = if in_bucket > 0.0 { (rank - lower.1 as f64) / in_bucket } else { 1.0 };
            return Some(lower.0 + (bound - lower.0) * fraction.clamp(0.0, 1.0));
        }
        lower = (bound, cumulative);
    }
    Some(lower.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_are_the_counters_differences() {
        let registry = prometheus::Registry::new();
        let opts = |name: &str| prometheus::Opts::new(name, "help");
        let cached = IntCounterVec::new(opts("c"), &["w"]).unwrap();
        let prompt = IntCounterVec::new(opts("p"), &["w"]).unwrap();
        let ttfb = HistogramVec::new(
            prometheus::HistogramOpts::new("t", "help").buckets(vec![0.1, 0.2, 0.4]),
            &["endpoint"],
        )
        .unwrap();
        registry.register(Box::new(ttfb.clone())).unwrap();
        let mut history = History::default();
        history.step(0, Totals::read(&cached, &prompt, &ttfb));
        cached.with_label_values(&["a"]).inc_by(30);
        prompt.with_label_values(&["a"]).inc_by(100);
        for seconds in [0.05, 0.15, 0.15, 0.15, 0.3] {
            ttfb.with_label_values(&["chat"]).observe(seconds);
        }
        history.step(5_000, Totals::read(&cached, &prompt, &ttfb));
        history.step(10_000, Totals::read(&cached, &prompt, &ttfb));
        let points = history.points();
        assert_eq!(points.len(), 2);
        let first = points[0];
        assert_eq!((first.at_ms, first.hit_rate, first.requests), (5_000, Some(0.3), 5));
        assert!((first.ttft_mean_ms.unwrap() - 160.0).abs() < 1e-6, "{first:?}");
        // 4.5 of 5 observations: half-way through the last bucket (0.2-0.4 s).
        assert!((first.ttft_p90_ms.unwrap() - 300.0).abs() < 1e-6, "{first:?}");
        assert_eq!(
            points[1],
            HistoryPoint {
                at_ms: 10_000,
                hit_rate: None,
                requests: 0,
                ttft_mean_ms: None,
                ttft_p90_ms: None
            }
        );
    }
}
