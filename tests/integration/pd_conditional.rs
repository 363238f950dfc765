//! Conditional disaggregation (`--pd-conditional`) through the gateway, against loopback
//! upstreams playing prefill and decode engines, with both protocols: the decode engine is
//! chosen first by the decode side's policy, then a conversation coming back to the decode
//! engine that holds it is prefilled there (the plain request, no bootstrap fields or transfer
//! params), a long new prompt goes through a pair; a failing prefill side fails its pair whole;
//! the dry run and the metrics name the path.
//!
//! Engine behaviour the in-place path relies on: vLLM's KV connectors compute a request that
//! carries no `kv_transfer_params` locally (`get_num_new_matched_tokens` returns no external
//! tokens when `do_remote_prefill` is absent: `vllm/distributed/kv_transfer/kv_connector/v1/
//! nixl_connector.py` and `mooncake_connector.py`, vLLM 0.10 to main in 2026), so a decode
//! instance (`kv_role` `kv_both`) prefills it in place. SGLang's decode-mode server (`python/
//! sglang/srt/disaggregation/decode.py`, `DecodePreallocQueue.add`, 0.5.x) makes a KV receiver
//! for every request from its `bootstrap_host` (a fake transfer only for its warm-up host), so
//! in place with the SGLang protocol needs decode engines that also serve plain requests, as
//! `kvgate mock --role decode` does (docs/PD.md, "Conditional disaggregation").

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::*;
use kvgate_gateway::{GatewayConfig, PdProtocol};
use kvgate_policy::PolicyKind;
use serde_json::{json, Value};

use super::pd::{last_body, pd_config, post};

/// A conditional PD gateway config, cache_aware on both sides (the decode side's tree knows
/// which decode engine holds which conversation).
pub(crate) fn conditional(
    prefill: &Arc<Upstream>,
    decode: &[&Arc<Upstream>],
    protocol: PdProtocol,
) -> GatewayConfig {
    let mut cfg = pd_config(&[(prefill, Some(8998))], decode, protocol);
    cfg.routing.policy = PolicyKind::CacheAware;
    cfg.routing.pd_conditional = true;
    cfg
}

/// A first turn of about 5,000 tokens (20,000 characters, the gateway's estimate for text).
fn long_turn(topic: &str) -> Value {
    long_turn_of("m", topic)
}

pub(crate) fn long_turn_of(model: &str, topic: &str) -> Value {
    let content: String = (0..2000).map(|i| format!("{topic}{i:05} ")).collect();
    json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8})
}

/// `first` with an answer and a short follow-up question.
fn next_turn(first: &Value) -> Value {
    let mut body = first.clone();
    let messages = body["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": "an answer of a few words"}));
    messages.push(json!({"role": "user", "content": "and then what happened next?"}));
    body
}

pub(crate) fn pd_path(response: &reqwest::Response) -> String {
    response.headers()["x-kvgate-pd-path"].to_str().unwrap().to_string()
}

fn has_pd_fields(body: &Value) -> bool {
    ["bootstrap_host", "bootstrap_port", "bootstrap_room", "kv_transfer_params"]
        .iter()
        .any(|field| body.get(field).is_some())
}

