//! SMG 1.13 command lines in `kvgate launch`: every option of `smg launch` (SMG 1.13.0, in
//! tests/data/smg-1.13-options.txt) classified, the same and mapped ones parsing, the refused ones
//! saying why, docs/SMG.md current, SMG's documented command lines through `--print-config`, and a
//! typical SMG deployment's command line serving requests and Prometheus metrics.

use std::collections::BTreeSet;
use std::time::Duration;

use kvgate::smg::{self, Class};

#[test]
fn every_smg_option_is_classified_once() {
    let options = smg::smg_options();
    assert_eq!(options.len(), 212, "SMG 1.13.0's smg launch has 212 options");
    let listed: BTreeSet<&str> = options.iter().map(|option| option.names[0].as_str()).collect();
    let classified: Vec<&str> = smg::TABLE.iter().map(|entry| entry.smg).collect();
    let unique: BTreeSet<&str> = classified.iter().copied().collect();
    assert_eq!(unique.len(), classified.len(), "an SMG option is classified twice");
    let unclassified: Vec<_> = listed.difference(&unique).collect();
    assert!(unclassified.is_empty(), "SMG options without a class: {unclassified:?}");
    let unknown: Vec<_> = unique.difference(&listed).collect();
    assert!(unknown.is_empty(), "classified options SMG 1.13 does not have: {unknown:?}");
}

/// Each name of an SMG option (aliases too) with its example values.
fn command_lines(pick: fn(&Class) -> Option<&'static str>) -> Vec<Vec<String>> {
    let mut lines = Vec::new();
    for option in smg::smg_options() {
        let Some(example) = smg::entry(&option.names[0]).and_then(|entry| pick(&entry.class)) else {
            continue;
        };
        for name in &option.names {
            let mut line = vec![name.clone()];
            line.extend(example.split_whitespace().map(str::to_string));
            lines.push(line);
        }
    }
    lines
}

#[test]
fn same_and_mapped_options_parse() {
    let accepted = command_lines(|class| match class {
        Class::Same { example, .. } | Class::Mapped { example, .. } => Some(example),
        Class::Refused { .. } => None,
    });
    assert!(accepted.len() > 80, "{}", accepted.len());
    let mut failures = Vec::new();
    for line in &accepted {
        let args: Vec<&str> = line.iter().map(String::as_str).collect();
        if let Err(error) = kvgate::launch_config(&args) {
            failures.push(format!("{}: {error}", line.join(" ")));
        }
    }
    assert!(
        failures.is_empty(),
        "same/mapped SMG options that kvgate launch does not take:\n{}",
        failures.join("\n")
    );
}

#[test]
fn refused_options_name_the_missing_feature_and_what_to_use() {
    let mut refused = 0;
    for option in smg::smg_options() {
        let entry = smg::entry(&option.names[0]).unwrap();
        let Class::Refused { feature, instead } = &entry.class else { continue };
        refused += 1;
        for name in &option.names {
            let mut args = vec![name.as_str()];
            if option.arity != smg::Arity::Zero {
                args.push("1");
            }
            // A valid kvgate flag after it: the refused option's value is consumed, not misread.
            args.extend(["--port", "0"]);
            let error = kvgate::launch_config(&args).expect_err(name);
            assert!(error.contains(&format!("{name} (SMG) is not supported")), "{error}");
            assert!(error.contains(feature) && error.contains(instead), "{error}");
            assert!(!error.contains("unexpected argument"), "{error}");
        }
    }
    assert!(refused > 50);
}

#[test]
fn every_refused_option_of_a_command_line_is_reported_at_once() {
    let error = kvgate::launch_config(&[
        "--enable-mesh",
        "--port",
        "0",
        "--dp-minimum-tokens-scheduler",
        "--history-backend",
        "postgres",
    ])
    .unwrap_err();
    for name in ["--enable-mesh", "--dp-minimum-tokens-scheduler", "--history-backend"] {
        assert!(error.contains(name), "{error}");
    }
    assert!(error.contains("docs/SMG.md"), "{error}");
}

