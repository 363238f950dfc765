//! The registry's operations: registering a worker (check its URL, learn its model and first
//! health, publish it, start its KV-event subscriptions) and removing one. `POST` and
//! `DELETE /workers`, the initial workers and Kubernetes discovery all go through here.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use crate::error::ApiError;
use crate::kv_events::KvEvents;
use crate::load_snapshot::LoadSnapshot;
use crate::registry::{NewWorker, Registry, RegistryError};
use crate::upstream::HealthCheck;
use crate::worker::Worker;
use crate::worker_url::normalize_url;

/// The gateway's own listener, which is never a worker (routing to it would loop).
#[derive(Clone, Debug)]
pub struct OwnAddress {
    /// The configured listen host (`--host`).
    pub host: String,
    /// The bound address, set once the listener is up.
    pub listen: Arc<OnceLock<SocketAddr>>,
}

/// What registration is built from.
pub struct Registration {
    pub registry: Arc<Registry>,
    /// A removed worker's load sample goes at once.
    pub loads: Arc<LoadSnapshot>,
    /// A new worker's model (unless given) and first health.
    pub check: HealthCheck,
    /// `--disable-health-check`: a new worker starts healthy, unprobed.
    pub probes_disabled: bool,
    pub kv_events: KvEvents,
    pub own_address: OwnAddress,
}

impl Registration {
    /// Add a worker: learn its model (unless given) and its first health state, then publish it.
    /// A worker whose model cannot be learned yet is registered and retried by the health loop.
    pub async fn register(&self, mut new: NewWorker) -> Result<Arc<Worker>, ApiError> {
        let url = normalize_url(&new.url).map_err(ApiError::BadRequest)?;
        if self.own_address.is_own(&url) {
            return Err(ApiError::BadRequest(format!(
                "{url} is this gateway's own address: routing to it would loop"
            )));
        }
        if self.registry.snapshot().find(&url).is_some() {
            return Err(ApiError::Conflict(format!("worker {url} is already registered")));
        }
        let model = match new.model.take() {
            Some(model) => Some(model),
            None => match self.check.discover_model(&url).await {
                Ok(model) => Some(model),
                Err(error) => {
                    tracing::warn!(worker = %url, %error, "could not learn the worker's model yet; will retry");
                    None
                }
            },
        };
        let healthy = self.probes_disabled || self.check.probe(&url).await;
        let worker = self.registry.add(NewWorker { url, model, ..new }, healthy).map_err(|e| match e {
            RegistryError::InvalidUrl(message) => ApiError::BadRequest(message),
            RegistryError::Duplicate(url) => {
                ApiError::Conflict(format!("worker {url} is already registered"))
            }
            RegistryError::PolicyConflict(message) => ApiError::Conflict(message),
        })?;
        self.kv_events.subscribe(&worker);
        tracing::info!(
            worker = %worker.url,
            model = worker.model().unwrap_or("<unknown>"),
            role = worker.role.as_str(),
            healthy,
            "worker added"
        );
        Ok(worker)
    }

    /// Remove a worker: no new request goes to it; requests already sent to it finish normally
    /// (they hold their own handle on it).
    pub fn deregister(&self, url: &str) -> Option<Arc<Worker>> {
        let worker = self.registry.remove(url)?;
        self.loads.forget(worker.id);
        tracing::info!(worker = %worker.url, "worker removed");
        Some(worker)
    }
}

impl OwnAddress {
    /// Whether `url` (normalized) points at this gateway's listener: its port, on a loopback or
    /// unspecified address, `localhost`, or the configured listen host.
    fn is_own(&self, url: &str) -> bool {
        let Some(listen) = self.listen.get() else { return false };
        let Ok(uri) = url.parse::<http::Uri>() else { return false };
        let default = if uri.scheme_str() == Some("https") { 443 } else { 80 };
        if uri.port_u16().unwrap_or(default) != listen.port() {
            return false;
        }
        let host = uri.host().unwrap_or("").trim_start_matches('[').trim_end_matches(']');
        if host == "localhost" || host.eq_ignore_ascii_case(&self.host) {
            return true;
        }
        match host.parse::<std::net::IpAddr>() {
            Ok(ip) => {
                ip.is_loopback()
                    || ip.is_unspecified()
                    || ip == listen.ip()
                    || listen.ip().is_unspecified() && is_local(ip)
            }
            Err(_) => false,
        }
    }
}

/// Whether `ip` is one of this machine's addresses (when listening on all of them): only those
/// can be bound (nothing is sent).
fn is_local(ip: std::net::IpAddr) -> bool {
    std::net::UdpSocket::bind((ip, 0)).is_ok()
}
