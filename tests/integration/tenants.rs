//! Tenants over HTTP: who a request is for (client key, tenant header, `user`, `default`), each
//! quota's 429 with `Retry-After`, a higher priority class overtaking a queued lower one, a
//! reserved slot, the class forwarded as the engine's `priority`, and the key file reloaded
//! while requests keep flowing.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvgate_gateway::{GatewayHandle, TenantsConfig};
use serde_json::{json, Value};

use crate::common::{chat, client, config, gateway, metric, metric_line_appears, metrics_text, upstream};

fn tenants(config: Value) -> TenantsConfig {
    serde_json::from_value(config).unwrap()
}

/// `kvgate_tenant_requests_total` of `tenant` (every class), from `/metrics`.
async fn admitted(gw: &GatewayHandle, tenant: &str) -> f64 {
    metric(&metrics_text(gw).await, &format!(r#"kvgate_tenant_requests_total{{tenant="{tenant}"}}"#))
}

async fn post(gw: &GatewayHandle, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client().post(format!("{}/v1/chat/completions", gw.url())).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn identity_is_the_key_else_the_header_else_user_else_default() {
    let up = upstream("a", "m").await;
    let mut cfg = config(vec![up.url.clone()]);
    cfg.tenants = tenants(json!({"named": {"from-header": {}, "from-user": {}, "from-key": {}}}));
    let gw = gateway(cfg).await;
    let mut body = chat("m");
    body["user"] = json!("from-user");
    assert_eq!(post(&gw, &body, &[("x-kvgate-tenant", "from-header")]).await.status(), 200);
    assert_eq!(admitted(&gw, "from-header").await, 1.0);
    assert_eq!(post(&gw, &body, &[]).await.status(), 200);
    assert_eq!(admitted(&gw, "from-user").await, 1.0);
    assert_eq!(post(&gw, &chat("m"), &[]).await.status(), 200);
    assert_eq!(admitted(&gw, "default").await, 1.0);
    // A tenant no `tenants:` entry or key names is counted as `other` (bounded labels).
    assert_eq!(post(&gw, &chat("m"), &[("x-kvgate-tenant", "someone-else")]).await.status(), 200);
    assert_eq!(admitted(&gw, "other").await, 1.0);
    let refused = post(&gw, &chat("m"), &[("x-kvgate-priority", "urgent")]).await;
    assert_eq!(refused.status(), 400);
    gw.shutdown().await;

    // With client keys, the key names the tenant: the header and `user` are ignored.
    let mut cfg = config(vec![up.url.clone()]);
    cfg.client_api_keys = vec!["sk-1=from-key".into(), "sk-plain".into()];
    cfg.tenants = tenants(json!({"named": {"from-header": {}, "from-user": {}, "from-key": {}}}));
    let gw = gateway(cfg).await;
    let keyed = [("authorization", "Bearer sk-1"), ("x-kvgate-tenant", "from-header")];
    assert_eq!(post(&gw, &body, &keyed).await.status(), 200);
    assert_eq!(admitted(&gw, "from-key").await, 1.0);
    let plain = [("authorization", "Bearer sk-plain"), ("x-kvgate-tenant", "from-header")];
    assert_eq!(post(&gw, &body, &plain).await.status(), 200);
    assert_eq!(admitted(&gw, "default").await, 1.0);
    assert_eq!(admitted(&gw, "from-header").await + admitted(&gw, "from-user").await, 0.0);
    assert_eq!(post(&gw, &body, &[("x-kvgate-tenant", "from-header")]).await.status(), 401);
    gw.shutdown().await;
}

/// The 429 of a quota: its code, a `Retry-After` of at least `min_wait` seconds.
async fn expect_over_quota(response: reqwest::Response, code: &str, min_wait: u64) -> Value {
    assert_eq!(response.status(), 429);
    let wait: u64 = response.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(wait >= min_wait, "Retry-After {wait} for {code}");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    body
}

#[tokio::test]
async fn each_quota_answers_429_with_retry_after() {
    let up = upstream("a", "m").await;
    let mut cfg = config(vec![up.url.clone()]);
    cfg.tenants = tenants(json!({"named": {
        "rpm": {"requests_per_minute": 1}, "tpm": {"tokens_per_minute": 100}, "conc": {"max_concurrent": 1},
    }}));
    let gw = gateway(cfg).await;

    let rpm = [("x-kvgate-tenant", "rpm")];
    assert_eq!(post(&gw, &chat("m"), &rpm).await.status(), 200);
    let body = expect_over_quota(post(&gw, &chat("m"), &rpm).await, "requests_per_minute_exceeded", 30).await;
    assert!(body["error"]["message"].as_str().unwrap().contains("requests_per_minute"), "{body}");

    // A short prompt plus max_tokens 80: once, not twice in a minute; 500 never.
    let tpm = [("x-kvgate-tenant", "tpm")];
    let mut asks_80 = chat("m");
    asks_80["max_tokens"] = json!(80);
    assert_eq!(post(&gw, &asks_80, &tpm).await.status(), 200);
    expect_over_quota(post(&gw, &asks_80, &tpm).await, "tokens_per_minute_exceeded", 10).await;
    let mut asks_500 = chat("m");
    asks_500["max_completion_tokens"] = json!(500);
    let body = expect_over_quota(post(&gw, &asks_500, &tpm).await, "tokens_per_minute_exceeded", 60).await;
    assert!(body["error"]["message"].as_str().unwrap().contains("alone"), "{body}");

    // One request of `conc` at once: a second is refused while a stream is held open.
    up.hold_stream.store(true, Ordering::SeqCst);
    let conc = [("x-kvgate-tenant", "conc")];
    let mut streaming = chat("m");
    streaming["stream"] = json!(true);
    let held = post(&gw, &streaming, &conc).await;
    assert_eq!(held.status(), 200);
    expect_over_quota(post(&gw, &chat("m"), &conc).await, "max_concurrent_exceeded", 1).await;
    // Other tenants are not held back.
    assert_eq!(post(&gw, &chat("m"), &[("x-kvgate-tenant", "rpm2")]).await.status(), 200);
    up.release.notify_one();
    held.text().await.unwrap();
    assert!(
        crate::common::eventually(5.0, async || post(&gw, &chat("m"), &conc).await.status() == 200).await
    );
    let metrics = metrics_text(&gw).await;
    for (tenant, reason, count) in [
        ("rpm", "requests_per_minute", 1.0),
        ("tpm", "tokens_per_minute", 2.0),
        ("conc", "max_concurrent", 1.0),
    ] {
        let rejected = format!(r#"kvgate_tenant_rejected_total{{reason="{reason}",tenant="{tenant}"}}"#);
        assert_eq!(metric(&metrics, &rejected), count, "{tenant} {reason}:\n{metrics}");
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_higher_class_overtakes_a_queued_lower_one() {
    let up = upstream("a", "m").await;
    up.hold_stream.store(true, Ordering::SeqCst);
    let mut cfg = config(vec![up.url.clone()]);
    cfg.max_concurrent_requests = Some(1);
    cfg.queue_size = 10;
    cfg.tenants = tenants(json!({"named": {"batch": {"class": "low"}}}));
    let gw = Arc::new(gateway(cfg).await);
    let mut streaming = chat("m");
    streaming["stream"] = json!(true);
    let held = post(&gw, &streaming, &[]).await;
    assert_eq!(held.status(), 200);
    up.hold_stream.store(false, Ordering::SeqCst);
    let (done, mut order) = tokio::sync::mpsc::unbounded_channel();
    let send = |name: &'static str, headers: Vec<(&'static str, &'static str)>| {
        let (gw, done) = (gw.clone(), done.clone());
        tokio::spawn(async move {
            let mut body = chat("m");
            body["messages"][0]["content"] = json!(name);
            let status = post(&gw, &body, &headers).await.status();
            let _ = done.send((name, status.as_u16()));
        })
    };
    // The batch tenant's class is low; the interactive request asks for high.
    send("batch", vec![("x-kvgate-tenant", "batch")]);
    assert!(metric_line_appears(&gw, "kvgate_queue_depth 1").await);
    send("interactive", vec![("x-kvgate-priority", "high")]);
    assert!(metric_line_appears(&gw, "kvgate_queue_depth 2").await);
    up.release.notify_one();
    held.text().await.unwrap();
    let mut answered = Vec::new();
    for _ in 0..2 {
        answered.push(tokio::time::timeout(Duration::from_secs(10), order.recv()).await.unwrap().unwrap());
    }
    answered.sort();
    assert_eq!(answered, [("batch", 200), ("interactive", 200)]);
    // The order the engine received them in (the clients' answers may arrive in either order: the
    // slot is free once the first answer is sent, before its client reads it).
    let received: Vec<Value> =
        up.bodies.lock().unwrap().iter().skip(1).map(|body| body["messages"][0]["content"].clone()).collect();
    assert_eq!(received, [json!("interactive"), json!("batch")]);
    Arc::try_unwrap(gw).ok().expect("the senders are done").shutdown().await;
}

/// With a slot reserved for `high`, a high request is answered while the low class holds
/// every other slot (its streams held open) and more low requests wait.
#[tokio::test]
async fn a_reserved_slot_serves_a_higher_class_while_lower_ones_hold_the_rest() {
    let up = upstream("a", "m").await;
    up.hold_stream.store(true, Ordering::SeqCst);
    let mut cfg = config(vec![up.url.clone()]);
    cfg.max_concurrent_requests = Some(2);
    cfg.queue_size = 10;
    cfg.tenants = tenants(json!({
        "named": {"batch": {"class": "low"}},
        "classes": {"high": {"reserved_concurrency": 1}},
    }));
    let gw = gateway(cfg).await;
    let mut streaming = chat("m");
    streaming["stream"] = json!(true);
    let held = post(&gw, &streaming, &[("x-kvgate-tenant", "batch")]).await;
    assert_eq!(held.status(), 200);
    // The low class's second request waits: the other slot is high's.
    let waiting = {
        let url = gw.url();
        let body = streaming.clone();
        tokio::spawn(async move {
            let request = client().post(format!("{url}/v1/chat/completions")).json(&body);
            request.header("x-kvgate-tenant", "batch").send().await.unwrap().status().as_u16()
        })
    };
    assert!(metric_line_appears(&gw, "kvgate_queue_depth 1").await);
    up.hold_stream.store(false, Ordering::SeqCst);
    let high = tokio::time::timeout(
        Duration::from_secs(10),
        post(&gw, &chat("m"), &[("x-kvgate-priority", "high")]),
    )
    .await
    .expect("the high request is admitted at once");
    assert_eq!(high.status(), 200);
    assert!(!waiting.is_finished(), "the low request still waits for a low slot");
    up.release.notify_one();
    held.text().await.unwrap();
    assert_eq!(tokio::time::timeout(Duration::from_secs(10), waiting).await.unwrap().unwrap(), 200);
    gw.shutdown().await;
}

/// `--forward-priority` writes the class into the body as the engine's `priority`, in the
/// engine's convention; off, the body is the client's.
#[tokio::test]
async fn the_class_is_forwarded_as_the_engines_priority() {
    for (forward, expected) in [
        (kvgate_gateway::ForwardPriority::Vllm, [Some(-1), Some(0), Some(1)]),
        (kvgate_gateway::ForwardPriority::Sglang, [Some(1), Some(0), Some(-1)]),
        (kvgate_gateway::ForwardPriority::Off, [None, None, None]),
    ] {
        let up = upstream("a", "m").await;
        let mut cfg = config(vec![up.url.clone()]);
        cfg.forward_priority = forward;
        let gw = gateway(cfg).await;
        for class in ["high", "normal", "low"] {
            assert_eq!(post(&gw, &chat("m"), &[("x-kvgate-priority", class)]).await.status(), 200);
        }
        let seen: Vec<Option<i64>> =
            up.bodies.lock().unwrap().iter().map(|body| body["priority"].as_i64()).collect();
        assert_eq!(seen, expected, "{forward:?}");
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn the_key_file_reloads_without_dropping_requests() {
    let up = upstream("a", "m").await;
    let dir = std::env::temp_dir().join(format!(
        "kvgate-keys-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("keys.txt");
    std::fs::write(&file, "sk-old team-a\n").unwrap();
    let mut cfg = config(vec![up.url.clone()]);
    cfg.client_api_keys_file = Some(file.clone());
    let gw = Arc::new(gateway(cfg).await);
    let with_key =
        |key: &'static str| [("authorization", if key == "old" { "Bearer sk-old" } else { "Bearer sk-new" })];
    assert_eq!(post(&gw, &chat("m"), &with_key("new")).await.status(), 401);
    // A steady client with the old key runs across the reloads.
    let steady = {
        let gw = gw.clone();
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..200 {
                statuses.push(post(&gw, &chat("m"), &with_key("old")).await.status().as_u16());
            }
            statuses
        })
    };
    std::fs::write(&file, "sk-old team-a\nsk-new team-b high\n").unwrap();
    assert_eq!(gw.reload_client_keys(), Ok(2));
    assert_eq!(post(&gw, &chat("m"), &with_key("new")).await.status(), 200);
    // A broken file keeps the keys in use.
    std::fs::write(&file, "sk-new\n").unwrap();
    assert!(gw.reload_client_keys().unwrap_err().contains("line 1"));
    assert_eq!(post(&gw, &chat("m"), &with_key("new")).await.status(), 200);
    let statuses = steady.await.unwrap();
    assert!(statuses.iter().all(|&status| status == 200), "{statuses:?}");
    assert!(metric_line_appears(&gw, r#"kvgate_client_keys_reloads_total{result="error"} 1"#).await);
    Arc::try_unwrap(gw).ok().expect("the client is done").shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_token_charge_is_corrected_to_what_the_engine_used() {
    // Every answer is 300 tokens long, but the requests name no max_tokens: at admission each is
    // charged its short prompt plus the output estimate (256 tokens before any answer, then the
    // open-ended answers' running mean), and corrected to ~300 when its answer's usage arrives.
    let fleet = kvgate_mock::spawn_fleet(kvgate_mock::MockArgs {
        count: 1,
        time_scale: 1000.0,
        force_max_tokens: true,
        default_max_tokens: 300,
        ..kvgate_mock::MockArgs::default()
    })
    .await
    .unwrap();
    let mut cfg = config(fleet.urls());
    cfg.tenants = tenants(json!({"defaults": {"tokens_per_minute": 500}}));
    let gw = gateway(cfg).await;
    let mut served = 0;
    let refused = loop {
        let response = post(&gw, &chat("mock-model"), &[]).await;
        if response.status() != 200 {
            break response;
        }
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["usage"]["completion_tokens"], 300, "{answer}");
        served += 1;
        assert!(served <= 3, "uncorrected: {served} answers of 300 tokens within 500 tokens a minute");
    };
    assert!(served >= 1, "{served}");
    expect_over_quota(refused, "tokens_per_minute_exceeded", 1).await;
    gw.shutdown().await;
}
