//! The fleet page: `GET /v1/fleet` against `kvgate mock` engines publishing KV events (workers,
//! decisions by reason, the imbalance terms, the closed loop, the last decisions), where it is
//! served and behind which key, and `GET /dashboard` rendered by headless Chromium (Debian's
//! `chromium`; `.ci/run` installs it and sets `KVGATE_REQUIRE_CHROMIUM=1`, elsewhere the test
//! is skipped with a message when it is absent) under a short load, with a screenshot saved.

use crate::common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{client, eventually, exposition, gateway, kv_events_config, kv_events_fleet, metrics_text};
use kvgate_gateway::GatewayHandle;
use kvgate_mock::{spawn_fleet, MockArgs, MockFleet};
use serde_json::{json, Value};

const MODEL: &str = "mock-model";

/// A cache_aware gateway on the fleet's events, polling loads (a KV term below 1.0) quickly.
async fn fleet_gateway(fleet: &MockFleet) -> GatewayHandle {
    let mut cfg = kv_events_config(fleet);
    cfg.routing.balance_token_usage_threshold = 0.9;
    cfg.load_monitor_interval_ms = 100;
    cfg.admin_port = Some(0);
    let gw = gateway(cfg).await;
    let flowing = eventually(10.0, async || {
        let workers = common::workers(&gw).await;
        !workers.is_empty() && workers.iter().all(|w| common::kv_events_flowing(w) && common::healthy(w))
    })
    .await;
    assert!(flowing, "every worker healthy with its KV events flowing within 10 s");
    gw
}

/// Conversation `c`'s chat of `turns` turns (later turns extend earlier ones: prefix hits).
fn chat(c: usize, turns: usize) -> Value {
    let mut messages =
        vec![json!({"role": "system", "content": format!("conversation {c} system prompt with some words")})];
    for turn in 0..turns {
        let words: Vec<String> = (0..20).map(|w| format!("c{c}t{turn}w{w}")).collect();
        messages.push(json!({"role": "user", "content": words.join(" ")}));
    }
    json!({"model": MODEL, "messages": messages, "max_tokens": 2})
}

async fn send(gw: &GatewayHandle, body: &Value) {
    let res = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(body)
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    res.bytes().await.unwrap();
}

