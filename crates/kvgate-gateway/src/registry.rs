//! The worker registry: the set of workers grouped by model, each model with its own policy
//! instance, published as an immutable snapshot that the request path reads without locks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use kvgate_index::{ApproxIndex, BlockIndex, InFlightBlocks};
use kvgate_policy::{build_policy, Policy, PolicyConfig};

use crate::kv_events::KvEventsSource;
use crate::metrics::{Metrics, PoolSeries};
use crate::worker::{normalize_url, CircuitSettings, Worker};

/// The workers serving one model, and that model's policy and prefix indexes.
pub struct ModelPool {
    pub model: String,
    pub workers: Vec<Arc<Worker>>,
    pub policy: Arc<dyn Policy>,
    pub prefix: Arc<ModelPrefix>,
    pub series: PoolSeries,
    /// Whether any of its workers publishes KV events (the exact index can be fed).
    pub has_kv_events: bool,
}

/// One model's prefix indexes: the approximate tree of what was routed where, and the exact
/// index its workers' KV events feed. Kept while the model has workers.
pub struct ModelPrefix {
    pub tree: ApproxIndex,
    pub exact: Arc<BlockIndex>,
    /// Prompts of requests in flight, held in `exact` until they end.
    pub in_flight: InFlightBlocks,
}

/// What a model keeps across registry changes.
#[derive(Clone)]
struct ModelState {
    policy: Arc<dyn Policy>,
    prefix: Arc<ModelPrefix>,
}

/// An immutable view of the registry.
#[derive(Default)]
pub struct PoolSnapshot {
    /// Every registered worker, including those whose model is not known yet.
    pub workers: Vec<Arc<Worker>>,
    /// Pools by model name.
    pub models: BTreeMap<String, Arc<ModelPool>>,
}

impl PoolSnapshot {
    /// The pool a request for `model` goes to: the named model, or the only model when there is one.
    pub fn pool_for(&self, model: Option<&str>) -> Option<&Arc<ModelPool>> {
        if let Some(pool) = model.and_then(|name| self.models.get(name)) {
            return Some(pool);
        }
        if self.models.len() == 1 {
            return self.models.values().next();
        }
        None
    }

    pub fn find(&self, url: &str) -> Option<&Arc<Worker>> {
        self.workers.iter().find(|w| w.url == url)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{0}")]
    InvalidUrl(String),
    #[error("worker {0} is already registered")]
    Duplicate(String),
}

pub struct Registry {
    snapshot: ArcSwap<PoolSnapshot>,
    /// Serializes mutations; each model's policy and indexes live here so that a model keeps
    /// them across changes.
    models: Mutex<BTreeMap<String, ModelState>>,
    next_id: AtomicU32,
    policy_config: PolicyConfig,
    circuit: CircuitSettings,
    metrics: Arc<Metrics>,
}

impl Registry {
    pub fn new(policy_config: PolicyConfig, circuit: CircuitSettings, metrics: Arc<Metrics>) -> Self {
        Self {
            snapshot: ArcSwap::from_pointee(PoolSnapshot::default()),
            models: Mutex::new(BTreeMap::new()),
            next_id: AtomicU32::new(0),
            policy_config,
            circuit,
            metrics,
        }
    }

    /// The current snapshot (cheap; no lock).
    pub fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.snapshot.load_full()
    }

    /// Whether any model's policy reads engine loads.
    pub fn policies_need_loads(&self) -> bool {
        self.snapshot().models.values().any(|pool| pool.policy.needs_loads())
    }

    /// Register a worker. `healthy` is its initial health (true when health checks are off).
    pub fn add(
        &self,
        url: &str,
        model: Option<String>,
        healthy: bool,
        kv_events: Option<KvEventsSource>,
    ) -> Result<Arc<Worker>, RegistryError> {
        let url = normalize_url(url).map_err(RegistryError::InvalidUrl)?;
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.snapshot.load();
        if current.find(&url).is_some() {
            return Err(RegistryError::Duplicate(url));
        }
        let series = self.metrics.worker_series(&url);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let worker = Arc::new(Worker::new(id, url, model, healthy, self.circuit, series, kv_events));
        let mut workers = current.workers.clone();
        workers.push(worker.clone());
        self.publish(&mut models, workers);
        self.metrics.worker_healthy.with_label_values(&[&worker.url]).set(healthy as i64);
        self.metrics.circuit_state.with_label_values(&[&worker.url]).set(0);
        Ok(worker)
    }

    /// Remove a worker. Requests already sent to it finish normally (they hold their own handle).
    pub fn remove(&self, url: &str) -> Option<Arc<Worker>> {
        let url = normalize_url(url).ok()?;
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.snapshot.load();
        let removed = current.find(&url)?.clone();
        let workers = current.workers.iter().filter(|w| w.id != removed.id).cloned().collect();
        if let Some(state) = removed.model().and_then(|model| models.get(model)) {
            state.policy.remove_worker(removed.id);
            state.prefix.tree.remove_tenant(removed.id);
            state.prefix.in_flight.remove_worker(removed.id);
        }
        self.publish(&mut models, workers);
        self.metrics.remove_worker(&removed.url);
        removed.conns.clear();
        removed.stop_kv_events();
        Some(removed)
    }

    /// Rebuild the model pools after a worker learned its model.
    pub fn refresh(&self) {
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let workers = self.snapshot.load().workers.clone();
        self.publish(&mut models, workers);
    }

    fn publish(&self, models: &mut BTreeMap<String, ModelState>, workers: Vec<Arc<Worker>>) {
        let mut grouped: BTreeMap<String, Vec<Arc<Worker>>> = BTreeMap::new();
        for worker in &workers {
            if let Some(model) = worker.model() {
                grouped.entry(model.to_string()).or_default().push(worker.clone());
            }
        }
        models.retain(|model, _| grouped.contains_key(model));
        let pools = grouped
            .into_iter()
            .map(|(model, workers)| {
                let state = models.entry(model.clone()).or_insert_with(|| self.new_model()).clone();
                let pool = ModelPool {
                    model: model.clone(),
                    has_kv_events: workers.iter().any(|w| w.kv_events.is_some()),
                    workers,
                    policy: state.policy,
                    prefix: state.prefix,
                    series: PoolSeries::default(),
                };
                (model, Arc::new(pool))
            })
            .collect();
        self.snapshot.store(Arc::new(PoolSnapshot { workers, models: pools }));
    }

    fn new_model(&self) -> ModelState {
        ModelState {
            policy: build_policy(&self.policy_config),
            prefix: {
                let exact = Arc::new(BlockIndex::new());
                Arc::new(ModelPrefix {
                    tree: ApproxIndex::new(self.policy_config.tree_settings()),
                    in_flight: InFlightBlocks::new(exact.clone()),
                    exact,
                })
            },
        }
    }
}
