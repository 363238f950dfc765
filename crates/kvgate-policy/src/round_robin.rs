//! `round_robin`: each request goes to the next candidate in turn.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{Candidate, Decision, NoRoute, Policy, Reason, RouteRequest, SelectContext};

#[derive(Debug, Default)]
pub struct RoundRobinPolicy {
    next: AtomicUsize,
}

impl RoundRobinPolicy {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Policy for RoundRobinPolicy {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(
        &self,
        _request: &RouteRequest<'_>,
        candidates: &[Candidate],
        _ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        if candidates.is_empty() {
            return Err(NoRoute::NoCandidates);
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(Decision {
            worker: candidates[turn % candidates.len()].id,
            reason: Reason::RoundRobin,
            matches: None,
            index: None,
            predicted: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, ctx_rng};

    #[test]
    fn cycles_through_candidates() {
        let policy = RoundRobinPolicy::new();
        let pool = candidates(&[0, 0, 0]);
        let mut rng = ctx_rng(1);
        let mut ctx =
            SelectContext { now_ms: 0, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let picks: Vec<_> =
            (0..6).map(|_| policy.select(&RouteRequest::EMPTY, &pool, &mut ctx).unwrap().worker).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn empty_pool_is_no_route() {
        let policy = RoundRobinPolicy::new();
        let mut rng = ctx_rng(1);
        let mut ctx =
            SelectContext { now_ms: 0, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        assert_eq!(policy.select(&RouteRequest::EMPTY, &[], &mut ctx), Err(NoRoute::NoCandidates));
    }
}
