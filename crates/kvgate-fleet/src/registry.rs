//! The worker registry: the set of workers grouped by model and role (regular, prefill, decode),
//! each group with its own policy instance and prefix indexes, published as an immutable
//! snapshot that the request path reads without locks. A large pool keeps a load order of its
//! workers across snapshots (`pool_order`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arc_swap::ArcSwap;
use kvgate_index::{ApproxIndex, BlockIndex, InFlightBlocks, PeerBlocks};
use kvgate_policy::{build_policy, Policy, PolicyConfig, PolicyKind, WorkerId};

use crate::pool_order::{OrderBook, PoolOrder, ORDER_ABOVE};
use crate::worker::{CircuitSettings, Worker};
use kvgate_gateway_core::config::KvEventsSource;
use kvgate_gateway_core::metrics::{Metrics, PoolSeries};
use kvgate_gateway_core::worker_url::normalize_url;
use kvgate_protocol::role::WorkerRole;

/// The workers of one role serving one model, and their policy and prefix indexes.
pub struct ModelPool {
    pub model: String,
    pub role: WorkerRole,
    /// The pool's policy options (the model's `models:` entry, the role's policy).
    pub config: Arc<PolicyConfig>,
    pub workers: Vec<Arc<Worker>>,
    pub policy: Arc<dyn Policy>,
    pub prefix: Arc<ModelPrefix>,
    pub series: PoolSeries,
    /// Whether any of its workers publishes KV events (the exact index can be fed).
    pub has_kv_events: bool,
    /// Its load order, kept while it has more than `ORDER_ABOVE` workers.
    pub order: Option<Arc<PoolOrder>>,
    /// Each worker's place in `workers`, built on first use (a large pool's lookups).
    by_id: OnceLock<HashMap<WorkerId, usize>>,
}

impl ModelPool {
    /// The pool's worker `id`: by a map built once per snapshot for a pool that keeps an order,
    /// else by a walk over its workers.
    pub fn worker(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        if self.order.is_none() {
            return self.workers.iter().find(|w| w.id == id);
        }
        let by_id =
            self.by_id.get_or_init(|| self.workers.iter().enumerate().map(|(at, w)| (w.id, at)).collect());
        by_id.get(&id).map(|&at| &self.workers[at])
    }
}

/// One model's pools: regular workers, and the two sides of a disaggregated fleet.
#[derive(Clone, Default)]
pub struct ModelPools {
    pub regular: Option<Arc<ModelPool>>,
    pub prefill: Option<Arc<ModelPool>>,
    pub decode: Option<Arc<ModelPool>>,
}

impl ModelPools {
    pub fn get(&self, role: WorkerRole) -> Option<&Arc<ModelPool>> {
        match role {
            WorkerRole::Regular => self.regular.as_ref(),
            WorkerRole::Prefill => self.prefill.as_ref(),
            WorkerRole::Decode => self.decode.as_ref(),
        }
    }

    fn slot(&mut self, role: WorkerRole) -> &mut Option<Arc<ModelPool>> {
        match role {
            WorkerRole::Regular => &mut self.regular,
            WorkerRole::Prefill => &mut self.prefill,
            WorkerRole::Decode => &mut self.decode,
        }
    }

    /// Every pool of the model.
    pub fn all(&self) -> impl Iterator<Item = &Arc<ModelPool>> {
        [&self.regular, &self.prefill, &self.decode].into_iter().flatten()
    }

    /// The model's name.
    pub fn model(&self) -> &str {
        self.all().next().map_or("", |pool| pool.model.as_str())
    }
}

/// One model's prefix indexes: the approximate tree of what was routed where, and the exact
/// index its workers' KV events feed. Kept while the model has workers.
pub struct ModelPrefix {
    pub tree: ApproxIndex,
    pub exact: Arc<BlockIndex>,
    /// Prompts of requests in flight, held in `exact` until they end.
    pub in_flight: InFlightBlocks,
    /// What the other gateway replicas routed (`--replica-sync-redis-url`; empty otherwise).
    pub peers: PeerBlocks,
    /// The closed loop over the model's answers (every worker's).
    pub accuracy: Arc<crate::worker::ModelAccuracy>,
}

/// What a pool keeps across registry changes.
#[derive(Clone)]
struct ModelState {
    config: Arc<PolicyConfig>,
    policy: Arc<dyn Policy>,
    prefix: Arc<ModelPrefix>,
    order: Option<Arc<PoolOrder>>,
}

