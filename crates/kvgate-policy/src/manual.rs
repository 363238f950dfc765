//! `manual`: sticky sessions. A request's session key (the routing-key header, else the body's
//! `user` field) is bound to a worker on first sight, placed by `--assignment-mode` (`random`,
//! `min_load`: fewest in flight, `min_group`: fewest sessions bound); later requests of the
//! session go to the same worker for as long as it is a candidate. A session whose worker is
//! gone (removed, unhealthy) is bound anew, once: it then stays on its new worker. Sessions idle
//! longer than `--max-idle-secs` are forgotten, and at most `--max-sessions` are kept (the least
//! recently used go first), so memory stays bounded. Requests without a key are placed by the
//! assignment mode and not remembered.

use std::collections::HashMap;
use std::sync::Mutex;

use rand::Rng;

use crate::hashing::session_key;
use crate::pick::pick_min_by;
use crate::{
    Candidate, Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, SelectContext, WorkerId,
};

/// How a new session picks its worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum AssignmentMode {
    /// A uniformly random worker.
    Random,
    /// The worker with the fewest requests in flight.
    MinLoad,
    /// The worker with the fewest sessions bound to it.
    MinGroup,
}

#[derive(Clone, Copy, Debug)]
struct Session {
    worker: WorkerId,
    last_ms: u64,
}

#[derive(Debug, Default)]
struct Sessions {
    by_key: HashMap<u64, Session>,
    per_worker: HashMap<WorkerId, usize>,
}

impl Sessions {
    fn bind(&mut self, key: u64, worker: WorkerId, now_ms: u64) {
        if let Some(old) = self.by_key.insert(key, Session { worker, last_ms: now_ms }) {
            self.unbind_count(old.worker);
        }
        *self.per_worker.entry(worker).or_default() += 1;
    }

    fn unbind_count(&mut self, worker: WorkerId) {
        if let Some(count) = self.per_worker.get_mut(&worker) {
            *count = count.saturating_sub(1);
        }
    }

    /// Forgets the sessions `keep` refuses.
    fn retain(&mut self, mut keep: impl FnMut(&Session) -> bool) {
        let per_worker = &mut self.per_worker;
        self.by_key.retain(|_, session| {
            let kept = keep(session);
            if !kept {
                if let Some(count) = per_worker.get_mut(&session.worker) {
                    *count = count.saturating_sub(1);
                }
            }
            kept
        });
    }
}

pub struct ManualPolicy {
    sessions: Mutex<Sessions>,
    mode: AssignmentMode,
    max_idle_ms: u64,
    max_sessions: usize,
}

