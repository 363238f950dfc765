//! One pool of simulated engines routed by one policy, as the gateway keeps it per (model, role): the policy, its prefix index (the tree, or the exact index fed by the pool's engines' KV events), the in-flight counts and the load monitor's last samples; the routing plan (`kvgate_route`) reads it through `kvgate_route::Pool`, as it reads the gateway's pools.
//!
//! A regular fleet is one pool; a prefill/decode fleet is two, each routed on its own state.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use kvgate_engine::RequestStats;
use kvgate_engine::{EngineLoad, KvEvent, KvEventBatch, Tier};
use kvgate_index::{
    choose_index, ApproxIndex, BlockIndex, CacheBlocks, CacheId, InFlightBlocks, InFlightPrompt, IndexInputs,
    IndexKind, IndexView, Namespace, PrefixIndex, PrefixIndexMode, ReadOnlyTree, Residency, StoredBlocks,
};
use kvgate_policy::{
    build_policy, Answered, Candidate, LoadSample, Policy, PolicyConfig, PolicyKind, PredictedTtft,
    RouteRequest, WorkerId,
};
use kvgate_route::{IndexMode, Offer, Planning};

use crate::outside::OutsideCandidate;

/// The pool's prefix index, as the host keeps it.
enum Prefix {
    Approximate(Box<ApproxIndex>),
    /// The engines' KV events applied, one writer per engine, and the prompts in flight (as the
    /// gateway counts them until their requests end).
    Exact {
        index: Arc<BlockIndex>,
        caches: Vec<CacheBlocks>,
        in_flight: InFlightBlocks,
        prompts: HashMap<u64, InFlightPrompt>,
    },
}

/// Engines `first_engine..first_engine + n_workers` of the simulation, routed by one policy.
/// Candidate ids (and the exact index's cache ids) are pool-local, `0..n_workers`. Public as the
/// simulator's `kvgate_route::Pool`, so that a test can drive the gateway's plan on it and on the
/// gateway's pools with the same inputs.
pub struct SimPool {
    policy: Arc<dyn Policy>,
    needs_loads: bool,
    /// The pool's `prefix_index` mode (the plan chooses the index per decision by it).
    prefix_index: PrefixIndexMode,
    prefix: Prefix,
    pub(super) first_engine: usize,
    in_flight: Vec<u64>,
    loads: Vec<Option<LoadSample>>,
    /// What the decision of each request in flight predicted (kv_aware's), handed to the
    /// policy with its answer ([`SimPool::answered`]).
    predicted: HashMap<u64, PredictedTtft>,
}

impl SimPool {
    /// A fresh policy built from `config`, with the index it consults, chosen by the gateway's
    /// rule (`choose_index`): the simulated engines publish KV events when the policy matches
    /// on them, prompts are token ids and the events always flow, so `prefix_index=auto` is
    /// exact here; else the approximate tree.
    pub fn new(config: &PolicyConfig, first_engine: usize, n_workers: usize) -> SimPool {
        SimPool::with_policy(config, build_policy(config), first_engine, n_workers)
    }

    /// [`SimPool::new`] routed by `policy` (built from `config`, or standing in for it).
    pub(crate) fn with_policy(
        config: &PolicyConfig,
        policy: Arc<dyn Policy>,
        first_engine: usize,
        n_workers: usize,
    ) -> SimPool {
        let index = choose_index(&IndexInputs {
            mode: config.prefix_index,
            has_kv_events: config.uses_exact_index(),
            key_is_tokens: true,
            events_flowing: true,
        });
        let prefix = if index == IndexKind::Exact {
            let index = Arc::new(config.block_index());
            let caches = (0..n_workers as u32)
                .map(|worker| CacheBlocks::new(index.clone(), CacheId { worker, rank: 0 }))
                .collect();
            let in_flight = InFlightBlocks::new(index.clone());
            Prefix::Exact { index, caches, in_flight, prompts: HashMap::new() }
        } else {
            Prefix::Approximate(Box::new(ApproxIndex::new(config.tree_settings())))
        };
        SimPool {
            needs_loads: policy.needs_loads(),
            prefix_index: config.prefix_index,
            policy,
            prefix,
            first_engine,
            in_flight: vec![0; n_workers],
            loads: vec![None; n_workers],
            predicted: HashMap::new(),
        }
    }

    /// The pool of an outside policy's run (`crate::outside`): kvgate's policy is never asked
    /// (a round_robin stands in, with the approximate tree it never consults); the load
    /// monitor's samples are kept for the outside policy's candidates.
    pub(super) fn for_outside(n_workers: usize) -> SimPool {
        let config = PolicyConfig { policy: PolicyKind::RoundRobin, ..PolicyConfig::default() };
        let mut pool = SimPool::new(&config, 0, n_workers);
        pool.needs_loads = true;
        pool
    }

    /// Every worker with its in-flight count and last load sample, as an outside policy sees it.
    pub(super) fn outside_candidates(&self) -> Vec<OutsideCandidate> {
        (0..self.n_workers())
            .map(|worker| OutsideCandidate {
                worker,
                in_flight: self.in_flight[worker],
                load: self.loads[worker],
            })
            .collect()
    }

