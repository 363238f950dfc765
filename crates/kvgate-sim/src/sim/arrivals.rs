//! When requests arrive at the simulated gateway, and when each ended: every request at its
//! timestamp (open loop), except a session's later turns, which arrive once the previous turn of
//! their session ended (answered, refused or unrouted) plus their think time
//! ([`SessionSchedule`]: closed loop, one turn of a session in flight at most). Requests are
//! identified by their position in arrival order (the trace's order by timestamp), as everywhere
//! in the simulation.

use kvgate_trace::SessionSchedule;

use super::{Event, Simulation};
use kvgate_trace::Trace;

/// The arrival side of a simulation.
pub(super) struct Arrivals {
    pub(super) schedule: SessionSchedule,
    /// The next position that may be a timed arrival (requests before it are in the heap or
    /// arrived).
    next_timed: usize,
    /// Requests arrived so far.
    pub(super) arrived: usize,
    /// Each trace index's position in arrival order.
    position_of: Vec<usize>,
    /// Entries of `outcome.finished` already accounted as ended.
    finished_seen: usize,
}

impl Arrivals {
    /// `order`: the trace's indices in arrival order.
    pub(super) fn new(trace: &Trace, order: &[usize], rate_scale: f64) -> Arrivals {
        let mut position_of = vec![0; trace.requests.len()];
        for (position, &index) in order.iter().enumerate() {
            position_of[index] = position;
        }
        Arrivals {
            schedule: SessionSchedule::new(order.iter().map(|&index| &trace.requests[index]), rate_scale),
            next_timed: 0,
            arrived: 0,
            position_of,
            finished_seen: 0,
        }
    }
}

impl Simulation<'_> {
    /// Puts the next request sent at its timestamp (outside sessions, or a session's first turn)
    /// in the heap.
    pub(super) fn push_next_timed(&mut self) {
        let schedule = &self.arrivals.schedule;
        let mut position = self.arrivals.next_timed;
        while position < schedule.len() && schedule.follows_previous_turn(position) {
            position += 1;
        }
        self.arrivals.next_timed = position + 1;
        if position < schedule.len() {
            self.push(self.arrival_us[position], Event::Arrival(position as u64));
        }
    }

    /// Request `id` arrives now: routed (or queued at the gateway), then the next timed arrival
    /// is scheduled if it was one.
    pub(super) fn arrival(&mut self, now: u64, id: u64) {
        self.arrivals.arrived += 1;
        self.arrive(now, id);
        if !self.arrivals.schedule.follows_previous_turn(id as usize) {
            self.push_next_timed();
        }
    }

    /// Request `id` ended at `ended_us` (at most a step before `now`): answered, refused by its
    /// engine or unrouted. Its session's next turn, if any, arrives its think time later (never
    /// before `now`: virtual time does not go back).
    pub(super) fn turn_ended(&mut self, id: u64, ended_us: u64, now: u64) {
        let position = id as usize;
        if let Some(slot) = self.outcome.ended_us.get_mut(position) {
            *slot = Some(ended_us);
        }
        if let Some((next, at)) = self.arrivals.schedule.next_turn(position, ended_us) {
            let at = at.max(now);
            self.arrival_us[next] = at;
            self.push(at, Event::Arrival(next as u64));
        }
    }

    /// Accounts the requests finished since the last call as ended (both fleets record a
    /// finished request in `outcome.finished`, a disaggregated one when its decode ends).
    pub(super) fn note_finished(&mut self, now: u64) {
        while self.arrivals.finished_seen < self.outcome.finished_requests.len() {
            let seen = self.arrivals.finished_seen;
            self.arrivals.finished_seen += 1;
            let position = self.arrivals.position_of[self.outcome.finished_requests[seen]];
            let ended_us = self.outcome.finished[seen].finished_us;
            self.turn_ended(position as u64, ended_us, now);
        }
    }

    /// The run is over: the send times, and the per-session figures when the trace has sessions.
    pub(super) fn finish_arrivals(&mut self) {
        let sent: Vec<Option<u64>> = self.arrival_us.iter().map(|&at| Some(at)).collect();
        self.outcome.sessions = self.arrivals.schedule.figures(&sent, &self.outcome.ended_us);
        self.outcome.sent_us = std::mem::take(&mut self.arrival_us);
    }
}
