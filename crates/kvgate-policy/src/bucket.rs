//! `bucket` (for prefill pools): prompts are sorted into length buckets, one per worker, whose
//! boundaries adapt every `--bucket-adjust-interval-secs` to the recent prompt lengths so that
//! each worker gets a similar share of prefill tokens (not of requests: one long prompt weighs
//! as much as many short ones). Prompts of similar length batch well together. When the
//! chosen worker is far busier than the least busy one (`--balance-abs-threshold` and
//! `--balance-rel-threshold`, as for cache_aware) the request goes to the least busy instead.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::pick::least_in_flight;
use crate::{Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, Routed, SelectContext, WorkerId};

/// Recent prompt lengths remembered for placing the boundaries.
const WINDOW: usize = 4096;

#[derive(Debug, Default)]
struct Buckets {
    /// Prompt lengths seen, most recent last.
    recent: VecDeque<u64>,
    /// Upper bounds (exclusive) of each worker's bucket but the last, in `members` order.
    boundaries: Vec<u64>,
    members: Vec<WorkerId>,
    adjusted_ms: Option<u64>,
}

impl Buckets {
    /// Boundaries splitting the recent prompts' tokens into `n` equal shares.
    fn placed(&self, n: usize) -> Vec<u64> {
        let mut lengths: Vec<u64> = self.recent.iter().copied().collect();
        lengths.sort_unstable();
        let total: u64 = lengths.iter().sum();
        let mut boundaries = Vec::new();
        if total == 0 || n < 2 {
            return boundaries;
        }
        let mut cumulative = 0u64;
        let mut next_share = 1;
        for &length in &lengths {
            cumulative += length;
            while next_share < n && cumulative * n as u64 >= total * next_share as u64 {
                boundaries.push(length + 1);
                next_share += 1;
            }
        }
        boundaries
    }

    /// Whether the boundaries are placed again before deciding among `members` (sorted) at
    /// `now_ms`: the members changed, or `adjust_ms` passed since the last placement.
    fn due(&self, members: &[WorkerId], now_ms: u64, adjust_ms: u64) -> bool {
        members != self.members || self.adjusted_ms.is_none_or(|at| now_ms.saturating_sub(at) >= adjust_ms)
    }
}

/// The bucket (index into the members) of a prompt of `length` tokens.
fn bucket(boundaries: &[u64], length: u64) -> usize {
    boundaries.partition_point(|&bound| bound <= length)
}

/// The candidates' ids, sorted: the buckets' owners in order.
fn members(candidates: &Candidates<'_>) -> Vec<WorkerId> {
    let mut members: Vec<WorkerId> = candidates.iter().map(|c| c.id).collect();
    members.sort_unstable();
    members
}

pub struct BucketPolicy {
    buckets: Mutex<Buckets>,
    adjust_ms: u64,
    balance_abs: f64,
    balance_rel: f64,
}

impl BucketPolicy {
    pub fn new(adjust_interval_secs: f64, balance_abs: f64, balance_rel: f64) -> Self {
        Self {
            buckets: Mutex::default(),
            adjust_ms: (adjust_interval_secs * 1000.0) as u64,
            balance_abs,
            balance_rel,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buckets> {
        self.buckets.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Policy for BucketPolicy {
    fn name(&self) -> &'static str {
        "bucket"
    }

    /// The bucket owner of the prompt's length, on the boundaries as they stand or, when they are
    /// due to be placed again, as `on_routed` will place them (from the lengths seen before
    /// this request).
    fn decide(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let buckets = self.lock();
        let members = members(&candidates);
        let placed;
        let (boundaries, members) = if buckets.due(&members, ctx.now_ms, self.adjust_ms) {
            placed = buckets.placed(members.len());
            (&placed, &members)
        } else {
            (&buckets.boundaries, &buckets.members)
        };
        let length = request.prompt_tokens;
        let fallback = least_in_flight(&candidates, ctx.rng);
        if boundaries.is_empty() {
            return Ok(Decision::plain(candidates[fallback].id, Reason::Bucket));
        }
        let worker = members[bucket(boundaries, length).min(members.len() - 1)];
        let chosen = candidates.iter().position(|c| c.id == worker).unwrap_or(fallback);
        let (busy, idle) = (candidates[chosen].in_flight as f64, candidates[fallback].in_flight as f64);
        if busy - idle > self.balance_abs && busy > self.balance_rel * idle {
            return Ok(Decision::plain(candidates[fallback].id, Reason::ImbalanceCount));
        }
        Ok(Decision::plain(worker, Reason::Bucket))
    }

    /// Places the boundaries when due (the members changed, or the interval passed), then
    /// remembers the prompt's length.
    fn on_routed(&self, routed: &Routed<'_>) {
        let mut buckets = self.lock();
        let members = members(&routed.candidates);
        if buckets.due(&members, routed.now_ms, self.adjust_ms) {
            buckets.boundaries = buckets.placed(members.len());
            buckets.members = members;
            buckets.adjusted_ms = Some(routed.now_ms);
        }
        if buckets.recent.len() == WINDOW {
            buckets.recent.pop_front();
        }
        buckets.recent.push_back(routed.request.prompt_tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, decide};
    use crate::{Candidate, RoutingKey};

    fn route(policy: &BucketPolicy, tokens: u64, pool: &[Candidate], now_ms: u64) -> Decision {
        let request = RouteRequest { key: RoutingKey::None, prompt_tokens: tokens, session: None };
        decide(policy, &request, pool, now_ms)
    }

    #[test]
    fn boundaries_give_each_worker_a_similar_share_of_prefill_tokens() {
        let policy = BucketPolicy::new(1.0, 64.0, 1.5);
        let pool = candidates(&[0; 4]);
        // Lengths skewed like chat traffic: many short prompts, a few long ones.
        let lengths: Vec<u64> =
            (0..4000u64).map(|i| if i % 10 == 0 { 8000 + i % 997 } else { 200 + (i * 37) % 800 }).collect();
        for (i, &len) in lengths.iter().enumerate() {
            route(&policy, len, &pool, i as u64); // learns (adjusts once a second)
        }
        let mut tokens = [0u64; 4];
        for (i, &len) in lengths.iter().enumerate() {
            let decision = route(&policy, len, &pool, 10_000 + i as u64);
            assert_eq!(decision.reason, Reason::Bucket);
            tokens[decision.worker as usize] += len;
        }
        let total: u64 = tokens.iter().sum();
        for share in tokens {
            let fraction = share as f64 / total as f64;
            assert!((0.15..=0.35).contains(&fraction), "shares {tokens:?}");
        }
        // Short prompts go to the first bucket, the longest to the last.
        assert_eq!(route(&policy, 1, &pool, 20_000).worker, 0);
        assert_eq!(route(&policy, 100_000, &pool, 20_001).worker, 3);
    }

    #[test]
    fn a_far_busier_bucket_owner_is_skipped() {
        let policy = BucketPolicy::new(1.0, 4.0, 1.5);
        for i in 0..100 {
            route(&policy, 100 + i * 10, &candidates(&[0, 0]), i);
        }
        let decision = route(&policy, 1_000_000, &candidates(&[0, 50]), 10_000);
        assert_eq!((decision.worker, decision.reason), (0, Reason::ImbalanceCount));
    }
}
