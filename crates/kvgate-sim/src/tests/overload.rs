//! The gateway's per-worker overload protection in the simulator: the routing plan's filter
//! leaves out an engine whose last load sample shows too many waiting requests, before the
//! policy decides, and with `--worker-overload-shed` refuses a request when every engine is
//! over the bound (counted unrouted).

use super::{args, request, simulate};
use kvgate_trace::Trace;

/// A burst of 120 requests on one shared prefix, 2 ms apart: cache_aware keeps it on the
/// engine that holds the prefix, whose queue grows.
fn burst() -> Trace {
    Trace {
        requests: (0..120u64).map(|i| request(i as f64 * 2.0, 4096, 4, &[0, 1, 2, 3, 1000 + i])).collect(),
    }
}

#[test]
fn busy_engines_are_left_out_before_the_policy_decides() {
    let mut plain = args("cache_aware:prefix_index=approximate", 4);
    plain.load_monitor_interval_ms = 20;
    let without = simulate(&plain, &burst());
    let mut bounded = plain.clone();
    bounded.worker_overload_waiting_requests = Some(2);
    let with = simulate(&bounded, &burst());
    let count = |report: &crate::SimReport, reason: &str| {
        report.runs[0].decisions.iter().find(|(name, _)| name == reason).map_or(0, |(_, n)| *n)
    };
    // Without the filter the count spread moves requests off the prefix (imbalance_count);
    // with it, an engine past 2 waiting requests is no candidate, and the policy finds the
    // prefix on one of the others (it spreads as they fill).
    let decisions = (&with.runs[0].decisions, &without.runs[0].decisions);
    assert!(count(&without, "imbalance_count") > 0, "{decisions:?}");
    assert!(count(&with, "imbalance_count") < count(&without, "imbalance_count"), "{decisions:?}");
    assert!(count(&with, "cache_hit") > count(&without, "cache_hit"), "{decisions:?}");
    assert_eq!(with.runs[0].metrics.completed, 120);
    assert!(with.markdown().contains("Overload protection: an engine at 2 waiting requests or more"));
    assert!(!without.markdown().contains("Overload protection"));

    // Shedding: when every engine is over the bound, the request is refused.
    let mut shed = bounded.clone();
    shed.worker_overload_waiting_requests = Some(1);
    shed.worker_overload_shed = true;
    let shed = simulate(&shed, &burst());
    assert!(shed.runs[0].metrics.unrouted > 0, "{:?}", shed.runs[0].metrics);
    assert_eq!(shed.runs[0].metrics.completed + shed.runs[0].metrics.unrouted, 120);
}

#[test]
fn bounds_that_would_leave_out_every_engine_are_refused() {
    let mut zero = args("round_robin", 2);
    zero.worker_overload_waiting_requests = Some(0);
    zero.worker_overload_token_usage = Some(1.5);
    let message = crate::run_on_trace(&zero, &burst(), false).unwrap_err().to_string();
    assert!(message.contains("--worker-overload-waiting-requests"), "{message}");
    assert!(message.contains("--worker-overload-token-usage"), "{message}");
}
