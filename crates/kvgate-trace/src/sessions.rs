//! Closed-loop sessions: when each request of a trace is sent, for every replayer (`kvgate sim`'s
//! event loop in virtual time, `kvgate replay`'s scheduler in wall time), and the per-session
//! figures both report.
//!
//! A request that names no session, and the first turn of each session (the earliest in arrival
//! order), is sent at its timestamp (open loop). Every later turn of a session is sent once the
//! previous turn's answer has ended, plus its think time (`think_ms`): closed loop, so a session
//! never has two turns in flight, and a slow answer delays the rest of its session instead of
//! stacking turns no real user or agent would send. A later turn without a think time is sent at
//! its timestamp, or when the previous answer ends if that is later. A failed turn (refused,
//! unrouted, an HTTP error) ends like an answered one: the session goes on. Timestamps and think
//! times are divided by the replay's rate scale alike.
//!
//! A session's makespan is the time from its first turn's send to its last turn's end: what an
//! agent or a user waits for the whole task.

use std::collections::HashMap;

use serde::Serialize;

use crate::percentile;
use crate::trace::TraceRequest;

/// When each request of a trace is sent. Positions are the requests' indices in arrival order
/// (the order given to [`SessionSchedule::new`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionSchedule {
    /// Each request's timestamp after the rate scale, in microseconds.
    timestamp_us: Vec<u64>,
    /// Each request's session (index in order of first appearance).
    session: Vec<Option<usize>>,
    /// The turn after each request in its session.
    next_turn: Vec<Option<usize>>,
    /// Whether each request waits for its session's previous turn.
    follows: Vec<bool>,
    /// Each later turn's think time after the rate scale, in microseconds.
    think_us: Vec<Option<u64>>,
    n_sessions: usize,
}

/// Microseconds of `ms` milliseconds after the rate scale (the simulator's rounding).
fn scaled_us(ms: f64, rate_scale: f64) -> u64 {
    (ms * 1000.0 / rate_scale).round() as u64
}

impl SessionSchedule {
    /// The schedule of `requests`, given in arrival order (by timestamp, ties in file order), at
    /// `rate_scale` (timestamps and think times are divided by it).
    pub fn new<'a>(requests: impl IntoIterator<Item = &'a TraceRequest>, rate_scale: f64) -> SessionSchedule {
        let mut schedule = SessionSchedule::default();
        // Each session's index and latest turn so far.
        let mut sessions: HashMap<&str, (usize, usize)> = HashMap::new();
        for (position, request) in requests.into_iter().enumerate() {
            schedule.timestamp_us.push(scaled_us(request.timestamp_ms, rate_scale));
            schedule.next_turn.push(None);
            let Some(name) = request.session_id.as_deref() else {
                schedule.session.push(None);
                schedule.follows.push(false);
                schedule.think_us.push(None);
                continue;
            };
            let next_index = sessions.len();
            let entry = sessions.entry(name).or_insert((next_index, usize::MAX));
            let (index, previous) = *entry;
            entry.1 = position;
            schedule.session.push(Some(index));
            let follows = previous != usize::MAX;
            if follows {
                schedule.next_turn[previous] = Some(position);
            }
            schedule.follows.push(follows);
            schedule.think_us.push(request.think_ms.filter(|_| follows).map(|ms| scaled_us(ms, rate_scale)));
        }
        schedule.n_sessions = sessions.len();
        schedule
    }

    /// Requests in the schedule.
    pub fn len(&self) -> usize {
        self.timestamp_us.len()
    }

    pub fn is_empty(&self) -> bool {
        self.timestamp_us.is_empty()
    }

    /// Whether any request names a session (else every request is sent at its timestamp).
    pub fn has_sessions(&self) -> bool {
        self.n_sessions > 0
    }

    /// Sessions named by the requests.
    pub fn n_sessions(&self) -> usize {
        self.n_sessions
    }

    /// Request `position`'s timestamp after the rate scale, in microseconds.
    pub fn timestamp_us(&self, position: usize) -> u64 {
        self.timestamp_us[position]
    }

    /// Whether request `position` is a later turn of a session, sent by [`Self::next_turn`]
    /// rather than at its timestamp.
    pub fn follows_previous_turn(&self, position: usize) -> bool {
        self.follows[position]
    }

    /// The session of request `position` (indices in order of first appearance).
    pub fn session_of(&self, position: usize) -> Option<usize> {
        self.session[position]
    }

    /// The requests sent at their timestamps (outside sessions, and sessions' first turns), in
    /// arrival order.
    pub fn timed(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).filter(|&position| !self.follows[position])
    }

    /// Request `position` ended (answered or failed) at `ended_us` (the timestamps' clock): the
    /// next turn of its session, if any, and when to send it: `ended_us` plus its think time, or
    /// without one its timestamp if that is later.
    pub fn next_turn(&self, position: usize, ended_us: u64) -> Option<(usize, u64)> {
        let next = self.next_turn[position]?;
        let at = match self.think_us[next] {
            Some(think_us) => ended_us.saturating_add(think_us),
            None => ended_us.max(self.timestamp_us[next]),
        };
        Some((next, at))
    }

    /// The per-session figures of a replay, from each request's send and end time (the same
    /// clock; `None`: never sent, or never ended). `None` when no request names a session.
    pub fn figures(&self, sent_us: &[Option<u64>], ended_us: &[Option<u64>]) -> Option<SessionFigures> {
        if !self.has_sessions() {
            return None;
        }
        // Per session: first send, last end, turns, and whether a turn is missing.
        let mut spans = vec![(u64::MAX, 0u64, 0u64, false); self.n_sessions];
        for position in 0..self.len() {
            let Some(session) = self.session[position] else { continue };
            let span = &mut spans[session];
            span.2 += 1;
            match (sent_us.get(position).copied().flatten(), ended_us.get(position).copied().flatten()) {
                (Some(sent), Some(ended)) => {
                    span.0 = span.0.min(sent);
                    span.1 = span.1.max(ended);
                }
                _ => span.3 = true,
            }
        }
        let mut makespans_ms: Vec<f64> = Vec::new();
        let mut turns = 0;
        for &(first_sent, last_end, n_turns, cut) in &spans {
            if !cut {
                makespans_ms.push(last_end.saturating_sub(first_sent) as f64 / 1000.0);
                turns += n_turns;
            }
        }
        makespans_ms.sort_by(f64::total_cmp);
        let n = makespans_ms.len();
        Some(SessionFigures {
            sessions: n as u64,
            unfinished: (self.n_sessions - n) as u64,
            turns,
            makespan_mean_ms: if n == 0 { 0.0 } else { makespans_ms.iter().sum::<f64>() / n as f64 },
            makespan_p50_ms: percentile(&makespans_ms, 50.0),
            makespan_p99_ms: percentile(&makespans_ms, 99.0),
        })
    }
}

