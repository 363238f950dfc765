//! What a pod means to the gateway: its key, and the worker it stands for when it is Ready
//! (`http://{podIP}:{port}`, its role, a prefill pod's bootstrap port from an annotation).

use k8s_openapi::api::core::v1::Pod;

use kvgate_protocol::role::WorkerRole;

/// A pod's identity: `namespace/name`.
pub type PodKey = String;

/// The worker a Ready pod stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodTarget {
    pub url: String,
    pub role: WorkerRole,
    pub bootstrap_port: Option<u16>,
}

/// How pods become workers.
#[derive(Clone, Debug)]
pub struct PodRules {
    /// The worker port on every pod (`--service-discovery-port`).
    pub port: u16,
    /// The annotation holding a prefill pod's bootstrap port (`--bootstrap-port-annotation`).
    pub bootstrap_port_annotation: String,
    /// The annotation overriding `port` for one pod (`--worker-port-annotation`).
    pub worker_port_annotation: String,
}

/// `namespace/name` of a pod.
pub fn pod_key(pod: &Pod) -> PodKey {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("");
    let name = pod.metadata.name.as_deref().unwrap_or("");
    format!("{namespace}/{name}")
}

/// The worker `pod` stands for, if it should receive requests: it has an IP, its `Ready`
/// condition is `True`, and it is not being deleted.
pub fn pod_target(pod: &Pod, role: WorkerRole, rules: &PodRules) -> Option<PodTarget> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .as_ref()?
        .iter()
        .any(|condition| condition.type_ == "Ready" && condition.status == "True");
    if !ready {
        return None;
    }
    let ip: std::net::IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    let host = match ip {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
    };
    let bootstrap_port = match role {
        WorkerRole::Prefill => annotated_port(pod, &rules.bootstrap_port_annotation),
        _ => None,
    };
    let port = annotated_port(pod, &rules.worker_port_annotation).unwrap_or(rules.port);
    Some(PodTarget { url: format!("http://{host}:{port}"), role, bootstrap_port })
}

/// A port number (1-65535) in annotation `name` of `pod`.
fn annotated_port(pod: &Pod, name: &str) -> Option<u16> {
    let value = pod.metadata.annotations.as_ref()?.get(name)?;
    value.trim().parse::<u16>().ok().filter(|port| *port > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> PodRules {
        PodRules {
            port: 8000,
            bootstrap_port_annotation: "sglang.ai/bootstrap-port".into(),
            worker_port_annotation: "kvgate.io/worker-port".into(),
        }
    }

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).expect("a pod")
    }

    fn ready_pod(ip: &str, ready: &str) -> Pod {
        pod(serde_json::json!({
            "metadata": {"name": "w0", "namespace": "ns", "annotations": {"sglang.ai/bootstrap-port": "8998"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}
        }))
    }

    #[test]
    fn a_ready_pod_is_a_worker_at_its_ip_and_the_port() {
        let target = pod_target(&ready_pod("10.0.0.7", "True"), WorkerRole::Regular, &rules());
        assert_eq!(
            target,
            Some(PodTarget {
                url: "http://10.0.0.7:8000".into(),
                role: WorkerRole::Regular,
                bootstrap_port: None
            })
        );
        assert_eq!(pod_key(&ready_pod("10.0.0.7", "True")), "ns/w0");
    }

    #[test]
    fn a_prefill_pod_takes_its_bootstrap_port_from_the_annotation() {
        let target = pod_target(&ready_pod("10.0.0.7", "True"), WorkerRole::Prefill, &rules()).unwrap();
        assert_eq!(target.bootstrap_port, Some(8998));
        let ipv6 = pod_target(&ready_pod("fd00::7", "True"), WorkerRole::Decode, &rules()).unwrap();
        assert_eq!(ipv6.url, "http://[fd00::7]:8000");
        assert_eq!(ipv6.bootstrap_port, None);
    }

    #[test]
    fn pods_not_ready_without_ip_or_being_deleted_are_not_workers() {
        let check = |pod: Pod| pod_target(&pod, WorkerRole::Regular, &rules());
        assert_eq!(check(ready_pod("10.0.0.7", "False")), None);
        assert_eq!(check(ready_pod("not-an-ip", "True")), None);
        assert_eq!(check(pod(serde_json::json!({"metadata": {"name": "w"}}))), None);
        assert_eq!(
            check(pod(serde_json::json!({"metadata": {"name": "w"},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}))),
            None
        );
        let mut deleting = ready_pod("10.0.0.7", "True");
        deleting.metadata.deletion_timestamp =
            Some(serde_json::from_value(serde_json::json!("2026-01-01T00:00:00Z")).unwrap());
        assert_eq!(check(deleting), None);
        let mut bad_annotation = ready_pod("10.0.0.7", "True");
        bad_annotation
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("sglang.ai/bootstrap-port".into(), "x".into());
        assert_eq!(pod_target(&bad_annotation, WorkerRole::Prefill, &rules()).unwrap().bootstrap_port, None);
    }

    #[test]
    fn an_annotation_overrides_the_port() {
        let mut pod = ready_pod("10.0.0.7", "True");
        pod.metadata.annotations.as_mut().unwrap().insert("kvgate.io/worker-port".into(), "9001".into());
        assert_eq!(pod_target(&pod, WorkerRole::Regular, &rules()).unwrap().url, "http://10.0.0.7:9001");
        pod.metadata.annotations.as_mut().unwrap().insert("kvgate.io/worker-port".into(), "0".into());
        assert_eq!(pod_target(&pod, WorkerRole::Regular, &rules()).unwrap().url, "http://10.0.0.7:8000");
    }
}
