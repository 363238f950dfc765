//! Decisions per second from the cumulative decision counters: the counters are sampled when
//! the fleet is read (at most one sample per half second, kept 15 s), and a rate is the
//! difference from the sample closest to five seconds old (from the gateway's start, counters
//! at zero, while there is none), so any number of pages polling at any pace agree.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// (model, role, reason) → decisions.
pub type Totals = BTreeMap<(String, &'static str, String), u64>;

const MIN_SPACING: Duration = Duration::from_millis(500);
const TARGET_WINDOW: Duration = Duration::from_secs(5);
const KEEP: Duration = Duration::from_secs(15);

pub struct RateHistory {
    started: Instant,
    samples: VecDeque<(Instant, Totals)>,
}

impl RateHistory {
    pub fn new(started: Instant) -> Self {
        Self { started, samples: VecDeque::new() }
    }

    /// The rates of `totals` at `now`, with the window they are over, and the sample kept.
    pub fn rates(
        &mut self,
        now: Instant,
        totals: &Totals,
    ) -> (Duration, BTreeMap<(String, &'static str, String), f64>) {
        self.samples.retain(|(at, _)| now.saturating_duration_since(*at) <= KEEP);
        let baseline = self
            .samples
            .iter()
            .filter(|(at, _)| now.saturating_duration_since(*at) >= MIN_SPACING)
            .min_by_key(|(at, _)| now.saturating_duration_since(*at).abs_diff(TARGET_WINDOW));
        let empty = Totals::new();
        let (since, before) = baseline.map_or((self.started, &empty), |(at, totals)| (*at, totals));
        let window = now.saturating_duration_since(since).max(Duration::from_millis(1));
        let rates = totals
            .iter()
            .map(|(key, count)| {
                let delta = count.saturating_sub(before.get(key).copied().unwrap_or(0));
                (key.clone(), delta as f64 / window.as_secs_f64())
            })
            .collect();
        let spaced =
            self.samples.back().is_none_or(|(at, _)| now.saturating_duration_since(*at) >= MIN_SPACING);
        if spaced {
            self.samples.push_back((now, totals.clone()));
        }
        (window, rates)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(n: u64) -> Totals {
        [(("m".to_string(), "regular", "cache_hit".to_string()), n)].into_iter().collect()
    }

    #[test]
    fn a_rate_is_over_the_sample_nearest_five_seconds_old() {
        let start = Instant::now();
        let mut history = RateHistory::new(start);
        // The first read: since the start.
        let (window, rates) = history.rates(start + Duration::from_secs(2), &totals(10));
        assert_eq!(window, Duration::from_secs(2));
        assert_eq!(rates.values().copied().collect::<Vec<_>>(), [5.0]);
        for second in 3..=9 {
            history.rates(start + Duration::from_secs(second), &totals(10 + 4 * (second - 2)));
        }
        // At 10 s: the sample of 5 s (count 22), 5 s before; 42 at 10 s.
        let (window, rates) = history.rates(start + Duration::from_secs(10), &totals(42));
        assert_eq!(window, Duration::from_secs(5));
        assert_eq!(rates.values().copied().collect::<Vec<_>>(), [4.0]);
        // Reads closer together than the spacing reuse the baseline and add no sample.
        let before = history.samples.len();
        history.rates(start + Duration::from_millis(10_100), &totals(42));
        assert_eq!(history.samples.len(), before);
    }
}