/// Load reports of workers, as published.
type Reports = Vec<(WorkerId, kvgate_policy::LoadSample)>;

/// An immutable view of the registry.
#[derive(Default)]
pub struct PoolSnapshot {
    /// Every registered worker, including those whose model is not known yet.
    pub workers: Vec<Arc<Worker>>,
    /// Pools by model name.
    pub models: BTreeMap<String, ModelPools>,
    /// Each pooled worker's pool, built on first use.
    pool_by_worker: OnceLock<HashMap<WorkerId, Arc<ModelPool>>>,
}

impl PoolSnapshot {
    /// The pools a request for `model` goes to: the named model, or the only model when there is one.
    pub fn pool_for(&self, model: Option<&str>) -> Option<&ModelPools> {
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

    /// The data-parallel ranks registered for the engine at `address` (`--dp-aware`).
    pub fn ranks_of<'a>(&'a self, address: &'a str) -> impl Iterator<Item = &'a Arc<Worker>> + 'a {
        self.workers.iter().filter(move |w| w.dp_rank.is_some() && w.address == address)
    }

    /// The pool `worker` belongs to (once its model is known).
    pub fn pool_of(&self, worker: &Worker) -> Option<&Arc<ModelPool>> {
        self.models.get(worker.model()?)?.get(worker.role)
    }

    /// Every pool of every model.
    pub fn pools(&self) -> impl Iterator<Item = &Arc<ModelPool>> {
        self.models.values().flat_map(ModelPools::all)
    }

    /// Load reports the load snapshot published (`fetched_at_ms` stamped), told to the policies
    /// of the workers' pools ([`Policy::on_load_reports`]) at `now_ms`.
    pub fn tell_load_reports(
        &self,
        reports: &[(WorkerId, kvgate_policy::LoadSample)],
        now_ms: u64,
        poll_ms: u64,
    ) {
        let by_worker = self.pool_by_worker.get_or_init(|| {
            self.pools().flat_map(|pool| pool.workers.iter().map(move |w| (w.id, pool.clone()))).collect()
        });
        let mut groups: Vec<(&Arc<ModelPool>, Reports)> = Vec::new();
        for &(id, sample) in reports {
            let Some(pool) = by_worker.get(&id) else { continue };
            match groups.iter_mut().find(|(known, _)| Arc::ptr_eq(known, pool)) {
                Some((_, group)) => group.push((id, sample)),
                None => groups.push((pool, vec![(id, sample)])),
            }
        }
        for (pool, group) in groups {
            pool.policy.on_load_reports(&group, now_ms, poll_ms);
        }
    }
}

/// A worker to register.
#[derive(Clone, Debug, Default)]
pub struct NewWorker {
    pub url: String,
    /// Its model; learned from the worker when unset.
    pub model: Option<String>,
    pub role: WorkerRole,
    /// A prefill worker's SGLang bootstrap port.
    pub bootstrap_port: Option<u16>,
    pub kv_events: Option<KvEventsSource>,
    /// The policy its model should route with, if it is the model's first worker.
    pub policy: Option<PolicyKind>,
    /// One data-parallel rank of the engine at `url` (`--dp-aware`): registered as `url@rank`.
    pub dp_rank: Option<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{0}")]
    InvalidUrl(String),
    #[error("worker {0} is already registered")]
    Duplicate(String),
    #[error("{0}")]
    PolicyConflict(String),
    #[error("the gateway has its most workers already ({0}, --max-workers)")]
    Full(usize),
}

pub struct Registry {
    snapshot: ArcSwap<PoolSnapshot>,
    /// Serializes mutations; each pool's policy and indexes live here so that a pool keeps
    /// them across changes.
    models: Mutex<BTreeMap<(String, WorkerRole), ModelState>>,
    next_id: AtomicU32,
    policy_config: PolicyConfig,
    /// The policies of the prefill and decode sides (default: the model's policy).
    role_policies: [Option<PolicyKind>; 2],
    /// Per-model options (the configuration's `models:`), and policies named by the first
    /// worker registered for a model (`POST /workers {"policy": ...}`).
    model_configs: BTreeMap<String, PolicyConfig>,
    hints: Mutex<BTreeMap<String, PolicyKind>>,
    circuit: CircuitSettings,
    metrics: Arc<Metrics>,
    /// Capacity of each pool's peer block index.
    peer_blocks: usize,
    /// Most workers registered at once (`--max-workers`).
    max_workers: usize,
    /// Which large pool's load order each of its workers is in.
    orders: Arc<OrderBook>,
}