    /// An outside policy routed a request to `worker`: it counts in flight there until `ended`.
    pub(super) fn admit_outside(&mut self, worker: usize) {
        self.in_flight[worker] += 1;
    }

    pub fn n_workers(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether the pool's engines must emit KV events (its index is the exact one).
    pub(super) fn wants_kv_events(&self) -> bool {
        matches!(self.prefix, Prefix::Exact { .. })
    }

    /// The pool-local worker of engine `engine`, if the pool has it.
    pub(super) fn local(&self, engine: usize) -> Option<usize> {
        engine.checked_sub(self.first_engine).filter(|&local| local < self.n_workers())
    }

    /// Names `worker` for the hash policies' rings, as the gateway names a worker by its URL
    /// (unnamed, a worker is placed by its id).
    pub fn name_worker(&self, worker: usize, name: &str) {
        self.policy.add_worker(worker as WorkerId, name);
    }

    /// Request `id` was sent to `worker` (a pick of a live plan): it counts in flight there (its
    /// prompt too, with the exact index) until `ended`.
    pub fn routed(&mut self, worker: usize, id: u64, prompt: &[u32]) {
        self.in_flight[worker] += 1;
        if let Prefix::Exact { in_flight, prompts, .. } = &mut self.prefix {
            prompts.insert(id, in_flight.add(worker as u32, prompt, Namespace::BASE));
        }
    }

    /// Request `id`'s decision predicted `predicted` (kv_aware's decisions do): kept until its
    /// answer ([`SimPool::answered`]).
    pub(super) fn predicted(&mut self, id: u64, predicted: PredictedTtft) {
        self.predicted.insert(id, predicted);
    }

    /// Request `id` finished on `worker` (`stats`: the engine's, its arrival the gateway's;
    /// `decided_us`: when it was decided and sent to the engine, after any wait in the
    /// gateway's admission queue): the policy learns from the answer what the gateway's usage
    /// tap teaches it when a stream ends (`kvgate_observe::accuracy::Learn`: the decision's
    /// prediction, the prompt and cached tokens the engine reported, the time from the decision
    /// to the first token, `Answered::ttft_s`). Only requests whose decision predicted a time to
    /// first token.
    pub(super) fn answered(&mut self, worker: usize, id: u64, stats: &RequestStats, decided_us: u64) {
        let Some(predicted) = self.predicted.remove(&id) else { return };
        self.policy.on_answered(&Answered {
            worker: worker as WorkerId,
            predicted,
            prompt_tokens: stats.prompt_tokens,
            cached_tokens: stats.cached_tokens.min(stats.prompt_tokens),
            ttft_s: stats.first_token_us.saturating_sub(decided_us) as f64 / 1e6,
        });
    }

    /// Request `id` left `worker`: it no longer counts in flight (nor does its prompt).
    pub fn ended(&mut self, worker: usize, id: u64) {
        self.predicted.remove(&id);
        self.in_flight[worker] -= 1;
        if let Prefix::Exact { in_flight, prompts, .. } = &mut self.prefix {
            if let Some(prompt) = prompts.remove(&id) {
                in_flight.remove(prompt);
            }
        }
    }

    /// The exact index learns `worker`'s engine's block size before the first request, as the
    /// gateway's does when the worker joins (its alignment probe's canary: a stored block), so a
    /// burst arriving before any engine has finished a prefill is matched on the prompts in
    /// flight instead of routed blind: a block stored and evicted at once, leaving nothing held.
    pub(super) fn learn_layout(&mut self, worker: usize, block_size: u32) {
        if let Prefix::Exact { caches, .. } = &mut self.prefix {
            let canary = u64::MAX; // an engine hash of the canary's one block (its cache's own)
            let tokens = vec![0; block_size as usize];
            let gpu = residency(Tier::Gpu);
            let stored = caches[worker].apply_stored(StoredBlocks {
                group: 0,
                block_hashes: &[canary],
                parent_block_hash: None,
                token_ids: &tokens,
                block_size,
                lookahead: &[],
                opaque: &[],
                namespace: Namespace::BASE,
                residency: gpu,
            });
            if stored.is_ok() {
                caches[worker].apply_removed(0, &[canary], gpu);
            }
        }
    }

    /// Applies `worker`'s KV event batches to the exact index; returns how many events it refused.
    pub(super) fn apply_kv_events(&mut self, worker: usize, batches: &[KvEventBatch]) -> u64 {
        let mut refused = 0;
        if let Prefix::Exact { caches, .. } = &mut self.prefix {
            for batch in batches {
                for event in &batch.events {
                    if !apply_event(&mut caches[worker], event) {
                        refused += 1;
                    }
                }
            }
        }
        refused
    }

    /// The gateway's once-a-second maintenance of the policy and the tree.
    pub fn maintain(&self, now_us: u64) {
        self.policy.maintain(now_us / 1000);
        if let Prefix::Approximate(tree) = &self.prefix {
            tree.maintain(now_us / 1000);
        }
    }

    /// Publishes `worker`'s load sample to the plan if the policy or the overload protection
    /// (`overload`: on) reads loads (as the gateway polls only then), and tells the policy of it
    /// as it lands, as the gateway's load monitor does (`poll_ms`: the polls' interval).
    pub fn record_load(&mut self, worker: usize, sample: LoadSample, overload: bool, poll_ms: u64) {
        if self.needs_loads || overload {
            self.loads[worker] = Some(sample);
            self.policy.on_load_reports(&[(worker as WorkerId, sample)], sample.fetched_at_ms, poll_ms);
        }
    }
}

/// An engine's load as the load monitor's sample of it at `now_us`.
pub(super) fn load_sample(load: &EngineLoad, now_us: u64) -> LoadSample {
    LoadSample {
        token_usage: load.token_usage,
        num_running_reqs: load.num_running_reqs,
        num_waiting_reqs: load.num_waiting_reqs,
        num_waiting_uncached_tokens: load.num_waiting_uncached_tokens,
        gen_throughput: load.gen_throughput,
        max_total_num_tokens: load.max_total_num_tokens,
        fetched_at_ms: now_us / 1000,
    }
}

impl kvgate_route::Pool for SimPool {
    type Index<'a> = PoolIndex<'a>;

