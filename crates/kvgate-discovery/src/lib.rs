//! kvgate-discovery: Kubernetes service discovery for the gateway, on `kvgate-fleet`'s
//! registration. One pod watch (kube-rs `watcher`: list, then watch, re-list when the watch
//! breaks) per role's label selector. Ready pods join the registry through the same path as
//! `POST /workers`; pods deleted or no longer Ready leave through the same path as
//! `DELETE /workers`, so requests already in flight on them finish.
//!
//! A crate of its own, entered through [`spawn`] and [`DiscoverySettings::client`] (neither
//! generic nor async), so that the Kubernetes client's generic code (the watcher, the pod types'
//! deserializers) is compiled here, optimised for size in release builds, and not in the
//! gateway's crate, whose request path is optimised for speed (docs/BENCHMARKS.md, release build).

mod pod;
mod reconcile;
mod settings;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use tokio::sync::watch as signal;

pub use kube::Client;
use kvgate_fleet::registration::Registration;
use kvgate_fleet::registry::NewWorker;
use kvgate_gateway_core::error::ApiError;
use kvgate_protocol::role::WorkerRole;
use pod::{pod_key, pod_target, PodTarget};
use reconcile::{Action, Reconciler};
pub use settings::{DiscoveryError, DiscoverySettings};

/// The workers discovery wants registered, and those it registered itself (only those leave
/// with their pods; a worker given by flag or `POST /workers` is never removed by discovery).
#[derive(Default)]
struct Book {
    desired: HashSet<String>,
    owned: HashSet<String>,
}

/// What discovery is built from: the registry's operations its joins and leaves go through,
/// its metric, and whether prefill and decode pods may join.
#[derive(Clone)]
pub struct Discovery {
    pub registration: Arc<Registration>,
    /// `kvgate_discovery_events_total`.
    pub events: prometheus::IntCounterVec,
    /// `--pd-disaggregation`: prefill and decode pods join; without it they are ignored.
    pub pd_disaggregation: bool,
}

/// Watch the pods on a task of its own until `shutdown`.
pub fn spawn(
    discovery: Discovery,
    client: kube::Client,
    settings: DiscoverySettings,
    shutdown: signal::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(discovery, client, settings, shutdown))
}

/// Watch the pods until `shutdown`; the watcher retries with backoff on API errors.
async fn run(
    discovery: Discovery,
    client: kube::Client,
    settings: DiscoverySettings,
    mut shutdown: signal::Receiver<bool>,
) {
    let streams = settings.selectors.iter().enumerate().map(|(slot, (_, selector))| {
        let api: Api<Pod> = match &settings.namespace {
            Some(namespace) => Api::namespaced(client.clone(), namespace),
            None => Api::all(client.clone()),
        };
        watcher::watcher(api, watcher::Config::default().labels(selector))
            .default_backoff()
            .map(move |event| (slot, event))
            .boxed()
    });
    let mut events = futures_util::stream::select_all(streams);
    let mut reconcilers: Vec<Reconciler> = settings.selectors.iter().map(|_| Reconciler::default()).collect();
    let book = Arc::new(Mutex::new(Book::default()));
    tracing::info!(
        namespace = settings.namespace.as_deref().unwrap_or("<all>"),
        selectors = ?settings.selectors,
        "kubernetes service discovery started"
    );
    loop {
        let (slot, event) = tokio::select! {
            next = events.next() => match next {
                Some(next) => next,
                None => return,
            },
            _ = shutdown.changed() => return,
        };
        let role = settings.selectors[slot].0;
        let reconciler = &mut reconcilers[slot];
        let target = |pod: &Pod| pod_target(pod, role, &settings.rules);
        let actions = match event {
            Ok(Event::Init) => {
                count(&discovery, "relist");
                reconciler.begin_relist();
                Vec::new()
            }
            Ok(Event::InitApply(pod)) => {
                reconciler.relist_pod(pod_key(&pod), target(&pod));
                Vec::new()
            }
            Ok(Event::InitDone) => reconciler.end_relist(),
            Ok(Event::Apply(pod)) => reconciler.apply(pod_key(&pod), target(&pod)),
            Ok(Event::Delete(pod)) => reconciler.delete(&pod_key(&pod)),
            Err(error) => {
                count(&discovery, "error");
                tracing::warn!(%error, role = role.as_str(), "pod watch failed; retrying");
                Vec::new()
            }
        };
        for action in actions {
            apply(&discovery, &book, action);
        }
    }
}

fn count(discovery: &Discovery, event: &str) {
    discovery.events.with_label_values(&[event]).inc();
}

fn apply(discovery: &Discovery, book: &Arc<Mutex<Book>>, action: Action) {
    match action {
        Action::Join(target) => {
            lock(book).desired.insert(target.url.clone());
            tokio::spawn(join(discovery.clone(), book.clone(), target));
        }
        Action::Leave(target) => {
            let owned = {
                let mut book = lock(book);
                book.desired.remove(&target.url);
                book.owned.remove(&target.url)
            };
            // Not owned yet: a join still in progress sees it is no longer desired and undoes it.
            if owned && !discovery.registration.deregister(&target.url).is_empty() {
                count(discovery, "left");
                tracing::info!(worker = %target.url, "pod left: worker removed");
            }
        }
    }
}

async fn join(discovery: Discovery, book: Arc<Mutex<Book>>, target: PodTarget) {
    let new = NewWorker {
        url: target.url.clone(),
        model: None,
        role: target.role,
        bootstrap_port: target.bootstrap_port,
        kv_events: None,
        policy: None,
        dp_rank: None,
    };
    if target.role != WorkerRole::Regular && !discovery.pd_disaggregation {
        return;
    }
    match discovery.registration.register(new).await {
        Ok(workers) => {
            let still_wanted = {
                let mut book = lock(&book);
                let wanted = book.desired.contains(&target.url);
                if wanted {
                    book.owned.insert(target.url.clone());
                }
                wanted
            };
            if still_wanted {
                count(&discovery, "joined");
                let ranks = workers.len();
                tracing::info!(worker = %target.url, role = target.role.as_str(), ranks, "pod ready: worker added");
            } else {
                discovery.registration.deregister(&target.url);
            }
        }
        Err(ApiError::Conflict(message)) => {
            tracing::debug!(worker = %target.url, %message, "discovered worker already registered");
        }
        Err(error) => {
            count(&discovery, "error");
            tracing::warn!(worker = %target.url, %error, "discovered pod not registered");
        }
    }
}

fn lock(book: &Mutex<Book>) -> std::sync::MutexGuard<'_, Book> {
    book.lock().unwrap_or_else(|p| p.into_inner())
}
