//! The guard's comparison: which moves fail (more than the tolerance worse), which pass (better,
//! or worse within it), and what makes the figures not comparable.

use std::collections::BTreeMap;

use super::{compare, Baseline, Figures, ScenarioBaseline};

fn figures(ttft_mean_ms: f64, ttft_p99_ms: f64, hit: f64, session_p99_ms: Option<f64>) -> Figures {
    Figures { ttft_mean_ms, ttft_p99_ms, cache_hit_rate: hit, session_makespan_p99_ms: session_p99_ms }
}

fn scenario(id: &str, requests: usize, policies: &[(&str, Figures)]) -> ScenarioBaseline {
    let policies: BTreeMap<String, Figures> = policies.iter().map(|(p, f)| (p.to_string(), *f)).collect();
    ScenarioBaseline { id: id.to_string(), requests, prompt_tokens: 1000, policies }
}

fn baseline(scenarios: Vec<ScenarioBaseline>) -> Baseline {
    Baseline { about: String::new(), seed: 0, scenarios }
}

/// (figure, worse by in %, fails) of each move of `now` against `before`.
fn moves(before: Figures, now: Figures) -> Vec<(&'static str, i64, bool)> {
    let report = compare(
        &baseline(vec![scenario("S9", 10, &[("kv_aware", before)])]),
        &[scenario("S9", 10, &[("kv_aware", now)])],
        3.0,
    );
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    report.moves.iter().map(|m| (m.figure, (m.worse_by * 1000.0).round() as i64, m.fails)).collect()
}

#[test]
fn a_figure_more_than_the_tolerance_worse_fails_and_a_better_one_passes() {
    let base = figures(1000.0, 5000.0, 0.5, Some(60_000.0));
    assert_eq!(moves(base, base), []);
    // TTFT mean 5% worse: fails; p99 2% worse: printed, passes.
    assert_eq!(
        moves(base, figures(1050.0, 5100.0, 0.5, Some(60_000.0))),
        [("ttft_mean_ms", 50, true), ("ttft_p99_ms", 20, false)]
    );
    // Better: printed, passes.
    assert_eq!(
        moves(base, figures(900.0, 5000.0, 0.6, Some(50_000.0))),
        [
            ("ttft_mean_ms", -100, false),
            ("session_makespan_p99_ms", -167, false),
            ("cache_hit_rate", -200, false)
        ]
    );
    // A lower hit rate is worse: 0.5 to 0.48 is 4% worse.
    assert_eq!(moves(base, figures(1000.0, 5000.0, 0.48, Some(60_000.0))), [("cache_hit_rate", 40, true)]);
    assert_eq!(
        moves(base, figures(1000.0, 5000.0, 0.5, Some(61_900.0))),
        [("session_makespan_p99_ms", 32, true)]
    );
    // Below the absolute epsilons (0.5 ms, 0.05 points of hit rate), nothing moved.
    assert_eq!(moves(base, figures(1000.4, 5000.0, 0.5004, Some(60_000.0))), []);
    // A tiny latency doubling by 1 ms is 50% of its 2 ms: a move that fails.
    assert_eq!(
        moves(figures(2.0, 2.0, 0.0, None), figures(3.0, 2.0, 0.0, None)),
        [("ttft_mean_ms", 500, true)]
    );
    // A session figure that disappears is a change of the scenario: it fails.
    assert_eq!(moves(base, figures(1000.0, 5000.0, 0.5, None)), [("session_makespan_p99_ms", 0, true)]);
}

#[test]
fn a_changed_trace_or_a_missing_entry_fails_and_the_update_merges() {
    let base = figures(1000.0, 5000.0, 0.5, None);
    let before = baseline(vec![
        scenario("S1", 1500, &[("round_robin", base), ("kv_aware", base)]),
        scenario("S9", 10, &[("kv_aware", base)]),
    ]);
    // S1 at another size: not comparable.
    let report = compare(&before, &[scenario("S1", 1400, &[("round_robin", base)])], 3.0);
    assert!(report.failed() && report.problems[0].contains("the trace changed"), "{:?}", report.problems);
    assert!(report.moves.is_empty(), "figures of another trace are not compared");
    // A policy or scenario the baseline lacks fails until the baseline is updated.
    let report = compare(&before, &[scenario("S9", 10, &[("manual", base)])], 3.0);
    assert!(
        report.failed() && report.problems == ["S9 manual: not in the baseline"],
        "{:?}",
        report.problems
    );
    let report = compare(&before, &[scenario("S11", 5, &[("manual", base)])], 3.0);
    assert_eq!(report.problems, ["S11: not in the baseline"]);
    // The update keeps what was not run, merges what was, and orders scenarios S1..S11.
    let worse = figures(2000.0, 5000.0, 0.5, None);
    let report = compare(
        &before,
        &[scenario("S11", 5, &[("manual", base)]), scenario("S1", 1500, &[("kv_aware", worse)])],
        3.0,
    );
    let updated = &report.updated;
    let ids: Vec<&str> = updated.scenarios.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["S1", "S9", "S11"]);
    assert_eq!(updated.scenarios[0].policies["kv_aware"], worse);
    assert_eq!(updated.scenarios[0].policies["round_robin"], base);
    assert!(updated.about.contains("--update"));
    let markdown = report.markdown(3.0, false);
    assert!(
        markdown.contains("| S1 | kv_aware | ttft_mean_ms | 1000.0 | 2000.0 | +100.00% | **worse: fails** |"),
        "{markdown}"
    );
    assert!(markdown.contains("The routing guard FAILS"), "{markdown}");
    let updating = report.markdown(3.0, true);
    assert!(updating.contains("The baseline takes these figures (1 were more than 3% worse)"), "{updating}");
    let passing = compare(&before, &[scenario("S9", 10, &[("kv_aware", base)])], 3.0);
    assert!(
        passing.markdown(3.0, false).contains("No figure moved (3 compared)"),
        "{}",
        passing.markdown(3.0, false)
    );
}
