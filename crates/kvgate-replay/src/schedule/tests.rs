//! The replayer's scheduler in paused time, with requests that take as long as a table says:
//! no session ever has two turns in flight and each later turn waits for its think time (a
//! property over random traces, answer times and concurrency limits); the deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvgate_trace::{SessionSchedule, TraceRequest};
use proptest::prelude::*;
use tokio::time::Instant;

use super::{run_schedule, ScheduleRun, ScheduleSettings};

fn request(timestamp_ms: f64, session: Option<usize>, think_ms: Option<f64>) -> TraceRequest {
    TraceRequest {
        timestamp_ms,
        input_length: 1,
        output_length: 1,
        hash_ids: vec![1],
        session_id: session.map(|s| format!("s{s}")),
        think_ms,
        ..TraceRequest::default()
    }
}

/// What the fake server saw of each request: (sent, ended) since the run's start.
type Seen = Arc<Mutex<HashMap<usize, (Duration, Duration)>>>;

/// Runs `requests` (in arrival order) through the scheduler in paused time; request `i` takes
/// `answer_ms[i]`. Returns the run and what the server saw.
fn replay(
    requests: &[TraceRequest],
    answer_ms: &[u64],
    settings: ScheduleSettings,
) -> (ScheduleRun<usize>, Seen) {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
    let schedule = SessionSchedule::new(requests, 1.0);
    let seen: Seen = Arc::default();
    let run = runtime.block_on(async {
        let started = Instant::now();
        run_schedule(
            &schedule,
            settings,
            &tokio::runtime::Handle::current(),
            |position| {
                let (seen, answer) = (seen.clone(), Duration::from_millis(answer_ms[position]));
                async move {
                    let sent = started.elapsed();
                    tokio::time::sleep(answer).await;
                    seen.lock().unwrap().insert(position, (sent, started.elapsed()));
                    position
                }
            },
            |_| usize::MAX,
        )
        .await
    });
    (run, seen)
}

fn settings(limit: Option<usize>, deadline_secs: u64) -> ScheduleSettings {
    ScheduleSettings { limit, deadline: Duration::from_secs(deadline_secs), show_progress: false }
}

#[test]
fn a_later_turn_is_sent_its_think_time_after_the_previous_answer() {
    let requests = [
        request(0.0, Some(0), None),
        request(100.0, None, None),
        request(200.0, Some(0), Some(50.0)),
        request(300.0, Some(0), None),
    ];
    let (run, seen) = replay(&requests, &[400, 10, 30, 5], settings(None, 60));
    let seen = seen.lock().unwrap();
    let ms = |position: usize| (seen[&position].0.as_millis(), seen[&position].1.as_millis());
    assert_eq!(ms(0), (0, 400));
    assert_eq!(ms(1), (100, 110), "open loop beside the session");
    assert_eq!(ms(2), (450, 480), "the answer at 400 ms, then 50 ms of think time");
    assert_eq!(ms(3), (480, 485), "no think time: at its timestamp (300 ms) or the answer's end");
    assert_eq!((run.sent, run.results.len(), run.deadline_hits), (4, 4, 0));
    let sessions = run.sessions.unwrap();
    assert_eq!((sessions.sessions, sessions.turns, sessions.unfinished), (1, 3, 0));
    assert_eq!(sessions.makespan_p99_ms, 485.0);
    // The send delay counts only lateness behind each request's due time.
    assert_eq!(run.send_delay_total, Duration::ZERO);
}

#[test]
fn nothing_is_sent_past_the_deadline_and_cut_sessions_are_unfinished() {
    let requests =
        [request(0.0, Some(0), None), request(1.0, Some(0), Some(0.0)), request(500.0, None, None)];
    // The first answer takes 3 s, past the 2 s deadline: its next turn is never sent.
    let (run, seen) = replay(&requests, &[3_000, 1, 1], settings(None, 2));
    assert_eq!((run.sent, run.deadline_hits), (2, 1));
    assert_eq!(seen.lock().unwrap().len(), 1, "only the request at 500 ms was answered");
    let sessions = run.sessions.unwrap();
    assert_eq!((sessions.sessions, sessions.unfinished), (0, 1));
}

/// Sessions of random turns and think times beside requests of no session, with answer times.
fn workloads() -> impl Strategy<Value = (Vec<TraceRequest>, Vec<u64>)> {
    let turn = (0u32..400, prop::option::of(0u32..300), 1u64..800);
    let session = (0u32..2_000, prop::collection::vec(turn, 1..6));
    let single = (0u32..3_000, 1u64..800);
    (prop::collection::vec(session, 1..6), prop::collection::vec(single, 0..5)).prop_map(
        |(sessions, singles)| {
            let mut timed: Vec<(TraceRequest, u64)> = Vec::new();
            for (index, (start_ms, turns)) in sessions.into_iter().enumerate() {
                let mut at_ms = f64::from(start_ms);
                for (turn_index, (gap_ms, think_ms, answer_ms)) in turns.into_iter().enumerate() {
                    at_ms += f64::from(gap_ms);
                    let think_ms = think_ms.filter(|_| turn_index > 0).map(f64::from);
                    timed.push((request(at_ms, Some(index), think_ms), answer_ms));
                }
            }
            timed.extend(
                singles
                    .into_iter()
                    .map(|(at_ms, answer_ms)| (request(f64::from(at_ms), None, None), answer_ms)),
            );
            // Arrival order: by timestamp, ties in insertion order.
            timed.sort_by(|a, b| a.0.timestamp_ms.total_cmp(&b.0.timestamp_ms));
            timed.into_iter().unzip()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// In a closed-loop replay no session ever has two turns in flight: each later turn is sent
    /// after its previous turn's answer ended plus its think time; every request is sent and
    /// answered once, under any concurrency limit.
    #[test]
    fn no_session_ever_has_two_turns_in_flight(
        (requests, answer_ms) in workloads(),
        limit in prop::option::of(1usize..4),
    ) {
        let (run, seen) = replay(&requests, &answer_ms, settings(limit, 3_600));
        let seen = seen.lock().unwrap();
        prop_assert_eq!((run.sent, run.results.len(), seen.len()), (requests.len(), requests.len(), requests.len()));
        let ms = |ms: f64| Duration::from_micros((ms * 1000.0).round() as u64);
        // The replay starts at the first request's timestamp.
        let first_ms = requests[0].timestamp_ms;
        let mut previous: HashMap<&str, usize> = HashMap::new();
        for (position, request) in requests.iter().enumerate() {
            let (sent, _) = seen[&position];
            let timestamp = ms(request.timestamp_ms - first_ms);
            let due = match request.session_id.as_deref() {
                None => timestamp,
                Some(session) => match previous.insert(session, position) {
                    None => timestamp,
                    Some(before) => {
                        let ended = seen[&before].1;
                        prop_assert!(sent >= ended, "two turns of {} in flight", session);
                        match request.think_ms {
                            Some(think_ms) => ended + ms(think_ms),
                            None => ended.max(timestamp),
                        }
                    }
                },
            };
            prop_assert!(sent >= due, "request {} sent before it was due", position);
            if limit.is_none() {
                prop_assert_eq!(sent, due, "request {} late with no concurrency limit", position);
            }
        }
        prop_assert_eq!(run.sessions.map(|s| s.unfinished), Some(0));
    }
}
