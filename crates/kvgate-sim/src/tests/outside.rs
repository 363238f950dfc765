//! The outside-policy API: an outside round robin gives the built-in round_robin's report, and sees every KV event, first token and finish.

use super::{args, mixed_trace, simulate};
use crate::outside::{KvEventBatch, OutsideCandidate, OutsidePolicy, OutsideRequest};
use crate::{run_outside, SimError};

/// Round robin from outside, counting what the simulator told it.
#[derive(Default)]
struct OutsideRoundRobin {
    next: usize,
    kv_batches: u64,
    first_tokens: u64,
    finished: u64,
    in_flight_seen: u64,
}

impl OutsidePolicy for OutsideRoundRobin {
    fn kv_events(&mut self, _worker: usize, batches: &[KvEventBatch], _now_us: u64) {
        self.kv_batches += batches.len() as u64;
    }

    fn select(&mut self, _request: &OutsideRequest<'_>, candidates: &[OutsideCandidate]) -> Option<usize> {
        self.in_flight_seen += candidates.iter().map(|c| c.in_flight).sum::<u64>();
        let worker = candidates[self.next % candidates.len()].worker;
        self.next += 1;
        Some(worker)
    }

    fn first_token(&mut self, _worker: usize, _id: u64, _now_us: u64) {
        self.first_tokens += 1;
    }

    fn finished(&mut self, _worker: usize, _id: u64, _now_us: u64) {
        self.finished += 1;
    }
}

#[test]
fn an_outside_round_robin_gives_the_built_in_round_robins_report() {
    let mut args = args("round_robin", 3);
    args.rate_scale = 4.0;
    let trace = mixed_trace();
    let built_in = simulate(&args, &trace).runs.remove(0);
    let mut outside = OutsideRoundRobin::default();
    let run = run_outside(&args, &trace, "outside_round_robin", &mut outside).unwrap();
    assert_eq!(run.label, "outside_round_robin");
    assert_eq!(run.metrics, built_in.metrics);
    assert_eq!(run.ttft_ms_sorted, built_in.ttft_ms_sorted);
    assert_eq!(run.kv_series, built_in.kv_series);
    assert_eq!(run.metrics.completed, 60);
    assert_eq!((outside.first_tokens, outside.finished), (60, 60));
    assert!(outside.kv_batches > 0, "the engines' KV events reach the outside policy");
    assert!(outside.in_flight_seen > 0, "candidates carry the in-flight counts");
}

#[test]
fn an_outside_policy_refuses_a_disaggregated_fleet() {
    let mut args = args("round_robin", 3);
    args.prefill_workers = Some(2);
    args.decode_workers = Some(2);
    let error = run_outside(&args, &mixed_trace(), "x", &mut OutsideRoundRobin::default()).unwrap_err();
    assert!(matches!(error, SimError::InvalidOptions(_)), "{error}");
    assert!(error.to_string().contains("an outside policy runs on a regular fleet"), "{error}");
}
