//! End-to-end tests of the simulator on small hand-made traces: determinism, prefix affinity, TTFT accounting, sweeps, outputs.

use crate::{run, run_on_trace, write_outputs, SimArgs, SimError, SimReport};
use kvgate_trace::{Trace, TraceRequest};

fn request(timestamp_ms: f64, input_length: u32, output_length: u32, hash_ids: &[u64]) -> TraceRequest {
    TraceRequest {
        timestamp_ms,
        input_length,
        output_length,
        hash_ids: hash_ids.to_vec(),
        ..Default::default()
    }
}

/// `n` requests every `gap_ms`, each one shared 512-token block then a block of its own.
fn shared_prefix_trace(n: u64, gap_ms: f64) -> Trace {
    Trace { requests: (0..n).map(|i| request(i as f64 * gap_ms, 1024, 4, &[0, 1000 + i])).collect() }
}

/// A mixed trace: a few conversations that grow turn by turn, plus one-off prompts.
fn mixed_trace() -> Trace {
    let mut requests = Vec::new();
    for i in 0..60u64 {
        let conversation = i % 5;
        let turns = 1 + i / 5;
        let mut ids: Vec<u64> = (0..turns).map(|t| conversation * 100 + t).collect();
        if i % 7 == 0 {
            ids = vec![10_000 + i, 10_001 + i];
        }
        let input = (ids.len() as u32 * 512).saturating_sub(100).max(1);
        requests.push(request(i as f64 * 37.0, input, 20 + (i as u32 % 13), &ids));
    }
    Trace { requests }
}

fn args(policies: &str, workers: usize) -> SimArgs {
    let mut args = SimArgs::new("inline");
    args.policies = policies.split(',').map(str::to_string).collect();
    args.workers = workers;
    args
}

fn simulate(args: &SimArgs, trace: &Trace) -> SimReport {
    run_on_trace(args, trace, false).unwrap()
}

#[test]
fn same_inputs_give_identical_json_and_markdown() {
    let mut args = args(
        "round_robin,random,power_of_two,least_load,cache_aware,\
         cache_aware:balance_token_usage_threshold=0.05:overload_token_usage_threshold=0.5",
        3,
    );
    args.seed = 7;
    args.rate_scale = 4.0;
    let trace = mixed_trace();
    let first = simulate(&args, &trace);
    let second = simulate(&args, &trace);
    assert_eq!(first.to_json(), second.to_json());
    assert_eq!(first.markdown(), second.markdown());
    assert_eq!(first.runs.len(), 6);
    for run in &first.runs {
        assert_eq!(run.metrics.completed, 60, "{}", run.label);
    }
    // The seed matters to random routing.
    args.seed = 8;
    let other = simulate(&args, &trace);
    assert_ne!(first.runs[1].metrics, other.runs[1].metrics);
}

#[test]
fn cache_aware_keeps_a_shared_prefix_on_one_engine() {
    let report = simulate(&args("round_robin,cache_aware", 8), &shared_prefix_trace(40, 200.0));
    let round_robin = &report.runs[0].metrics;
    let cache_aware = &report.runs[1].metrics;
    // Round robin prefills the shared block once per engine (8 times); cache_aware once.
    assert_eq!(round_robin.cache_hit_rate, 32.0 * 512.0 / (40.0 * 1024.0));
    assert_eq!(cache_aware.cache_hit_rate, 39.0 * 512.0 / (40.0 * 1024.0));
    assert!(cache_aware.hit_of_ceiling > round_robin.hit_of_ceiling);
    assert_eq!(cache_aware.hit_of_ceiling, 1.0);
    assert!(
        report.runs[1].decisions.contains(&("cache_hit".to_string(), 39)),
        "{:?}",
        report.runs[1].decisions
    );
    // What each reason's requests cost: 39 hits with half their prompt cached, 1 miss with none.
    let by_reason: Vec<(&str, u64, f64)> = report.runs[1]
        .ttft_by_reason
        .iter()
        .map(|cost| (cost.reason.as_str(), cost.requests, cost.cache_hit_rate))
        .collect();
    assert_eq!(by_reason, [("cache_hit", 39, 0.5), ("cache_miss", 1, 0.0)]);
    let hit = &report.runs[1].ttft_by_reason[0];
    assert!(hit.ttft_mean_ms > 0.0 && hit.ttft_p99_ms >= hit.ttft_mean_ms, "{hit:?}");
    assert_eq!(report.trace.ceiling_hit_rate, 39.0 * 512.0 / (40.0 * 1024.0));
    // The fleet's 8 x 262,144 KV tokens hold the whole trace: the pooled LRU serves the ceiling.
    assert_eq!(report.trace.pooled_kv_tokens, 8 * 262_144);
    assert_eq!(report.trace.pooled_lru_hit_rate, report.trace.ceiling_hit_rate);
    assert_eq!(report.trace.pooled_belady_hit_rate, report.trace.ceiling_hit_rate);
    assert_eq!(cache_aware.hit_of_pooled_lru, 1.0);
    assert!((round_robin.hit_of_pooled_lru - 32.0 / 39.0).abs() < 1e-12);
}

