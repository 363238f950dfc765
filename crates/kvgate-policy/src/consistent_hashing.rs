//! `consistent_hashing`: the request's session key (the routing-key header, else the body's
//! `user` field) picks a point on a consistent-hash ring with virtual nodes; the first worker
//! clockwise that is a candidate serves it. When the fleet changes, about 1/N of the keys move.
//! A request without a session key is placed by its prompt prefix (as `prefix_hash` does,
//! without the load bound), and without either at random.

use crate::hashing::{prefix_key, session_key, SharedRing};
use crate::{Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, SelectContext, WorkerId};
use rand::Rng;

pub struct ConsistentHashingPolicy {
    ring: SharedRing,
    prefix_tokens: usize,
}

impl ConsistentHashingPolicy {
    pub fn new(prefix_tokens: usize, virtual_nodes: usize) -> Self {
        Self { ring: SharedRing::new(virtual_nodes), prefix_tokens }
    }
}

impl Policy for ConsistentHashingPolicy {
    fn name(&self) -> &'static str {
        "consistent_hashing"
    }

    fn decide(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let key = session_key(request)
            .or_else(|| prefix_key(request, self.prefix_tokens))
            .unwrap_or_else(|| ctx.rng.random());
        let chosen = self.ring.find(key, &candidates, |_| true).unwrap_or(0);
        Ok(Decision::plain(candidates[chosen].id, Reason::ConsistentHash))
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
    use crate::{Candidate, RoutingKey};

    fn route(policy: &ConsistentHashingPolicy, session: &str, pool: &[Candidate]) -> WorkerId {
        let request = RouteRequest { key: RoutingKey::None, prompt_tokens: 0, session: Some(session) };
        decide(policy, &request, pool, 1).worker
    }

    #[test]
    fn keys_are_stable_and_about_one_nth_move_when_a_worker_joins() {
        let policy = ConsistentHashingPolicy::new(256, 160);
        for w in 0..9u32 {
            policy.add_worker(w, &format!("http://127.0.0.1:{}", 8000 + w));
        }
        let eight = candidates(&[0; 8]);
        let nine = candidates(&[0; 9]);
        let keys: Vec<String> = (0..10_000).map(|i| format!("user-{i}")).collect();
        let before: Vec<_> = keys.iter().map(|k| route(&policy, k, &eight)).collect();
        assert_eq!(before, keys.iter().map(|k| route(&policy, k, &eight)).collect::<Vec<_>>(), "stable");
        let after: Vec<_> = keys.iter().map(|k| route(&policy, k, &nine)).collect();
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        assert!((700..=1_600).contains(&moved), "{moved} of 10,000 moved (ideal 1,111)");
        // A worker missing from the candidates (unhealthy): only its keys go elsewhere, and
        // they come back when it does.
        let without_3: Vec<Candidate> = eight.iter().copied().filter(|c| c.id != 3).collect();
        let degraded: Vec<_> = keys.iter().map(|k| route(&policy, k, &without_3)).collect();
        assert!(before.iter().zip(&degraded).all(|(a, b)| a == b || *a == 3));
        assert_eq!(before, keys.iter().map(|k| route(&policy, k, &eight)).collect::<Vec<_>>());
    }
}