/// The `kvgate_pd_decisions_total` series of `role` on `path`, summed.
fn decisions(text: &str, role: &str, path: &str) -> f64 {
    metric(text, &format!(r#"kvgate_pd_decisions_total{{path="{path}",role="{role}"}}"#))
}

#[tokio::test]
async fn a_conversation_coming_back_is_prefilled_in_place_on_its_decode_holder_and_a_long_new_prompt_in_a_pair(
) {
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let p = upstream("p", "m").await;
        let (d1, d2) = (upstream("d1", "m").await, upstream("d2", "m").await);
        let gw = gateway(conditional(&p, &[&d1, &d2], protocol)).await;
        let holder = |url: &str| if url == d1.url { d1.clone() } else { d2.clone() };

        // A long new prompt: nothing cached anywhere, so a pair.
        let first = long_turn("alpha");
        let response = post(&gw, &first).await;
        assert_eq!(response.status(), 200, "{protocol:?}");
        assert!(
            pd_path(&response).starts_with("pair; why=long_uncached; prompt_tokens="),
            "{}",
            pd_path(&response)
        );
        let decode_url = response.headers()["x-kvgate-worker"].to_str().unwrap().to_string();
        assert_eq!(response.headers()["x-kvgate-prefill-worker"], p.url.as_str());
        let d = holder(&decode_url);
        assert!(has_pd_fields(&last_body(&d)), "{protocol:?}: the pair's decode side gets the PD fields");
        assert_eq!(p.requests.load(Ordering::SeqCst), 1);

        // The conversation comes back: its decode holder has all but the new turn, so the
        // plain request goes there and the prefill side sees nothing.
        let second = next_turn(&first);
        let decode_requests = d.requests.load(Ordering::SeqCst);
        let response = post(&gw, &second).await;
        assert_eq!(response.status(), 200);
        let path = pd_path(&response);
        assert!(path.starts_with("in_place; why=short_uncached;"), "{protocol:?}: {path}");
        assert_eq!(response.headers()["x-kvgate-worker"], decode_url.as_str(), "the decode holder");
        assert!(response.headers().get("x-kvgate-prefill-worker").is_none());
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["worker"], d.name);
        assert_eq!(p.requests.load(Ordering::SeqCst), 1, "{protocol:?}: no prefill request");
        assert_eq!(d.requests.load(Ordering::SeqCst), decode_requests + 1);
        let body = last_body(&d);
        assert!(!has_pd_fields(&body), "{protocol:?}: in place is the plain request: {body}");
        assert_eq!(body, second, "the client's request, untouched");

        // A short new prompt is cheaper to prefill in place too; a long new one is a pair.
        let response = post(&gw, &chat("m")).await;
        assert!(pd_path(&response).starts_with("in_place; why=short_uncached;"), "{}", pd_path(&response));
        let response = post(&gw, &long_turn("bravo")).await;
        assert!(pd_path(&response).starts_with("pair; why=long_uncached;"), "{}", pd_path(&response));
        assert_eq!(p.requests.load(Ordering::SeqCst), 2);

        // The dry run names the path, the rule's clause and its inputs. The pair's prefill
        // request can still count as in flight for a moment after the client has its answer
        // (the prefill side finishes beside the decode side), so wait for the queue to drain.
        let third = next_turn(&second);
        let mut planned = dry_run(&gw, &third).await;
        let drained = eventually(5.0, async || {
            planned = dry_run(&gw, &third).await;
            planned["pd"]["prefill_queue"] == 0
        })
        .await;
        assert!(drained, "the prefill queue drains once the pair is done: {planned}");
        assert_eq!(planned["path"], "in_place", "{planned}");
        assert_eq!(planned["pd"]["why"], "short_uncached", "{planned}");
        assert_eq!(planned["decode"]["worker"], decode_url.as_str(), "{planned}");
        assert!(planned.get("prefill").is_none(), "{planned}");
        let pd = &planned["pd"];
        assert!(pd["uncached_tokens"].as_u64().unwrap() < 2048, "{planned}");
        assert!(pd["cached_tokens"].as_u64().unwrap() > 4000, "{planned}");
        assert_eq!(pd["prefill_queue"], 0, "{planned}");
        let planned = dry_run(&gw, &long_turn("charlie")).await;
        assert_eq!(
            (planned["path"].as_str(), planned["pd"]["why"].as_str()),
            (Some("pair"), Some("long_uncached"))
        );
        assert_eq!(planned["prefill"]["worker"], p.url.as_str(), "{planned}");

        // Each decision counted on its path; the dry runs are not.
        let text = metrics_text(&gw).await;
        assert_eq!(decisions(&text, "decode", "in_place"), 2.0, "{text}");
        assert_eq!(decisions(&text, "decode", "pair"), 2.0, "{text}");
        assert_eq!(decisions(&text, "prefill", "pair"), 2.0, "{text}");
        assert_eq!(decisions(&text, "prefill", "in_place"), 0.0, "{text}");
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn a_failing_prefill_side_fails_its_pair_whole_and_the_retry_prefills_in_place() {
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let p = upstream("p", "m").await;
        let d = upstream("d", "m").await;
        p.status.store(503, Ordering::SeqCst);

        // Without retries the pair's failure is the client's answer.
        let mut cfg = conditional(&p, &[&d], protocol);
        cfg.disable_retries = true;
        cfg.disable_circuit_breaker = true;
        let gw = gateway(cfg).await;
        let response = post(&gw, &long_turn("delta")).await;
        assert_eq!(response.status(), 503, "{protocol:?}");
        assert_eq!(p.requests.load(Ordering::SeqCst), 1);
        gw.shutdown().await;

        // With a retry, the failed prefill worker is avoided: no prefill engine is left, so the
        // decode engine prefills the request itself.
        let mut cfg = conditional(&p, &[&d], protocol);
        cfg.disable_circuit_breaker = true;
        let gw = gateway(cfg).await;
        let response = post(&gw, &long_turn("echo")).await;
        assert_eq!(response.status(), 200, "{protocol:?}");
        // (The decode side's tree recorded the failed pair's choice, so the rule may see the
        // prompt as cached there: either clause sends it in place.)
        let path = pd_path(&response);
        assert!(path.starts_with("in_place; why=") && path.ends_with("prefill_queue=none"), "{path}");
        assert_eq!(p.requests.load(Ordering::SeqCst), 2, "{protocol:?}: one prefill attempt");
        assert!(!has_pd_fields(&last_body(&d)), "{protocol:?}");
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn conditional_disaggregation_needs_a_disaggregated_fleet() {
    let mut cfg = config(vec!["http://127.0.0.1:9".into()]);
    cfg.routing.pd_conditional = true;
    let error = kvgate_gateway::start(cfg).await.err().expect("refused").to_string();
    assert!(error.contains("pd_conditional") && error.contains("needs pd_disaggregation"), "{error}");
}

#[tokio::test]
async fn simulated_decode_engines_prefill_in_place_from_what_they_hold_in_both_protocols() {
    use kvgate_mock::WorkerRole;
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let prefill = pd_fleet(WorkerRole::Prefill, 1, |_| {}).await;
        let decode = pd_fleet(WorkerRole::Decode, 2, |_| {}).await;
        let mut cfg = pd_mock_config(&[&prefill], &decode, protocol);
        cfg.routing.policy = PolicyKind::CacheAware;
        cfg.routing.pd_conditional = true;
        let gw = gateway(cfg).await;
        let cached = |answer: &Value| answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();

        let first = long_turn_of("mock-model", "alpha");
        let response = post(&gw, &first).await;
        assert_eq!(response.status(), 200, "{protocol:?}");
        assert!(pd_path(&response).starts_with("pair;"), "{}", pd_path(&response));
        let holder = response.headers()["x-kvgate-worker"].clone();
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["usage"]["completion_tokens"], 8, "{protocol:?}: {answer}");

        // The second turn, in place on the engine the first turn's KV was moved to: the engine
        // serves the first turn's prompt from its cache and prefills only the new turn.
        let response = post(&gw, &next_turn(&first)).await;
        assert_eq!(response.status(), 200, "{protocol:?}");
        assert!(pd_path(&response).starts_with("in_place;"), "{}", pd_path(&response));
        assert_eq!(response.headers()["x-kvgate-worker"], holder);
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["usage"]["completion_tokens"], 8, "{protocol:?}: {answer}");
        assert!(cached(&answer).is_some_and(|n| n >= 1900), "{protocol:?}: {answer}");
        gw.shutdown().await;
        prefill.shutdown().await;
        decode.shutdown().await;
    }
}

