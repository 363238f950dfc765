//! `--pd-fallback-in-place` (on under `--pd-conditional`): a pair whose decode engine answers a
//! failed KV transfer (a server error other than 503) is sent once more, plain, to that engine,
//! which prefills it in place; with both protocols, against simulated engines whose decode side
//! gives up waiting for the KV, and against loopback upstreams (the fallback is taken once, a
//! 503 is a plain retry, the option off leaves the failure to the client).
//!
//! Engine behaviour followed: the mock's decode engine answers 502 with a `kv_transfer_error`
//! when its KV does not arrive within `--kv-hold-timeout-secs` (docs/PD.md);
//! SGLang's decode side aborts a request whose transfer failed or timed out with a 500
//! (`python/sglang/srt/disaggregation/decode.py`, `DecodeTransferQueue`, 0.5.x, and
//! `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`).

use crate::common;

use std::sync::atomic::Ordering;

use common::*;
use kvgate_gateway::PdProtocol;
use kvgate_policy::PolicyKind;
use serde_json::Value;

use super::pd::post;
// A first turn of about 5,000 tokens (`long_turn_of`) is long and new: the rule sends it
// through a pair.
use super::pd_conditional::{conditional, long_turn_of as long_turn, pd_path};

#[tokio::test]
async fn a_decode_engine_that_never_gets_its_kv_prefills_the_request_in_place_in_both_protocols() {
    use kvgate_mock::WorkerRole;
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        for fallback in [true, false] {
            // The prefill engine's link is slow (its bootstrap server takes ~6.5 s of wall time
            // to move a 5,000-token KV) while the decode engine, expecting the default link,
            // waits its hold (5 ms wall) + the transfer it expects (1.3 ms) + the mock's 100 ms
            // grace: every pair's transfer fails and the decode engine answers 502.
            let prefill = pd_fleet(WorkerRole::Prefill, 1, |args| args.kv_transfer_gbps = 0.005).await;
            let decode = pd_fleet(WorkerRole::Decode, 1, |args| args.kv_hold_timeout_secs = 0.1).await;
            let mut cfg = pd_mock_config(&[&prefill], &decode, protocol);
            cfg.routing.policy = PolicyKind::CacheAware;
            cfg.routing.pd_conditional = true;
            cfg.pd_fallback_in_place = fallback;
            // No retries: the fallback is not one.
            cfg.disable_retries = true;
            cfg.disable_circuit_breaker = true;
            let gw = gateway(cfg).await;
            let response = post(&gw, &long_turn("mock-model", "kilo")).await;
            let what = format!("{protocol:?}, fallback {fallback}");
            if !fallback {
                assert_eq!(response.status(), 502, "{what}: the failed transfer is the answer");
                assert_eq!(
                    metric(&metrics_text(&gw).await, "kvgate_pd_transfer_fallbacks_total"),
                    0.0,
                    "{what}"
                );
            } else {
                assert_eq!(response.status(), 200, "{what}");
                let path = pd_path(&response);
                assert!(path.starts_with("in_place; why=transfer_failed; "), "{what}: {path}");
                assert_eq!(response.headers()["x-kvgate-worker"], decode.urls()[0].as_str(), "{what}");
                let answer: Value = response.json().await.unwrap();
                assert_eq!(answer["usage"]["completion_tokens"], 8, "{what}: {answer}");
                assert_eq!(
                    metric(&metrics_text(&gw).await, "kvgate_pd_transfer_fallbacks_total"),
                    1.0,
                    "{what}"
                );
            }
            gw.shutdown().await;
            prefill.shutdown().await;
            decode.shutdown().await;
        }
    }
}

#[tokio::test]
async fn the_fallback_is_taken_once_and_a_503_is_a_plain_retry() {
    for protocol in [PdProtocol::Sglang, PdProtocol::Vllm] {
        // The decode engine answers every request with a 500: the pair, then the plain request
        // in place, and no third time.
        let p = upstream("p", "m").await;
        let d = upstream("d", "m").await;
        d.status.store(500, Ordering::SeqCst);
        let mut cfg = conditional(&p, &[&d], protocol);
        cfg.disable_circuit_breaker = true;
        let gw = gateway(cfg).await;
        let response = post(&gw, &long_turn("m", "lima")).await;
        // The in-place attempt's answer, passed through.
        assert_eq!(response.status(), 500, "{protocol:?}");
        assert_eq!(d.requests.load(Ordering::SeqCst), 2, "{protocol:?}: the pair's half, then in place");
        // (SGLang: the prefill request may be cancelled before it reached the engine.)
        assert!(p.requests.load(Ordering::SeqCst) <= 1, "{protocol:?}");
        let path = pd_path(&response);
        assert!(path.starts_with("in_place; why=transfer_failed; "), "{protocol:?}: {path}");
        assert_eq!(
            metric(&metrics_text(&gw).await, "kvgate_pd_transfer_fallbacks_total"),
            1.0,
            "{protocol:?}"
        );
        gw.shutdown().await;

        // A 503 (overloaded, unhealthy) is no failed transfer: in place would not help there.
        let p = upstream("p", "m").await;
        let d = upstream("d", "m").await;
        d.status.store(503, Ordering::SeqCst);
        let mut cfg = conditional(&p, &[&d], protocol);
        cfg.disable_retries = true;
        cfg.disable_circuit_breaker = true;
        let gw = gateway(cfg).await;
        let response = post(&gw, &long_turn("m", "mike")).await;
        assert_eq!(response.status(), 503, "{protocol:?}");
        assert_eq!(d.requests.load(Ordering::SeqCst), 1, "{protocol:?}");
        assert_eq!(
            metric(&metrics_text(&gw).await, "kvgate_pd_transfer_fallbacks_total"),
            0.0,
            "{protocol:?}"
        );
        gw.shutdown().await;
    }
}
