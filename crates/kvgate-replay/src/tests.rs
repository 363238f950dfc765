//! Replays small inline traces against an in-process fleet of simulated engines on loopback.

use kvgate_mock::{spawn_fleet, MockArgs};

use crate::{markdown_all, run, run_all, run_all_on_trace, run_on_trace, Endpoint, ReplayArgs};

/// Five requests; the later ones repeat the first one's leading block(s).
const TRACE: &str = r#"{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}
{"timestamp": 100, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]}
{"timestamp": 200, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 4]}
{"timestamp": 300, "input_length": 300, "output_length": 2, "hash_ids": [9]}
{"timestamp": 400, "input_length": 1024, "output_length": 6, "hash_ids": [1, 2]}
"#;

fn fast_engines() -> MockArgs {
    MockArgs { count: 1, time_scale: 20.0, ..MockArgs::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_a_trace_against_a_simulated_engine_and_sees_cached_prefixes() {
    let fleet = spawn_fleet(fast_engines()).await.unwrap();
    let url = fleet.urls()[0].clone();
    let path = std::env::temp_dir().join(format!("kvgate-replay-{}.jsonl", std::process::id()));
    std::fs::write(&path, TRACE).unwrap();
    let json = path.with_extension("json");
    let mut args = ReplayArgs::new(&path, &url);
    args.rate_scale = 10.0;
    args.json = Some(json.clone());
    args.label = vec!["direct".to_string()];
    // Three blocks: LRU serves 512 + 1,024 of the 3,724 prompt tokens (the last [1, 2] finds
    // block 1 evicted by [9]); Belady also the last 1,024 (it evicts [1, 3] and [1, 2, 4]).
    args.fleet_kv_tokens = Some(1536);
    let report = run(&args).await.unwrap();
    assert_eq!(report.model, "mock-model", "discovered from /v1/models");
    assert_eq!((report.sent, report.succeeded, report.errors), (5, 5, 0), "{:?}", report.error_samples);
    assert_eq!(report.prompt_tokens, 600 + 700 + 1100 + 300 + 1024);
    assert_eq!(report.completion_tokens, 4 + 3 + 5 + 2 + 6);
    // Requests 2, 3 and 5 find block 1 (512 tokens) cached; 3 and 5 also much of block 2.
    assert!(report.cached_tokens >= 3 * 512, "{report:?}");
    assert!(report.cache_hit_rate > 0.0 && report.hit_of_ceiling > 0.5, "{report:?}");
    assert!(report.ttft_p50_ms > 0.0 && report.e2e_p99_ms >= report.ttft_p99_ms);
    // Every request succeeded: the p99 over all of them is the successes' p99.
    assert_eq!(report.e2e_p99_all_ms, Some(report.e2e_p99_ms));
    assert!(report.ttft_mean_ms > 0.0 && report.ttft_mean_ms <= report.ttft_p99_ms, "{report:?}");
    assert_eq!(report.ceiling_hit_rate, 2560.0 / 3724.0);
    assert_eq!(report.fleet_kv_tokens, Some(1536));
    assert_eq!(report.pooled_lru_hit_rate, Some(1536.0 / 3724.0));
    assert_eq!(report.pooled_belady_hit_rate, Some(2560.0 / 3724.0));
    assert_eq!(report.hit_of_pooled_lru, Some(report.cache_hit_rate / (1536.0 / 3724.0)));
    let markdown = report.markdown();
    assert!(markdown.contains("| direct |"));
    assert!(
        markdown.contains(
            "infinite-cache ceiling 68.7% of prompt tokens; pooled LRU 41.2%, pooled Belady 68.7% \
             (one cache of the fleet's 1536 KV tokens)."
        ),
        "{markdown}"
    );
    assert!(markdown.contains("\n| TTFT mean (ms) | ") && markdown.contains("\n| hit rate / pooled LRU | "));
    crate::run_cli(args).await.unwrap();
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(written["succeeded"], 5);
    assert_eq!(written["fleet_kv_tokens"], 1536);
    assert!(written["ttft_mean_ms"].as_f64().unwrap() > 0.0);
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(&json).unwrap();
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_endpoint_max_requests_and_concurrency_limit() {
    let fleet = spawn_fleet(fast_engines()).await.unwrap();
    let trace = kvgate_trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    let mut args = ReplayArgs::new("inline", fleet.urls()[0].clone());
    args.endpoint = Endpoint::Chat;
    args.model = Some("mock-model".to_string());
    args.rate_scale = 100.0;
    args.max_requests = Some(3);
    args.concurrency_limit = Some(1);
    let report = run_on_trace(&args, &trace).await.unwrap();
    assert_eq!((report.sent, report.succeeded, report.errors), (3, 3, 0), "{:?}", report.error_samples);
    // The chat template adds role markers around the prompt.
    assert!(report.prompt_tokens > 600 + 700 + 1100);
    // Without --fleet-kv-tokens the pooled references are left out.
    assert_eq!(
        (report.fleet_kv_tokens, report.pooled_lru_hit_rate, report.hit_of_pooled_lru),
        (None, None, None)
    );
    let markdown = report.markdown();
    assert!(!markdown.contains("pooled"), "{markdown}");
    assert!(markdown.contains("\n| TTFT mean (ms) | "), "{markdown}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_not_fatal() {
    let fleet = spawn_fleet(MockArgs { fail_rate: 1.0, ..fast_engines() }).await.unwrap();
    let trace = kvgate_trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    let mut args = ReplayArgs::new("inline", fleet.urls()[0].clone());
    args.rate_scale = 100.0;
    let report = run_on_trace(&args, &trace).await.unwrap();
    assert_eq!((report.succeeded, report.errors), (0, 5));
    assert!(report.error_samples[0].starts_with("HTTP 500"), "{:?}", report.error_samples);
    // Over every request sent, the p99 is a failure.
    assert_eq!((report.ttft_p99_all_ms, report.e2e_p99_all_ms), (None, None));
    assert!(report.markdown().contains("\n| e2e p99, all requests (ms) | failed |"), "{}", report.markdown());
    fleet.shutdown().await;
}

#[tokio::test]
async fn the_deadline_bounds_the_run() {
    // Nothing listens on this port's accept queue in time: a listener that never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let trace = kvgate_trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    let mut args = ReplayArgs::new("inline", url);
    args.model = Some("m".to_string());
    args.rate_scale = 1000.0;
    args.deadline_secs = Some(0.3);
    let report = run_on_trace(&args, &trace).await.unwrap();
    assert_eq!(report.succeeded, 0);
    assert_eq!(report.errors, report.sent as u64);
    assert!(report.deadline_hits > 0);
    assert!(report.wall_s < 5.0);
    drop(listener);
}

#[test]
fn invalid_options_are_all_reported() {
    let mut args = ReplayArgs::new("t.jsonl", "localhost:1");
    args.rate_scale = 0.0;
    args.concurrency_limit = Some(0);
    args.fleet_kv_tokens = Some(0);
    let error = args.validate().unwrap_err().to_string();
    for needle in ["rate_scale (--rate-scale)", "--concurrency-limit", "--url", "--fleet-kv-tokens"] {
        assert!(error.contains(needle), "{error}");
    }
    let mut args = ReplayArgs::new("t.jsonl", "http://127.0.0.1:1");
    args.label = vec!["a".to_string(), "b".to_string()];
    args.flush_cache_urls = vec!["127.0.0.1:2".to_string()];
    args.pause_secs = -1.0;
    let error = args.validate().unwrap_err().to_string();
    for needle in ["--label", "--flush-cache-urls", "--pause-secs"] {
        assert!(error.contains(needle), "{error}");
    }
}

#[test]
fn url_and_label_are_repeatable_on_the_command_line() {
    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        args: ReplayArgs,
    }
    let parse = |argv: &[&str]| <Command as clap::Parser>::try_parse_from(argv).map(|c| c.args);
    let args = parse(&[
        "replay",
        "--trace",
        "t",
        "--url",
        "http://a",
        "http://b",
        "--url",
        "http://c",
        "--label",
        "A",
        "--flush-cache-urls",
        "http://e1",
        "http://e2",
        "--pause-secs",
        "2",
    ])
    .unwrap();
    assert_eq!(args.url, ["http://a", "http://b", "http://c"]);
    assert_eq!(args.label, ["A"]);
    assert_eq!(args.flush_cache_urls, ["http://e1", "http://e2"]);
    assert_eq!(args.pause_secs, 2.0);
    assert_eq!(
        (args.label(0), args.label(1), args.label(2)),
        ("A".into(), "http://b".into(), "http://c".into())
    );
    assert!(parse(&["replay", "--trace", "t"]).is_err(), "--url is required");
    let twice = ReplayArgs { url: vec!["http://a".into(), "http://a".into()], ..ReplayArgs::new("t", "-") };
    assert_eq!((twice.label(0), twice.label(1)), ("http://a".into(), "http://a #2".into()));
    assert_eq!(ReplayArgs::new("t", "http://x").url, ["http://x"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compares_two_gateways_in_one_run_with_cold_caches() {
    let (one, two) = (spawn_fleet(fast_engines()).await.unwrap(), spawn_fleet(fast_engines()).await.unwrap());
    let path = std::env::temp_dir().join(format!("kvgate-replay-two-{}.jsonl", std::process::id()));
    std::fs::write(&path, TRACE).unwrap();
    let json = path.with_extension("json");
    let mut args = ReplayArgs::new(&path, one.urls()[0].clone());
    args.url.push(two.urls()[0].clone());
    args.label = vec!["first".to_string(), "second".to_string()];
    args.flush_cache_urls = one.urls().into_iter().chain(two.urls()).collect();
    args.pause_secs = 0.05;
    args.rate_scale = 10.0;
    args.json = Some(json.clone());
    let reports = run_all(&args).await.unwrap();
    assert_eq!(reports.len(), 2);
    for (report, (label, url)) in
        reports.iter().zip([("first", one.urls()[0].clone()), ("second", two.urls()[0].clone())])
    {
        assert_eq!((report.sent, report.succeeded, report.errors), (5, 5, 0), "{:?}", report.error_samples);
        assert_eq!(report.label, label);
        assert!(report.url.starts_with(&url), "{} vs {url}", report.url);
    }
    let markdown = markdown_all(&reports);
    assert!(markdown.contains("| metric | first | second |"), "{markdown}");
    assert!(markdown.contains("| --- | ---: | ---: |"), "{markdown}");
    assert!(markdown.contains("| succeeded | 5 | 5 |"), "{markdown}");
    assert!(
        markdown.contains("**first**: Replay of") && markdown.contains("**second**: Replay of"),
        "{markdown}"
    );
    // A single run still renders (and serializes) exactly as before.
    assert_eq!(markdown_all(&reports[..1]), reports[0].markdown());
    crate::run_cli(args).await.unwrap();
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let written = written.as_array().expect("several reports are a JSON array");
    assert_eq!(written.len(), 2);
    assert_eq!((written[0]["label"].as_str(), written[1]["succeeded"].as_u64()), (Some("first"), Some(5)));
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(&json).unwrap();
    one.shutdown().await;
    two.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushing_between_targets_keeps_the_second_run_from_reusing_the_first_runs_cache() {
    let fleet = spawn_fleet(fast_engines()).await.unwrap();
    let trace = kvgate_trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    let url = fleet.urls()[0].clone();
    let mut args = ReplayArgs::new("inline", url.clone());
    args.url.push(url.clone());
    args.model = Some("mock-model".to_string());
    args.rate_scale = 10.0;
    // One request at a time: the hits depend only on the order, not on timing.
    args.concurrency_limit = Some(1);
    args.flush_cache_urls = vec![url.clone()];
    let flushed = run_all_on_trace(&args, &trace).await.unwrap();
    assert_eq!(flushed.len(), 2);
    assert!(flushed.iter().all(|r| r.succeeded == 5), "{flushed:?}");
    assert!(flushed[0].cached_tokens > 0, "{flushed:?}");
    assert_eq!(flushed[0].cached_tokens, flushed[1].cached_tokens, "{flushed:?}");
    assert_eq!(flushed[0].cache_hit_rate, flushed[1].cache_hit_rate);
    assert_eq!((flushed[0].label.as_str(), flushed[1].label.as_str()), (url.as_str(), &*format!("{url} #2")));
    // Without the flush the second run finds the first one's prefixes already cached.
    args.flush_cache_urls.clear();
    let warm = run_all_on_trace(&args, &trace).await.unwrap();
    assert!(warm[1].cached_tokens > flushed[1].cached_tokens, "{warm:?}");
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_failed_flush_is_a_clear_error() {
    let trace = kvgate_trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    // A server that hangs up on every connection (kept bound for the test: a port freed to mean
    // "closed" could be taken by another test's server meanwhile).
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || listener.incoming().take(16).for_each(drop));
        url
    };
    let fleet = spawn_fleet(fast_engines()).await.unwrap();
    let mut args = ReplayArgs::new("inline", fleet.urls()[0].clone());
    args.model = Some("mock-model".to_string());
    args.flush_cache_urls = vec![closed.clone()];
    let error = format!("{:#}", run_all_on_trace(&args, &trace).await.unwrap_err());
    assert!(error.contains(&format!("POST {closed}/flush_cache")), "{error}");
    // An HTTP error status (here 404: no such route) fails too, without retrying.
    args.flush_cache_urls = vec![format!("{}/nowhere", fleet.urls()[0])];
    let error = format!("{:#}", run_on_trace(&args, &trace).await.unwrap_err());
    assert!(error.contains("flushing the cache") && error.contains("404"), "{error}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spread_urls_sends_one_run_round_robin_over_the_replicas() {
    let (one, two) = (spawn_fleet(fast_engines()).await.unwrap(), spawn_fleet(fast_engines()).await.unwrap());
    let path = std::env::temp_dir().join(format!("kvgate-replay-spread-{}.jsonl", std::process::id()));
    std::fs::write(&path, TRACE).unwrap();
    let mut args = ReplayArgs::new(&path, one.urls()[0].clone());
    args.url.push(two.urls()[0].clone());
    args.spread_urls = true;
    args.rate_scale = 10.0;
    let reports = run_all(&args).await.unwrap();
    assert_eq!(reports.len(), 1, "one run over both URLs");
    assert_eq!((reports[0].sent, reports[0].succeeded), (5, 5), "{:?}", reports[0].error_samples);
    let prompts = |url: String| async move {
        let text = reqwest::get(format!("{url}/metrics")).await.unwrap().text().await.unwrap();
        text.lines()
            .find(|l| l.starts_with("vllm:prompt_tokens_total"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Requests 1, 3, 5 (600 + 1100 + 1024 tokens) to the first URL, 2 and 4 to the second.
    assert_eq!(prompts(one.urls()[0].clone()).await, 2724.0);
    assert_eq!(prompts(two.urls()[0].clone()).await, 1000.0);
    std::fs::remove_file(&path).unwrap();
    one.shutdown().await;
    two.shutdown().await;
}

/// Two sessions (three and two turns, each later turn 100 ms after the previous answer) beside
/// one request of no session.
const SESSIONS: &str = r#"{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2], "session_id": "a"}
{"timestamp": 10, "input_length": 300, "output_length": 2, "hash_ids": [9], "session_id": 7}
{"timestamp": 20, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3], "session_id": "a", "think_ms": 100}
{"timestamp": 30, "input_length": 200, "output_length": 2, "hash_ids": [20]}
{"timestamp": 40, "input_length": 700, "output_length": 3, "hash_ids": [9, 10], "session_id": 7, "delay": 100}
{"timestamp": 50, "input_length": 1600, "output_length": 6, "hash_ids": [1, 2, 3, 4], "session_id": "a", "think_ms": 100}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_with_sessions_replays_closed_loop_and_reports_their_makespans() {
    let fleet = spawn_fleet(fast_engines()).await.unwrap();
    let trace = kvgate_trace::Trace::parse_mooncake(SESSIONS.as_bytes()).unwrap();
    let mut args = ReplayArgs::new("inline", fleet.urls()[0].clone());
    args.model = Some("mock-model".to_string());
    let report = run_on_trace(&args, &trace).await.unwrap();
    assert_eq!((report.sent, report.succeeded, report.errors), (6, 6, 0), "{:?}", report.error_samples);
    let sessions = report.sessions.clone().expect("the trace names sessions");
    assert_eq!((sessions.sessions, sessions.turns, sessions.unfinished), (2, 5, 0));
    // Session "a": two think times of 100 ms after answers, so at least 200 ms from first send
    // to last answer; the open-loop timestamps (50 ms apart) would have overlapped its turns.
    assert!(sessions.makespan_p99_ms >= 200.0, "{sessions:?}");
    assert!(sessions.makespan_p50_ms >= 100.0 && sessions.makespan_p50_ms <= sessions.makespan_p99_ms);
    // Each later turn finds its previous turn's whole prompt cached on the one engine (in whole
    // 16-token blocks: 592 + 1,088 of session a, 288 of session 7), as it would not if it had
    // been sent at its timestamp, while the previous turn was still being prefilled.
    assert_eq!(report.cached_tokens, 592 + 1088 + 288, "{report:?}");
    let markdown = report.markdown();
    assert!(markdown.contains("\n| sessions (turns) | 2 (5) |"), "{markdown}");
    assert!(markdown.contains("\n| session makespan p99 (ms) |"), "{markdown}");
    assert!(report.to_json().contains("\"makespan_p99_ms\""));
    // Without sessions: no session rows.
    let open = kvgate_trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    let report = run_on_trace(&args, &open).await.unwrap();
    assert!(report.sessions.is_none() && !report.markdown().contains("session"));
    fleet.shutdown().await;
}
