//! The alignment probe and the index repair against `kvgate mock` engines: a right configuration
//! passes at the join (and its requests count nowhere as traffic); each fault injected is named
//! by the probe within one probe interval of the join (of the fault, for an engine restarted
//! later): KV events off, stores stating another block size, a wrong chat template, an engine
//! restarted without replay; and with `--index-repair resync` and `quarantine` the routing
//! returns to the exact index and the closed loop's error falls back under 1%.

use crate::common;

use std::time::Instant;

use common::{
    client, dead_url, eventually, gateway, kv_events_config, kv_events_fleet, metric, metrics_text,
    mock_fleet,
};
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use kvgate_index::IndexRepair;
use kvgate_mock::MockFleet;
use serde_json::{json, Value};

const MODEL: &str = "mock-model";
/// The probe interval of these tests, in seconds.
const INTERVAL: f64 = 3.0;
/// What a probe itself may take on top (its requests, the wait for events).
const SLACK: f64 = 8.0;

fn probing(mut cfg: GatewayConfig, repair: IndexRepair) -> GatewayConfig {
    cfg.alignment_probe_interval_secs = INTERVAL;
    cfg.index_repair = repair;
    cfg.expose_routing_headers = true;
    cfg
}

async fn workers(gw: &GatewayHandle) -> Vec<Value> {
    let listing: Value =
        client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    listing["workers"].as_array().cloned().unwrap_or_default()
}

/// Worker `url`'s alignment in `/workers` (null before its first probe).
async fn alignment(gw: &GatewayHandle, url: &str) -> Value {
    let listing = workers(gw).await;
    listing.into_iter().find(|w| w["url"] == url).map_or(Value::Null, |w| w["alignment"].clone())
}

/// Waits at most `secs` for worker `url`'s probe to conclude `outcome` (and `cause`); returns
/// its alignment and the time it took.
async fn concluded(
    gw: &GatewayHandle,
    url: &str,
    outcome: &str,
    cause: Option<&str>,
    secs: f64,
) -> (Value, f64) {
    let started = Instant::now();
    let mut seen = Value::Null;
    let reached = eventually(secs, async || {
        seen = alignment(gw, url).await;
        seen["outcome"] == outcome && cause.is_none_or(|cause| seen["cause"] == cause)
    })
    .await;
    assert!(reached, "{url}: {outcome} {cause:?} within {secs} s, last seen: {seen:#}");
    (seen, started.elapsed().as_secs_f64())
}

/// `n` words of conversation `c`, turn `t`.
fn words(c: usize, t: usize, n: usize) -> String {
    (0..n).map(|i| format!("a{c}t{t}w{i}")).collect::<Vec<_>>().join(" ")
}

/// Conversation `c`'s messages up to turn `turns`.
fn messages(c: usize, turns: usize) -> Vec<Value> {
    let mut messages = vec![json!({"role": "system", "content": words(c, 99, 20)})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": words(c, t, 24)}));
        if t + 1 < turns {
            messages.push(json!({"role": "assistant", "content": words(c, t + 50, 6)}));
        }
    }
    messages
}

/// One chat turn; returns the prefix index that decided it.
async fn turn(gw: &GatewayHandle, c: usize, turns: usize) -> String {
    let body = json!({"model": MODEL, "messages": messages(c, turns), "max_tokens": 1});
    let res = client().post(format!("{}/v1/chat/completions", gw.url())).json(&body).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let index = res.headers()["x-kvgate-prefix-index"].to_str().unwrap().to_string();
    res.bytes().await.unwrap();
    index
}

