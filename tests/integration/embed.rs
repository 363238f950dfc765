//! The Rust embedding API end to end: a configuration from `GatewayConfig::builder()`, a gateway
//! started in-process in front of simulated engines, a request through it, a graceful stop.

use kvgate_gateway::GatewayConfig;
use kvgate_policy::{PolicyConfig, PolicyKind};

#[tokio::test]
async fn a_built_configuration_starts_serves_and_stops() {
    let fleet = kvgate_mock::spawn_fleet(kvgate_mock::MockArgs {
        count: 2,
        engine: kvgate_mock::EngineKind::Canned,
        ..kvgate_mock::MockArgs::default()
    })
    .await
    .unwrap();
    let config = GatewayConfig::builder()
        .port(0u16)
        .worker_urls(fleet.urls())
        .routing(PolicyConfig::builder().policy(PolicyKind::RoundRobin).build().unwrap())
        .shutdown_grace_period_secs(5.0)
        .build()
        .unwrap();
    let gateway = kvgate_gateway::start(config).await.unwrap();
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", gateway.url()))
        .json(&serde_json::json!({"model": "mock-model", "prompt": "hello there", "max_tokens": 4}))
        .timeout(std::time::Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    assert!(body["choices"][0]["text"].is_string(), "{body}");
    let url = gateway.url();
    gateway.shutdown().await;
    let after = reqwest::Client::new()
        .get(format!("{url}/health"))
        .timeout(std::time::Duration::from_secs(2))
        .send()
        .await;
    assert!(after.is_err(), "the gateway stopped listening");
    fleet.shutdown().await;
}

#[tokio::test]
async fn an_invalid_built_configuration_never_starts() {
    let errors =
        GatewayConfig::builder().port(0u16).max_connections(0usize).cb_failure_threshold(0u32).build();
    let errors = errors.unwrap_err();
    assert_eq!(errors.errors().len(), 2, "{errors}");
    // A configuration assembled by hand is validated by `start` as well.
    let config = GatewayConfig { max_connections: 0, port: 0, ..GatewayConfig::default() };
    let Err(kvgate_gateway::StartError::Config(errors)) = kvgate_gateway::start(config).await else {
        panic!("an invalid configuration must not start");
    };
    assert!(errors.names("max_connections"), "{errors}");
}
