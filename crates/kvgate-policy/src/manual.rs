//! `manual`: sticky sessions. A request's session key (the routing-key header, else the body's
//! `user` field) is bound to a worker on first sight, placed by `--assignment-mode` (`random`,
//! `min_load`: fewest in flight, `min_group`: fewest sessions bound); later requests of the
//! session go to the same worker for as long as it is a candidate. A session whose worker is
//! gone (removed, unhealthy) is bound anew, once: it then stays on its new worker. Sessions idle
//! longer than `--max-idle-secs` are forgotten, and at most `--max-sessions` are kept (an
//! `lru::LruCache`: the least recently used go first), so memory stays bounded. Requests without
//! a key are placed by the assignment mode and not remembered.

use std::collections::HashMap;
use std::sync::Mutex;

use lru::LruCache;
use rand::Rng;

use crate::hashing::session_key;
use crate::pick::pick_min_by;
use crate::{
    Candidate, Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, Routed, SelectContext, WorkerId,
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

/// The sessions in least-recently-used order (each use stamps `last_ms` with the host's clock,
/// which never goes back, so that order is also the order of `last_ms`), and how many are bound to
/// each worker.
#[derive(Debug)]
struct Sessions {
    by_key: LruCache<u64, Session>,
    per_worker: HashMap<WorkerId, usize>,
}

impl Default for Sessions {
    fn default() -> Self {
        // Unbounded: `--max-sessions` is enforced on insertion, and nothing is allocated ahead.
        Sessions { by_key: LruCache::unbounded(), per_worker: HashMap::new() }
    }
}

impl Sessions {
    fn bind(&mut self, key: u64, worker: WorkerId, now_ms: u64) {
        if let Some(old) = self.by_key.put(key, Session { worker, last_ms: now_ms }) {
            unbind_count(&mut self.per_worker, old.worker);
        }
        *self.per_worker.entry(worker).or_default() += 1;
    }

    /// Forgets the sessions idle longer than `max_idle_ms`, from the least recently used on.
    fn expire(&mut self, now_ms: u64, max_idle_ms: u64) {
        while let Some((_, oldest)) = self.by_key.peek_lru() {
            if now_ms.saturating_sub(oldest.last_ms) <= max_idle_ms {
                return;
            }
            self.forget_least_recent();
        }
    }

    fn forget_least_recent(&mut self) {
        if let Some((_, session)) = self.by_key.pop_lru() {
            unbind_count(&mut self.per_worker, session.worker);
        }
    }

    fn remove_worker(&mut self, worker: WorkerId) {
        self.by_key.retain(|_, session| session.worker != worker);
        self.per_worker.remove(&worker);
    }
}

fn unbind_count(per_worker: &mut HashMap<WorkerId, usize>, worker: WorkerId) {
    if let Some(count) = per_worker.get_mut(&worker) {
        *count = count.saturating_sub(1);
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

    /// Where a new session goes. `evicted`: the sessions binding it would first forget (to make
    /// room), not counted for `min_group`.
    fn place(
        &self,
        sessions: &Sessions,
        evicted: &[WorkerId],
        candidates: &[Candidate],
        rng: &mut dyn rand::RngCore,
    ) -> usize {
        let bound = |worker: WorkerId| {
            let gone = evicted.iter().filter(|&&w| w == worker).count();
            sessions.per_worker.get(&worker).copied().unwrap_or(0).saturating_sub(gone)
        };
        match self.mode {
            AssignmentMode::Random => Some(rng.random_range(0..candidates.len())),
            AssignmentMode::MinLoad => pick_min_by(0..candidates.len(), |i| candidates[i].in_flight, rng),
            AssignmentMode::MinGroup => {
                pick_min_by(0..candidates.len(), |i| (bound(candidates[i].id), candidates[i].in_flight), rng)
            }
        }
        .unwrap_or(0)
    }

    /// How many sessions, least recently used first, binding one more would forget: none while
    /// there is room, else the idle ones and as many more as the bound needs (what
    /// [`ManualPolicy::make_room`] forgets).
    fn to_evict(&self, sessions: &Sessions, now_ms: u64) -> usize {
        let held = sessions.by_key.len();
        if held < self.max_sessions {
            return 0;
        }
        let idle = sessions
            .by_key
            .iter()
            .rev()
            .take_while(|(_, session)| now_ms.saturating_sub(session.last_ms) > self.max_idle_ms)
            .count();
        idle.max(held + 1 - self.max_sessions)
    }

    /// Makes room for one more session: idle ones go first, then the least recently used.
    fn make_room(&self, sessions: &mut Sessions, now_ms: u64) {
        for _ in 0..self.to_evict(sessions, now_ms) {
            sessions.forget_least_recent();
        }
    }

    /// The worker of `key`'s session, if it is bound, not idle and a candidate.
    fn bound_worker(
        &self,
        sessions: &Sessions,
        key: u64,
        candidates: &[Candidate],
        now_ms: u64,
    ) -> Option<WorkerId> {
        let session = sessions.by_key.peek(&key)?;
        let fresh = now_ms.saturating_sub(session.last_ms) <= self.max_idle_ms;
        fresh.then_some(session.worker).filter(|&worker| candidates.iter().any(|c| c.id == worker))
    }
}

impl Policy for ManualPolicy {
    fn name(&self) -> &'static str {
        "manual"
    }

    /// The session's worker (`sticky`), or where the assignment mode places a new, idle or
    /// orphaned session (`session_assigned`); nothing is bound until `on_routed`.
    fn decide(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let sessions = self.lock();
        let Some(key) = session_key(request) else {
            let chosen = self.place(&sessions, &[], &candidates, ctx.rng);
            return Ok(Decision::plain(candidates[chosen].id, Reason::SessionAssigned));
        };
        if let Some(worker) = self.bound_worker(&sessions, key, &candidates, ctx.now_ms) {
            return Ok(Decision::plain(worker, Reason::Sticky));
        }
        // A new session first makes room (`on_routed`): those it would forget do not count.
        let evicted: Vec<WorkerId> = match sessions.by_key.contains(&key) {
            true => Vec::new(),
            false => {
                let n = self.to_evict(&sessions, ctx.now_ms);
                sessions.by_key.iter().rev().take(n).map(|(_, session)| session.worker).collect()
            }
        };
        let chosen = candidates[self.place(&sessions, &evicted, &candidates, ctx.rng)].id;
        Ok(Decision::plain(chosen, Reason::SessionAssigned))
    }

    /// A sticky request renews its session; an assigned one binds it (a new session first makes
    /// room under `--max-sessions`).
    fn on_routed(&self, routed: &Routed<'_>) {
        let Some(key) = session_key(routed.request) else { return };
        let (worker, now_ms) = (routed.decision.worker, routed.now_ms);
        let mut sessions = self.lock();
        match routed.decision.reason {
            Reason::Sticky => {
                if let Some(session) = sessions.by_key.get_mut(&key) {
                    session.last_ms = now_ms;
                }
            }
            Reason::SessionAssigned => {
                if !sessions.by_key.contains(&key) {
                    self.make_room(&mut sessions, now_ms);
                }
                sessions.bind(key, worker, now_ms);
            }
            _ => {}
        }
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.lock().remove_worker(worker);
    }

    fn maintain(&self, now_ms: u64) {
        self.lock().expire(now_ms, self.max_idle_ms);
    }
}

#[cfg(test)]
mod tests {
    use expect_test::{expect, Expect};

    use super::*;
    use crate::test_support::{candidates, decide};
    use crate::RoutingKey;

    /// Runs `steps` (`at_ms session workers`: the request's time, its session key, the
    /// candidates' ids; `maintain` as the session runs the host's maintenance) and checks one
    /// line per decision against `expected`, with the sessions remembered after it.
    fn check(policy: &ManualPolicy, steps: &str, expected: Expect) {
        let mut trace = String::new();
        for step in steps.lines().map(str::trim).filter(|line| !line.is_empty()) {
            let fields: Vec<&str> = step.split_whitespace().collect();
            let at_ms: u64 = fields[0].parse().expect("a time");
            if fields[1] == "maintain" {
                policy.maintain(at_ms);
                trace.push_str(&format!("at {at_ms:>5} maintain         sessions={}\n", policy.len()));
                continue;
            }
            let pool: Vec<Candidate> = fields[2]
                .split(',')
                .map(|id| Candidate { id: id.parse().expect("a worker id"), in_flight: 0, load: None })
                .collect();
            let decision = route(policy, fields[1], &pool, at_ms);
            let reason = format!("{:?}", decision.reason);
            trace.push_str(&format!(
                "at {at_ms:>5} {:<6} -> {} {reason:<16} sessions={}\n",
                fields[1],
                decision.worker,
                policy.len()
            ));
        }
        expected.assert_eq(&trace);
    }

    #[test]
    fn the_least_recently_used_session_goes_first_and_idle_ones_expire() {
        // At most three sessions, idle ones forgotten after 10 s, new ones on the emptiest worker.
        let policy = ManualPolicy::new(AssignmentMode::MinGroup, 10.0, 3);
        check(
            &policy,
            "
            0 a 0,1,2
            1 b 0,1,2
            2 c 0,1,2
            3 a 0,1,2
            4 d 0,1,2
            5 b 0,1,2
            6 a 1,2
            7 a 0,1,2
            20000 maintain
            20001 c 0,1,2
            ",
            expect![[r#"
                at     0 a      -> 0 SessionAssigned  sessions=1
                at     1 b      -> 2 SessionAssigned  sessions=2
                at     2 c      -> 1 SessionAssigned  sessions=3
                at     3 a      -> 0 Sticky           sessions=3
                at     4 d      -> 2 SessionAssigned  sessions=3
                at     5 b      -> 1 SessionAssigned  sessions=3
                at     6 a      -> 2 SessionAssigned  sessions=3
                at     7 a      -> 2 Sticky           sessions=3
                at 20000 maintain         sessions=0
                at 20001 c      -> 0 SessionAssigned  sessions=1
            "#]],
        );
    }

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