impl Registry {
    pub fn new(
        policy_config: PolicyConfig,
        model_configs: BTreeMap<String, PolicyConfig>,
        role_policies: [Option<PolicyKind>; 2],
        circuit: CircuitSettings,
        metrics: Arc<Metrics>,
        peer_blocks: usize,
        max_workers: usize,
    ) -> Self {
        Self {
            snapshot: ArcSwap::from_pointee(PoolSnapshot::default()),
            models: Mutex::new(BTreeMap::new()),
            next_id: AtomicU32::new(0),
            policy_config,
            role_policies,
            model_configs,
            hints: Mutex::new(BTreeMap::new()),
            circuit,
            metrics,
            peer_blocks,
            max_workers,
            orders: Arc::default(),
        }
    }

    /// The large pools' load orders, for the load snapshot to tell of its changes
    /// (`LoadSnapshot::with_orders`).
    pub fn orders(&self) -> Arc<OrderBook> {
        self.orders.clone()
    }

    /// The current snapshot (cheap; no lock).
    pub fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.snapshot.load_full()
    }

    /// Whether any model's policy reads engine loads.
    pub fn policies_need_loads(&self) -> bool {
        self.snapshot().pools().any(|pool| pool.policy.needs_loads())
    }

    /// Register a worker. `healthy` is its initial health (true when health checks are off).
    pub fn add(&self, new: NewWorker, healthy: bool) -> Result<Arc<Worker>, RegistryError> {
        let NewWorker { url, model, role, bootstrap_port, kv_events, policy, dp_rank } = new;
        let url = normalize_url(&url).map_err(RegistryError::InvalidUrl)?;
        let name = match dp_rank {
            Some(rank) => format!("{url}@{rank}"),
            None => url.clone(),
        };
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.snapshot.load();
        if current.find(&name).is_some() {
            return Err(RegistryError::Duplicate(name));
        }
        if current.workers.len() >= self.max_workers {
            return Err(RegistryError::Full(self.max_workers));
        }
        if let (Some(kind), Some(model)) = (policy, &model) {
            self.hint(&models, model, role, kind)?;
        }
        let series = self.metrics.worker_series(&name);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let worker = Arc::new(
            Worker::new(id, url, model, healthy, self.circuit, series, kv_events)
                .with_role(role, bootstrap_port)
                .with_dp_rank(dp_rank),
        );
        let mut workers = current.workers.clone();
        workers.push(worker.clone());
        self.publish(&mut models, workers);
        worker.series.write(|url| {
            self.metrics.worker_healthy.with_label_values(&[url]).set(healthy as i64);
            self.metrics.circuit_state.with_label_values(&[url]).set(0);
        });
        Ok(worker)
    }

    /// Remove a worker by its name (`URL`, or `URL@RANK` for one data-parallel rank).
    /// Requests already sent to it finish normally (they hold their own handle).
    pub fn remove(&self, url: &str) -> Option<Arc<Worker>> {
        let url = match url.rsplit_once('@') {
            Some((base, rank)) if rank.parse::<u32>().is_ok() => {
                format!("{}@{rank}", normalize_url(base).ok()?)
            }
            _ => normalize_url(url).ok()?,
        };
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.snapshot.load();
        let removed = current.find(&url)?.clone();
        let workers = current.workers.iter().filter(|w| w.id != removed.id).cloned().collect();
        if let Some(state) = removed.model().and_then(|model| models.get(&(model.to_string(), removed.role)))
        {
            state.policy.remove_worker(removed.id);
            state.prefix.tree.remove_tenant(removed.id);
            state.prefix.in_flight.remove_worker(removed.id);
            state.prefix.peers.remove_tenant(removed.id);
        }
        self.publish(&mut models, workers);
        self.orders.detach(removed.as_ref());
        self.metrics.remove_worker(&removed.series);
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

    /// Records that `model` should route with `kind`, unless it already routes otherwise.
    fn hint(
        &self,
        models: &BTreeMap<(String, WorkerRole), ModelState>,
        model: &str,
        role: WorkerRole,
        kind: PolicyKind,
    ) -> Result<(), RegistryError> {
        let current = match models.get(&(model.to_string(), role)) {
            Some(state) => Some(state.config.policy),
            None => self.model_configs.get(model).map(|config| config.policy),
        };
        match current {
            Some(current) if current != kind => Err(RegistryError::PolicyConflict(format!(
                "model `{model}` already routes its {} workers with {}, not {}",
                role.as_str(),
                current.as_str(),
                kind.as_str()
            ))),
            Some(_) => Ok(()),
            None => {
                self.hints.lock().unwrap_or_else(|p| p.into_inner()).insert(model.to_string(), kind);
                Ok(())
            }
        }
    }

    fn publish(&self, models: &mut BTreeMap<(String, WorkerRole), ModelState>, workers: Vec<Arc<Worker>>) {
        let mut grouped: BTreeMap<(String, WorkerRole), Vec<Arc<Worker>>> = BTreeMap::new();
        for worker in &workers {
            if let Some(model) = worker.model() {
                grouped.entry((model.to_string(), worker.role)).or_default().push(worker.clone());
            }
        }
        // Candidates in URL order: replicas registering the same workers in another order
        // still offer the policy the same list (and break ties alike).
        for workers in grouped.values_mut() {
            workers.sort_by(|a, b| a.url.cmp(&b.url));
        }
        models.retain(|key, _| grouped.contains_key(key));
        let mut pools: BTreeMap<String, ModelPools> = BTreeMap::new();
        for ((model, role), workers) in grouped {
            let state = models.entry((model.clone(), role)).or_insert_with(|| self.new_pool(&model, role));
            self.keep_order(state, &workers);
            let state = state.clone();
            for worker in &workers {
                state.policy.add_worker(worker.id, &worker.url);
            }
            let pool = ModelPool {
                model: model.clone(),
                role,
                config: state.config,
                has_kv_events: workers.iter().any(|w| w.kv_events.is_some()),
                workers,
                policy: state.policy,
                prefix: state.prefix,
                series: PoolSeries::default(),
                order: state.order,
                by_id: OnceLock::new(),
            };
            *pools.entry(model).or_default().slot(role) = Some(Arc::new(pool));
        }
        self.snapshot.store(Arc::new(PoolSnapshot {
            workers,
            models: pools,
            pool_by_worker: OnceLock::new(),
        }));
    }

    /// A pool of more than `ORDER_ABOVE` workers keeps a load order (every worker in it), one of
    /// at most half that many drops it; new workers of a pool that keeps one join it.
    fn keep_order(&self, state: &mut ModelState, workers: &[Arc<Worker>]) {
        match &state.order {
            None if workers.len() > ORDER_ABOVE => {
                let order = Arc::new(PoolOrder::default());
                for worker in workers {
                    self.orders.attach(worker.as_ref(), &order);
                }
                state.order = Some(order);
            }
            Some(_) if workers.len() <= ORDER_ABOVE / 2 => {
                for worker in workers {
                    self.orders.detach(worker.as_ref());
                }
                state.order = None;
            }
            Some(order) => {
                for worker in workers.iter().filter(|worker| !worker.is_in(order)) {
                    self.orders.attach(worker.as_ref(), order);
                }
            }
            None => {}
        }
    }

    /// The policy configuration of `model`'s pool of `role`: the model's options (`models:`,
    /// else `routing:`), its policy named at registration if any, the role's policy for the
    /// sides of a disaggregated pair.
    pub fn policy_config(&self, model: &str, role: WorkerRole) -> PolicyConfig {
        let mut config = self.model_configs.get(model).cloned().unwrap_or_else(|| self.policy_config.clone());
        if let Some(kind) = self.hints.lock().unwrap_or_else(|p| p.into_inner()).get(model) {
            config.policy = *kind;
        }
        let role_kind = match role {
            WorkerRole::Regular => None,
            WorkerRole::Prefill => self.role_policies[0],
            WorkerRole::Decode => self.role_policies[1],
        };
        if let Some(kind) = role_kind {
            config.policy = kind;
        }
        config
    }

    fn new_pool(&self, model: &str, role: WorkerRole) -> ModelState {
        let config = Arc::new(self.policy_config(model, role));
        ModelState {
            policy: build_policy(&config),
            prefix: {
                let exact = Arc::new(config.block_index());
                Arc::new(ModelPrefix {
                    tree: ApproxIndex::new(config.tree_settings()),
                    in_flight: InFlightBlocks::new(exact.clone()),
                    exact,
                    peers: PeerBlocks::new(self.peer_blocks),
                    accuracy: Arc::default(),
                })
            },
            config,
            order: None,
        }
    }
}
