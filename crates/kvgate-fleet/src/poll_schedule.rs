//! When each worker is polled next, for the health loop and the load monitor: first polls spread
//! over the interval (no burst of every worker at once), and a worker whose last polls found
//! nothing new polled less often, at most `2^max_backoff` intervals apart, back to every interval
//! as soon as its activity mark (requests routed to it, answers it gave) moves.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvgate_policy::WorkerId;

/// One worker's place in the schedule.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// When it is due while its mark stays where it was (backed off).
    next: Instant,
    /// When it is due once its mark moved (one interval after the last poll).
    soon: Instant,
    /// Polls in a row that found nothing new (bounded by `max_backoff`).
    backoff: u32,
    /// Its activity mark when last polled.
    mark: u64,
    /// A poll of it is under way (`started`, not yet `polled`): not due again meanwhile.
    in_flight: bool,
}

/// What `due` says of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    NotYet,
    /// Due, its activity mark where it was at the last poll.
    Quiet,
    /// Due, its activity mark moved since the last poll.
    Active,
}

/// The poll times of a fleet (the host's clock is an input: `Instant`s passed in).
#[derive(Debug)]
pub struct PollSchedule {
    interval: Duration,
    max_backoff: u32,
    entries: HashMap<WorkerId, Entry>,
}

impl PollSchedule {
    pub fn new(interval: Duration, max_backoff: u32) -> Self {
        Self { interval, max_backoff, entries: HashMap::new() }
    }

    /// Whether worker `id`, whose activity mark is `mark`, is due at `now`. A worker seen for the
    /// first time is due at a point of the interval its id spreads it to.
    pub fn due(&mut self, id: WorkerId, mark: u64, now: Instant) -> Due {
        let interval = self.interval;
        let entry = self.entries.entry(id).or_insert_with(|| {
            let first = now + interval.mul_f64(spread(id));
            Entry { next: first, soon: first, backoff: 0, mark, in_flight: false }
        });
        let moved = entry.mark != mark;
        match (moved, now >= entry.next, now >= entry.soon) {
            _ if entry.in_flight => Due::NotYet,
            (false, true, _) => Due::Quiet,
            (true, _, true) => Due::Active,
            _ => Due::NotYet,
        }
    }

    /// Worker `id` was polled at `now`, with its activity mark at `mark`: `unchanged` when the
    /// poll found what the last one did (its next poll backs off one step), else it is polled
    /// every interval again.
    pub fn polled(&mut self, id: WorkerId, mark: u64, unchanged: bool, now: Instant) {
        let (interval, max_backoff) = (self.interval, self.max_backoff);
        let entry = self.entries.entry(id).or_insert(Entry {
            next: now,
            soon: now,
            backoff: 0,
            mark,
            in_flight: false,
        });
        entry.in_flight = false;
        entry.backoff = if unchanged { (entry.backoff + 1).min(max_backoff) } else { 0 };
        entry.mark = mark;
        entry.soon = now + interval;
        entry.next = now + interval * (1u32 << entry.backoff);
    }

    /// Worker `id` needs attention (unhealthy, its circuit not closed, no load sample): its
    /// back-off is dropped, so it is due one interval after its last poll whatever its mark.
    pub fn hurry(&mut self, id: WorkerId) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.backoff = 0;
            entry.next = entry.next.min(entry.soon);
        }
    }

    /// A poll of worker `id` started (it is not due again until `polled`).
    pub fn started(&mut self, id: WorkerId) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.in_flight = true;
        }
    }

    /// Whether worker `id` is backed off (its last poll found nothing new) and its activity mark
    /// is still `mark`: what it last answered still holds as far as this gateway knows.
    pub fn quiet_since_last_poll(&self, id: WorkerId, mark: u64) -> bool {
        self.entries.get(&id).is_some_and(|entry| entry.backoff > 0 && entry.mark == mark)
    }

    /// Forget the workers not in `workers` (removed from the registry).
    pub fn retain(&mut self, workers: &HashSet<WorkerId>) {
        self.entries.retain(|id, _| workers.contains(id));
    }
}

