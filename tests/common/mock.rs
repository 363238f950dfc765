//! `kvgate mock` fleets for the integration tests: a fleet from `MockArgs` changed by the test, a
//! prefill or decode fleet, and a PD gateway config in front of such fleets.

use kvgate_gateway::{GatewayConfig, PdProtocol};
use kvgate_mock::{MockArgs, MockFleet, WorkerRole};

/// A mock fleet on loopback: `MockArgs::default()` as `tweak` changes it.
pub async fn mock_fleet(tweak: impl FnOnce(&mut MockArgs)) -> MockFleet {
    let mut args = MockArgs::default();
    tweak(&mut args);
    kvgate_mock::spawn_fleet(args).await.expect("the mock fleet starts")
}

/// `count` engines of PD `role`, 20x faster than wall time, holding a prefill's KV up to 20 s;
/// prefill engines serve their bootstrap ports (on free ports). `tweak` comes last.
pub async fn pd_fleet(role: WorkerRole, count: usize, tweak: impl FnOnce(&mut MockArgs)) -> MockFleet {
    mock_fleet(|args| {
        args.count = count;
        args.role = role;
        args.time_scale = 20.0;
        args.kv_hold_timeout_secs = 20.0;
        args.bootstrap_base_port = (role == WorkerRole::Prefill).then_some(0);
        tweak(args);
    })
    .await
}

/// A PD gateway config in front of mock fleets: every prefill engine with its bootstrap port,
/// the decode fleet's engines, routing headers on, up to 3 retries.
pub fn pd_mock_config(prefill: &[&MockFleet], decode: &MockFleet, protocol: PdProtocol) -> GatewayConfig {
    let mut cfg = super::config(Vec::new());
    cfg.pd_disaggregation = true;
    cfg.pd_protocol = protocol;
    cfg.expose_routing_headers = true;
    cfg.retry_max_retries = 3;
    for fleet in prefill {
        for (url, port) in fleet.urls().into_iter().zip(fleet.bootstrap_ports()) {
            cfg.prefill.extend([url, port.to_string()]);
        }
    }
    cfg.decode = decode.urls();
    cfg
}
