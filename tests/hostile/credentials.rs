//! A worker that should not see clients' credentials: every request's `Authorization` reached
//! whatever answered on a worker URL (an attacker's server registered through `/workers` got
//! them all). Now the client's credentials go to a worker only with `--forward-client-auth`, and
//! `Expect` (the body was read already) never does.
//!
//! Second round (issue 40): SMG's `--tenant-api-key TENANT:KEY` with a comma in the key gave
//! two weaker keys (`--client-api-keys` splits at commas): the real key `sk-live,weak` got 401,
//! `sk-live` was accepted as tenant `default` and `weak` as the tenant. Now such a key (or a
//! tenant with a comma or `=`) is refused with an error naming `--client-api-keys-file`, where
//! a key is taken whole.

use serde_json::json;

use crate::common::{client, config, gateway, upstream};

/// The worker's copy of a chat sent with credentials and `Expect`.
async fn headers_seen(forward_client_auth: bool) -> axum::http::HeaderMap {
    let worker = upstream("w", "m").await;
    let mut cfg = config(vec![worker.url.clone()]);
    cfg.forward_client_auth = forward_client_auth;
    let gw = gateway(cfg).await;
    let res = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("authorization", "Bearer client-secret")
        .header("cookie", "session=client-cookie")
        .header("x-api-key", "client-key")
        .header("expect", "100-continue")
        .header("x-request-id", "r1")
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    gw.shutdown().await;
    let headers = worker.last_headers.lock().unwrap().clone();
    headers
}

#[tokio::test]
async fn client_credentials_reach_workers_only_when_told() {
    let kept = headers_seen(false).await;
    for name in ["authorization", "cookie", "x-api-key", "expect"] {
        assert!(kept.get(name).is_none(), "{name} reached the worker: {kept:?}");
    }
    assert_eq!(kept["x-request-id"], "r1", "other headers pass");
    let forwarded = headers_seen(true).await;
    assert_eq!(forwarded["authorization"], "Bearer client-secret");
    assert_eq!(forwarded["cookie"], "session=client-cookie");
    assert_eq!(forwarded["x-api-key"], "client-key");
    assert!(forwarded.get("expect").is_none(), "expect is never forwarded");
}

#[tokio::test]
async fn an_smg_tenant_key_with_a_comma_is_refused_never_split() {
    for value in ["team-a:sk-live,weak", "team,a:sk-live", "team=a:sk-live"] {
        let message = match kvgate::launch_config(&["--tenant-api-key", value]) {
            Ok(config) => panic!("{value}: taken as the keys {:?}", config.client_api_keys),
            Err(message) => message,
        };
        assert!(
            message.contains("--tenant-api-key") && message.contains("--client-api-keys-file"),
            "{message}"
        );
    }
    // A key with a colon or an `=` is taken whole.
    let config = kvgate::launch_config(&["--tenant-api-key", "team-a:sk:live=1", "--port", "0"]).unwrap();
    let worker = upstream("w", "m").await;
    let config = kvgate_gateway::GatewayConfig { worker_urls: vec![worker.url.clone()], ..config };
    let gw = gateway(kvgate_gateway::GatewayConfig { admin_port: Some(0), ..config }).await;
    for (key, expected) in [("sk:live=1", 200), ("sk:live", 401), ("sk", 401)] {
        let res = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .bearer_auth(key)
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), expected, "{key}");
    }
    gw.shutdown().await;
}
