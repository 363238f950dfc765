//! A dry run records nothing in the policy's state, over HTTP (issue 42's probes): `POST
//! /v1/route` for forty new session keys binds no `manual` session, and 300 `kv_aware` dry runs
//! of prompts on one worker's prefix do not move an unrelated live request off that worker. Before
//! the plan split deciding from recording, each dry run bound its session (the sessions' first
//! requests were `sticky`) and queued its prompt's work on the worker it named.

use crate::common;

use common::*;
use kvgate_gateway::{GatewayConfig, GatewayHandle};
use kvgate_policy::{AssignmentMode, PolicyConfig, PolicyKind};
use serde_json::{json, Value};

fn routed_config(urls: Vec<String>, routing: PolicyConfig) -> GatewayConfig {
    GatewayConfig { expose_routing_headers: true, load_monitor_interval_ms: 100, routing, ..config(urls) }
}

/// A live chat request of `text` with session `key`: its status, worker and reason.
async fn send(gw: &GatewayHandle, text: &str, key: &str) -> (u16, String, String) {
    let response = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("x-kvgate-routing-key", key)
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": text}]}))
        .send()
        .await
        .unwrap();
    let header =
        |name: &str| response.headers().get(name).map_or(String::new(), |v| v.to_str().unwrap().to_string());
    let (worker, route) = (header("x-kvgate-worker"), header("x-kvgate-route"));
    (response.status().as_u16(), worker, route)
}

/// The dry run of a chat request of `text` with session `key` (`POST /v1/route`): its worker and
/// reason.
async fn dry(gw: &GatewayHandle, text: &str, key: &str) -> (String, String) {
    let answer: Value = json_answer(
        client()
            .post(format!("{}/v1/route", gw.admin_url()))
            .header("x-kvgate-routing-key", key)
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": text}]})),
    )
    .await;
    let field = |name: &str| answer[name].as_str().unwrap_or_default().to_string();
    (field("worker"), field("reason"))
}

#[tokio::test]
async fn dry_runs_of_new_sessions_bind_none() {
    let ups = [
        upstream("a", "m").await,
        upstream("b", "m").await,
        upstream("c", "m").await,
        upstream("d", "m").await,
    ];
    let urls: Vec<String> = ups.iter().map(|u| u.url.clone()).collect();
    let manual = PolicyConfig {
        policy: PolicyKind::Manual,
        assignment_mode: AssignmentMode::MinGroup,
        ..Default::default()
    };
    let gw = gateway(routed_config(urls, manual)).await;
    for session in 0..40 {
        let (worker, reason) = dry(&gw, "hello", &format!("s{session}")).await;
        assert_eq!(reason, "session_assigned");
        assert!(!worker.is_empty());
    }
    // Every session a dry run asked about is still new when its first request comes, and
    // min_group, starting from no session, spreads the forty exactly.
    let mut per_worker = std::collections::BTreeMap::<String, usize>::new();
    for session in 0..40 {
        let (status, home, route) = send(&gw, "hello", &format!("s{session}")).await;
        assert_eq!(
            (status, route.as_str()),
            (200, "session_assigned"),
            "session s{session} was bound by a dry run"
        );
        *per_worker.entry(home).or_default() += 1;
    }
    assert_eq!(per_worker.values().copied().collect::<Vec<_>>(), vec![10; 4], "{per_worker:?}");
    // Live requests bind: the session is sticky, and a dry run reads the binding.
    let (_, home, _) = send(&gw, "again", "s7").await;
    assert_eq!(dry(&gw, "hello", "s7").await, (home, "sticky".to_string()));
    gw.shutdown().await;
}

#[tokio::test]
async fn kv_aware_dry_runs_do_not_move_an_unrelated_live_decision() {
    let (a, b) = (upstream("a", "m").await, upstream("b", "m").await);
    let kv_aware = PolicyConfig { policy: PolicyKind::KvAware, ..Default::default() };
    let gw = gateway(routed_config(vec![a.url.clone(), b.url.clone()], kv_aware)).await;
    let document = format!("<doc>{}</doc>", "a shared document sentence. ".repeat(400));
    // One live request puts the document on one worker's prefix.
    let (status, holder, _) = send(&gw, &format!("{document} question 0"), "doc").await;
    assert_eq!(status, 200);
    // Once a load poll has come after it, both workers are idle again in kv_aware's view.
    let polled = a.loads_polls.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        eventually(5.0, async || a.loads_polls.load(std::sync::atomic::Ordering::SeqCst) > polled + 1).await,
        "the load monitor polls"
    );
    // An unrelated short prompt the tie-break sends to the document's holder.
    let mut unrelated = None;
    for i in 0..64 {
        let text = format!("an unrelated question {i}");
        if dry(&gw, &text, "other").await.0 == holder {
            unrelated = Some(text);
            break;
        }
    }
    let unrelated = unrelated.expect("some unrelated prompt ties onto the holder");
    // 300 dry runs of questions on the document: each would queue its uncached question (and
    // the document, wherever it is not held) on the worker it names.
    for i in 1..=300 {
        let question = format!("{document} question {i}: {}", "why? ".repeat(100));
        let (worker, reason) = dry(&gw, &question, "doc").await;
        assert!(!worker.is_empty() && reason.starts_with("kv_aware"), "{reason}");
    }
    let (status, worker, route) = send(&gw, &unrelated, "other").await;
    assert_eq!((status, route.as_str()), (200, "kv_aware"));
    assert_eq!(worker, holder, "the dry runs queued nothing on the document's holder");
    gw.shutdown().await;
}
