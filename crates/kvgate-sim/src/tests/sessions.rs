//! Closed-loop sessions: a session's later turn arrives once its previous turn ended plus its
//! think time, so no session ever has two turns in flight (a property over random traces, fleets
//! and policies); the report's per-session figures; traces without sessions stay open loop.

use proptest::prelude::*;

use super::{args, request, simulate};
use crate::sim::{simulate as simulate_one, SimOutcome};
use crate::SimArgs;
use kvgate_trace::{Trace, TraceRequest};

fn turn(timestamp_ms: f64, session: &str, think_ms: Option<f64>, hash_ids: &[u64]) -> TraceRequest {
    TraceRequest {
        session_id: Some(session.to_string()),
        think_ms,
        ..request(timestamp_ms, hash_ids.len() as u32 * 512, 50, hash_ids)
    }
}

/// The first run of `args` on `trace`, as `run_on_trace` runs it, with the raw outcome.
fn outcome(args: &SimArgs, trace: &Trace) -> SimOutcome {
    let runs = args.runs().unwrap();
    let fleet = args.fleet().unwrap();
    let engines = (0..fleet.n_engines()).map(|engine| args.engine_config_for(engine)).collect();
    let trace = trace.truncated(args.max_requests);
    let setup = crate::sim_setup(args, fleet, engines, &trace).unwrap();
    simulate_one(&trace, &setup, &runs[0].policy, &mut |_, _| {})
}

#[test]
fn a_later_turn_arrives_its_think_time_after_the_previous_answer() {
    // One engine; the first turn's 4,096 tokens take 512 ms to the first token, and its 50
    // tokens 49 decode steps of 6.35 ms more. The second turn (recorded at 100 ms, while the
    // first was still being answered) comes 1 s after that answer.
    let trace = Trace {
        requests: vec![
            turn(0.0, "a", None, &[1, 2, 3, 4, 5, 6, 7, 8]),
            turn(100.0, "a", Some(1000.0), &[1, 2, 3, 4, 5, 6, 7, 8, 9]),
            request(50.0, 512, 1, &[77]),
        ],
    };
    let outcome = outcome(&args("round_robin", 1), &trace);
    let first_end = outcome.ended_us[0].unwrap();
    // The one-block request (position 1) arrived at 50 ms and delayed the first turn's decode.
    assert_eq!(outcome.sent_us[..2], [0, 50_000]);
    assert_eq!(outcome.sent_us[2], first_end + 1_000_000);
    assert!(outcome.ended_us[2].unwrap() > outcome.sent_us[2]);
    let sessions = outcome.sessions.clone().unwrap();
    assert_eq!((sessions.sessions, sessions.turns, sessions.unfinished), (1, 2, 0));
    assert_eq!(sessions.makespan_p99_ms, outcome.ended_us[2].unwrap() as f64 / 1000.0);

    // The report shows them; the same trace open loop (no session fields) has none.
    let report = simulate(&args("round_robin", 1), &trace);
    let markdown = report.markdown();
    assert!(markdown.contains("\n| sessions (turns) | 1 (2) |"), "{markdown}");
    assert!(markdown.contains("\n| session makespan p99 (ms) |"), "{markdown}");
    assert!(report.to_json().contains("\"makespan_p99_ms\""));
    let mut open = trace.clone();
    for request in &mut open.requests {
        (request.session_id, request.think_ms) = (None, None);
    }
    let open_outcome = super::sessions::outcome(&args("round_robin", 1), &open);
    assert_eq!(open_outcome.sent_us, [0, 50_000, 100_000], "open loop: every request at its timestamp");
    assert_eq!(open_outcome.sessions, None);
    let open_report = simulate(&args("round_robin", 1), &open);
    assert!(!open_report.markdown().contains("session") && !open_report.to_json().contains("makespan_p"));
}

#[test]
fn without_a_think_time_a_later_turn_keeps_its_timestamp_unless_the_answer_ends_later() {
    let trace = Trace {
        requests: vec![
            turn(0.0, "a", None, &[1]),
            turn(5_000.0, "a", None, &[1, 2]), // the first answer is long over by then
            turn(5_001.0, "a", None, &[1, 2, 3]), // but this one comes right after the second's
        ],
    };
    let outcome = outcome(&args("round_robin", 2), &trace);
    assert_eq!(outcome.sent_us[1], 5_000_000);
    assert_eq!(outcome.sent_us[2], outcome.ended_us[1].unwrap());
}