#[test]
fn mapped_options_become_kvgate_settings() {
    let config = kvgate::launch_config(&[
        "--eviction-interval-secs",
        "45",
        "--idle-connection-timeout-secs=75",
        "--max-concurrent-requests",
        "-1",
        "--model-path",
        "/models/llama",
        "--routing-key-headers",
        "x-session-id",
        "--cache-match-threshold",
        "0.4",
        "--spill-abs-threshold",
        "8",
        "--sticky-sessions",
        "--disable-worker-overload-protection",
        "--worker-startup-timeout-secs",
        "600",
        "--backend",
        "sglang",
        "--control-plane-api-keys",
        "admin-secret",
    ])
    .unwrap();
    assert_eq!(config.routing.eviction_interval, 45.0);
    assert_eq!(config.keep_alive_timeout_secs, 75.0);
    assert_eq!(config.max_concurrent_requests, None);
    assert_eq!(config.tokenizer_path.as_deref(), Some(std::path::Path::new("/models/llama")));
    assert_eq!(config.routing_key_header, "x-session-id");
    assert_eq!(config.routing.cache_threshold, 0.4);
    assert_eq!(config.routing.balance_abs_threshold, 8.0);
    assert!(config.routing_key_override);
    assert_eq!(config.admin_api_key.as_deref(), Some("admin-secret"));
    let limited = kvgate::launch_config(&["--max-concurrent-requests", "32"]).unwrap();
    assert_eq!(limited.max_concurrent_requests, Some(32));
    // --tokenizer-path wins over --model-path, in either order.
    for args in [
        ["--model-path", "/models/a", "--tokenizer-path", "/models/b/tokenizer.json"],
        ["--tokenizer-path", "/models/b/tokenizer.json", "--model-path", "/models/a"],
    ] {
        let config = kvgate::launch_config(&args).unwrap();
        assert_eq!(config.tokenizer_path.as_deref(), Some(std::path::Path::new("/models/b/tokenizer.json")));
    }
    let error = kvgate::launch_config(&["--model-path", "meta-llama/Llama-3.1-8B-Instruct"]).unwrap_err();
    assert!(error.contains("is a Hugging Face model id, not a local path"), "{error}");
    let error = kvgate::launch_config(&["--backend", "openai"]).unwrap_err();
    assert!(error.contains("--backend (SMG) openai") && error.contains("sglang, vllm"), "{error}");
}

#[test]
fn docs_smg_md_is_the_rendered_table() {
    let rendered = smg::render_doc();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/SMG.md");
    if std::env::var_os("KVGATE_UPDATE_DOCS").is_some() {
        std::fs::write(path, &rendered).unwrap();
    }
    let written = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        written == rendered,
        "docs/SMG.md is stale: regenerate with `KVGATE_UPDATE_DOCS=1 cargo test --test commands docs`"
    );
    assert!(!rendered.contains("unclassified"));
}

