//! `prefix_hash`: the hash of the prompt's first `--prefix-token-count` tokens (characters for
//! text) picks a point on a consistent-hash ring; the request goes to the first worker clockwise
//! whose load stays within `--prefix-hash-load-factor` times the mean (consistent hashing with
//! bounded loads: a worker may take the request if its in-flight count plus one is at most
//! ceil(factor x (total in flight + 1) / workers)). A cheap stand-in for the prefix tree: the same
//! system prompt or conversation start lands on the same worker while it is not overloaded.

use crate::hashing::{prefix_key, SharedRing};
use crate::{
    Candidate, Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, SelectContext, WorkerId,
};
use rand::Rng;

pub struct PrefixHashPolicy {
    ring: SharedRing,
    prefix_tokens: usize,
    load_factor: f64,
}

impl PrefixHashPolicy {
    pub fn new(prefix_tokens: usize, load_factor: f64, virtual_nodes: usize) -> Self {
        Self { ring: SharedRing::new(virtual_nodes), prefix_tokens, load_factor }
    }
}

/// The most requests a worker may have in flight, the new one included.
pub(crate) fn bounded_capacity(candidates: &[Candidate], load_factor: f64) -> u64 {
    let total: u64 = candidates.iter().map(|c| c.in_flight).sum();
    ((load_factor * (total + 1) as f64) / candidates.len() as f64).ceil().max(1.0) as u64
}

impl Policy for PrefixHashPolicy {
    fn name(&self) -> &'static str {
        "prefix_hash"
    }

    fn decide(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let key = prefix_key(request, self.prefix_tokens).unwrap_or_else(|| ctx.rng.random());
        let capacity = bounded_capacity(&candidates, self.load_factor);
        let chosen = self
            .ring
            .find(key, &candidates, |i| candidates[i].in_flight < capacity)
            .unwrap_or_else(|| crate::pick::least_in_flight(&candidates, ctx.rng));
        Ok(Decision::plain(candidates[chosen].id, Reason::PrefixHash))
    }

    fn needs_routing_key(&self) -> bool {
        true
    }

    fn add_worker(&self, worker: WorkerId, name: &str) {
        self.ring.name(worker, name);
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.ring.forget(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, decide};
    use crate::RoutingKey;

    fn route(policy: &PrefixHashPolicy, prompt: &str, in_flight: &[u64]) -> WorkerId {
        let request = RouteRequest { key: RoutingKey::Text(prompt), prompt_tokens: 10, session: None };
        decide(policy, &request, &candidates(in_flight), 1).worker
    }

    #[test]
    fn the_same_prefix_goes_to_the_same_worker_until_it_is_overloaded() {
        let policy = PrefixHashPolicy::new(16, 1.25, 160);
        let prompt = "You are a helpful assistant. Answer briefly. question 1";
        let home = route(&policy, prompt, &[0; 4]);
        // Only the first 16 characters count.
        assert_eq!(route(&policy, "You are a helpful assistant. Something else entirely", &[0; 4]), home);
        let spread: std::collections::BTreeSet<_> =
            (0..64).map(|i| route(&policy, &format!("{i:>4} distinct prompt"), &[0; 4])).collect();
        assert_eq!(spread.len(), 4, "different prefixes spread over the ring");
        // The home worker at 5 in flight while the others have 1: capacity ceil(1.25 x 9 / 4) = 3.
        let mut loads = [1u64; 4];
        loads[home as usize] = 5;
        let moved = route(&policy, prompt, &loads);
        assert_ne!(moved, home, "a worker past the load bound is walked past");
        // Within the bound it stays home: 1 + 1 in flight <= ceil(1.25 x 5 / 4) = 2.
        loads[home as usize] = 1;
        assert_eq!(route(&policy, prompt, &loads), home);
    }

    #[test]
    fn the_bound_always_leaves_a_worker() {
        for in_flight in [[0u64, 0, 0], [5, 5, 5], [100, 0, 0], [7, 3, 9]] {
            let capacity = bounded_capacity(&candidates(&in_flight), 1.0);
            assert!(in_flight.iter().any(|&n| n < capacity), "{in_flight:?} capacity {capacity}");
        }
    }
}