/// Waits until the index holds what every engine caches of turn `turns` of conversation `c`
/// (the engine's stores travel after its answer: a next turn sent before them would be
/// predicted without them, which is their latency, not the index being wrong).
async fn wait_indexed(gw: &GatewayHandle, fleet: &MockFleet, c: usize, turns: usize) {
    let pairs: Vec<(String, String)> = messages(c, turns)
        .iter()
        .map(|m| (m["role"].as_str().unwrap().to_string(), m["content"].as_str().unwrap().to_string()))
        .collect();
    let tokens = kvgate_engine::tokenize(&kvgate_protocol::render_chat(&pairs));
    let indexed = eventually(5.0, async || {
        let Some(index) = gw.exact_index(MODEL) else {
            return false;
        };
        let mut matched = kvgate_index::PrefixMatch::default();
        index.overlap(&tokens, kvgate_index::Namespace::BASE, &mut matched);
        fleet.urls().iter().enumerate().all(|(i, url)| {
            let id = gw.worker_id(url).unwrap();
            matched.matched(id) >= fleet.cached_prefix_tokens(i, &tokens)
        })
    })
    .await;
    assert!(indexed, "the engines' stores reach the index within 5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_right_configuration_passes_at_the_join_and_counts_as_no_traffic() {
    let fleet = kv_events_fleet(2).await;
    let gw = gateway(probing(kv_events_config(&fleet), IndexRepair::Quarantine)).await;
    for url in fleet.urls() {
        let (seen, _) = concluded(&gw, &url, "passed", None, INTERVAL + SLACK).await;
        let forms = seen["forms"].as_array().unwrap();
        assert_eq!(forms.len(), 2, "{seen:#}");
        let completion = &forms[0];
        assert_eq!(
            (completion["form"].as_str(), completion["prompt_tokens"].as_u64()),
            (Some("completion"), Some(128))
        );
        assert_eq!(completion["aligned"], true, "128 tokens in blocks of 16: {seen:#}");
        assert_eq!(completion["predicted"], 112, "held whole, the last block recomputed: {seen:#}");
        assert_eq!(completion["cached"], 112, "{seen:#}");
        assert_eq!(forms[1]["form"], "chat");
        assert_eq!(forms[1]["predicted"], forms[1]["cached"], "{seen:#}");
        assert_eq!(seen["quarantined"], false);
    }
    // The next probe checks the previous one's prompt is still held and served.
    let url = &fleet.urls()[0];
    let sentinel =
        eventually(INTERVAL + SLACK, async || alignment(&gw, url).await["sentinel"]["outcome"] == "passed");
    assert!(sentinel.await, "{:#}", alignment(&gw, url).await);
    // None of it is traffic: no decision, no closed-loop sample, no hit rate.
    let text = metrics_text(&gw).await;
    assert!(metric(&text, "kvgate_alignment_probes_total{result=\"passed\"}") >= 3.0, "{text}");
    assert_eq!(metric(&text, "kvgate_alignment_failures_total"), 0.0);
    assert_eq!(metric(&text, "kvgate_routing_decisions_total"), 0.0);
    assert_eq!(metric(&text, "kvgate_prefix_predicted_tokens_total"), 0.0);
    assert_eq!(metric(&text, "kvgate_prefix_engine_cached_tokens_total"), 0.0);
    assert!(workers(&gw).await.iter().all(|w| w["index_accuracy"].is_null()));
    gw.shutdown().await;
    fleet.shutdown().await;
}

/// The faults that are there at the join: each is named within one interval (plus the probe's
/// own time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fault_is_named_within_one_interval_of_the_join() {
    // KV events off: the engine publishes nothing where the gateway subscribes.
    let silent = mock_fleet(|args| args.time_scale = 50.0).await;
    let mut cfg = probing(common::config(silent.urls()), IndexRepair::Warn);
    cfg.routing.policy = kvgate_policy::PolicyKind::CacheAware;
    cfg.mock_tokenizer = true;
    let nowhere = dead_url().await.replace("http://", "tcp://");
    cfg.kv_events_endpoints = vec![nowhere];
    let started = Instant::now();
    let gw = gateway(cfg).await;
    let (seen, _) =
        concluded(&gw, &silent.urls()[0], "failed", Some("events_not_flowing"), INTERVAL + SLACK).await;
    assert!(seen["advice"].as_str().unwrap().contains("--kv-events-endpoints"), "{seen:#}");
    eprintln!("events off named {:.1} s after the join", started.elapsed().as_secs_f64());
    gw.shutdown().await;
    silent.shutdown().await;

    // Stores stating blocks of 32 where the engine caches blocks of 16: refused for their shape.
    let restated = mock_fleet(|args| {
        args.time_scale = 50.0;
        args.kv_events_base_port = Some(0);
        args.kv_events_replay_base_port = Some(0);
        args.kv_events_block_size_override = Some(32);
    })
    .await;
    let started = Instant::now();
    let gw = gateway(probing(kv_events_config(&restated), IndexRepair::Warn)).await;
    let (seen, _) = concluded(&gw, &restated.urls()[0], "failed", Some("block_size"), INTERVAL + SLACK).await;
    assert!(seen["forms"][0]["refused_shape"].as_u64().unwrap() > 0, "{seen:#}");
    eprintln!("block size named {:.1} s after the join", started.elapsed().as_secs_f64());
    let text = metrics_text(&gw).await;
    assert_eq!(metric(&text, "kvgate_alignment_failures_total{cause=\"block_size\"}"), 1.0, "{text}");
    assert_eq!(metric(&text, "kvgate_index_repairs_total{action=\"warn\"}"), 1.0, "{text}");
    gw.shutdown().await;
    restated.shutdown().await;

    // Another tokenizer than the engines': the completion's prompt has another length.
    let fleet = kv_events_fleet(1).await;
    let mut cfg = probing(kv_events_config(&fleet), IndexRepair::Warn);
    cfg.mock_tokenizer = false;
    cfg.tokenizer_path =
        Some(concat!(env!("CARGO_MANIFEST_DIR"), "/crates/kvgate-tokenizer/testdata/tiny-chatml").into());
    let gw = gateway(cfg).await;
    let (seen, _) = concluded(&gw, &fleet.urls()[0], "failed", Some("tokenizer"), INTERVAL + SLACK).await;
    let completion = &seen["forms"][0];
    assert_ne!(completion["prompt_tokens"], completion["engine_prompt_tokens"], "{seen:#}");
    gw.shutdown().await;
    fleet.shutdown().await;

    // A chat template other than the engines': the completion agrees, the chat does not.
    let fleet = kv_events_fleet(1).await;
    let template = common::WrongTemplate::new("alignment");
    let mut cfg = probing(kv_events_config(&fleet), IndexRepair::Quarantine);
    cfg.chat_template = Some(template.path.clone());
    // The exact index forced: a quarantine still routes the pool on the tree.
    cfg.routing.prefix_index = kvgate_index::PrefixIndexMode::Exact;
    let started = Instant::now();
    let gw = gateway(cfg).await;
    let (seen, _) =
        concluded(&gw, &fleet.urls()[0], "failed", Some("template_or_content_format"), INTERVAL + SLACK)
            .await;
    assert_eq!(seen["forms"][0]["outcome"], "passed", "the completion agrees: {seen:#}");
    assert_eq!(seen["quarantined"], true, "{seen:#}");
    eprintln!("wrong template named {:.1} s after the join", started.elapsed().as_secs_f64());
    assert_eq!(turn(&gw, 1, 1).await, "approximate", "a quarantined pool routes on the tree");
    gw.shutdown().await;
    fleet.shutdown().await;
}

