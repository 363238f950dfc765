//! Replays small inline traces against an in-process fleet of simulated engines on loopback.

use kvgate_mock::{spawn_fleet, MockArgs};

use crate::{run, run_on_trace, Endpoint, ReplayArgs};

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
    args.speedup = 10.0;
    args.json = Some(json.clone());
    args.label = Some("direct".to_string());
    let report = run(&args).await.unwrap();
    assert_eq!(report.model, "mock-model", "discovered from /v1/models");
    assert_eq!((report.sent, report.succeeded, report.errors), (5, 5, 0), "{:?}", report.error_samples);
    assert_eq!(report.prompt_tokens, 600 + 700 + 1100 + 300 + 1024);
    assert_eq!(report.completion_tokens, 4 + 3 + 5 + 2 + 6);
    // Requests 2, 3 and 5 find block 1 (512 tokens) cached; 3 and 5 also much of block 2.
    assert!(report.cached_tokens >= 3 * 512, "{report:?}");
    assert!(report.cache_hit_rate > 0.0 && report.hit_of_ceiling > 0.5, "{report:?}");
    assert!(report.ttft_p50_ms > 0.0 && report.e2e_p99_ms >= report.ttft_p99_ms);
    assert!(report.markdown().contains("| direct |"));
    crate::run_cli(args).await.unwrap();
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(written["succeeded"], 5);
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(&json).unwrap();
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_endpoint_max_requests_and_concurrency_limit() {
    let fleet = spawn_fleet(fast_engines()).await.unwrap();
    let trace = kvgate_sim::trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    let mut args = ReplayArgs::new("inline", fleet.urls()[0].clone());
    args.endpoint = Endpoint::Chat;
    args.model = Some("mock-model".to_string());
    args.speedup = 100.0;
    args.max_requests = Some(3);
    args.concurrency_limit = Some(1);
    let report = run_on_trace(&args, &trace).await.unwrap();
    assert_eq!((report.sent, report.succeeded, report.errors), (3, 3, 0), "{:?}", report.error_samples);
    // The chat template adds role markers around the prompt.
    assert!(report.prompt_tokens > 600 + 700 + 1100);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_not_fatal() {
    let fleet = spawn_fleet(MockArgs { fail_rate: 1.0, ..fast_engines() }).await.unwrap();
    let trace = kvgate_sim::trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    let mut args = ReplayArgs::new("inline", fleet.urls()[0].clone());
    args.speedup = 100.0;
    let report = run_on_trace(&args, &trace).await.unwrap();
    assert_eq!((report.succeeded, report.errors), (0, 5));
    assert!(report.error_samples[0].starts_with("HTTP 500"), "{:?}", report.error_samples);
    fleet.shutdown().await;
}

#[tokio::test]
async fn the_deadline_bounds_the_run() {
    // Nothing listens on this port's accept queue in time: a listener that never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let trace = kvgate_sim::trace::Trace::parse_mooncake(TRACE.as_bytes()).unwrap();
    let mut args = ReplayArgs::new("inline", url);
    args.model = Some("m".to_string());
    args.speedup = 1000.0;
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
    args.speedup = 0.0;
    args.concurrency_limit = Some(0);
    let error = args.validate().unwrap_err().to_string();
    for needle in ["--speedup", "--concurrency-limit", "--url"] {
        assert!(error.contains(needle), "{error}");
    }
}