/// What the sessions of a replay took. Latencies in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SessionFigures {
    /// Sessions every turn of which was sent and ended.
    pub sessions: u64,
    /// Sessions cut short: a turn never sent or never ended (a replay's deadline or request
    /// limit); left out of the figures below.
    pub unfinished: u64,
    /// Turns of the finished sessions.
    pub turns: u64,
    /// Session makespan (first turn's send to last turn's end): mean and percentiles.
    pub makespan_mean_ms: f64,
    pub makespan_p50_ms: f64,
    pub makespan_p99_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(timestamp_ms: f64, session: Option<&str>, think_ms: Option<f64>) -> TraceRequest {
        TraceRequest {
            timestamp_ms,
            input_length: 1,
            output_length: 1,
            hash_ids: vec![1],
            session_id: session.map(str::to_string),
            think_ms,
            ..TraceRequest::default()
        }
    }

    #[test]
    fn later_turns_wait_for_the_previous_answer_plus_their_think_time() {
        let requests = [
            turn(0.0, Some("a"), None),
            turn(10.0, None, None),
            turn(20.0, Some("b"), Some(5.0)), // a first turn: sent at its timestamp
            turn(30.0, Some("a"), Some(100.0)),
            turn(40.0, Some("a"), None),
            turn(50.0, Some("b"), Some(7.0)),
        ];
        // At rate scale 2: timestamps and think times halved.
        let schedule = SessionSchedule::new(&requests, 2.0);
        assert_eq!(schedule.n_sessions(), 2);
        assert_eq!(schedule.timed().collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(schedule.timestamp_us(3), 15_000);
        assert_eq!(schedule.session_of(4), Some(0));
        assert_eq!(schedule.session_of(1), None);
        // a's first answer ends at 1 ms: its second turn 50 ms later.
        assert_eq!(schedule.next_turn(0, 1_000), Some((3, 51_000)));
        // No think time: its timestamp (20 ms), or the end if later.
        assert_eq!(schedule.next_turn(3, 2_000), Some((4, 20_000)));
        assert_eq!(schedule.next_turn(3, 90_000), Some((4, 90_000)));
        assert_eq!(schedule.next_turn(4, 1), None, "a's last turn");
        assert_eq!(schedule.next_turn(2, 60_000), Some((5, 63_500)));
        assert_eq!(schedule.next_turn(1, 0), None, "outside any session");
        assert!(schedule.follows_previous_turn(5) && !schedule.follows_previous_turn(2));
    }

    #[test]
    fn makespans_run_from_the_first_send_to_the_last_end() {
        let requests =
            [turn(0.0, Some("a"), None), turn(0.0, Some("b"), None), turn(1.0, Some("a"), Some(1.0))];
        let schedule = SessionSchedule::new(&requests, 1.0);
        let sent = [Some(0), Some(0), Some(5_000)];
        let ended = [Some(3_000), Some(2_000), Some(9_000)];
        let figures = schedule.figures(&sent, &ended).unwrap();
        assert_eq!((figures.sessions, figures.unfinished, figures.turns), (2, 0, 3));
        assert_eq!((figures.makespan_p50_ms, figures.makespan_p99_ms), (2.0, 9.0));
        assert_eq!(figures.makespan_mean_ms, 5.5);
        // A turn never sent: that session is unfinished and left out.
        let cut = schedule.figures(&[Some(0), Some(0), None], &[Some(3_000), Some(2_000), None]).unwrap();
        assert_eq!((cut.sessions, cut.unfinished, cut.turns, cut.makespan_p99_ms), (1, 1, 1, 2.0));
        let open = SessionSchedule::new(&[turn(0.0, None, None)], 1.0);
        assert_eq!(open.figures(&[Some(0)], &[Some(1)]), None);
        assert_eq!(open.timed().count(), 1);
    }
}
