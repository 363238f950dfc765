//! When each worker is polled next, for the health loop and the load monitor: first polls spread
//! over the interval (no burst of every worker at once), and a worker whose last polls found
//! nothing new polled less often, at most `2^max_backoff` intervals apart, back to every interval
//! as soon as its activity mark (requests routed to it, answers it gave) moves. The entries are
//! kept in order of their due times too, so a tick while nothing moved on any worker visits only
//! the workers whose time came ([`PollSchedule::due_by_time`]) instead of the whole fleet.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_policy::WorkerId;

use crate::registry::PoolSnapshot;
use crate::worker::Worker;

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
    /// The highest activity mark `due` saw (it may move while a poll is under way).
    latest: u64,
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
    /// `(next, id)` of every entry without a poll under way.
    by_time: BTreeSet<(Instant, WorkerId)>,
}

impl PollSchedule {
    pub fn new(interval: Duration, max_backoff: u32) -> Self {
        Self { interval, max_backoff, entries: HashMap::new(), by_time: BTreeSet::new() }
    }

    /// Whether worker `id`, whose activity mark is `mark`, is due at `now`. A worker seen for the
    /// first time is due at a point of the interval its id spreads it to.
    pub fn due(&mut self, id: WorkerId, mark: u64, now: Instant) -> Due {
        let interval = self.interval;
        let entry = self.entries.entry(id).or_insert_with(|| {
            let first = now + interval.mul_f64(spread(id));
            self.by_time.insert((first, id));
            Entry { next: first, soon: first, backoff: 0, mark, latest: mark, in_flight: false }
        });
        entry.latest = entry.latest.max(mark);
        let moved = entry.mark != mark;
        if moved && !entry.in_flight && entry.next > entry.soon {
            // Due at `soon` from now on, whatever comes: the time order finds it then.
            self.by_time.remove(&(entry.next, id));
            entry.next = entry.soon;
            self.by_time.insert((entry.next, id));
        }
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
            latest: mark,
            in_flight: true,
        });
        if !entry.in_flight {
            self.by_time.remove(&(entry.next, id));
        }
        entry.in_flight = false;
        entry.backoff = if unchanged { (entry.backoff + 1).min(max_backoff) } else { 0 };
        entry.mark = mark;
        entry.latest = entry.latest.max(mark);
        entry.soon = now + interval;
        entry.next = now + interval * (1u32 << entry.backoff);
        if entry.latest != mark {
            // Its mark moved while the poll was under way: due at `soon` whatever comes.
            entry.next = entry.soon;
        }
        self.by_time.insert((entry.next, id));
    }

    /// Worker `id` needs attention (unhealthy, its circuit not closed, no load sample): its
    /// back-off is dropped, so it is due one interval after its last poll whatever its mark.
    pub fn hurry(&mut self, id: WorkerId) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.backoff = 0;
            if entry.next > entry.soon {
                if !entry.in_flight {
                    self.by_time.remove(&(entry.next, id));
                    self.by_time.insert((entry.soon, id));
                }
                entry.next = entry.soon;
            }
        }
    }

    /// A poll of worker `id` started (it is not due again until `polled`).
    pub fn started(&mut self, id: WorkerId) {
        if let Some(entry) = self.entries.get_mut(&id) {
            if !entry.in_flight {
                self.by_time.remove(&(entry.next, id));
            }
            entry.in_flight = true;
        }
    }

    /// The workers that may be due at `now` as far as time goes: their due time passed and no
    /// poll of them is under way. While no activity mark moved and no worker needs attention
    /// since the last visit of every worker, these are the only ones `due` can find due.
    pub fn due_by_time(&self, now: Instant) -> Vec<WorkerId> {
        self.by_time.range(..=(now, WorkerId::MAX)).map(|&(_, id)| id).collect()
    }

    /// Whether worker `id` is backed off (its last poll found nothing new) and its activity mark
    /// is still `mark`: what it last answered still holds as far as this gateway knows.
    pub fn quiet_since_last_poll(&self, id: WorkerId, mark: u64) -> bool {
        self.entries.get(&id).is_some_and(|entry| entry.backoff > 0 && entry.mark == mark)
    }

    /// Forget the workers not in `workers` (removed from the registry).
    pub fn retain(&mut self, workers: &HashSet<WorkerId>) {
        let by_time = &mut self.by_time;
        self.entries.retain(|id, entry| {
            let keep = workers.contains(id);
            if !keep && !entry.in_flight {
                by_time.remove(&(entry.next, *id));
            }
            keep
        });
    }
}

