//! In-flight correction between load samples: the prompt tokens this host routed to each worker
//! and when, so that a policy can add what a stale sample cannot know yet.

use std::collections::{HashMap, VecDeque};

use crate::{Candidate, LoadSample, WorkerId};

/// Prompt tokens routed per worker, by routing time (milliseconds on the host's clock).
#[derive(Debug, Default)]
pub struct RoutedLog {
    routed: HashMap<WorkerId, VecDeque<(u64, f64)>>,
}

impl RoutedLog {
    /// Record `tokens` routed to `worker` at `now_ms`, forgetting entries older than `keep_ms`.
    pub fn record(&mut self, worker: WorkerId, now_ms: u64, tokens: f64, keep_ms: u64) {
        let queue = self.routed.entry(worker).or_default();
        while queue.front().is_some_and(|(at, _)| at.saturating_add(keep_ms) < now_ms) {
            queue.pop_front();
        }
        if tokens > 0.0 {
            queue.push_back((now_ms, tokens));
        }
    }

    /// Tokens routed to `worker` at or after `since_ms`.
    pub fn since(&self, worker: WorkerId, since_ms: u64) -> f64 {
        self.routed
            .get(&worker)
            .map(|q| q.iter().filter(|(at, _)| *at >= since_ms).map(|(_, tokens)| tokens).sum())
            .unwrap_or(0.0)
    }

    /// Every remembered `(routed at, tokens)` of `worker`, oldest first.
    pub fn entries(&self, worker: WorkerId) -> impl Iterator<Item = (u64, f64)> + '_ {
        self.routed.get(&worker).into_iter().flat_map(|queue| queue.iter().copied())
    }

    pub fn forget(&mut self, worker: WorkerId) {
        self.routed.remove(&worker);
    }
}

/// The candidate's load sample if it is fresh (at most three poll intervals old).
pub fn fresh_load(candidate: &Candidate, now_ms: u64, poll_interval_ms: u64) -> Option<LoadSample> {
    candidate.load.filter(|load| {
        now_ms.saturating_sub(load.fetched_at_ms) <= poll_interval_ms.saturating_mul(3)
            && load.token_usage.is_finite()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_only_what_came_after_the_sample_and_forgets_old_entries() {
        let mut log = RoutedLog::default();
        log.record(1, 100, 10.0, 1000);
        log.record(1, 200, 5.0, 1000);
        assert_eq!(log.since(1, 150), 5.0);
        assert_eq!(log.since(1, 100), 15.0);
        log.record(1, 5000, 1.0, 1000);
        assert_eq!(log.since(1, 0), 1.0, "entries older than keep_ms are dropped");
        assert_eq!(log.since(2, 0), 0.0);
    }
}
