//! The one backoff of every retry and reconnect loop (the proxy's retries, the KV-event
//! subscriptions, replica sync): delays double from a first one up to a ceiling, each drawn at
//! random in `[d/2, d)` ("equal jitter"), so that loops that failed together (a thousand
//! subscriptions after an engine-side blip) do not retry in lockstep, and no wait is longer than
//! the ceiling (to f32 rounding). The delays come from backon's `ExponentialBuilder`.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

pub struct Backoff {
    builder: ExponentialBuilder,
    delays: ExponentialBackoff,
    max: Duration,
}

impl Backoff {
    /// Delays of `first`, `2 first`, `4 first`, ... up to `max`, each scaled by a random factor
    /// in `[0.5, 1)`. A `first` above `max` starts at `max`.
    pub fn new(first: Duration, max: Duration) -> Backoff {
        let first = first.min(max);
        // backon's jitter adds a random share in [0, 1) of the current delay: from half of each
        // bound, a delay d comes out in [d/2, d).
        let builder = ExponentialBuilder::new()
            .with_min_delay(first / 2)
            .with_max_delay(max / 2)
            .with_jitter()
            .without_max_times();
        Backoff { delays: builder.build(), builder, max }
    }

    /// The wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        // Never `None`: there is no limit on the number of attempts.
        self.delays.next().unwrap_or(self.max)
    }

    /// Starts over from the first delay (after a connection that held).
    pub fn reset(&mut self) {
        self.delays = self.builder.build();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const US: Duration = Duration::from_micros(1);

    #[test]
    fn delays_double_up_to_the_ceiling_each_within_its_jitter_band() {
        let mut backoff = Backoff::new(100 * MS, 5000 * MS);
        let nominal = [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000];
        for round in 0..2 {
            for ms in nominal {
                let delay = backoff.next_delay();
                // backon computes in f32 seconds: allow a microsecond of rounding.
                let band = (ms * MS / 2 - US)..=(ms * MS + US);
                assert!(band.contains(&delay), "round {round}: {delay:?} outside {band:?}");
            }
            backoff.reset();
        }
    }

    #[test]
    fn loops_that_fail_together_do_not_retry_together() {
        let firsts: Vec<Duration> = (0..50).map(|_| Backoff::new(100 * MS, 5000 * MS).next_delay()).collect();
        let mut distinct = firsts.clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 40, "50 loops, {} distinct first delays: {firsts:?}", distinct.len());
    }

    #[test]
    fn no_delay_exceeds_the_ceiling_even_from_a_larger_first_one() {
        let mut backoff = Backoff::new(900 * MS, 300 * MS);
        assert!((0..5).all(|_| backoff.next_delay() <= 300 * MS + US));
    }

    #[test]
    fn a_zero_first_delay_stays_zero() {
        let mut backoff = Backoff::new(Duration::ZERO, 5 * MS);
        assert!((0..5).all(|_| backoff.next_delay() == Duration::ZERO));
    }
}