impl ManualPolicy {
    pub fn new(mode: AssignmentMode, max_idle_secs: f64, max_sessions: usize) -> Self {
        Self {
            sessions: Mutex::default(),
            mode,
            max_idle_ms: (max_idle_secs * 1000.0) as u64,
            max_sessions: max_sessions.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sessions currently remembered.
    pub fn len(&self) -> usize {
        self.lock().by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn place(&self, sessions: &Sessions, candidates: &[Candidate], rng: &mut dyn rand::RngCore) -> usize {
        match self.mode {
            AssignmentMode::Random => Some(rng.random_range(0..candidates.len())),
            AssignmentMode::MinLoad => pick_min_by(0..candidates.len(), |i| candidates[i].in_flight, rng),
            AssignmentMode::MinGroup => pick_min_by(
                0..candidates.len(),
                |i| {
                    (
                        sessions.per_worker.get(&candidates[i].id).copied().unwrap_or(0),
                        candidates[i].in_flight,
                    )
                },
                rng,
            ),
        }
        .unwrap_or(0)
    }

    /// Makes room for one more session: idle ones go first, then the least recently used.
    fn make_room(&self, sessions: &mut Sessions, now_ms: u64) {
        if sessions.by_key.len() < self.max_sessions {
            return;
        }
        let max_idle = self.max_idle_ms;
        sessions.retain(|s| now_ms.saturating_sub(s.last_ms) <= max_idle);
        if sessions.by_key.len() >= self.max_sessions {
            // Drop the oldest eighth at once, so this stays amortised O(1) per new session.
            let mut ages: Vec<u64> = sessions.by_key.values().map(|s| s.last_ms).collect();
            let cut = (self.max_sessions / 8).max(1).min(ages.len() - 1);
            let (_, &mut threshold, _) = ages.select_nth_unstable(cut);
            sessions.retain(|s| s.last_ms > threshold);
        }
    }
}

impl Policy for ManualPolicy {
    fn name(&self) -> &'static str {
        "manual"
    }

    fn select(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let mut sessions = self.lock();
        let Some(key) = session_key(request) else {
            let chosen = self.place(&sessions, &candidates, ctx.rng);
            return Ok(Decision::plain(candidates[chosen].id, Reason::SessionAssigned));
        };
        let now_ms = ctx.now_ms;
        if let Some(session) = sessions.by_key.get_mut(&key) {
            if now_ms.saturating_sub(session.last_ms) <= self.max_idle_ms {
                if let Some(c) = candidates.iter().find(|c| c.id == session.worker) {
                    session.last_ms = now_ms;
                    return Ok(Decision::plain(c.id, Reason::Sticky));
                }
            }
        } else {
            self.make_room(&mut sessions, now_ms);
        }
        let chosen = candidates[self.place(&sessions, &candidates, ctx.rng)].id;
        sessions.bind(key, chosen, now_ms);
        Ok(Decision::plain(chosen, Reason::SessionAssigned))
    }

    fn remove_worker(&self, worker: WorkerId) {
        let mut sessions = self.lock();
        sessions.retain(|s| s.worker != worker);
        sessions.per_worker.remove(&worker);
    }

    fn maintain(&self, now_ms: u64) {
        let max_idle = self.max_idle_ms;
        self.lock().retain(|s| now_ms.saturating_sub(s.last_ms) <= max_idle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, decide};
    use crate::RoutingKey;

    fn route(policy: &ManualPolicy, session: &str, pool: &[Candidate], now_ms: u64) -> Decision {
        let request = RouteRequest { key: RoutingKey::None, prompt_tokens: 0, session: Some(session) };
        decide(policy, &request, pool, now_ms)
    }

    #[test]
    fn sessions_stick_and_survive_unrelated_churn() {
        let policy = ManualPolicy::new(AssignmentMode::MinGroup, 3600.0, 1000);
        let pool = candidates(&[0; 4]);
        let homes: Vec<WorkerId> =
            (0..40).map(|i| route(&policy, &format!("s{i}"), &pool, 0).worker).collect();
        for worker in 0..4 {
            assert_eq!(
                homes.iter().filter(|&&w| w == worker).count(),
                10,
                "min_group spreads sessions evenly"
            );
        }
        // Worker 3 leaves, a worker 4 joins: sessions on 0-2 stay where they were.
        policy.remove_worker(3);
        let churned: Vec<Candidate> = candidates(&[0; 5]).into_iter().filter(|c| c.id != 3).collect();
        for (i, &home) in homes.iter().enumerate() {
            let now = route(&policy, &format!("s{i}"), &churned, 10);
            if home == 3 {
                assert_eq!(now.reason, Reason::SessionAssigned, "a session whose worker left is bound anew");
            } else {
                assert_eq!((now.worker, now.reason), (home, Reason::Sticky));
            }
        }
    }

    #[test]
    fn a_dead_workers_session_is_reassigned_once_and_stays() {
        let policy = ManualPolicy::new(AssignmentMode::MinLoad, 3600.0, 1000);
        let pool = candidates(&[0, 0]);
        let home = route(&policy, "chat", &pool, 0).worker;
        let survivors: Vec<Candidate> = pool.iter().copied().filter(|c| c.id != home).collect();
        let moved = route(&policy, "chat", &survivors, 1);
        assert_ne!(moved.worker, home);
        // The old worker is back: the session stays on its new one.
        assert_eq!(route(&policy, "chat", &pool, 2).worker, moved.worker);
    }

    #[test]
    fn idle_sessions_are_forgotten_and_memory_is_bounded() {
        let policy = ManualPolicy::new(AssignmentMode::Random, 10.0, 100);
        let pool = candidates(&[0; 3]);
        for i in 0..50 {
            route(&policy, &format!("old{i}"), &pool, 0);
        }
        policy.maintain(5_000);
        assert_eq!(policy.len(), 50);
        policy.maintain(10_001);
        assert!(policy.is_empty(), "idle past max_idle_secs");
        for i in 0..1_000u64 {
            route(&policy, &format!("k{i}"), &pool, 20_000 + i);
        }
        assert!(policy.len() <= 100, "{} sessions kept", policy.len());
        // The most recent sessions are the ones kept.
        assert_eq!(route(&policy, "k999", &pool, 30_000).reason, Reason::Sticky);
    }
}