/// Whether a poll loop's tick visits every worker, or only those whose time came
/// (`PollSchedule::due_by_time`): every worker once an interval (`full_round`), and at every
/// tick after a worker's state moved (`worker::activity`: requests, answers, health, circuits,
/// models, forgotten samples), the registry changed, or the last visit of every worker found one
/// that needs a look at each tick (`attention`: not routable, no load sample, not steady). At 10,000 quiet workers, ten visits of every worker a second were most of what an
/// idle gateway spent between polls.
#[derive(Default)]
pub struct Visits {
    /// The registry's snapshot and the fleet's activity when every worker was last visited.
    snapshot: Option<Arc<PoolSnapshot>>,
    activity: u64,
    /// That visit found a worker to look at every tick.
    pub attention: bool,
    /// That snapshot's workers by id.
    pub by_id: HashMap<WorkerId, Arc<Worker>>,
}

impl Visits {
    /// Whether this tick visits every worker (and if so, it is noted as the last such visit).
    pub fn every_worker(&mut self, snapshot: &Arc<PoolSnapshot>, activity: u64, full_round: bool) -> bool {
        let same = self.snapshot.as_ref().is_some_and(|last| Arc::ptr_eq(last, snapshot));
        if same && !full_round && activity == self.activity && !self.attention {
            return false;
        }
        if !same {
            self.by_id = snapshot.workers.iter().map(|w| (w.id, w.clone())).collect();
            self.snapshot = Some(snapshot.clone());
        }
        self.activity = activity;
        true
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

    /// A fleet of 200 workers polled over 60 s of ticks (a tenth of a second each): some marks
    /// move (of workers whose poll is under way too), some workers are hurried, a third of the
    /// polls answer three ticks later, a fifth find something new. Visiting every worker at every tick (`every_tick`), or as the loops do:
    /// every worker once a second and at a tick where a mark moved, else only `due_by_time`'s.
    /// The polls made, and the workers visited.
    fn fleet_polls(every_tick: bool) -> (Vec<(u32, WorkerId, Due)>, usize) {
        const WORKERS: u32 = 200;
        let start = Instant::now();
        let mut schedule = PollSchedule::new(SECOND, 4);
        let mut marks = [0u64; WORKERS as usize];
        let (mut polls, mut visits, mut answering) = (Vec::new(), 0, Vec::new());
        // Pseudo-random by tick and worker, whatever order the workers are visited in.
        let random = |tick: u32, id: WorkerId| {
            let seed = (u64::from(tick) << 32 | u64::from(id)).wrapping_add(0x2545_F491_4F6C_DD1D);
            (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as u32
        };
        for tick in 0..600u32 {
            let now = start + SECOND * tick / 10;
            let moved = tick % 7 == 3;
            if moved {
                // Half the time, requests go to a worker whose poll is under way.
                answering.sort_unstable();
                let pick = random(tick, WORKERS) as usize;
                let id = match answering.get(pick % (2 * answering.len().max(1))) {
                    Some(&(id, _, _)) => id,
                    None => pick as u32 % WORKERS,
                };
                marks[id as usize] += 1;
            }
            let (landed, later): (Vec<_>, Vec<_>) = answering.drain(..).partition(|&(_, _, at)| at <= tick);
            answering = later;
            for (id, mark, _) in landed {
                schedule.polled(id, mark, random(tick, id) % 5 != 0, now);
            }
            if tick % 13 == 5 {
                schedule.hurry(random(tick, WORKERS + 1) % WORKERS);
            }
            let visited: Vec<WorkerId> = if every_tick || moved || tick % 10 == 0 {
                (0..WORKERS).collect()
            } else {
                schedule.due_by_time(now)
            };
            visits += visited.len();
            let mut polled = Vec::new();
            for id in visited {
                let mark = marks[id as usize];
                let due = schedule.due(id, mark, now);
                if due == Due::NotYet {
                    continue;
                }
                polled.push((tick, id, due));
                if id % 3 == 0 {
                    schedule.started(id);
                    answering.push((id, mark, tick + 3));
                } else {
                    schedule.polled(id, mark, due == Due::Quiet && random(tick, id) % 5 != 0, now);
                }
            }
            polled.sort_by_key(|&(_, id, _)| id);
            polls.extend(polled);
        }
        (polls, visits)
    }

    #[test]
    fn visiting_only_the_workers_whose_time_came_while_nothing_moved_polls_as_visiting_all() {
        let (every, every_visits) = fleet_polls(true);
        let (timed, timed_visits) = fleet_polls(false);
        let first = every.iter().zip(&timed).position(|(a, b)| a != b);
        assert_eq!(
            every,
            timed,
            "first difference at {first:?}: {:?}",
            first.map(|i| (&every[i.saturating_sub(3)..i + 3], &timed[i.saturating_sub(3)..i + 3]))
        );
        let count = |kind: Due| every.iter().filter(|(_, _, due)| *due == kind).count();
        assert!(
            count(Due::Quiet) > 1000 && count(Due::Active) > 50,
            "{} {}",
            count(Due::Quiet),
            count(Due::Active)
        );
        assert_eq!(every_visits, 600 * 200);
        assert!(timed_visits < every_visits / 3, "{timed_visits} of {every_visits}");
    }

    #[test]
    fn a_mark_that_moved_while_a_poll_was_under_way_makes_the_worker_due_by_time_one_interval_on() {
        let start = Instant::now();
        let mut schedule = PollSchedule::new(SECOND, 4);
        let at = |tenths: u32| start + SECOND * tenths / 10;
        for second in [0, 2, 6] {
            assert_eq!(schedule.due(0, 0, at(second * 10)), Due::Quiet);
            schedule.polled(0, 0, true, at(second * 10));
        }
        assert_eq!(schedule.due_by_time(at(139)), [] as [WorkerId; 0], "backed off to 14 s");
        assert_eq!(schedule.due_by_time(at(140)), [0]);
        schedule.started(0);
        assert_eq!(schedule.due_by_time(at(140)), [] as [WorkerId; 0], "under way");
        // A request goes to it while its poll is under way; the poll answers with the mark it
        // was sent with, 0.2 s later.
        assert_eq!(schedule.due(0, 1, at(141)), Due::NotYet);
        schedule.polled(0, 0, true, at(142));
        assert_eq!(schedule.due_by_time(at(151)), [] as [WorkerId; 0]);
        assert_eq!(schedule.due_by_time(at(152)), [0], "one interval after the poll, not 16");
        assert_eq!(schedule.due(0, 1, at(152)), Due::Active);
        // Hurried: due by time one interval after its last poll too.
        schedule.polled(0, 1, true, at(152));
        assert_eq!(schedule.due_by_time(at(162)), [] as [WorkerId; 0], "backed off to 17.2 s");
        schedule.hurry(0);
        assert_eq!(schedule.due_by_time(at(162)), [0]);
        schedule.retain(&HashSet::new());
        assert_eq!(schedule.due_by_time(at(1000)), [] as [WorkerId; 0], "forgotten");
    }
}
