//! The registry's operations: registering a worker (check its URL, learn its model and first
//! health, publish it, start its KV-event subscriptions) and removing one. `POST` and
//! `DELETE /workers`, the initial workers and Kubernetes discovery all go through here.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use crate::kv_events::KvEvents;
use crate::load_snapshot::LoadSnapshot;
use crate::registry::{NewWorker, Registry, RegistryError};
use crate::worker::Worker;
use kvgate_gateway_core::config::KvEventsSource;
use kvgate_gateway_core::error::ApiError;
use kvgate_gateway_core::upstream::{HealthCheck, Via};
use kvgate_gateway_core::worker_url::{normalize_url, AllowList};

/// The gateway's own listeners, which are never workers (routing to them would loop).
#[derive(Clone, Debug)]
pub struct OwnAddress {
    /// The bound address, set once the listener is up.
    pub listen: Arc<OnceLock<SocketAddr>>,
    /// The admin listener's, when it has one.
    pub admin: Arc<OnceLock<SocketAddr>>,
    /// The metrics listener's (`--prometheus-port`), when it has one.
    pub metrics: Arc<OnceLock<SocketAddr>>,
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
    /// `--worker-url-allow`: where workers (and their KV event publishers) may be.
    pub allow: AllowList,
    /// `--dp-aware`: an engine's data-parallel ranks are registered as workers of their own.
    pub dp_aware: bool,
}

impl Registration {
    /// Add a worker (with `--dp-aware`, one per data-parallel rank of the engine, in rank
    /// order): learn its model (unless given) and its first health state, then publish it. A
    /// worker whose model cannot be learned yet is registered and retried by the health loop.
    pub async fn register(&self, new: NewWorker) -> Result<Vec<Arc<Worker>>, ApiError> {
        if !self.dp_aware || new.dp_rank.is_some() {
            return Ok(vec![self.register_one(new).await?]);
        }
        let url = normalize_url(&new.url).map_err(ApiError::BadRequest)?;
        if self.registry.snapshot().ranks_of(&url).next().is_some() {
            return Err(ApiError::Conflict(format!("worker {url} is already registered")));
        }
        let size = self.check.dp_size(&url).await.map_err(|error| {
            ApiError::UpstreamUnreachable(format!(
                "{url}: --dp-aware needs the engine's data-parallel size: {error}"
            ))
        })?;
        let sources = split_ranks(new.kv_events.as_ref(), size)
            .map_err(|why| ApiError::BadRequest(format!("{url}: {why}")))?;
        let mut added = Vec::with_capacity(size as usize);
        for (rank, kv_events) in (0..size).zip(sources) {
            let one = NewWorker { url: url.clone(), dp_rank: Some(rank), kv_events, ..new.clone() };
            match self.register_one(one).await {
                Ok(worker) => added.push(worker),
                Err(error) => {
                    for worker in added {
                        self.deregister(&worker.url);
                    }
                    return Err(error);
                }
            }
        }
        Ok(added)
    }

