//! Prefill/decode disaggregated fleets (`--prefill-workers`, `--decode-workers`): every request completes, TTFT is prefill + KV transfer + one decode step, decode engines never prefill, runs are deterministic.

use super::{args, mixed_trace, request, shared_prefix_trace, simulate};
use crate::SimArgs;
use kvgate_trace::Trace;

fn pd_args(policies: &str, prefill_workers: usize, decode_workers: usize) -> SimArgs {
    let mut args = args(policies, 8);
    args.prefill_workers = Some(prefill_workers);
    args.decode_workers = Some(decode_workers);
    args
}

#[test]
fn disaggregated_runs_complete_every_request_and_are_deterministic() {
    let mut args =
        pd_args("round_robin,cache_aware,kv_aware,cache_aware:prefix_index=approximate@approx", 2, 2);
    args.rate_scale = 4.0;
    let trace = mixed_trace();
    let first = simulate(&args, &trace);
    let second = simulate(&args, &trace);
    assert_eq!(first.to_json(), second.to_json());
    assert_eq!(first.markdown(), second.markdown());
    for run in &first.runs {
        let metrics = &run.metrics;
        assert_eq!((metrics.completed, metrics.rejected, metrics.unrouted), (60, 0, 0), "{}", run.label);
        assert!(metrics.ttft_p50_ms > 0.0 && metrics.e2e_p99_ms >= metrics.ttft_p99_ms, "{}", run.label);
        assert_eq!(run.decode_decisions, [("least_load".to_string(), 60)], "{}", run.label);
    }
    assert_eq!(first.setup.workers, 4);
    let markdown = first.markdown();
    assert!(markdown.contains("disaggregated, 2 prefill + 2 decode engines"), "{markdown}");
    assert!(markdown.contains("one cache of the prefill engines' 524288 KV tokens"), "{markdown}");
    assert!(markdown.contains("\n| decode decisions: least_load | 60 | 60 | 60 | 60 |"), "{markdown}");
    let json: serde_json::Value = serde_json::from_str(&first.to_json()).unwrap();
    assert_eq!(json["setup"]["pd"]["decode_policy_entry"], "least_load");
    assert_eq!(json["runs"][1]["metrics"]["pd"]["decode_uncached_tokens_max"], 0);
    // A regular fleet's report has no PD fields.
    let regular = simulate(&super::args("round_robin", 2), &trace).to_json();
    assert!(!regular.contains("\"pd\"") && !regular.contains("decode_decisions"), "{regular}");
}

#[test]
fn ttft_is_prefill_then_kv_transfer_then_one_decode_step() {
    // 1,024 prompt tokens: one 128 ms prefill step; 1,024 x 131,072 bytes at 25 GB/s: 5.369 ms
    // of transfer; then 4 decode steps of 6 + 0.35 x 1 ms on the decode engine, the first
    // giving the first token (no prefill there).
    let trace = Trace { requests: vec![request(0.0, 1024, 4, &[1, 2])] };
    let metrics = simulate(&pd_args("round_robin", 1, 1), &trace).runs[0].metrics.clone();
    assert_eq!(metrics.ttft_p50_ms, 128.0 + 5.369 + 6.35);
    assert_eq!(metrics.e2e_p50_ms, 128.0 + 5.369 + 4.0 * 6.35);
    let pd = metrics.pd.clone().unwrap();
    assert_eq!((pd.kv_transfer_mean_ms, pd.decode_queue_mean_ms), (5.369, 0.0));
    // Half the bandwidth: the transfer, and only it, takes twice as long.
    let mut slow = pd_args("round_robin", 1, 1);
    slow.policy.kv_transfer_gbps = 12.5;
    let slow = simulate(&slow, &trace).runs[0].metrics.clone();
    assert_eq!(slow.ttft_p50_ms, 128.0 + 10.737 + 6.35);
    assert_eq!(slow.e2e_p50_ms - slow.ttft_p50_ms, metrics.e2e_p50_ms - metrics.ttft_p50_ms);
    // The unified engine: first token at the end of prefill, 3 more decode steps.
    let unified = simulate(&super::args("round_robin", 1), &trace).runs[0].metrics.clone();
    assert_eq!((unified.ttft_p50_ms, unified.e2e_p50_ms), (128.0, 128.0 + 3.0 * 6.35));
}

