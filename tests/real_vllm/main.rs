//! kvgate against real vLLM engines (vLLM 0.32.0's CPU build, `scripts/real-vllm/`): two tiny
//! random-weight Llamas made locally, one with a chat template that loops over content parts
//! (vLLM's `auto` content format picks `openai`), one without (`string`), each behind gateways
//! started in process. It proves, on every request of the no-pressure cases, that the dry run's
//! predicted cached tokens equal what the engine then reports (`usage.prompt_tokens_details
//! .cached_tokens`) for completions, token-id prompts and chat with vLLM's default content format;
//! that every KV event decodes; that a gateway started late recovers the holdings by replay; that
//! the closed loop stays quiet when the configuration is right (also under eviction pressure) and
//! names the cause when the chat template is wrong; that an engine restart is resubscribed
//! within 2 s of the engine answering `/health`; and that the alignment probe passes at a
//! worker's join when the configuration is right and, before any client request, names an
//! engine rendering chats with another content format than the gateway.
//!
//! Skipped (saying so) unless `scripts/real-vllm/install.sh` has run; `.ci/run` runs it and sets
//! `KVGATE_REQUIRE_VLLM=1`, which makes a missing install or an engine that does not start a
//! failure. At most two engines run at once (about 4 GiB each).

#[path = "../common/mod.rs"]
mod common;
mod engines;

use std::time::{Duration, Instant};

use common::{client, config, dry_run, eventually, gateway, metric, metrics_text};
use engines::{Engine, EngineSpec, Harness};
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use kvgate_index::{IndexRepair, PrefixIndexMode};
use kvgate_policy::PolicyKind;
use kvgate_tokenizer::ContentFormatOption;
use serde_json::{json, Value};

const MODEL: &str = "tiny-llama";
const BLOCK: u64 = 32;
/// Engine start (two at once take 28-49 s on two cores; a loaded CI machine more).
const START_LIMIT: Duration = Duration::from_secs(240);

/// A gateway in front of `engine` routing on its KV events, with the tokenizer and chat template
/// of `model_dir` (or `template` in its place).
async fn gateway_for(
    engine: &Engine,
    tokenizer: &std::path::Path,
    template: Option<std::path::PathBuf>,
) -> GatewayHandle {
    gateway_tuned(engine, tokenizer, |cfg| cfg.chat_template = template).await
}

/// [`gateway_for`]'s gateway with the template's own, and `tune` applied last.
async fn gateway_tuned(
    engine: &Engine,
    tokenizer: &std::path::Path,
    tune: impl FnOnce(&mut GatewayConfig),
) -> GatewayHandle {
    let mut cfg: GatewayConfig = config(vec![engine.url()]);
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.routing.prefix_index = PrefixIndexMode::Exact;
    cfg.kv_events_endpoints = vec![engine.events_endpoint()];
    cfg.kv_events_replay_endpoints = vec![engine.replay_endpoint()];
    cfg.tokenizer_path = Some(tokenizer.to_path_buf());
    cfg.health_check_interval_secs = 1.0;
    cfg.request_timeout_secs = 120.0;
    tune(&mut cfg);
    let gw = gateway(cfg).await;
    assert!(
        eventually(30.0, async || flowing(&gw).await).await,
        "the gateway subscribes to {}",
        engine.events_endpoint()
    );
    gw
}

async fn workers(gw: &GatewayHandle) -> Vec<Value> {
    let answer: Value =
        client().get(format!("{}/workers", gw.admin_url())).send().await.unwrap().json().await.unwrap();
    answer["workers"].as_array().cloned().unwrap_or_default()
}

async fn flowing(gw: &GatewayHandle) -> bool {
    workers(gw).await.iter().all(|w| w["kv_events"]["flowing"] == true)
}

/// The tokens an engine serves from cache of a fully held prompt of `n` tokens.
fn served(n: u64) -> u64 {
    n.saturating_sub(1) / BLOCK * BLOCK
}

