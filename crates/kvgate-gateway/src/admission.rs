//! Admission of proxied requests: a concurrency limit (`--max-concurrent-requests`), a bounded
//! queue in front of it (`--queue-size` waiting requests, each for at most
//! `--queue-timeout-secs`), and a token-bucket rate limit (`--rate-limit-tokens-per-second`
//! requests per second, bursts of up to one second's worth). A request that finds the queue
//! full, or no room and no queue, is refused with 429; one that waited its full time gets 408.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;
use crate::metrics::AdmissionMetrics;

/// A token bucket: `rate` tokens per second, holding at most `capacity`.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: f64) -> Self {
        let capacity = rate.max(1.0);
        Self { rate, capacity, tokens: capacity, at: Instant::now() }
    }

    /// Takes a token now if one is there (`Ok`), else says how long until one would be.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.rate))
        }
    }

    /// Reserves the next token: it is taken now (the bucket goes below zero) and is the
    /// caller's after the returned wait.
    fn reserve(&mut self, now: Instant) -> Duration {
        match self.take(now) {
            Ok(()) => Duration::ZERO,
            Err(wait) => {
                self.tokens -= 1.0;
                wait
            }
        }
    }
}

pub struct Admission {
    permits: Option<Arc<Semaphore>>,
    limit: usize,
    bucket: Option<Mutex<Bucket>>,
    queue_size: usize,
    queued: AtomicUsize,
    queue_timeout: Duration,
    metrics: AdmissionMetrics,
}

/// Holds a concurrency slot (if limited) until dropped.
pub type Permit = Option<OwnedSemaphorePermit>;

/// Decrements the queue depth when the wait ends, however it ends.
struct Queued<'a>(&'a Admission);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
        self.0.metrics.queue_depth.dec();
    }
}

impl Admission {
    pub fn new(
        max_concurrent: Option<usize>,
        rate_per_sec: Option<f64>,
        queue_size: usize,
        queue_timeout: Duration,
        metrics: AdmissionMetrics,
    ) -> Self {
        Self {
            permits: max_concurrent.map(|n| Arc::new(Semaphore::new(n))),
            limit: max_concurrent.unwrap_or(0),
            bucket: rate_per_sec.map(|rate| Mutex::new(Bucket::new(rate))),
            queue_size,
            queued: AtomicUsize::new(0),
            queue_timeout,
            metrics,
        }
    }

    fn refuse(&self, reason: &str) -> ApiError {
        self.metrics.rejected.with_label_values(&[reason]).inc();
        match reason {
            "rate_limited" => ApiError::RateLimited,
            "queue_timeout" => ApiError::QueueTimeout(self.queue_timeout.as_secs_f64()),
            _ => ApiError::TooManyRequests(self.limit),
        }
    }

    /// Enters the queue, or says why not.
    fn enqueue(&self, reason: &str) -> Result<Queued<'_>, ApiError> {
        let admitted = self
            .queued
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < self.queue_size).then_some(n + 1))
            .is_ok();
        if !admitted {
            return Err(self.refuse(reason));
        }
        self.metrics.queue_depth.inc();
        Ok(Queued(self))
    }

    /// A rate-limit token: now (`None`), reserved after a wait the queue allows, or refused.
    fn token(&self) -> Result<Option<Duration>, ApiError> {
        let Some(bucket) = &self.bucket else { return Ok(None) };
        let now = Instant::now();
        let mut bucket = bucket.lock().unwrap_or_else(|p| p.into_inner());
        match bucket.take(now) {
            Ok(()) => Ok(None),
            Err(wait) if self.queue_size == 0 || wait > self.queue_timeout || self.queue_full() => {
                drop(bucket);
                Err(self.refuse("rate_limited"))
            }
            Err(_) => Ok(Some(bucket.reserve(now))),
        }
    }

    fn queue_full(&self) -> bool {
        self.queued.load(Ordering::Relaxed) >= self.queue_size
    }

    /// Admits one request: a token and a concurrency slot, waiting in the queue when allowed.
    pub async fn admit(&self) -> Result<Permit, ApiError> {
        let deadline = tokio::time::Instant::now() + self.queue_timeout;
        let mut queued = None;
        if let Some(wait) = self.token()? {
            queued = Some(self.enqueue("rate_limited")?);
            tokio::time::sleep(wait).await;
        }
        let Some(permits) = &self.permits else { return Ok(None) };
        if let Ok(permit) = permits.clone().try_acquire_owned() {
            return Ok(Some(permit));
        }
        if self.queue_size == 0 {
            return Err(self.refuse("concurrency"));
        }
        let _queued = match queued {
            Some(queued) => queued,
            None => self.enqueue("queue_full")?,
        };
        match tokio::time::timeout_at(deadline, permits.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(Some(permit)),
            _ => Err(self.refuse("queue_timeout")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_refills_at_its_rate_and_bursts_one_second() {
        let start = Instant::now();
        let mut bucket = Bucket::new(4.0);
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
}
