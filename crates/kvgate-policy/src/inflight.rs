//! In-flight correction between load samples: the requests this host routed to each worker, when,
//! and the prompt tokens each was expected to compute there, so that a policy can add what a
//! stale sample cannot know yet (work queued, KV taken, requests waiting: counted in requests,
//! not only in prompt tokens, since a cached prompt still needs its KV and its decode there).

use std::collections::VecDeque;

use crate::{Candidate, LoadSample, WorkerId, WorkerMap};

/// What was routed to a worker since some time: requests and their (uncached) prompt tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sent {
    pub requests: f64,
    pub tokens: f64,
}

/// One routing: when, how many requests (a request asking for `n` choices counts `n`), the
/// prompt tokens they were expected to compute, and the hash of the whole prompt when known.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Entry {
    at_ms: u64,
    requests: f64,
    tokens: f64,
    prompt: Option<u64>,
}

/// Requests and prompt tokens routed per worker, by routing time (milliseconds on the host's clock).
#[derive(Debug, Default)]
pub struct RoutedLog {
    routed: WorkerMap<VecDeque<Entry>>,
}

impl RoutedLog {
    /// Record one request of `tokens` prompt tokens routed to `worker` at `now_ms`, forgetting
    /// entries older than `keep_ms`.
    pub fn record(&mut self, worker: WorkerId, now_ms: u64, tokens: f64, keep_ms: u64) {
        self.record_sent(worker, now_ms, Sent { requests: 1.0, tokens }, keep_ms);
    }

    /// Record `sent` routed to `worker` at `now_ms`, forgetting entries older than `keep_ms`.
    pub fn record_sent(&mut self, worker: WorkerId, now_ms: u64, sent: Sent, keep_ms: u64) {
        self.record_prompt(worker, now_ms, sent, None, keep_ms);
    }

    /// Record `sent` routed to `worker` at `now_ms` with the hash of its whole prompt, forgetting
    /// entries older than `keep_ms`: requests with one prompt routed to one worker since a time
    /// count their prompt tokens once ([`RoutedLog::sent_since`]), as the engine computes and
    /// holds a prompt once for all of them.
    pub fn record_prompt(
        &mut self,
        worker: WorkerId,
        now_ms: u64,
        sent: Sent,
        prompt: Option<u64>,
        keep_ms: u64,
    ) {
        let queue = self.routed.entry(worker).or_default();
        while queue.front().is_some_and(|entry| entry.at_ms.saturating_add(keep_ms) < now_ms) {
            queue.pop_front();
        }
        if sent.tokens > 0.0 || sent.requests > 0.0 {
            queue.push_back(Entry {
                at_ms: now_ms,
                requests: sent.requests,
                tokens: sent.tokens.max(0.0),
                prompt,
            });
        }
    }

    /// Tokens routed to `worker` at or after `since_ms`.
    pub fn since(&self, worker: WorkerId, since_ms: u64) -> f64 {
        self.sent_since(worker, since_ms).tokens
    }

    /// Requests and tokens routed to `worker` at or after `since_ms`, the tokens of one prompt
    /// (by its hash) counted once.
    pub fn sent_since(&self, worker: WorkerId, since_ms: u64) -> Sent {
        self.of(worker).sent_since(since_ms)
    }

    /// Whether a request with the whole prompt of hash `prompt` was routed to `worker` at or
    /// after `since_ms` (and is still remembered).
    pub fn holds_prompt(&self, worker: WorkerId, prompt: u64, since_ms: u64) -> bool {
        self.of(worker).holds_prompt(prompt, since_ms)
    }

    /// How many requests with the whole prompt of hash `prompt` were routed to `worker` at or
    /// after `since_ms`, and the prompt tokens the first of them was expected to compute there.
    pub fn prompt_routed(&self, worker: WorkerId, prompt: u64, since_ms: u64) -> (f64, f64) {
        let mut found = (0.0, 0.0);
        for entry in self.routed.get(&worker).into_iter().flatten() {
            if entry.at_ms >= since_ms && entry.prompt == Some(prompt) {
                if found.0 == 0.0 {
                    found.1 = entry.tokens;
                }
                found.0 += entry.requests;
            }
        }
        found
    }