/// The `key=value` terms of an `x-kvgate-pd-path` value.
fn pd_terms(path: &str) -> std::collections::HashMap<String, String> {
    path.split("; ")
        .filter_map(|term| term.split_once('='))
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .collect()
}

#[tokio::test]
async fn with_kv_aware_on_both_sides_the_predicted_sooner_path_wins_and_the_decode_engines_queue_sends_pairs()
{
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        let p = upstream("p", "m").await;
        let d = upstream("d", "m").await;
        let mut cfg = conditional(&p, &[&d], protocol);
        cfg.routing.policy = PolicyKind::KvAware;
        let gw = gateway(cfg).await;

        // An idle fleet: prefilling in place spares the transfer, so the first long prompt
        // goes there. Each one routed in place adds its prefill to the decode engine's queue
        // (kv_aware's fluid queue, ~0.6 s per prompt here): the requests arriving behind it
        // there make in place costlier, and the prompts move to the idle prefill engine.
        let mut paths = Vec::new();
        for i in 0..12 {
            let response = post(&gw, &long_turn(&format!("topic{i}x"))).await;
            assert_eq!(response.status(), 200, "{protocol:?}");
            let path = pd_path(&response);
            let terms = pd_terms(&path);
            let number = |key: &str| terms[key].parse::<f64>().unwrap_or_else(|_| panic!("{key}: {path}"));
            // The verdict follows the predictions it shows.
            let pair = path.starts_with("pair; why=pair_sooner;");
            assert!(pair || path.starts_with("in_place; why=in_place_sooner;"), "{protocol:?}: {path}");
            assert_eq!(pair, number("pair_cost_s") < number("in_place_cost_s"), "{path}");
            let sum = number("prefill_s") + number("transfer_s") + number("decode_wait_s");
            assert!((number("pair_s") - sum).abs() < 1e-3, "the pair's terms add up: {path}");
            // ~5,000 tokens x 128 KiB at 25 GB/s.
            assert!((0.02..0.04).contains(&number("transfer_s")), "{path}");
            assert_eq!(pair, response.headers().get("x-kvgate-prefill-worker").is_some(), "{path}");
            assert_eq!(pair, has_pd_fields(&last_body(&d)), "{protocol:?}: {path}");
            paths.push(pair);
        }
        assert!(!paths[0], "{protocol:?}: the idle decode engine prefills the first one: {paths:?}");
        assert!(paths.iter().any(|&pair| pair), "{protocol:?}: the queue built up sends pairs: {paths:?}");

        // The dry run shows both predictions.
        let planned = dry_run(&gw, &long_turn("zulu")).await;
        let predicted = &planned["pd"]["predicted"];
        for key in [
            "in_place_s",
            "pair_s",
            "prefill_s",
            "transfer_s",
            "decode_wait_s",
            "in_place_cost_s",
            "pair_cost_s",
        ] {
            assert!(predicted[key].as_f64().is_some_and(|s| s >= 0.0), "{key}: {planned}");
        }
        let pair = predicted["pair_cost_s"].as_f64() < predicted["in_place_cost_s"].as_f64();
        assert_eq!(planned["path"], if pair { "pair" } else { "in_place" }, "{planned}");
        gw.shutdown().await;
    }
}
