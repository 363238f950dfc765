//! `round_robin`: each request goes to the next candidate in turn (the turn advances when a
//! request is sent, not when one is only decided).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, Routed, SelectContext};

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

    fn decide(
        &self,
        _request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        _ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let turn = self.next.load(Ordering::Relaxed);
        Ok(Decision::plain(candidates[turn % candidates.len()].id, Reason::RoundRobin))
    }

    fn on_routed(&self, _routed: &Routed<'_>) {
        self.next.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, ctx_rng, route};

    #[test]
    fn cycles_through_candidates() {
        let policy = RoundRobinPolicy::new();
        let pool = candidates(&[0, 0, 0]);
        let mut rng = ctx_rng(1);
        let mut ctx =
            SelectContext { now_ms: 0, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let picks: Vec<_> = (0..6)
            .map(|_| route(&policy, &RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx).worker)
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }
}