/// An engine restarted without replay (its cache empty, the index still holding its blocks, no
/// event yet): named `stale_index` within one interval; `repair` acts; the next probe passes,
/// the routing returns to the exact index and the closed loop agrees within 1%.
async fn restart_repaired(repair: IndexRepair) {
    let fleet = kv_events_fleet(2).await;
    let gw = gateway(probing(kv_events_config(&fleet), repair)).await;
    let urls = fleet.urls();
    for url in &urls {
        concluded(&gw, url, "passed", None, INTERVAL + SLACK).await;
    }
    // Each turn indexed before the next: the other worker's window keeps these requests, and
    // its error is asserted under 1% at the end.
    for c in 0..6 {
        for turns in 1..=2 {
            assert_eq!(turn(&gw, c, turns).await, "exact");
            wait_indexed(&gw, &fleet, c, turns).await;
        }
    }
    fleet.restart_engine(0).unwrap();
    let restarted = Instant::now();
    let (seen, _) = concluded(&gw, &urls[0], "failed", Some("stale_index"), INTERVAL + SLACK).await;
    assert_eq!(seen["sentinel"]["cached"], 0, "{seen:#}");
    eprintln!(
        "{} named stale_index {:.1} s after the restart",
        repair.as_str(),
        restarted.elapsed().as_secs_f64()
    );
    if repair == IndexRepair::Quarantine {
        // Quarantined until a probe passes, a second after the repair: the pool routes on the
        // tree meanwhile. A turn is judged when the probe that quarantined the worker still
        // stands, quarantined, once the turn was answered (no probe released it in between). A
        // loaded machine can miss that second: the engine is then restarted again (a new stale
        // index, a new quarantine), at most three times.
        assert_eq!(seen["quarantined"], true, "{seen:#}");
        let mut quarantine = seen.clone();
        let mut judged = false;
        for attempt in 0..3 {
            if attempt > 0 {
                concluded(&gw, &urls[0], "passed", None, 2.0 + SLACK).await;
                fleet.restart_engine(0).unwrap();
                (quarantine, _) =
                    concluded(&gw, &urls[0], "failed", Some("stale_index"), INTERVAL + SLACK).await;
            }
            let index = turn(&gw, 90 + attempt, 1).await;
            let after = alignment(&gw, &urls[0]).await;
            if quarantine["quarantined"] == true
                && after["quarantined"] == true
                && after["at_ms"] == quarantine["at_ms"]
            {
                assert_eq!(index, "approximate", "a turn while quarantined: {after:#}");
                judged = true;
                break;
            }
        }
        assert!(judged, "no turn was answered while the worker stayed quarantined, in three quarantines");
    }
    let (seen, _) = concluded(&gw, &urls[0], "passed", None, 2.0 + SLACK).await;
    assert_eq!(seen["quarantined"], false, "{seen:#}");
    let text = metrics_text(&gw).await;
    let action = format!("action=\"{}\"", repair.as_str());
    assert!(metric(&text, &format!("kvgate_index_repairs_total{{{action}}}")) >= 1.0, "{text}");
    if repair == IndexRepair::Quarantine {
        assert!(metric(&text, "kvgate_index_repairs_total{action=\"release\"}") >= 1.0, "{text}");
    }
    // Exact again, and the closed loop agrees.
    for c in 10..34 {
        for turns in 1..=3 {
            assert_eq!(turn(&gw, c, turns).await, "exact");
            wait_indexed(&gw, &fleet, c, turns).await;
        }
    }
    for worker in workers(&gw).await {
        let accuracy = &worker["index_accuracy"];
        assert!(accuracy["requests"].as_u64().unwrap_or(0) > 0, "{worker:#}");
        assert!(accuracy["error_share"].as_f64().unwrap() < 0.01, "{worker:#}");
        assert!(accuracy["disagreement"].is_null(), "{worker:#}");
    }
    gw.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_without_replay_is_named_and_resynced() {
    restart_repaired(IndexRepair::Resync).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_without_replay_is_named_and_quarantined_until_a_probe_passes() {
    restart_repaired(IndexRepair::Quarantine).await;
}

/// A disagreement the closed loop raises (here a wrong chat template, the probe off) is acted on
/// too: counted with `source="closed_loop"`, the worker's holdings resynced and its window
/// emptied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_loop_disagreement_is_repaired() {
    let fleet = kv_events_fleet(1).await;
    let template = common::WrongTemplate::new("alignment-loop");
    let mut cfg = probing(kv_events_config(&fleet), IndexRepair::Resync);
    cfg.alignment_probe = false;
    cfg.chat_template = Some(template.path.clone());
    let gw = gateway(cfg).await;
    common::wait_kv_events_flowing(&gw).await;
    // 102 answered requests fill the worker's window of 100.
    for c in 0..34 {
        for turns in 1..=3 {
            turn(&gw, c, turns).await;
        }
    }
    let line = "kvgate_index_repairs_total{action=\"resync\",cause=\"tokenizer_or_template\",model=\"mock-model\",source=\"closed_loop\"} 1";
    assert!(common::metric_line_appears(&gw, line).await, "{}", metrics_text(&gw).await);
    let worker = workers(&gw).await.remove(0);
    assert!(
        worker["index_accuracy"]["requests"].as_u64().unwrap_or(0) < 100,
        "the window was emptied: {worker:#}"
    );
    // Its disagreement went with it: /workers and the gauge agree.
    assert!(worker["index_accuracy"]["disagreement"].is_null(), "{worker:#}");
    let text = metrics_text(&gw).await;
    assert_eq!(metric(&text, "kvgate_prefix_index_disagreement"), 0.0, "{text}");
    assert!(worker["alignment"].is_null(), "the probe is off: {worker:#}");
    gw.shutdown().await;
    fleet.shutdown().await;
}

/// A quarantine sets a worker's holdings aside for routing, not for the closed loop: the exact
/// index still follows its engine's events and predicts each answer, so the wrong chat template
/// the probe quarantined the worker for is raised by the closed loop as that once the window
/// fills again, not as events that do not flow because the tree decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_worker_s_window_names_the_fault_it_still_sees() {
    let fleet = kv_events_fleet(1).await;
    let template = common::WrongTemplate::new("alignment-quarantined");
    let mut cfg = probing(kv_events_config(&fleet), IndexRepair::Quarantine);
    cfg.chat_template = Some(template.path.clone());
    let gw = gateway(cfg).await;
    let url = &fleet.urls()[0];
    let (seen, _) = concluded(&gw, url, "failed", Some("template_or_content_format"), INTERVAL + SLACK).await;
    assert_eq!(seen["quarantined"], true, "{seen:#}");
    // 102 answers, each decided on the tree: the quarantine holds (no probe passes on this
    // template, and a repeated finding empties nothing).
    for c in 0..34 {
        for turns in 1..=3 {
            assert_eq!(turn(&gw, c, turns).await, "approximate", "quarantined");
        }
    }
    let worker = workers(&gw).await.remove(0);
    let accuracy = &worker["index_accuracy"];
    assert_eq!(accuracy["requests"], 100, "{worker:#}");
    assert_eq!(accuracy["disagreement"]["cause"], "tokenizer_or_template", "{worker:#}");
    let text = metrics_text(&gw).await;
    assert_eq!(metric(&text, "kvgate_prefix_index_disagreement"), 1.0, "{text}");
    gw.shutdown().await;
    fleet.shutdown().await;
}
