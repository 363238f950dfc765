//! The discovery settings read from a validated configuration (the options and their checks are
//! `config/discovery.rs`): the label selectors per role, and the Kubernetes client (a given
//! kubeconfig, else the in-cluster or default one).

use std::path::PathBuf;

use futures_util::future::BoxFuture;

use super::pod::PodRules;
use kvgate_gateway_core::config::{label_selector, GatewayConfig};
use kvgate_protocol::role::WorkerRole;

/// What discovery watches and how pods become workers.
#[derive(Clone, Debug)]
pub struct DiscoverySettings {
    /// `None`: every namespace.
    pub namespace: Option<String>,
    /// One label selector (`k=v,k2=v2`) per role watched.
    pub selectors: Vec<(WorkerRole, String)>,
    pub rules: PodRules,
    pub kubeconfig: Option<PathBuf>,
}

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("reading the kubeconfig {path}: {source}")]
    Kubeconfig { path: PathBuf, source: kube::config::KubeconfigError },
    #[error("finding the Kubernetes configuration (in-cluster, $KUBECONFIG, ~/.kube/config): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("building the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

impl DiscoverySettings {
    /// The settings of a validated configuration, or `None` when discovery is off.
    pub fn from_config(config: &GatewayConfig) -> Option<Self> {
        if !config.service_discovery {
            return None;
        }
        let mut selectors = Vec::new();
        for (role, pairs) in [
            (WorkerRole::Regular, &config.selector),
            (WorkerRole::Prefill, &config.prefill_selector),
            (WorkerRole::Decode, &config.decode_selector),
        ] {
            if !pairs.is_empty() {
                if let Ok(selector) = label_selector(pairs) {
                    selectors.push((role, selector));
                }
            }
        }
        Some(Self {
            namespace: config.service_discovery_namespace.clone(),
            selectors,
            rules: PodRules {
                port: config.service_discovery_port,
                bootstrap_port_annotation: config.bootstrap_port_annotation.clone(),
                worker_port_annotation: config.worker_port_annotation.clone(),
            },
            kubeconfig: config.service_discovery_kubeconfig.clone(),
        })
    }

    /// A client of the cluster: the kubeconfig given, else inferred. Boxed, so that kube's
    /// generic code is compiled in this crate (optimised for size in release builds), not in the
    /// gateway's that awaits it.
    pub fn client(&self) -> BoxFuture<'_, Result<kube::Client, DiscoveryError>> {
        Box::pin(self.connect())
    }

    async fn connect(&self) -> Result<kube::Client, DiscoveryError> {
        let config = match &self.kubeconfig {
            Some(path) => {
                let kubeconfig = kube::config::Kubeconfig::read_from(path)
                    .map_err(|source| DiscoveryError::Kubeconfig { path: path.clone(), source })?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
                    .await
                    .map_err(|source| DiscoveryError::Kubeconfig { path: path.clone(), source })?
            }
            None => kube::Config::infer().await?,
        };
        Ok(kube::Client::try_from(config)?)
    }
}