/// Where in the interval worker `id`'s first poll falls, in [0, 1): ids in sequence spread
/// evenly (Fibonacci hashing).
fn spread(id: WorkerId) -> f64 {
    let hashed = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
    hashed as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    /// The due times of one worker over `seconds`, polled whenever due, its poll finding
    /// nothing new but in the seconds listed in `changes` and after its mark moved (in the
    /// seconds listed in `active`).
    fn poll_times(seconds: u64, changes: &[u64], active: &[u64]) -> Vec<u64> {
        let start = Instant::now();
        let mut schedule = PollSchedule::new(SECOND, 3);
        let (mut polled_at, mut mark) = (Vec::new(), 0);
        for tenth in 0..seconds * 10 {
            let now = start + SECOND * tenth as u32 / 10;
            if tenth % 10 == 0 && active.contains(&(tenth / 10)) {
                mark += 1;
            }
            let due = schedule.due(0, mark, now);
            if due != Due::NotYet {
                let second = tenth / 10;
                schedule.polled(0, mark, due == Due::Quiet && !changes.contains(&second), now);
                polled_at.push(second);
            }
        }
        polled_at
    }

    #[test]
    fn a_quiet_worker_is_polled_less_often_up_to_the_bound_and_at_once_again_when_it_changes() {
        // Backs off 2, 4, 8 s (the bound, 2^3 intervals); a changed answer resets to 1 s.
        assert_eq!(poll_times(40, &[], &[]), [0, 2, 6, 14, 22, 30, 38]);
        assert_eq!(poll_times(20, &[6], &[]), [0, 2, 6, 7, 9, 13]);
        // Requests routed to it at 9 s: polled at once (its last poll is an interval past), then
        // backing off again.
        assert_eq!(poll_times(20, &[], &[9]), [0, 2, 6, 9, 10, 12, 16]);
        assert_eq!(poll_times(20, &[], &[1]), [0, 1, 2, 4, 8, 16]);
    }

    #[test]
    fn a_hurried_worker_is_due_one_interval_after_its_last_poll_whatever_its_back_off() {
        let start = Instant::now();
        let mut schedule = PollSchedule::new(SECOND, 3);
        let at = |seconds: u32| start + SECOND * seconds;
        assert_eq!(schedule.due(0, 0, at(1)), Due::Quiet, "first seen at 1 s, spread to 1 s (id 0)");
        for second in [1, 3, 7] {
            assert_eq!(schedule.due(0, 0, at(second)), Due::Quiet);
            schedule.polled(0, 0, true, at(second));
        }
        // Backed off to 8 s after the poll at 7 s: not due at 8 s...
        assert_eq!(schedule.due(0, 0, at(8)), Due::NotYet);
        // ... unless it needs attention (its circuit opened, its sample went).
        schedule.hurry(0);
        assert_eq!(schedule.due(0, 0, at(8)), Due::Quiet);
        schedule.polled(0, 0, true, at(8));
        assert_eq!(schedule.due(0, 0, at(9)), Due::NotYet, "backing off again from its first step");
        assert_eq!(schedule.due(0, 0, at(10)), Due::Quiet);
        // A poll under way is not due twice, hurried or not.
        schedule.started(0);
        schedule.hurry(0);
        assert_eq!(schedule.due(0, 0, at(20)), Due::NotYet);
    }

    #[test]
    fn first_polls_spread_over_the_interval() {
        let start = Instant::now();
        let mut schedule = PollSchedule::new(SECOND, 3);
        // All seen first at the first tick: due over the ten ticks that follow.
        let mut per_tenth = [0usize; 11];
        for tenth in 0..11u32 {
            let now = start + SECOND * tenth / 10 + SECOND / 20;
            for id in 0..1000 {
                if schedule.due(id, 0, now) != Due::NotYet {
                    schedule.polled(id, 0, true, now);
                    per_tenth[tenth as usize] += 1;
                }
            }
        }
        assert_eq!(per_tenth.iter().sum::<usize>(), 1000, "{per_tenth:?}");
        assert!(per_tenth[1..].iter().all(|&n| (80..=120).contains(&n)), "{per_tenth:?}");
        assert!(schedule.quiet_since_last_poll(7, 0) && !schedule.quiet_since_last_poll(7, 1));
        schedule.retain(&HashSet::from([7]));
        assert_eq!(schedule.entries.len(), 1);
    }
}
