//! A token bucket that can owe: the gateway-wide rate limit reserves tokens ahead (a request
//! waits for its token in the queue), and a tenant's buckets take a request's whole cost or
//! nothing, and are given back what a refused request was charged. governor (0.10, GCRA) was
//! considered: it neither returns tokens nor goes below zero, which both of these need.

use std::time::{Duration, Instant};

/// `rate` tokens per second, holding at most `capacity`.
#[derive(Debug)]
pub(super) struct Bucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// Bursts of up to one second's worth (at least one token).
    pub(super) fn per_second(rate: f64, now: Instant) -> Self {
        Self::new(rate, rate.max(1.0), now)
    }

    /// `per_minute` tokens a minute, bursts of up to one minute's worth.
    pub(super) fn per_minute(per_minute: f64, now: Instant) -> Self {
        Self::new(per_minute / 60.0, per_minute.max(1.0), now)
    }

    fn new(rate: f64, capacity: f64, now: Instant) -> Self {
        Self { rate, capacity, tokens: capacity, at: now }
    }

    pub(super) fn capacity(&self) -> f64 {
        self.capacity
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity);
        self.at = self.at.max(now);
    }

    /// `Ok` when `n` tokens are there now (nothing is taken), else how long until they would be.
    pub(super) fn check(&mut self, now: Instant, n: f64) -> Result<(), Duration> {
        self.refill(now);
        if self.tokens >= n {
            Ok(())
        } else {
            Err(Duration::from_secs_f64((n - self.tokens) / self.rate))
        }
    }

    /// Takes `n` tokens (the bucket may go below zero).
    pub(super) fn charge(&mut self, n: f64) {
        self.tokens -= n;
    }

    /// Gives `n` tokens back (never above the capacity).
    pub(super) fn refund(&mut self, n: f64) {
        self.tokens = (self.tokens + n).min(self.capacity);
    }

    /// Takes a token now if one is there (`Ok`), else says how long until one would be.
    pub(super) fn take(&mut self, now: Instant) -> Result<(), Duration> {
        self.check(now, 1.0)?;
        self.charge(1.0);
        Ok(())
    }

    /// Reserves the next token: it is taken now (the bucket goes below zero) and is the
    /// caller's after the returned wait.
    pub(super) fn reserve(&mut self, now: Instant) -> Duration {
        let wait = self.check(now, 1.0).err().unwrap_or(Duration::ZERO);
        self.charge(1.0);
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_refills_at_its_rate_and_bursts_one_second() {
        let start = Instant::now();
        let mut bucket = Bucket::per_second(4.0, start);
        for _ in 0..4 {
            assert_eq!(bucket.take(start), Ok(()));
        }
        let wait = bucket.take(start).unwrap_err();
        assert!((wait.as_secs_f64() - 0.25).abs() < 1e-9, "{wait:?}");
        assert_eq!(bucket.take(start + Duration::from_millis(250)), Ok(()));
        // Reservations queue up behind each other.
        let later = start + Duration::from_millis(250);
        assert!((bucket.reserve(later).as_secs_f64() - 0.25).abs() < 1e-9);
        assert!((bucket.reserve(later).as_secs_f64() - 0.5).abs() < 1e-9);
    }

    #[test]
    fn a_minute_bucket_takes_whole_costs_and_takes_refunds() {
        let start = Instant::now();
        let mut bucket = Bucket::per_minute(600.0, start);
        assert_eq!(bucket.check(start, 500.0), Ok(()));
        bucket.charge(500.0);
        // 200 more: 100 are missing, at 10 a second.
        let wait = bucket.check(start, 200.0).unwrap_err();
        assert!((wait.as_secs_f64() - 10.0).abs() < 1e-9, "{wait:?}");
        bucket.refund(500.0);
        assert_eq!(bucket.check(start, 600.0), Ok(()));
        bucket.refund(1000.0);
        assert!(bucket.check(start, 601.0).is_err());
    }
}