/// A random trace: sessions of random turns, think times (some absent) and prompts growing
/// turn by turn, beside requests of no session; some prompts too large for a small engine.
fn traces() -> impl Strategy<Value = Trace> {
    let turn = (1u32..12, 0u32..300, prop::option::of(0u32..3000), 1u32..200);
    let session = (0u32..4000, prop::collection::vec(turn, 1..6));
    let single = (0u32..6000, 1u32..12, 1u32..100);
    (prop::collection::vec(session, 1..8), prop::collection::vec(single, 0..6)).prop_map(
        |(sessions, singles)| {
            let mut requests = Vec::new();
            for (index, (start_ms, turns)) in sessions.into_iter().enumerate() {
                let (mut at_ms, mut hash_ids) = (f64::from(start_ms), Vec::new());
                for (turn_index, (blocks, gap_ms, think_ms, output)) in turns.into_iter().enumerate() {
                    at_ms += f64::from(gap_ms);
                    let base = 1000 * index as u64 + hash_ids.len() as u64;
                    hash_ids.extend((0..u64::from(blocks)).map(|b| base + b));
                    requests.push(TraceRequest {
                        session_id: Some(format!("s{index}")),
                        think_ms: think_ms.filter(|_| turn_index > 0).map(f64::from),
                        ..request(at_ms, hash_ids.len() as u32 * 512 - 100, output, &hash_ids)
                    });
                }
            }
            for (index, (at_ms, blocks, output)) in singles.into_iter().enumerate() {
                let hash_ids: Vec<u64> =
                    (0..u64::from(blocks)).map(|b| 900_000 + 100 * index as u64 + b).collect();
                requests.push(request(f64::from(at_ms), blocks * 512, output, &hash_ids));
            }
            Trace { requests }
        },
    )
}

/// The simulated fleets and policies a trace runs on.
fn setups() -> impl Strategy<Value = SimArgs> {
    let policy = prop::sample::select(vec!["round_robin", "cache_aware", "kv_aware", "least_load", "manual"]);
    // 0: regular; 1: the gateway's admission cap; 2: disaggregated.
    (policy, 1usize..4, 0u8..3, prop::sample::select(vec![8_192u64, 65_536])).prop_map(
        |(policy, workers, fleet, kv)| {
            let mut args = args(policy, workers);
            args.engine.kv_capacity_tokens = Some(kv);
            match fleet {
                1 => args.max_concurrent_requests = Some(2),
                2 => (args.prefill_workers, args.decode_workers) = (Some(workers), Some(1)),
                _ => {}
            }
            args
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// In a closed-loop replay no session ever has two turns in flight: each later turn arrives
    /// at or after its previous turn's end plus its think time (its timestamp without one), every
    /// request ends exactly once, and requests outside sessions arrive at their timestamps.
    #[test]
    fn no_session_ever_has_two_turns_in_flight(trace in traces(), args in setups()) {
        let order = trace.arrival_order();
        let outcome = outcome(&args, &trace);
        let ended: Vec<u64> = outcome.ended_us.iter().map(|end| end.expect("every request ends")).collect();
        let finished = outcome.finished.len() as u64;
        prop_assert_eq!(finished + outcome.rejected + outcome.unrouted, trace.requests.len() as u64);
        let mut previous: std::collections::HashMap<&str, usize> = Default::default();
        for (position, &index) in order.iter().enumerate() {
            let request = &trace.requests[index];
            let (sent, timestamp_us) = (outcome.sent_us[position], (request.timestamp_ms * 1000.0).round() as u64);
            prop_assert!(ended[position] >= sent, "ends after it arrives");
            let Some(session) = request.session_id.as_deref() else {
                prop_assert_eq!(sent, timestamp_us);
                continue;
            };
            match previous.insert(session, position) {
                None => prop_assert_eq!(sent, timestamp_us, "a first turn at its timestamp"),
                Some(before) => {
                    prop_assert!(sent >= ended[before], "two turns of {} in flight", session);
                    let due = match request.think_ms {
                        Some(think_ms) => ended[before] + (think_ms * 1000.0).round() as u64,
                        None => ended[before].max(timestamp_us),
                    };
                    // Engines' steps end at their events' times: the end is seen when it happens.
                    prop_assert_eq!(sent, due, "{} turn {}", session, position);
                }
            }
        }
        let sessions = outcome.sessions.expect("the trace has sessions");
        prop_assert_eq!(sessions.unfinished, 0);
        prop_assert_eq!(sessions.sessions as usize, previous.len());
    }
}
