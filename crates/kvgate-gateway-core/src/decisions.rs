//! What the fleet page shows of recent routing: the last decisions in a bounded ring (recorded
//! by the request path with one short lock and no allocation), and each worker's tally of the
//! prefix match it was chosen with against the best any candidate offered.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kvgate_policy::Decision;

use kvgate_protocol::role::WorkerRole;

/// One live routing decision, as `GET /v1/fleet` lists it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecisionRecord {
    /// When it was made, on the gateway's millisecond clock (`Clock::now_ms`).
    pub at_ms: u64,
    /// The pool's side: regular, or the prefill or decode side of a pair.
    pub role: WorkerRole,
    pub decision: Decision,
}

/// The last `capacity` live decisions, oldest first. Pushing never allocates (the ring is
/// allocated whole at construction) and holds the lock only to copy one record in.
pub struct DecisionLog {
    ring: Mutex<VecDeque<DecisionRecord>>,
    capacity: usize,
}

/// Decisions kept for the fleet page.
pub const RECENT_DECISIONS: usize = 64;

impl DecisionLog {
    pub fn new(capacity: usize) -> Self {
        Self { ring: Mutex::new(VecDeque::with_capacity(capacity.max(1))), capacity: capacity.max(1) }
    }

    pub fn record(&self, record: DecisionRecord) {
        let mut ring = self.ring.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if ring.len() == self.capacity {
            ring.pop_front();
        }
        ring.push_back(record);
    }

    /// The records, newest first.
    pub fn recent(&self) -> Vec<DecisionRecord> {
        let ring = self.ring.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        ring.iter().rev().copied().collect()
    }
}

impl Default for DecisionLog {
    fn default() -> Self {
        Self::new(RECENT_DECISIONS)
    }
}

/// Match rates are summed in millionths (a u64 holds 10^13 decisions at rate 1).
const MATCH_SCALE: f64 = 1e6;

/// One worker's routing tally: decisions that chose it, and over those made by a prefix-aware
/// policy the sums of the match rate it was chosen with and of the best one available.
#[derive(Debug, Default)]
pub struct RoutedTally {
    decisions: AtomicU64,
    matched: AtomicU64,
    chosen_match: AtomicU64,
    best_match: AtomicU64,
}

/// A worker's tally as read: the mean match rates are over `matched` decisions.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TallyView {
    pub decisions: u64,
    pub matched: u64,
    pub chosen_match_sum: f64,
    pub best_match_sum: f64,
}

impl RoutedTally {
    pub fn record(&self, decision: &Decision) {
        self.decisions.fetch_add(1, Ordering::Relaxed);
        if let Some(matches) = decision.matches {
            let scaled = |rate: f64| (rate.clamp(0.0, 1.0) * MATCH_SCALE).round() as u64;
            self.matched.fetch_add(1, Ordering::Relaxed);
            self.chosen_match.fetch_add(scaled(matches.chosen_match_rate), Ordering::Relaxed);
            self.best_match.fetch_add(scaled(matches.best_match_rate), Ordering::Relaxed);
        }
    }

    pub fn view(&self) -> TallyView {
        TallyView {
            decisions: self.decisions.load(Ordering::Relaxed),
            matched: self.matched.load(Ordering::Relaxed),
            chosen_match_sum: self.chosen_match.load(Ordering::Relaxed) as f64 / MATCH_SCALE,
            best_match_sum: self.best_match.load(Ordering::Relaxed) as f64 / MATCH_SCALE,
        }
    }
}

impl TallyView {
    pub fn add(&mut self, other: TallyView) {
        self.decisions += other.decisions;
        self.matched += other.matched;
        self.chosen_match_sum += other.chosen_match_sum;
        self.best_match_sum += other.best_match_sum;
    }

    /// Mean match rate of the chosen worker and of the best candidate (None before any
    /// prefix-aware decision).
    pub fn means(&self) -> Option<(f64, f64)> {
        (self.matched > 0).then(|| {
            let n = self.matched as f64;
            (self.chosen_match_sum / n, self.best_match_sum / n)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_policy::{MatchInfo, Reason};

    fn record(at_ms: u64) -> DecisionRecord {
        DecisionRecord { at_ms, role: WorkerRole::Regular, decision: Decision::plain(1, Reason::CacheHit) }
    }

    #[test]
    fn the_ring_keeps_the_newest_and_lists_them_newest_first() {
        let log = DecisionLog::new(3);
        for at in 0..5 {
            log.record(record(at));
        }
        let ats: Vec<u64> = log.recent().iter().map(|r| r.at_ms).collect();
        assert_eq!(ats, [4, 3, 2]);
    }

    #[test]
    fn a_tally_averages_prefix_aware_decisions_only() {
        let tally = RoutedTally::default();
        tally.record(&Decision::plain(1, Reason::RoundRobin));
        let mut hit = Decision::plain(1, Reason::CacheHit);
        hit.matches = Some(MatchInfo { best_match_rate: 0.8, chosen_match_rate: 0.6 });
        tally.record(&hit);
        hit.matches = Some(MatchInfo { best_match_rate: 1.0, chosen_match_rate: 0.2 });
        tally.record(&hit);
        let view = tally.view();
        assert_eq!((view.decisions, view.matched), (3, 2));
        let (chosen, best) = view.means().unwrap();
        assert!((chosen - 0.4).abs() < 1e-9 && (best - 0.9).abs() < 1e-9, "{chosen} {best}");
        assert_eq!(RoutedTally::default().view().means(), None);
    }
}