#[test]
fn hit_rate_is_the_prefill_sides_and_decode_engines_never_prefill() {
    // cache_aware keeps the shared block on one prefill engine; round robin prefills it once
    // per prefill engine. The decode engines (which also cache the transferred prompts) count
    // for nothing: they compute no prompt.
    let trace = shared_prefix_trace(40, 200.0);
    let report = simulate(&pd_args("round_robin,cache_aware", 4, 2), &trace);
    let (round_robin, cache_aware) = (&report.runs[0].metrics, &report.runs[1].metrics);
    assert_eq!(round_robin.cache_hit_rate, 36.0 * 512.0 / (40.0 * 1024.0));
    assert_eq!(cache_aware.cache_hit_rate, 39.0 * 512.0 / (40.0 * 1024.0));
    assert_eq!(report.trace.pooled_kv_tokens, 4 * 262_144);
    for metrics in [round_robin, cache_aware] {
        let pd = metrics.pd.as_ref().unwrap();
        assert_eq!(pd.decode_uncached_tokens_max, 0);
        // Idle engines: each request's first token is its KV transfer plus one decode step
        // after its prefill (cached or not), never a prefill on the decode engine.
        assert!(metrics.ttft_p99_ms < 128.0 + 5.369 + 6.35 + 1e-9, "{metrics:?}");
    }
}

#[test]
fn a_prompt_larger_than_the_kv_cache_is_rejected_once() {
    let trace = Trace { requests: vec![request(0.0, 2000, 10, &[1, 2, 3, 4]), request(1.0, 100, 10, &[5])] };
    let mut args = pd_args("round_robin", 1, 1);
    args.engine.kv_capacity_tokens = Some(1024);
    let metrics = simulate(&args, &trace).runs[0].metrics.clone();
    assert_eq!((metrics.completed, metrics.rejected), (1, 1));
}

#[test]
fn conditional_runs_prefill_a_returning_conversation_in_place_on_its_decode_holder() {
    // A conversation's first turn (8 blocks), its second turn (one block more) once the first
    // is done, a new long prompt, a short one. With the decode side matching prefixes, the
    // second turn's holder has all but 512 tokens: in place (under 2,048 uncached); the short
    // prompt too; the long new prompt goes through a pair, as every request without the rule.
    let first: Vec<u64> = (1..=8).collect();
    let second: Vec<u64> = (1..=9).collect();
    let fresh: Vec<u64> = (20..28).collect();
    let trace = Trace {
        requests: vec![
            request(0.0, 4096, 4, &first),
            request(2000.0, 4608, 4, &second),
            request(4000.0, 4096, 4, &fresh),
            request(6000.0, 512, 4, &[40]),
        ],
    };
    let mut args = pd_args("cache_aware@pair,cache_aware:pd_conditional=true@conditional", 2, 2);
    args.decode_policy = "cache_aware".into();
    let report = simulate(&args, &trace);
    let (pair, conditional) = (&report.runs[0].metrics, &report.runs[1].metrics);
    for metrics in [pair, conditional] {
        assert_eq!((metrics.completed, metrics.rejected, metrics.unrouted), (4, 0, 0));
    }
    assert_eq!(pair.pd.as_ref().unwrap().in_place_share, 0.0);
    assert_eq!(pair.pd.as_ref().unwrap().decode_prefill_share, 0.0);
    let pd = conditional.pd.as_ref().unwrap();
    assert_eq!(pd.in_place_share, 0.5, "{pd:?}");
    // The decode engines computed the in-place requests' uncached parts (512 + 512 tokens), the
    // prefill engines the pairs' prompts (4,096 + 4,096).
    assert_eq!(pd.decode_prefill_share, 1024.0 / (1024.0 + 8192.0), "{pd:?}");
    // In place, the decode engine computes what it lacks, and its cache hit counts: the second
    // turn's 4,096 tokens (held on the decode side from the first turn's transfer).
    assert_eq!(conditional.cache_hit_rate, 4096.0 / (4096.0 + 4608.0 + 4096.0 + 512.0));
    assert_eq!(pair.cache_hit_rate, conditional.cache_hit_rate, "the pair's prefill engine held it too");
    // No transfer for the in-place requests: lower TTFT on the short ones, the same on the
    // pairs (the fleet is idle between arrivals).
    assert!(
        conditional.ttft_mean_ms < pair.ttft_mean_ms,
        "{} vs {}",
        conditional.ttft_mean_ms,
        pair.ttft_mean_ms
    );
    assert!(
        report.markdown().contains("| share prefilled in place | 0.0% | 50.0% |"),
        "{}",
        report.markdown()
    );
}