#[test]
fn pooled_references_take_the_fleets_kv_and_show_in_the_report() {
    // Two engines of 512 KV tokens: one pooled cache of two blocks. LRU evicts each block
    // before its reuse; Belady keeps [1] for its reuse (512 of 2,560 tokens).
    let trace = Trace {
        requests: [1, 2, 3, 1, 2]
            .iter()
            .enumerate()
            .map(|(i, &id)| request(i as f64 * 1000.0, 512, 1, &[id]))
            .collect(),
    };
    let mut args = args("round_robin,cache_aware", 2);
    args.engine.kv_capacity_tokens = Some(512);
    let report = simulate(&args, &trace);
    let t = &report.trace;
    assert_eq!(
        (t.pooled_kv_tokens, t.pooled_lru_cached_tokens, t.pooled_belady_cached_tokens),
        (1024, 0, 512)
    );
    assert_eq!((t.pooled_lru_hit_rate, t.pooled_belady_hit_rate), (0.0, 0.2));
    let markdown = report.markdown();
    assert!(
        markdown.contains(
            "infinite-cache ceiling 40.0% of prompt tokens; pooled LRU 0.0%, pooled Belady 20.0% \
             (one cache of the fleet's 1024 KV tokens)."
        ),
        "{markdown}"
    );
    assert!(markdown.contains("\n| hit rate / pooled LRU | "), "{markdown}");
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["trace"]["pooled_belady_cached_tokens"], 512);
    assert!(json["runs"][0]["metrics"]["hit_of_pooled_lru"].is_number());
    // Sweep tables have the column too.
    let mut sweep = args.clone();
    sweep.sweep = vec!["cache_threshold=0.5".to_string()];
    let markdown = simulate(&sweep, &trace).markdown();
    assert!(markdown.contains("| hit rate / ceiling | hit rate / pooled LRU |"), "{markdown}");
}

#[test]
fn ttft_of_one_request_on_an_idle_engine_matches_the_hand_computation() {
    // 4096 tokens at 8000 tok/s in two 2048-token chunks: 2 x 256 ms = 512 ms to the first
    // token, then 2 decode steps of 6 + 0.35 x 1 ms for the other 2 tokens.
    let trace = Trace { requests: vec![request(250.0, 4096, 3, &[1, 2, 3, 4, 5, 6, 7, 8])] };
    let report = simulate(&args("round_robin", 1), &trace);
    let metrics = &report.runs[0].metrics;
    assert_eq!(metrics.ttft_p50_ms, 512.0);
    assert_eq!(metrics.ttft_p99_ms, 512.0);
    assert_eq!(metrics.e2e_p50_ms, 512.0 + 2.0 * 6.35);
    assert_eq!(metrics.mean_queue_ms, 0.0);
    assert_eq!(metrics.cache_hit_rate, 0.0);
    // Engine flags reach the engines: twice the prefill rate halves the TTFT.
    let mut fast = args("round_robin", 1);
    fast.engine.prefill_tokens_per_sec = Some(16_000.0);
    assert_eq!(simulate(&fast, &trace).runs[0].metrics.ttft_p50_ms, 256.0);
}

