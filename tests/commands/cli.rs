//! End-to-end tests of the `kvgate` binary: the README's demo command and startup errors.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn kvgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvgate"))
}

/// Kills the child when the test ends, pass or fail.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start `kvgate ARGS` (a demo with mock workers) and return it with the gateway URL and the
/// admin URL it prints.
fn launch_demo(args: &[&str]) -> (Child, String, String) {
    let mut child = Child(kvgate().args(args).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap());
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            for prefix in ["gateway: ", "admin: "] {
                if let Some(rest) = line.strip_prefix(prefix) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
                }
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(30)).expect("kvgate prints the gateway URL");
    let admin = rx.recv_timeout(Duration::from_secs(30)).expect("kvgate prints the admin URL");
    (child, url, admin)
}

#[tokio::test]
async fn demo_command_serves_a_chat_completion() {
    let (_child, url, admin) = launch_demo(&["launch", "--mock-workers", "2", "--port", "0"]);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let body = serde_json::json!({"model": "mock-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8});
    let started = Instant::now();
    let res = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let answer: serde_json::Value = res.json().await.unwrap();
    assert!(answer["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{answer}");
    assert!(answer["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(started.elapsed() < Duration::from_secs(10));
    let workers: serde_json::Value =
        client.get(format!("{admin}/workers")).send().await.unwrap().json().await.unwrap();
    assert_eq!(workers["workers"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn the_pd_demo_routes_pairs_of_simulated_engines() {
    let (_child, url, admin) = launch_demo(&[
        "launch",
        "--pd-disaggregation",
        "--mock-prefill",
        "2",
        "--mock-decode",
        "1",
        "--port",
        "0",
        "--expose-routing-headers",
    ]);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let body = serde_json::json!({"model": "mock-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8});
    let res = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(res.headers().contains_key("x-kvgate-prefill-worker"));
    let answer: serde_json::Value = res.json().await.unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 8, "{answer}");
    let workers: serde_json::Value =
        client.get(format!("{admin}/workers")).send().await.unwrap().json().await.unwrap();
    let mut roles: Vec<&str> =
        workers["workers"].as_array().unwrap().iter().map(|w| w["worker_type"].as_str().unwrap()).collect();
    roles.sort_unstable();
    assert_eq!(roles, ["decode", "prefill", "prefill"]);
    // Asking for one side only is a clear error.
    let out = kvgate()
        .args(["launch", "--pd-disaggregation", "--mock-prefill", "1", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--mock-decode"));
}

#[test]
fn an_unknown_policy_is_a_clear_startup_error() {
    let out = kvgate().args(["launch", "--policy", "fastest"]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    for name in ["round_robin", "random", "cache_aware", "power_of_two", "least_load"] {
        assert!(stderr.contains(name), "{stderr}");
    }
}

#[test]
fn invalid_thresholds_are_rejected_with_the_field_name() {
    let out = kvgate()
        .args(["launch", "--port", "0", "--balance-token-usage-threshold", "NaN", "--cache-threshold", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("balance_token_usage_threshold") && stderr.contains("cache_threshold"),
        "{stderr}"
    );
}

#[test]
fn a_config_file_with_an_unknown_key_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("kvgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "port: 0\nrouting:\n  cache_treshold: 0.4\n").unwrap();
    let out = kvgate().args(["launch", "--config", bad.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cache_treshold"), "{stderr}");
    // A valid file is validated like flags: NaN thresholds are rejected by name.
    let nan = dir.join("nan.yaml");
    std::fs::write(&nan, "port: 0\nrouting:\n  balance_token_usage_threshold: .nan\n").unwrap();
    let out = kvgate().args(["launch", "--config", nan.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("balance_token_usage_threshold"));
}

#[tokio::test]
async fn a_config_file_configures_the_demo_and_flags_override_it() {
    let dir = std::env::temp_dir().join(format!("kvgate-cli-ok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gw.yaml");
    std::fs::write(&file, "port: 1\nexpose_routing_headers: true\nrouting:\n  policy: round_robin\n")
        .unwrap();
    // `--port 0` must override the file's port 1, or no URL is printed.
    let (_child, url, _admin) =
        launch_demo(&["launch", "--config", file.to_str().unwrap(), "--mock-workers", "1", "--port", "0"]);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let body = serde_json::json!({"model": "mock-model", "prompt": "hello", "max_tokens": 2});
    let res = client.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["x-kvgate-route"], "round_robin", "routing options come from the file");
}

#[tokio::test]
async fn the_demo_routes_on_the_engines_kv_events() {
    let (_child, url, admin) =
        launch_demo(&["launch", "--mock-workers", "2", "--port", "0", "--expose-routing-headers"]);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let workers: serde_json::Value =
            client.get(format!("{admin}/workers")).send().await.unwrap().json().await.unwrap();
        let flowing =
            workers["workers"].as_array().unwrap().iter().all(|w| w["kv_events"]["flowing"] == true);
        if flowing {
            break;
        }
        assert!(Instant::now() < deadline, "the demo's KV events flow within 10 s: {workers}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let content = (0..64).map(|i| format!("word{i}")).collect::<Vec<_>>().join(" ");
    let body = serde_json::json!({"model": "mock-model", "max_tokens": 1,
        "messages": [{"role": "user", "content": content}]});
    let first = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(first.headers()["x-kvgate-prefix-index"], "exact");
    let owner = first.headers()["x-kvgate-worker"].clone();
    // Wait for the engine's stored-blocks event to reach the index (until then a repeat is a
    // miss and may be placed on the other engine, which then holds the prompt too).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = client.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        let stored = kvgate_protocol::exposition::samples(&metrics)
            .any(|sample| sample.name == "kvgate_kv_index_blocks" && sample.value > 0.0);
        if stored {
            break;
        }
        assert!(Instant::now() < deadline, "the engine's KV events reach the index within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Once the engine's stored-blocks event arrived, the same conversation is a hit there.
    let mut route = String::new();
    for _ in 0..100 {
        let res = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
        route = res.headers()["x-kvgate-route"].to_str().unwrap().to_string();
        if route == "cache_hit" {
            assert_eq!(res.headers()["x-kvgate-worker"], owner);
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no cache hit on the exact index: last route {route}");
}

#[test]
fn print_config_shows_the_merged_configuration_and_reads_back() {
    let dir = std::env::temp_dir().join(format!("kvgate-cli-print-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gw.yaml");
    std::fs::write(&file, "port: 31999\nrouting:\n  policy: CacheAware\n").unwrap();
    let out = kvgate()
        .args(["launch", "--config", file.to_str().unwrap(), "--policy", "manual", "--print-config"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(printed.contains("port: 31999") && printed.contains("policy: manual"), "{printed}");
    // The printed configuration is a valid --config file.
    std::fs::write(&file, &printed).unwrap();
    let again =
        kvgate().args(["launch", "--config", file.to_str().unwrap(), "--print-config"]).output().unwrap();
    assert_eq!(String::from_utf8(again.stdout).unwrap(), printed);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn sighup_reloads_the_client_keys_file() {
    let dir = std::env::temp_dir().join(format!("kvgate-cli-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("keys.txt");
    std::fs::write(&file, "sk-old team-a\n").unwrap();
    let (child, url, _admin) = launch_demo(&[
        "launch",
        "--mock-workers",
        "1",
        "--port",
        "0",
        "--client-api-keys-file",
        file.to_str().unwrap(),
    ]);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let body = serde_json::json!({"model": "mock-model", "prompt": "hello", "max_tokens": 2});
    let status = async |key: &str| {
        let request = client.post(format!("{url}/v1/completions")).bearer_auth(key).json(&body);
        request.send().await.unwrap().status().as_u16()
    };
    assert_eq!(status("sk-old").await, 200);
    assert_eq!(status("sk-new").await, 401);
    std::fs::write(&file, "sk-old team-a\nsk-new team-b\n").unwrap();
    let hup = Command::new("kill").args(["-HUP", &child.0.id().to_string()]).status().unwrap();
    assert!(hup.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while status("sk-new").await != 200 {
        assert!(Instant::now() < deadline, "the new key is not in force 10 s after SIGHUP");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status("sk-old").await, 200, "the gateway kept serving through the reload");
    let _ = std::fs::remove_dir_all(&dir);
}