async fn get_fleet(base: &str, query: &str) -> Value {
    let res = client().get(format!("{base}/v1/fleet{query}")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    res.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_shows_workers_decisions_terms_and_the_closed_loop() {
    let mock = kv_events_fleet(3).await;
    let gw = fleet_gateway(&mock).await;
    for turns in 1..=3 {
        for c in 0..4 {
            send(&gw, &chat(c, turns)).await;
        }
    }
    // Every worker's load sampled, every answer compared.
    let mut fleet = Value::Null;
    let complete = eventually(10.0, async || {
        fleet = get_fleet(&gw.admin_url(), "").await;
        let rows = fleet["workers"]["rows"].as_array().unwrap();
        rows.len() == 3
            && rows.iter().all(|row| row["kv_usage"].is_number())
            && fleet["pools"][0]["closed_loop"]["predicted_tokens"].as_u64().is_some_and(|n| n > 0)
    })
    .await;
    assert!(complete, "loads and the closed loop reach the fleet: {fleet:#}");
    assert_eq!(fleet["totals"]["workers"], 3, "{fleet:#}");
    assert_eq!(fleet["totals"]["healthy"], 3, "{fleet:#}");
    let pool = &fleet["pools"][0];
    assert_eq!(
        (pool["model"].as_str(), pool["role"].as_str(), pool["policy"].as_str()),
        (Some(MODEL), Some("regular"), Some("cache_aware"))
    );
    let decided: u64 =
        pool["decisions_total"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(decided, 12, "{pool:#}");
    assert!(pool["decisions_total"]["cache_hit"].as_u64().unwrap() >= 8, "later turns hit: {pool:#}");
    assert!(fleet["totals"]["decisions_per_sec"].as_f64().unwrap() > 0.0, "{fleet:#}");
    let hit = &pool["hit_rate"];
    assert_eq!(hit["decisions"], 12, "{pool:#}");
    assert!(
        hit["chosen"].as_f64().unwrap() > 0.3 && hit["chosen"].as_f64() <= hit["best"].as_f64(),
        "{pool:#}"
    );
    // The terms beside the thresholds they are compared with; none fired on this light load.
    let imbalance = &pool["imbalance"];
    assert_eq!(imbalance["kv_spread"]["threshold"], 0.9, "{imbalance:#}");
    assert!(
        imbalance["kv_spread"]["value"].as_f64().is_some_and(|v| (0.0..=1.0).contains(&v)),
        "{imbalance:#}"
    );
    assert_eq!(imbalance["count"]["threshold"], 64.0, "{imbalance:#}");
    assert_eq!(imbalance["firing"], json!({}), "{imbalance:#}");
    assert_eq!(pool["kv_usage"]["sampled"], 3);
    assert_eq!(
        pool["kv_usage"]["histogram"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum::<u64>(),
        3
    );
    let cl = &pool["closed_loop"];
    assert_eq!(
        cl["predicted_tokens"], cl["engine_cached_tokens"],
        "the index agrees with the engines: {cl:#}"
    );
    let rows = fleet["workers"]["rows"].as_array().unwrap();
    for row in rows {
        assert_eq!(row["circuit"], "closed");
        assert_eq!(row["events"]["flowing"], true, "{row:#}");
    }
    let batches: u64 = rows.iter().map(|row| row["events"]["batches"].as_u64().unwrap()).sum();
    assert!(batches > 0, "{fleet:#}");
    let served: u64 = rows.iter().filter_map(|row| row["hit_rate"]["decisions"].as_u64()).sum();
    assert_eq!(served, 12, "{fleet:#}");
    // The last decisions, newest first, with reason, index and match rates.
    let recent = fleet["recent_decisions"].as_array().unwrap();
    assert_eq!(recent.len(), 12);
    assert!(recent.windows(2).all(|w| w[0]["age_ms"].as_u64() <= w[1]["age_ms"].as_u64()), "{recent:#?}");
    assert!(recent
        .iter()
        .all(|d| d["index"] == "exact" && d["chosen_match"].is_number() && d["model"] == MODEL));
    // A short list on request: the fleet's aggregates stay whole.
    let one = get_fleet(&gw.admin_url(), "?workers=1").await;
    assert_eq!(
        (one["workers"]["rows"].as_array().unwrap().len(), one["workers"]["total"].as_u64()),
        (1, Some(3))
    );
    gw.shutdown().await;
}

/// The fleet's KV in `/v1/fleet`: each engine's holdings and share of the distinct cached
/// tokens, copies, the hottest prefixes with their holders, the tenants' cached tokens and KV
/// shares, the plots' points; the alignment probe's blocks counted nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_maps_its_kv_hot_prefixes_tenants_and_history() {
    let mock = kv_events_fleet(2).await;
    let mut cfg = kv_events_config(&mock);
    cfg.admin_port = Some(0);
    for tenant in ["chat", "batch"] {
        cfg.tenants.named.insert(tenant.into(), Default::default());
    }
    let gw = gateway(cfg).await;
    // Every worker probed first: its blocks must not show.
    let probed = eventually(20.0, async || {
        let fleet = get_fleet(&gw.admin_url(), "").await;
        fleet["workers"]["rows"].as_array().unwrap().iter().all(|row| row["alignment"]["outcome"] == "passed")
    })
    .await;
    assert!(probed, "{:#}", get_fleet(&gw.admin_url(), "").await);
    // Two tenants: `chat` comes back to four conversations, `batch` sends one long prompt.
    for turns in 1..=3 {
        for c in 0..4 {
            let res = client()
                .post(format!("{}/v1/chat/completions", gw.url()))
                .header("x-kvgate-tenant", "chat")
                .json(&chat(c, turns))
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 200);
            res.bytes().await.unwrap();
        }
    }
    let long = json!({"model": MODEL, "prompt": (0..200).map(|i| format!("b{i}")).collect::<Vec<_>>().join(" "), "max_tokens": 1});
    let res = client()
        .post(format!("{}/v1/completions", gw.url()))
        .header("x-kvgate-tenant", "batch")
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    res.bytes().await.unwrap();
    let mut fleet = Value::Null;
    let mapped = eventually(20.0, async || {
        fleet = get_fleet(&gw.admin_url(), "").await;
        let kv = &fleet["kv"];
        kv["tenants"].as_array().is_some_and(|t| t.len() == 2)
            && kv["pools"][0]["hot_by_hits"].as_array().is_some_and(|hot| !hot.is_empty())
            && kv["history"]["points"].as_array().is_some_and(|p| p.iter().any(|p| p["hit_rate"].is_number()))
    })
    .await;
    assert!(
        mapped,
        "the census, the hot prefixes, the tenants and a plot point within 20 s: {:#}",
        fleet["kv"]
    );
    let kv = &fleet["kv"];
    let pool = &kv["pools"][0];
    assert_eq!((pool["model"].as_str(), pool["block_size"].as_u64()), (Some(MODEL), Some(16)));
    let engines = pool["engines"].as_array().unwrap();
    assert_eq!(engines.len(), 2, "{pool:#}");
    let held: f64 = engines.iter().map(|e| e["cached_tokens"].as_f64().unwrap()).sum();
    assert_eq!(pool["held_tokens"].as_f64(), Some(held));
    let distinct = pool["distinct_tokens"].as_f64().unwrap();
    assert!(distinct > 0.0 && distinct <= held, "{pool:#}");
    assert!((pool["copies_per_block"].as_f64().unwrap() - held / distinct).abs() < 1e-9, "{pool:#}");
    assert_eq!(pool["tiers"]["GPU"].as_f64(), Some(held), "{pool:#}");
    // What the engines hold besides the probe's blocks: the workload's prompts only.
    let engine_blocks: usize = (0..2).map(|i| mock.cached_blocks(i)).sum();
    assert!(
        held < (engine_blocks * 16) as f64,
        "the probe's blocks are left out: {held} of {}",
        engine_blocks * 16
    );
    let hot = &pool["hot_by_hits"][0];
    assert!(hot["hits"].as_f64().unwrap() >= 1.0 && hot["tokens"].as_u64().unwrap() >= 16, "{hot:#}");
    assert_eq!(hot["copies"].as_u64(), Some(hot["engines"].as_array().unwrap().len() as u64), "{hot:#}");
    assert!(hot["engines"][0]["tier"] == "GPU", "{hot:#}");
    let tenants = kv["tenants"].as_array().unwrap();
    let tenant =
        |name: &str| tenants.iter().find(|t| t["tenant"] == name).unwrap_or_else(|| panic!("{tenants:#?}"));
    assert!(tenant("chat")["cached_tokens_total"].as_u64().unwrap() > 0, "later turns hit: {tenants:#?}");
    assert_eq!(tenant("batch")["cached_tokens_total"], 0);
    assert!(tenant("chat")["cached_share"].as_f64().unwrap() > 0.99, "{tenants:#?}");
    for name in ["chat", "batch"] {
        let share = tenant(name)["kv_share"].as_f64().unwrap();
        assert!(share > 0.0 && share <= 1.0, "{name}: {tenants:#?}");
    }
    let text = metrics_text(&gw).await;
    let chat_series =
        exposition::Selector::parse(r#"kvgate_tenant_cached_tokens_total{tenant="chat"}"#).unwrap();
    assert!(chat_series.first(&text).is_some(), "{text}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_decisions_show_their_predicted_terms() {
    let mock = kv_events_fleet(2).await;
    let mut cfg = kv_events_config(&mock);
    cfg.routing.policy = kvgate_policy::PolicyKind::KvAware;
    cfg.load_monitor_interval_ms = 100;
    let gw = gateway(cfg).await;
    assert!(eventually(10.0, async || common::workers(&gw).await.iter().all(common::healthy)).await);
    for c in 0..3 {
        send(&gw, &chat(c, 1)).await;
    }
    let fleet = get_fleet(&gw.admin_url(), "").await;
    let recent = fleet["recent_decisions"].as_array().unwrap();
    assert_eq!(recent.len(), 3, "{fleet:#}");
    for decision in recent {
        let terms = decision["predicted_ms"].as_object().unwrap_or_else(|| panic!("{decision:#}"));
        assert!(terms["total"].as_f64().unwrap() >= terms["prefill"].as_f64().unwrap(), "{decision:#}");
        assert!(decision["runner_up_ms"].as_f64().is_some_and(|ms| ms >= 0.0), "two engines: {decision:#}");
    }
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_key_the_page_asks_the_browser_for_it() {
    let mut cfg = common::config(Vec::new());
    cfg.admin_api_key = Some("operator-key".into());
    let gw = gateway(cfg).await;
    let basic = |password: &str| {
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("ops:{password}")))
    };
    for path in ["/dashboard", "/v1/fleet"] {
        let url = format!("{}{path}", gw.url());
        let res = client().get(&url).send().await.unwrap();
        assert_eq!(res.status(), 401, "{path}");
        assert_eq!(res.headers()["www-authenticate"], "Basic realm=\"kvgate admin\"", "{path}");
        let res = client().get(&url).header("authorization", basic("wrong")).send().await.unwrap();
        assert_eq!(res.status(), 401, "{path}");
        for auth in [basic("operator-key"), "Bearer operator-key".to_string()] {
            let res = client().get(&url).header("authorization", auth).send().await.unwrap();
            assert_eq!(res.status(), 200, "{path}");
        }
    }
    let res =
        client().get(format!("{}/dashboard", gw.url())).bearer_auth("operator-key").send().await.unwrap();
    assert!(res.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    assert!(res.headers()["content-security-policy"].to_str().unwrap().contains("default-src 'none'"));
    let page = res.text().await.unwrap();
    assert!(
        page.contains("fetch(\"/v1/fleet\"") && !page.contains("http://") && !page.contains("https://"),
        "no external asset"
    );
    gw.shutdown().await;
}

/// Debian's binary, or another Chromium on PATH.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|candidate| candidate.is_file())
}

/// Runs headless Chromium on `url` with `mode` (`--dump-dom` or `--screenshot=PATH`), loopback
/// only (every other host resolves nowhere; no background networking), within 120 s (a cold
/// start on two loaded cores takes seconds; the bound is for a hung browser). Each run has a
/// profile of its own below `profiles`: a browser still winding down holds its profile's lock,
/// and a second one started on it hands its command line over and exits without a page.
async fn run_chromium(binary: &PathBuf, profiles: &std::path::Path, url: &str, mode: &str) -> String {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let profile = profiles.join(format!("run-{run}"));
    let mut child = std::process::Command::new(binary)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions"])
        .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
        .arg("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--window-size=1400,2300", "--hide-scrollbars", "--virtual-time-budget=2500", mode, url])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("chromium starts");
    let mut stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("chromium's status").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = std::fs::remove_dir_all(&profile);
    reader.join().expect("the reader thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_renders_in_headless_chromium() {
    let Some(binary) = chromium() else {
        assert!(
            std::env::var_os("KVGATE_REQUIRE_CHROMIUM").is_none(),
            "KVGATE_REQUIRE_CHROMIUM is set but no chromium is on PATH (apt-get install chromium)"
        );
        eprintln!("SKIPPED the_dashboard_renders_in_headless_chromium: no chromium on PATH (Debian: apt-get install chromium)");
        return;
    };
    // Small KV caches and slower engines, so that usage bars and requests in flight show.
    let mut args = MockArgs { count: 4, time_scale: 5.0, ..MockArgs::default() };
    args.kv_events_base_port = Some(0);
    args.kv_events_replay_base_port = Some(0);
    args.engine_flags.kv_capacity_tokens = Some(2_000);
    let mock = spawn_fleet(args).await.expect("the mock fleet starts");
    let gw = fleet_gateway(&mock).await;
    // A bounded load (4 clients, at most 600 requests each), running while the page is read.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|client_idx| {
            let (base, stop) = (gw.url(), stop.clone());
            tokio::spawn(async move {
                for round in 0..600 {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    let mut body = chat(client_idx * 3 + round % 3, 1 + round % 4);
                    body["max_tokens"] = json!(48);
                    let _ = client().post(format!("{base}/v1/chat/completions")).json(&body).send().await;
                }
            })
        })
        .collect();
    let profile = std::env::temp_dir().join(format!("kvgate-chromium-{}", std::process::id()));
    let url = format!("{}/dashboard", gw.admin_url());
    // Each read of the page is a cold browser start: seconds each on two loaded cores.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut dom = String::new();
    // The plots' points, as the page says ("(N points, one per 5 s)").
    let points = |dom: &str| -> usize {
        let note = dom.split("id=\"history-note\">(").nth(1).unwrap_or("");
        note.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    let rendered = |dom: &str| {
        let rate =
            dom.split("id=\"decision-rate\" data-rate=\"").nth(1).and_then(|rest| rest.split('"').next());
        dom.matches("class=\"worker-row\"").count() == 4
            && rate.and_then(|r| r.parse::<f64>().ok()).is_some_and(|r| r > 0.0)
            // The fleet's KV: an engine row per worker, a hot prefix, a tenant, and both plots
            // with a line (two census steps of load).
            && dom.matches("class=\"kv-engine-row\"").count() == 4
            && dom.contains("class=\"hot-prefix\"")
            && dom.contains("class=\"tenant-row\"")
            && dom.contains("data-series=\"hit rate\"")
            && dom.contains("data-series=\"p90\"")
            && points(dom) >= 3
    };
    while Instant::now() < deadline {
        dom = run_chromium(&binary, &profile, &url, "--dump-dom").await;
        if rendered(&dom) {
            break;
        }
    }
    assert!(
        rendered(&dom),
        "four worker rows, a non-zero decision rate, the KV map and the plots rendered within 120 s:\n{dom}"
    );
    assert!(dom.contains("cache_aware") && dom.contains("decisions per second by reason"), "{dom}");
    assert!(
        dom.contains("hottest prefixes: tokens saved") && dom.contains("passed"),
        "the probe's verdicts: {dom}"
    );
    let screenshot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&screenshot);
    run_chromium(&binary, &profile, &url, &format!("--screenshot={}", screenshot.display())).await;
    let png = std::fs::read(&screenshot).expect("chromium wrote the screenshot");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "a PNG of the page ({} bytes)", png.len());
    println!("dashboard screenshot: {}", screenshot.display());
    eprintln!("dashboard screenshot: {}", screenshot.display());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for load in clients {
        load.await.unwrap();
    }
    let _ = std::fs::remove_dir_all(&profile);
    gw.shutdown().await;
}