/// One request checked: the dry run's prediction, then the engine's report, equal. Returns the
/// answer. `path` is the proxied path.
async fn checked(gw: &GatewayHandle, path: &str, body: &Value) -> Value {
    let plan = dry_run(gw, body).await;
    let predicted = plan["predicted_cached_tokens"].as_u64().unwrap_or_else(|| panic!("dry run: {plan}"));
    let answer: Value =
        client().post(format!("{}{path}", gw.url())).json(body).send().await.unwrap().json().await.unwrap();
    let usage = &answer["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or_else(|| panic!("answer: {answer}"));
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert_eq!(
        plan["prompt_tokens"].as_u64(),
        Some(prompt_tokens),
        "the gateway's prompt is the engine's: {body}"
    );
    assert_eq!(predicted, cached, "predicted vs engine-reported cached tokens of {prompt_tokens}: {body}");
    // The engine's events for this prompt reach the index before the next request is planned:
    // a prompt just computed is held whole.
    let held =
        async || dry_run(gw, body).await["predicted_cached_tokens"].as_u64() == Some(served(prompt_tokens));
    assert!(eventually(10.0, held).await, "the index holds the prompt just served: {body}");
    answer
}

fn words(seed: usize, n: usize) -> String {
    let vocabulary =
        ["route", "cache", "engine", "prefix", "token", "block", "event", "gateway", "replica", "queue"];
    (0..n)
        .map(|i| format!("{}{}", vocabulary[(seed * 7 + i * 3) % vocabulary.len()], (seed * 31 + i) % 97))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Completions sharing a prefix, a repeat (the last-token rule), and token-id prompts.
async fn completions(gw: &GatewayHandle) {
    let shared = words(1, 120);
    for (i, tail) in [words(2, 40), words(3, 10), String::new(), words(2, 40)].iter().enumerate() {
        let body = json!({"model": MODEL, "prompt": format!("{shared} {tail}"), "max_tokens": 2, "ignore_eos": true});
        checked(gw, "/v1/completions", &body).await;
        eprintln!("completion {i} agreed");
    }
    // Token ids: 96 and 97 tokens, repeated: a fully held prompt of 96 is served 64.
    let ids: Vec<u32> = (0..97).map(|i| 100 + (i * 13) % 2500).collect();
    for n in [96, 96, 97, 97, 64] {
        let body = json!({"model": MODEL, "prompt": &ids[..n], "max_tokens": 2, "ignore_eos": true});
        let answer = checked(gw, "/v1/completions", &body).await;
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        eprintln!("token-id prompt of {n}: {cached} cached");
    }
}

/// A conversation of `turns` turns (the engine's own answers kept in the history), its system
/// message a string and some user turns lists of text parts, with vLLM's default content format.
async fn conversation(gw: &GatewayHandle, seed: usize, turns: usize) {
    let mut messages =
        vec![json!({"role": "system", "content": format!("You answer briefly. {}", words(seed, 30))})];
    for turn in 0..turns {
        let text = words(seed * 10 + turn, 25 + turn * 5);
        messages.push(if turn % 2 == 1 {
            json!({"role": "user", "content": [{"type": "text", "text": text}, {"type": "text", "text": words(turn, 5)}]})
        } else {
            json!({"role": "user", "content": text})
        });
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8, "ignore_eos": true});
        let answer = checked(gw, "/v1/chat/completions", &body).await;
        let reply = answer["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
        messages.push(json!({"role": "assistant", "content": reply}));
    }
}

/// Conversations of 4 turns with `words_per_turn` words a user turn, one after another (no
/// check: the closed loop is what is being tested).
async fn converse(url: String, seeds: impl Iterator<Item = usize>, words_per_turn: usize) {
    for seed in seeds {
        let mut messages = vec![json!({"role": "system", "content": words(50 + seed, 20)})];
        for turn in 0..4 {
            messages.push(json!({"role": "user", "content": words(500 + seed * 10 + turn, words_per_turn)}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 4, "ignore_eos": true});
            let request = client().post(format!("{url}/v1/chat/completions")).json(&body);
            let answer: Value = request.send().await.unwrap().json().await.unwrap();
            let reply = answer["choices"][0]["message"]["content"].clone();
            messages.push(json!({"role": "assistant", "content": reply}));
        }
    }
}

async fn no_event_refused(gw: &GatewayHandle) {
    let text = metrics_text(gw).await;
    assert!(metric(&text, "kvgate_kv_events_batches_total") > 0.0, "{text}");
    assert_eq!(metric(&text, "kvgate_kv_events_malformed_total"), 0.0, "every message decodes");
    assert_eq!(metric(&text, "kvgate_kv_events_refused_total"), 0.0, "no event refused");
    assert_eq!(metric(&text, "kvgate_tokenize_failures_total"), 0.0);
}

async fn disagreement(gw: &GatewayHandle) -> Value {
    workers(gw).await[0]["index_accuracy"]["disagreement"].clone()
}

/// The gateway's alignment probe of its (one) worker, once it concluded (within `secs`).
async fn probe_report(gw: &GatewayHandle, secs: f64) -> Value {
    let mut seen = Value::Null;
    let concluded = eventually(secs, async || {
        seen = workers(gw).await[0]["alignment"].clone();
        seen["outcome"].is_string()
    })
    .await;
    assert!(concluded, "the alignment probe concluded within {secs} s: {seen:#}");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_real_vllm_engines() {
    let Some(harness) = Harness::find() else { return };
    let chatml = harness.model("tiny-llama-chatml");
    let plain = harness.model("tiny-llama-plain");
    let started = Instant::now();
    let mut looping = Engine::spawn(&harness, EngineSpec { model: chatml.clone(), flags: vec![] });
    let mut stringy = Engine::spawn(&harness, EngineSpec { model: plain.clone(), flags: vec![] });
    looping.wait_healthy(START_LIMIT).await;
    stringy.wait_healthy(START_LIMIT).await;
    eprintln!("two engines healthy in {:.1} s", started.elapsed().as_secs_f64());

    // Exact agreement on every request: completions, token ids, chat on both templates.
    let gw = gateway_for(&looping, &chatml, None).await;
    completions(&gw).await;
    conversation(&gw, 1, 6).await;
    conversation(&gw, 2, 3).await;
    let gw_plain = gateway_for(&stringy, &plain, None).await;
    conversation(&gw_plain, 3, 6).await;
    for gw in [&gw, &gw_plain] {
        no_event_refused(gw).await;
        assert_eq!(disagreement(gw).await, Value::Null, "the closed loop is quiet");
        // The alignment probe ran at the join: both forms agree (the completion's 128 tokens
        // are 4 blocks of 32, held whole and served 96: the last-token rule).
        let report = probe_report(gw, 30.0).await;
        assert_eq!(report["outcome"], "passed", "{report:#}");
        let completion = &report["forms"][0];
        assert_eq!(
            (completion["aligned"].as_bool(), completion["cached"].as_u64()),
            (Some(true), Some(96)),
            "{report:#}"
        );
    }
    gw_plain.shutdown().await;
    drop(stringy);
    eprintln!("exact agreement checked at {:.1} s", started.elapsed().as_secs_f64());

    // A gateway started late recovers the engine's holdings through replay.
    let late = gateway_for(&looping, &chatml, None).await;
    let repeat = json!({"model": MODEL, "prompt": format!("{} {}", words(1, 120), words(3, 10)), "max_tokens": 2, "ignore_eos": true});
    let plan = dry_run(&late, &repeat).await;
    assert!(plan["predicted_cached_tokens"].as_u64().unwrap_or(0) > 0, "replayed holdings: {plan}");
    checked(&late, "/v1/completions", &repeat).await;
    late.shutdown().await;

    // A wrong chat template is named by the closed loop.
    // (The repair only warns here, so that the routing stays on the exact index the loop
    // watches; the alignment probe names the template too.)
    let plain_template = harness.scripts.join("templates/plain.jinja");
    let wrong = gateway_tuned(&looping, &chatml, |cfg| {
        cfg.chat_template = Some(plain_template);
        cfg.index_repair = IndexRepair::Warn;
    })
    .await;
    assert_eq!(probe_report(&wrong, 60.0).await["cause"], "template_or_content_format");
    // The window is the worker's last 100 answered requests: 25 conversations of 4 turns.
    converse(wrong.url(), 0..25, 20).await;
    let named = disagreement(&wrong).await;
    assert_eq!(named["cause"], "tokenizer_or_template", "{named}");
    wrong.shutdown().await;

    // An engine restart is resubscribed within 2 s of the engine answering /health; the engine
    // comes back with a cache smaller than the working set.
    let ports = [looping.port, looping.events_port, looping.replay_port];
    looping.stop();
    assert!(eventually(20.0, async || !flowing(&gw).await).await, "the gateway sees the publisher go");
    // ... and it comes back rendering chats with the `string` content format where the
    // template's own (vLLM's `auto`) is `openai`.
    let small = EngineSpec {
        model: chatml.clone(),
        flags: [
            "--num-gpu-blocks-override",
            "64",
            "--max-model-len",
            "1024",
            "--chat-template-content-format",
            "string",
        ]
        .map(String::from)
        .to_vec(),
    };
    let mut restarted = Engine::spawn_on(&harness, small, ports);
    let healthy_at = restarted.wait_healthy(START_LIMIT).await;
    assert!(eventually(10.0, async || flowing(&gw).await).await, "resubscribed");
    let after = healthy_at.elapsed();
    eprintln!("resubscribed {:.2} s after /health", after.as_secs_f64());
    assert!(after <= Duration::from_secs(2), "resubscribed {after:?} after the engine answered /health");

    // A gateway rendering chats with the template's own format (`auto`): the alignment probe
    // names the mismatch before any client request is sent.
    let mismatched = gateway_for(&restarted, &chatml, None).await;
    let report = probe_report(&mismatched, 60.0).await;
    eprintln!("mismatched content format: {report}");
    assert_eq!(report["outcome"], "failed", "{report:#}");
    assert_eq!(report["cause"], "template_or_content_format", "{report:#}");
    assert_eq!(report["forms"][0]["outcome"], "passed", "completions agree: {report:#}");
    let text = metrics_text(&mismatched).await;
    assert_eq!(metric(&text, "kvgate_routing_decisions_total"), 0.0, "no client request was sent");
    mismatched.shutdown().await;

    // Under eviction pressure (64 blocks of 32 tokens; 28 conversations of 4 turns, more than a
    // full window, at concurrency 4) the loop stays quiet, with the engine's content format.
    let pressure = gateway_tuned(&restarted, &chatml, |cfg| {
        cfg.chat_template_content_format = ContentFormatOption::String
    })
    .await;
    let lanes: Vec<_> = (0..4)
        .map(|lane| tokio::spawn(converse(pressure.url(), (0..7).map(move |i| 100 + lane + 4 * i), 60)))
        .collect();
    for lane in lanes {
        lane.await.unwrap();
    }
    let accuracy = workers(&pressure).await[0]["index_accuracy"].clone();
    eprintln!("under pressure: {accuracy}");
    assert_eq!(accuracy["requests"], 100, "a full window: {accuracy}");
    assert_eq!(accuracy["disagreement"], Value::Null, "quiet under eviction pressure: {accuracy}");
    no_event_refused(&pressure).await;
    let text = metrics_text(&pressure).await;
    let evicted = metric(
        &text,
        &format!(
            "kvgate_prefix_evicted_after_routing_requests_total{{model=\"{MODEL}\",worker=\"{}\"}}",
            restarted.url()
        ),
    );
    eprintln!("{evicted} requests lost predicted blocks to eviction after routing");
    assert!(evicted > 0.0, "the cache was under pressure: {text}");
    pressure.shutdown().await;
    gw.shutdown().await;
    drop(restarted);
    eprintln!("real-engine suite done in {:.1} s", started.elapsed().as_secs_f64());
}