#[test]
fn an_unequal_fleet_runs_each_engine_at_its_own_speed_and_reports_the_shares_by_engine() {
    // Two one-block prompts alternating over two engines, the first 4x faster.
    let trace = Trace {
        requests: (0..4u32)
            .map(|i| request(f64::from(i) * 1000.0, 4096, 1, &[10 + u64::from(i); 8]))
            .collect(),
    };
    let mut args = args("round_robin", 2);
    args.engine.worker_speeds = vec![4.0];
    args.engine.worker_kv_capacity_tokens = vec![65_536, 8_192];
    let report = simulate(&args, &trace);
    let metrics = &report.runs[0].metrics;
    // 512 ms on the reference engine, 128 ms on the fast one: two of each.
    assert_eq!((metrics.ttft_p50_ms, metrics.ttft_p99_ms), (128.0, 512.0));
    assert_eq!(metrics.prefill_share_by_engine, [0.5, 0.5]);
    // Where the time went: each engine's mean, and the tail (the two 512 ms requests) on the slow one.
    assert_eq!(metrics.ttft_mean_ms_by_engine, [128.0, 512.0]);
    assert_eq!(metrics.slowest_share_by_engine, [0.0, 1.0]);
    assert_eq!(report.trace.pooled_kv_tokens, 65_536 + 8_192);
    assert!(report.markdown().contains("Unequal fleet: engine speeds 4, 1"), "{}", report.markdown());
    assert!(report.markdown().contains("| prefill share by engine (%) | 50/50 |"));
    args.engine.worker_speeds = vec![4.0, 1.0, 1.0];
    let Err(SimError::InvalidOptions(errors)) = run_on_trace(&args, &trace, false) else {
        panic!("three speeds for two engines");
    };
    assert!(errors.to_string().contains("--worker-speeds"), "{errors}");
}

#[test]
fn rate_scale_divides_timestamps_and_a_busy_engine_queues() {
    // Two 4096-token requests 100 ms apart on one engine: the second waits for the first's prefill.
    let trace = Trace { requests: vec![request(0.0, 4096, 1, &[1; 8]), request(200.0, 4096, 1, &[9; 8])] };
    let slow = simulate(&args("round_robin", 1), &trace);
    let mut scaled = args("round_robin", 1);
    scaled.rate_scale = 2.0;
    let fast = simulate(&scaled, &trace);
    // Unscaled: the second arrives at 200 ms, during the first's prefill; scaled at 100 ms,
    // earlier in it: it waits longer.
    assert!(fast.runs[0].metrics.ttft_p99_ms >= slow.runs[0].metrics.ttft_p99_ms);
    assert_eq!(fast.trace.span_s, 0.1);
}

#[test]
fn requests_larger_than_the_kv_cache_are_counted_as_rejected() {
    let trace = Trace { requests: vec![request(0.0, 2000, 10, &[1, 2, 3, 4]), request(1.0, 100, 10, &[5])] };
    let mut args = args("round_robin", 1);
    args.engine.kv_capacity_tokens = Some(1024);
    let metrics = simulate(&args, &trace).runs[0].metrics.clone();
    assert_eq!((metrics.completed, metrics.rejected), (1, 1));
}

#[test]
fn sweep_runs_the_grid_and_names_the_best_setting() {
    let mut args = args("cache_aware", 8);
    args.sweep = vec!["cache_threshold=1.0,0.3".to_string(), "balance_abs_threshold=64,32".to_string()];
    let report = simulate(&args, &shared_prefix_trace(40, 200.0));
    let labels: Vec<&str> = report.runs.iter().map(|run| run.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "cache_aware cache_threshold=1.0 balance_abs_threshold=64",
            "cache_aware cache_threshold=1.0 balance_abs_threshold=32",
            "cache_aware cache_threshold=0.3 balance_abs_threshold=64",
            "cache_aware cache_threshold=0.3 balance_abs_threshold=32",
        ]
    );
    // A threshold of 1.0 never counts a half-matched prompt as a hit.
    let hit = report.sweep_best.iter().find(|best| best.metric == "cache_hit_rate").unwrap();
    assert_eq!(hit.sweep_point[0], ("cache_threshold".to_string(), "0.3".to_string()));
    assert_eq!(hit.value, report.runs[2].metrics.cache_hit_rate);
    assert!(hit.value > report.runs[0].metrics.cache_hit_rate);
    assert_eq!(report.sweep_best.len(), crate::SWEEP_METRICS.len());
    assert!(report.markdown().contains("Best setting per metric"));
}