    fn policy(&self) -> &dyn Policy {
        &*self.policy
    }

    /// Every worker not tried, with its in-flight count and last load sample (the simulated
    /// engines are always routable, and their KV events always flow).
    fn offer(&self, tried: &[WorkerId]) -> Offer {
        let candidates = (0..self.n_workers())
            .filter(|&worker| !tried.contains(&(worker as WorkerId)))
            .map(|worker| Candidate {
                id: worker as WorkerId,
                in_flight: self.in_flight[worker],
                load: self.loads[worker],
            })
            .collect();
        Offer { candidates, events_flowing: true }
    }

    fn member(&self, worker: WorkerId) -> Option<bool> {
        ((worker as usize) < self.n_workers()).then_some(true)
    }

    fn index_mode(&self) -> IndexMode {
        IndexMode { mode: self.prefix_index, has_kv_events: self.wants_kv_events() }
    }

    /// The tree (read only for a dry run), or the exact index the engines' events feed.
    fn prefix_index(
        &self,
        kind: IndexKind,
        planning: Planning,
        _request: &RouteRequest<'_>,
    ) -> PoolIndex<'_> {
        let view = match (&self.prefix, planning) {
            (Prefix::Approximate(tree), Planning::Live) => Answering::Tree(tree),
            (Prefix::Approximate(tree), Planning::DryRun) => Answering::ReadOnly(ReadOnlyTree(tree)),
            (Prefix::Exact { index, .. }, _) => Answering::Exact(index),
        };
        PoolIndex { kind, view }
    }
}

/// The index one decision of a pool consults, named by the kind the plan chose (a request
/// without a prompt consults none).
pub struct PoolIndex<'a> {
    kind: IndexKind,
    view: Answering<'a>,
}

enum Answering<'a> {
    Tree(&'a ApproxIndex),
    ReadOnly(ReadOnlyTree<'a>),
    Exact(&'a BlockIndex),
}

impl IndexView for PoolIndex<'_> {
    fn kind(&self) -> IndexKind {
        self.kind
    }

    fn with<R>(&self, use_index: impl FnOnce(&dyn PrefixIndex) -> R) -> R {
        match &self.view {
            Answering::Tree(tree) => use_index(*tree),
            Answering::ReadOnly(tree) => use_index(tree),
            Answering::Exact(index) => use_index(*index),
        }
    }
}

/// The residency of an engine tier, as vLLM names it.
fn residency(tier: Tier) -> &'static Residency {
    static GPU: LazyLock<Residency> = LazyLock::new(Residency::gpu);
    static CPU: LazyLock<Residency> = LazyLock::new(|| Residency::of(Some("CPU"), None, None));
    match tier {
        Tier::Gpu => &GPU,
        Tier::Cpu => &CPU,
    }
}

/// Applies one engine KV event to its cache's writer (a host tier's placeholders as the gateway
/// applies vLLM's); false when the index refused it.
fn apply_event(cache: &mut CacheBlocks, event: &KvEvent) -> bool {
    match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, tier, .. } => cache
            .apply_stored(StoredBlocks {
                group: 0,
                block_hashes,
                parent_block_hash: *parent_block_hash,
                token_ids,
                block_size: *block_size,
                lookahead: &[],
                opaque: &[],
                namespace: Namespace::BASE,
                residency: residency(*tier),
            })
            .is_ok(),
        KvEvent::BlockRemoved { block_hashes, tier } => {
            cache.apply_removed(0, block_hashes, residency(*tier));
            true
        }
        KvEvent::AllBlocksCleared => {
            cache.clear();
            true
        }
    }
}