/// Command lines from SMG's own documentation (docs/getting-started/*.md of lightseekorg/smg,
/// HTTP routing) with `smg` replaced by `kvgate launch`, and what kvgate does with each.
const SMG_DOC_COMMAND_LINES: &[(&str, Result<&str, &str>)] = &[
    // cache_aware with the KV triggers (the typical deployment).
    (
        "--host 127.0.0.1 --port 30000 --worker-urls http://127.0.0.1:8000 http://127.0.0.1:8001 \
         --policy cache_aware --cache-threshold 0.5 --balance-abs-threshold 32 --balance-rel-threshold 1.5 \
         --eviction-interval-secs 60 --max-tree-size 67108864 --balance-token-usage-threshold 0.3 \
         --overload-token-usage-threshold 0.9 --load-monitor-interval 5 --prometheus-host 127.0.0.1 \
         --prometheus-port 29000 --log-level info --shutdown-grace-period-secs 1",
        Ok("prometheus_port: 29000"),
    ),
    // Load balancing guide: a policy and the workers.
    ("--worker-urls http://worker1:8000 http://worker2:8000 --policy power_of_two", Ok("policy: power_of_two")),
    // PD disaggregation, SGLang: several workers with bootstrap ports, per-side policies.
    (
        "--pd-disaggregation --prefill http://prefill1:8000 9001 --prefill http://prefill2:8000 9002 \
         --decode http://decode1:8001 --decode http://decode2:8001 --prefill-policy cache_aware \
         --decode-policy power_of_two",
        Ok("bootstrap_port: '9002'"),
    ),
    // The same with HTTP workers: SMG's --model-path is kvgate's (local) tokenizer.
    (
        "--worker-urls http://worker-1:8000 --model-path /models/llama --policy cache_aware --block-size 16 \
         --host 0.0.0.0 --port 30000",
        Ok("tokenizer_path: /models/llama"),
    ),
    // PD with the explicit `none` bootstrap port (smg launch --help's example).
    (
        "--pd-disaggregation --prefill http://prefill1:8000 9000 --prefill http://prefill2:8000 none \
         --prefill http://prefill3:8000 --decode http://decode1:8001 --decode http://decode2:8001",
        Ok("url: http://prefill3:8000"),
    ),
    // PD with SMG's per-prefill-worker admission: kvgate says why not.
    (
        "--pd-disaggregation --prefill http://prefill:8000 9001 --decode http://decode:8001 \
         --prefill-max-inflight-requests-per-worker 32 --prefill-queue-size 32 --prefill-queue-timeout-secs 30 \
         --host 0.0.0.0 --port 30000",
        Err("no per-worker cap on prefill requests"),
    ),
    // Service discovery, regular and PD.
    (
        "--service-discovery --selector app=sglang-worker --service-discovery-namespace inference \
         --service-discovery-port 8000",
        Ok("service_discovery_namespace: inference"),
    ),
    (
        "--service-discovery --pd-disaggregation --prefill-selector app=sglang role=prefill \
         --decode-selector app=sglang role=decode --service-discovery-namespace inference",
        Ok("- role=decode"),
    ),
    // The Kubernetes manifest's `--flag=value` form.
    (
        "--service-discovery --selector=app=sglang-worker --service-discovery-namespace=inference \
         --service-discovery-port=8000 --policy=cache_aware",
        Ok("- app=sglang-worker"),
    ),
    // gRPC workers (the KV-events guide): kvgate's workers are HTTP.
    (
        "--worker-urls grpc://worker-1:50051 --model-path meta-llama/Llama-3.1-8B-Instruct --policy cache_aware \
         --block-size 16 --host 0.0.0.0 --port 30000",
        Err("worker URL grpc://worker-1:50051 is not supported: kvgate lacks gRPC engines"),
    ),
];

#[test]
fn smg_documented_command_lines_through_print_config() {
    for (line, expected) in SMG_DOC_COMMAND_LINES {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .arg("launch")
            .args(line.split_whitespace())
            .arg("--print-config")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        match expected {
            Ok(shown) => {
                assert!(output.status.success(), "{line}\n{stderr}");
                assert!(stdout.contains(shown), "{line}: no {shown:?} in\n{stdout}");
            }
            Err(why) => {
                assert!(!output.status.success(), "{line}");
                assert!(stderr.contains(why) && !stderr.contains("unexpected argument"), "{line}\n{stderr}");
            }
        }
    }
}