#[test]
fn trace_errors_from_a_file_name_the_line() {
    let path = std::env::temp_dir().join(format!("kvgate-sim-bad-{}.jsonl", std::process::id()));
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"timestamp\": 1, \"input_length\": \"five\", \"output_length\": 1, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let error = run(&SimArgs::new(&path)).unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(error.starts_with("trace line 2:"), "{error}");
    let missing = run(&SimArgs::new("/nonexistent/trace.jsonl")).unwrap_err().to_string();
    assert!(missing.contains("/nonexistent/trace.jsonl"), "{missing}");
}

#[test]
fn invalid_options_fail_before_reading_the_trace() {
    let mut args = SimArgs::new("/nonexistent/trace.jsonl");
    args.rate_scale = 0.0;
    let error = run(&args).unwrap_err();
    assert!(matches!(error, SimError::InvalidOptions(_)), "{error}");
}

#[test]
fn writes_json_and_a_png() {
    let dir = std::env::temp_dir().join(format!("kvgate-sim-out-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut args = args("round_robin,cache_aware", 3);
    args.json = Some(dir.join("report.json"));
    args.plot = Some(dir.join("report.png"));
    let report = simulate(&args, &mixed_trace());
    write_outputs(&args, &report).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["runs"][1]["label"], "cache_aware");
    assert_eq!(json["runs"][1]["metrics"]["completed"], 60);
    let png = std::fs::read(dir.join("report.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
    crate::plot::draw_with(&report, &dir.join("plain.png"), false).unwrap();
    assert_eq!(&std::fs::read(dir.join("plain.png")).unwrap()[..4], b"\x89PNG");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn exact_and_approximate_indexes_run_side_by_side() {
    // Requests 200 ms apart with 1,024-token prompts: the first prefill (128 ms) is stored
    // before the next arrives, so the engines' events tell the exact index in time.
    let trace = shared_prefix_trace(40, 200.0);
    let report = simulate(&args("cache_aware:prefix_index=approximate@approx,cache_aware@exact", 8), &trace);
    let (approx, exact) = (&report.runs[0], &report.runs[1]);
    assert!(
        approx.decisions.contains(&("prefix_index=approximate".to_string(), 40)),
        "{:?}",
        approx.decisions
    );
    assert!(exact.decisions.contains(&("prefix_index=exact".to_string(), 40)), "{:?}", exact.decisions);
    assert!(exact.decisions.contains(&("cache_hit".to_string(), 39)), "{:?}", exact.decisions);
    assert_eq!(exact.metrics.cache_hit_rate, approx.metrics.cache_hit_rate);
    let markdown = report.markdown();
    assert!(markdown.contains("| decisions: prefix_index=exact | 0 | 40 |"), "{markdown}");
}

#[test]
fn a_burst_before_any_prefill_ends_is_matched_on_the_prompts_in_flight() {
    // An RL step's samples at once (docs/SCENARIOS.md S10), before any engine has stored a
    // block: the exact index knows the engines' block size from the start (as the gateway's
    // does once its alignment probe's canary is stored, at worker join), so the samples after
    // the first match it in flight, as over the approximate tree, instead of spreading blind.
    let requests = (0..12).map(|_| request(0.0, 4096, 4, &[0, 1, 2, 3])).collect();
    let report = simulate(
        &args("cache_aware:prefix_index=approximate@approx,cache_aware@exact", 8),
        &Trace { requests },
    );
    let count = |run: usize, name: &str| {
        report.runs[run].decisions.iter().find(|(n, _)| n == name).map_or(0, |(_, c)| *c)
    };
    for run in [0, 1] {
        assert_eq!(count(run, "cache_hit"), 11, "{:?}", report.runs[run].decisions);
    }
    assert_eq!(count(1, "prefix_index=exact"), 12);
    assert_eq!(report.runs[1].metrics.cache_hit_rate, report.runs[0].metrics.cache_hit_rate);
}

#[test]
fn the_exact_index_knows_what_engines_evicted() {
    // Engines that hold one prompt's blocks at a time: after a detour the prefix is gone from
    // the engine, and only the exact index knows it (the tree still sends it home, a phantom hit).
    let mut requests = Vec::new();
    for i in 0..30u64 {
        let ids = if i % 2 == 0 { vec![0, 1] } else { vec![100 + i, 200 + i] };
        requests.push(request(i as f64 * 1000.0, 1024, 2, &ids));
    }
    let mut args = args("cache_aware:prefix_index=approximate@approx,cache_aware@exact", 1);
    args.engine.kv_capacity_tokens = Some(1100);
    let report = simulate(&args, &Trace { requests });
    let count = |run: usize, name: &str| {
        report.runs[run].decisions.iter().find(|(n, _)| n == name).map_or(0, |(_, c)| *c)
    };
    let served = report.runs[0].metrics.cache_hit_rate;
    assert!(served < 0.05, "the engine evicted the shared prompt between its uses: {served}");
    assert!(count(0, "cache_hit") >= 14, "the tree believes the shared prompt is still cached");
    assert!(count(1, "cache_hit") <= 2, "the exact index knows it is not: {:?}", report.runs[1].decisions);
    let believed = |run: usize| report.runs[run].metrics.chosen_match_mean.unwrap();
    assert!(believed(1) < 0.1 && believed(0) > 0.4, "tree {} vs exact {}", believed(0), believed(1));
}

mod answers;
mod outside;
mod overload;
mod pd;
mod sessions;
mod tenants;

#[test]
fn kv_events_out_writes_every_engines_stream_in_order() {
    // Two engines of tiny KV caches given prompts of their own (so cache_aware, too, spreads
    // them by load): both store, and both evict.
    let path = std::env::temp_dir().join(format!("kvgate-sim-kv-events-{}.jsonl", std::process::id()));
    let mut args = args("round_robin,cache_aware", 2);
    args.engine.kv_capacity_tokens = Some(4096);
    args.kv_events_out = Some(path.clone());
    let requests = (0..20u64).map(|i| request(i as f64 * 50.0, 1024, 4, &[2 * i + 7000, 2 * i + 7001]));
    let trace = Trace { requests: requests.collect() };
    run_on_trace(&args, &trace, false).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let lines: Vec<serde_json::Value> =
        text.lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    for run in ["round_robin", "cache_aware"] {
        let of_run: Vec<&serde_json::Value> = lines.iter().filter(|l| l["run"] == run).collect();
        for engine in 0..2u64 {
            let seqs: Vec<u64> =
                of_run.iter().filter(|l| l["engine"] == engine).map(|l| l["seq"].as_u64().unwrap()).collect();
            assert!(!seqs.is_empty(), "{run}: engine {engine} emitted events");
            assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{run}: engine {engine} in order: {seqs:?}");
        }
        let events = of_run.iter().flat_map(|l| l["events"].as_array().unwrap());
        let (mut stored, mut removed) = (0, 0);
        for event in events {
            if let Some(store) = event.get("BlockStored") {
                let (hashes, digests) = (&store["block_hashes"], &store["block_digests"]);
                assert_eq!(hashes.as_array().unwrap().len(), digests.as_array().unwrap().len(), "{store}");
                assert_eq!(store["block_size"], 16);
                stored += 1;
            }
            removed += usize::from(event.get("BlockRemoved").is_some());
        }
        assert!(stored > 0 && removed > 0, "{run}: {stored} stores, {removed} removals");
    }
}