    /// What was routed to `worker`, looked up once for several questions (a decision asks
    /// three of each candidate).
    pub fn of(&self, worker: WorkerId) -> WorkerLog<'_> {
        WorkerLog { queue: self.routed.get(&worker) }
    }

    /// Every remembered `(routed at, tokens)` of `worker`, oldest first.
    pub fn entries(&self, worker: WorkerId) -> impl Iterator<Item = (u64, f64)> + '_ {
        self.of(worker).entries()
    }

    pub fn forget(&mut self, worker: WorkerId) {
        self.routed.remove(&worker);
    }
}

/// One worker's part of a [`RoutedLog`] (empty when nothing was routed there).
#[derive(Clone, Copy, Debug)]
pub struct WorkerLog<'a> {
    queue: Option<&'a VecDeque<Entry>>,
}

impl<'a> WorkerLog<'a> {
    /// Requests and tokens routed there at or after `since_ms`, the tokens of one prompt (by
    /// its hash) counted once.
    pub fn sent_since(&self, since_ms: u64) -> Sent {
        let mut sent = Sent::default();
        let Some(queue) = self.queue else { return sent };
        // A prompt's tokens count at its first entry since `since_ms`: an entry whose prompt an
        // earlier one since then had is skipped (looked for among those, with no set to allocate:
        // this runs for every candidate of every kv_aware decision).
        let (front, back) = queue.as_slices();
        let since = |e: &&Entry| e.at_ms >= since_ms;
        for (at, entry) in front.iter().chain(back).enumerate() {
            if entry.at_ms < since_ms {
                continue;
            }
            sent.requests += entry.requests;
            let repeated = entry.prompt.is_some_and(|hash| {
                front.iter().chain(back).take(at).filter(since).any(|e| e.prompt == Some(hash))
            });
            if !repeated {
                sent.tokens += entry.tokens;
            }
        }
        sent
    }

    /// Whether a request with the whole prompt of hash `prompt` was routed there at or after
    /// `since_ms` (and is still remembered).
    pub fn holds_prompt(&self, prompt: u64, since_ms: u64) -> bool {
        self.queue.is_some_and(|queue| queue.iter().any(|e| e.at_ms >= since_ms && e.prompt == Some(prompt)))
    }

    /// Every remembered `(routed at, tokens)`, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = (u64, f64)> + 'a {
        self.queue.into_iter().flat_map(|queue| queue.iter().map(|e| (e.at_ms, e.tokens)))
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

    #[test]
    fn a_cached_prompt_still_counts_as_a_request() {
        let mut log = RoutedLog::default();
        log.record(1, 100, 0.0, 1000);
        log.record_sent(1, 120, Sent { requests: 16.0, tokens: 0.0 }, 1000);
        log.record(1, 130, 400.0, 1000);
        assert_eq!(log.sent_since(1, 100), Sent { requests: 18.0, tokens: 400.0 });
        assert_eq!(log.sent_since(1, 125), Sent { requests: 1.0, tokens: 400.0 });
        assert_eq!(log.entries(1).map(|(_, tokens)| tokens).sum::<f64>(), 400.0);
    }

    #[test]
    fn one_prompt_routed_many_times_counts_its_tokens_once() {
        let mut log = RoutedLog::default();
        for at in [100, 110, 120] {
            log.record_prompt(1, at, Sent { requests: 1.0, tokens: 9_000.0 }, Some(7), 1000);
        }
        log.record_prompt(1, 130, Sent { requests: 1.0, tokens: 500.0 }, Some(8), 1000);
        log.record(1, 140, 300.0, 1000);
        assert_eq!(log.sent_since(1, 0), Sent { requests: 5.0, tokens: 9_800.0 });
        assert_eq!(log.sent_since(1, 115), Sent { requests: 3.0, tokens: 9_800.0 });
        assert!(log.holds_prompt(1, 7, 120) && !log.holds_prompt(1, 7, 121) && !log.holds_prompt(2, 7, 0));
        log.record(1, 2_000, 1.0, 1000);
        assert_eq!(log.sent_since(1, 0), Sent { requests: 1.0, tokens: 1.0 }, "forgotten after keep_ms");
    }
}