#[tokio::test]
async fn a_typical_smg_deployment_serves_requests_and_prometheus_metrics() {
    let fleet =
        kvgate_mock::spawn_fleet(kvgate_mock::MockArgs { count: 2, ..Default::default() }).await.unwrap();
    let urls = fleet.urls();
    // The options a typical SMG deployment sets, by SMG's names (ports 0: free ones).
    let mut args = vec!["--host", "127.0.0.1", "--port", "0", "--worker-urls"];
    args.extend(urls.iter().map(String::as_str));
    args.extend([
        "--policy",
        "cache_aware",
        "--cache-threshold",
        "0.5",
        "--balance-abs-threshold",
        "32",
        "--balance-rel-threshold",
        "1.5",
        "--eviction-interval-secs",
        "60",
        "--max-tree-size",
        "67108864",
        "--balance-token-usage-threshold",
        "0.3",
        "--overload-token-usage-threshold",
        "0.9",
        "--load-monitor-interval",
        "1",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "0",
        "--log-level",
        "warn",
        "--shutdown-grace-period-secs",
        "1",
        "--request-id-headers",
        "x-request-id",
        "x-correlation-id",
    ]);
    let mut config = kvgate::launch_config(&args).unwrap();
    config.admin_port = Some(0);
    config.io_threads = Some(0);
    let gateway = kvgate_gateway::start(config).await.unwrap();
    let metrics_addr = gateway.metrics_addr.expect("--prometheus-port starts the metrics listener");
    assert!(metrics_addr.ip().is_loopback());
    let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().unwrap();
    let body = serde_json::json!({"model": "mock-model", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hello from an SMG command line"}]});
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let answer = loop {
        let res =
            client.post(format!("{}/v1/chat/completions", gateway.url())).json(&body).send().await.unwrap();
        if res.status() == 200 {
            break res.json::<serde_json::Value>().await.unwrap();
        }
        assert!(std::time::Instant::now() < deadline, "no answer: {}", res.status());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(answer["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{answer}");
    // Request ids: the client's (the first of --request-id-headers given), else a new one.
    let chat = || client.post(format!("{}/v1/chat/completions", gateway.url())).json(&body);
    let given = chat().header("x-correlation-id", "corr-42").send().await.unwrap();
    assert_eq!(given.headers()["x-request-id"], "corr-42");
    let generated = chat().send().await.unwrap();
    let id = generated.headers()["x-request-id"].to_str().unwrap().to_string();
    assert!(id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    let refused = chat().header("x-request-id", "bad-1").body("{").send().await.unwrap();
    assert_eq!(
        (refused.status().as_u16(), &refused.headers()["x-request-id"]),
        (400, &"bad-1".parse().unwrap())
    );
    let scraped = client.get(format!("http://{metrics_addr}/metrics")).send().await.unwrap();
    assert_eq!(scraped.status(), 200);
    let metrics = scraped.text().await.unwrap();
    assert!(metrics.contains("kvgate_requests_total"), "{metrics}");
    // /metrics stays on the main port too; the metrics listener serves nothing else.
    let main = client.get(format!("{}/metrics", gateway.url())).send().await.unwrap();
    assert_eq!(main.status(), 200);
    let other =
        client.post(format!("http://{metrics_addr}/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(other.status(), 404);
    gateway.shutdown().await;
    fleet.shutdown().await;
}

/// Kills the child when the test ends, pass or fail.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn log_dir_and_log_json_write_json_lines_to_the_log_file() {
    let dir = std::env::temp_dir().join(format!("kvgate-smg-log-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["launch", "--host", "127.0.0.1", "--port", "0", "--admin-port", "0", "--log-dir"])
        .arg(&dir)
        .args(["--log-json", "--log-level", "info"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _child = Child(child);
    let path = dir.join("kvgate.log");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let log = loop {
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        if log.contains("kvgate listening") {
            break log;
        }
        assert!(std::time::Instant::now() < deadline, "no start line in {}: {log:?}", path.display());
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = std::fs::remove_dir_all(&dir);
    for line in log.lines() {
        let entry: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(entry["level"].is_string(), "{line}");
    }
}

#[test]
fn smg_settings_are_the_kvgate_options_a_command_line_sets() {
    let args: Vec<String> =
        ["--eviction-interval-secs", "45", "--prometheus-port", "29000", "--model-path", "/m"]
            .map(String::from)
            .to_vec();
    let settings = kvgate::smg_settings(&args).unwrap();
    let keys: Vec<&str> = settings.keys().map(String::as_str).collect();
    assert_eq!(keys, ["eviction_interval", "prometheus_port", "tokenizer_path"]);
    assert_eq!(settings["eviction_interval"], 45.0);
    assert_eq!(settings["prometheus_port"], 29000);
    let error = kvgate::smg_settings(&["--enable-mesh".to_string()]).unwrap_err();
    assert!(error.contains("--enable-mesh (SMG) is not supported"), "{error}");
}

#[tokio::test]
async fn cors_allowed_origins_answer_preflights_and_mark_responses() {
    let fleet =
        kvgate_mock::spawn_fleet(kvgate_mock::MockArgs { count: 1, ..Default::default() }).await.unwrap();
    let urls = fleet.urls();
    let mut args = vec!["--host", "127.0.0.1", "--port", "0", "--admin-port", "0", "--worker-urls"];
    args.extend(urls.iter().map(String::as_str));
    args.extend(["--policy", "round_robin", "--cors-allowed-origins", "https://app.example"]);
    let mut config = kvgate::launch_config(&args).unwrap();
    config.io_threads = Some(0);
    let gateway = kvgate_gateway::start(config).await.unwrap();
    let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().unwrap();
    let path = format!("{}/v1/chat/completions", gateway.url());
    let preflight = |origin: &'static str| {
        client
            .request(reqwest::Method::OPTIONS, &path)
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "content-type, authorization")
            .send()
    };
    let allowed = preflight("https://app.example").await.unwrap();
    assert_eq!(allowed.status(), 204);
    assert_eq!(allowed.headers()["access-control-allow-origin"], "https://app.example");
    assert_eq!(allowed.headers()["access-control-allow-headers"], "content-type, authorization");
    assert!(allowed.headers()["access-control-allow-methods"].to_str().unwrap().contains("POST"));
    let other = preflight("https://evil.example").await.unwrap();
    assert_eq!(other.status(), 403);
    assert!(other.headers().get("access-control-allow-origin").is_none());

    let body = serde_json::json!({"model": "mock-model", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hello from a browser"}]});
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let answer = loop {
        let res =
            client.post(&path).header("origin", "https://app.example").json(&body).send().await.unwrap();
        if res.status() == 200 {
            break res;
        }
        assert!(std::time::Instant::now() < deadline, "no answer: {}", res.status());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(answer.headers()["access-control-allow-origin"], "https://app.example");
    let foreign =
        client.post(&path).header("origin", "https://evil.example").json(&body).send().await.unwrap();
    assert!(foreign.headers().get("access-control-allow-origin").is_none());
    gateway.shutdown().await;
    fleet.shutdown().await;
}

/// The lines a child prints to stdout, on a channel.
fn stdout_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The binaries themselves: `kvgate mock` engines, and `kvgate launch` with the typical SMG
/// deployment's command line in front of them.
#[tokio::test]
async fn the_typical_smg_command_line_runs_in_the_kvgate_binary_in_front_of_kvgate_mock() {
    let kvgate = || std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"));
    let piped = std::process::Stdio::piped;
    let mut mock = Child(
        kvgate()
            .args(["mock", "--workers", "2", "--base-port", "0", "--host", "127.0.0.1"])
            .stdout(piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let lines = stdout_lines(&mut mock);
    let mut engines = Vec::new();
    while engines.len() < 2 {
        let line = lines.recv_timeout(Duration::from_secs(30)).expect("kvgate mock prints its engines");
        if let Some((_, url)) = line.split_once(": http://") {
            engines.push(format!("http://{url}"));
        }
    }
    let mut launch = Child(
        kvgate()
            .args(["launch", "--host", "127.0.0.1", "--port", "0", "--worker-urls"])
            .args(&engines)
            .args(["--policy", "cache_aware", "--cache-threshold", "0.5", "--balance-abs-threshold", "32"])
            .args(["--balance-rel-threshold", "1.5", "--eviction-interval-secs", "60"])
            .args(["--max-tree-size", "67108864", "--balance-token-usage-threshold", "0.3"])
            .args(["--overload-token-usage-threshold", "0.9", "--load-monitor-interval", "1"])
            .args(["--prometheus-host", "127.0.0.1", "--prometheus-port", "0", "--log-level", "warn"])
            .args(["--shutdown-grace-period-secs", "1"])
            .stdout(piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let line = stdout_lines(&mut launch).recv_timeout(Duration::from_secs(30)).expect("kvgate launch starts");
    // "kvgate listening on URL (admin API: URL; metrics: URL/metrics)"
    let url = line.split_whitespace().nth(3).unwrap().to_string();
    let metrics = line.rsplit(' ').next().unwrap().trim_end_matches(')').to_string();
    assert!(url.starts_with("http://127.0.0.1:") && metrics.ends_with("/metrics"), "{line}");
    let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().unwrap();
    let body = serde_json::json!({"model": "mock-model", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hello from the SMG command line"}]});
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let res = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
        if res.status() == 200 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no answer: {}", res.status());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let scraped = client.get(&metrics).send().await.unwrap().text().await.unwrap();
    assert!(scraped.contains("kvgate_requests_total{"), "{scraped}");
    drop(launch);
    drop(mock);
}

#[test]
fn worker_overload_and_warm_up_options_are_taken() {
    let config = kvgate::launch_config(&["--worker-overload-protection"]).unwrap();
    assert_eq!(config.worker_overload_waiting_requests, Some(8), "SMG's default bounds");
    assert_eq!(config.worker_overload_token_usage, Some(0.8));
    let config = kvgate::launch_config(&[
        "--worker-overload-protection",
        "--worker-overload-token-usage",
        "0.9",
        "--worker-overload-shed",
        "--worker-warmup-secs",
        "30",
        "--worker-warmup-divert-every",
        "4",
    ])
    .unwrap();
    assert_eq!(
        (config.worker_overload_waiting_requests, config.worker_overload_token_usage),
        (Some(8), Some(0.9))
    );
    assert!(config.worker_overload_shed);
    let config = kvgate::launch_config(&["--disable-worker-overload-protection"]).unwrap();
    assert_eq!((config.worker_overload_waiting_requests, config.worker_overload_token_usage), (None, None));
    let zero = kvgate::launch_config(&["--worker-overload-waiting-requests", "0"]).unwrap();
    let error = zero.validate().unwrap_err().to_string();
    assert!(error.contains("worker_overload_waiting_requests"), "{error}");
    let config = kvgate::launch_config(&["--dp-aware"]).unwrap();
    assert!(config.dp_aware);
}

#[test]
fn conditional_pd_options_join_an_smg_pd_command_line() {
    // SMG's PD command line, with kvgate's conditional disaggregation and the KV link it predicts
    // the pair's transfer with.
    let config = kvgate::launch_config(&[
        "--pd-disaggregation",
        "--prefill",
        "http://prefill:8000",
        "9001",
        "--decode",
        "http://decode:8001",
        "--prefill-policy",
        "kv_aware",
        "--decode-policy",
        "kv_aware",
        "--pd-conditional",
        "--pd-max-local-prefill-tokens",
        "1024",
        "--kv-transfer-gbps",
        "50",
        "--kv-bytes-per-token",
        "65536",
    ])
    .unwrap();
    config.validate().unwrap();
    let rule = config.routing.pd_rule().expect("the conditional rule is on");
    assert_eq!(rule.max_local_prefill_tokens, 1024);
    // 10,000 tokens x 64 KiB at 50 GB/s: 13.1 ms.
    assert!((rule.transfer_s(10_000) - 0.013_107_2).abs() < 1e-9, "{}", rule.transfer_s(10_000));
    let zero = kvgate::launch_config(&["--kv-transfer-gbps", "0", "--kv-bytes-per-token", "0"]).unwrap();
    let error = zero.validate().unwrap_err().to_string();
    assert!(error.contains("kv_transfer_gbps") && error.contains("kv_bytes_per_token"), "{error}");
}