    /// Adds one worker (one rank of an engine with `dp_rank`).
    async fn register_one(&self, mut new: NewWorker) -> Result<Arc<Worker>, ApiError> {
        let url = normalize_url(&new.url).map_err(ApiError::BadRequest)?;
        if self.own_address.is_own(&url).await {
            return Err(ApiError::BadRequest(format!(
                "{url} is this gateway's own address: routing to it would loop"
            )));
        }
        self.check_allowed(&url, new.kv_events.as_ref()).await?;
        let name = match new.dp_rank {
            Some(rank) => format!("{url}@{rank}"),
            None => url.clone(),
        };
        if self.registry.snapshot().find(&name).is_some() {
            return Err(ApiError::Conflict(format!("worker {name} is already registered")));
        }
        let (model, max_model_len) = match new.model.take() {
            Some(model) => (Some(model), None),
            None => match self.check.discover_model(Via::Client(&url)).await {
                Ok(served) => (Some(served.id), served.max_model_len),
                Err(error) => {
                    tracing::warn!(worker = %url, %error, "could not learn the worker's model yet; will retry");
                    (None, None)
                }
            },
        };
        let healthy = self.probes_disabled || self.check.probe(Via::Client(&url)).await;
        let worker = self.registry.add(NewWorker { url, model, ..new }, healthy).map_err(|e| match e {
            RegistryError::InvalidUrl(message) => ApiError::BadRequest(message),
            RegistryError::Duplicate(url) => {
                ApiError::Conflict(format!("worker {url} is already registered"))
            }
            RegistryError::PolicyConflict(message) => ApiError::Conflict(message),
            full @ RegistryError::Full(_) => ApiError::Conflict(full.to_string()),
        })?;
        if let Some(len) = max_model_len {
            worker.set_max_model_len(len);
        }
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

    /// Remove a worker (`URL@RANK`: one data-parallel rank; an engine's URL: the worker, or
    /// every rank registered for it): no new request goes to it; requests already sent to it
    /// finish normally (they hold their own handle on it). Empty when none is registered.
    pub fn deregister(&self, url: &str) -> Vec<Arc<Worker>> {
        let mut removed: Vec<Arc<Worker>> = self.registry.remove(url).into_iter().collect();
        if removed.is_empty() {
            if let Ok(address) = normalize_url(url) {
                let ranks: Vec<String> =
                    self.registry.snapshot().ranks_of(&address).map(|w| w.url.clone()).collect();
                removed.extend(ranks.iter().filter_map(|name| self.registry.remove(name)));
            }
        }
        for worker in &removed {
            self.loads.forget(worker.id);
            tracing::info!(worker = %worker.url, "worker removed");
        }
        removed
    }
}

/// One engine's KV event source split per data-parallel rank (`--dp-aware`): rank `r` gets
/// the `r`-th endpoint (and replay endpoint); an engine without events gives none to each.
fn split_ranks(source: Option<&KvEventsSource>, size: u32) -> Result<Vec<Option<KvEventsSource>>, String> {
    let Some(source) = source else {
        return Ok(vec![None; size as usize]);
    };
    if source.ranks.len() != size as usize {
        return Err(format!(
            "the engine runs {size} data-parallel ranks but {} KV events endpoints are given (one per \
             rank, comma-separated, in rank order)",
            source.ranks.len()
        ));
    }
    Ok(source.ranks.iter().map(|rank| Some(KvEventsSource { ranks: vec![rank.clone()] })).collect())
}

impl Registration {
    /// Refuses a worker outside `--worker-url-allow`: its URL's host, and each of its KV event
    /// publishers' (the gateway connects to those too).
    async fn check_allowed(&self, url: &str, kv_events: Option<&KvEventsSource>) -> Result<(), ApiError> {
        if self.allow.is_open() {
            return Ok(());
        }
        let uri: http::Uri = url.parse().map_err(|e| ApiError::BadRequest(format!("{url}: {e}")))?;
        let default_port = if uri.scheme_str() == Some("https") { 443 } else { 80 };
        let mut hosts =
            vec![(uri.host().unwrap_or_default().to_string(), uri.port_u16().unwrap_or(default_port))];
        for rank in kv_events.map(|source| source.ranks.as_slice()).unwrap_or_default() {
            for endpoint in std::iter::once(&rank.events).chain(&rank.replay) {
                if let Some((host, port)) = endpoint.trim_start_matches("tcp://").rsplit_once(':') {
                    hosts.push((host.to_string(), port.parse().unwrap_or(0)));
                }
            }
        }
        for (host, port) in hosts {
            if !self.allowed(&host, port).await {
                return Err(ApiError::Forbidden(format!(
                    "{host} is not an allowed worker address (--worker-url-allow)"
                )));
            }
        }
        Ok(())
    }

    /// Whether `host` is allowed: an address in an allowed network, a name that matches, or a
    /// name every address of which (resolved as the connector will) is in an allowed network.
    async fn allowed(&self, host: &str, port: u16) -> bool {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
            return self.allow.allows_ip(ip);
        }
        if self.allow.allows_name(bare) {
            return true;
        }
        let resolved = kvgate_gateway_core::own_address::resolve(host, port).await;
        !resolved.is_empty() && resolved.iter().all(|address| self.allow.allows_ip(address.ip()))
    }
}

impl OwnAddress {
    /// Whether `url` (normalized) leads back to one of this gateway's listeners, its host
    /// resolved as the connector resolves it (`own_address.rs`).
    async fn is_own(&self, url: &str) -> bool {
        let listeners: Vec<SocketAddr> = [self.listen.get(), self.admin.get(), self.metrics.get()]
            .into_iter()
            .flatten()
            .copied()
            .collect();
        kvgate_gateway_core::own_address::leads_to_gateway(url, &listeners).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engines_kv_events_split_one_endpoint_per_rank() {
        let source = KvEventsSource::parse(
            "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558",
            Some("tcp://127.0.0.1:6557,tcp://127.0.0.1:6558"),
        )
        .unwrap();
        let split = split_ranks(source.as_ref(), 2).unwrap();
        let ranks: Vec<(&str, Option<&str>)> = split
            .iter()
            .map(|one| {
                let rank = &one.as_ref().unwrap().ranks[..];
                assert_eq!(rank.len(), 1);
                (rank[0].events.as_str(), rank[0].replay.as_deref())
            })
            .collect();
        assert_eq!(
            ranks,
            [
                ("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:6557")),
                ("tcp://127.0.0.1:5558", Some("tcp://127.0.0.1:6558"))
            ]
        );
        assert_eq!(split_ranks(None, 3).unwrap(), vec![None, None, None]);
        let error = split_ranks(source.as_ref(), 4).unwrap_err();
        assert!(error.contains("4 data-parallel ranks but 2 KV events endpoints"), "{error}");
    }
}
