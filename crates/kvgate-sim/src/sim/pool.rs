//! One pool of simulated engines routed by one policy, as the gateway keeps it per (model, role): the policy, its prefix index (the tree, or the exact index fed by the pool's engines' KV events), the in-flight counts and the load monitor's last samples.
//!
//! A regular fleet is one pool; a prefill/decode fleet is two, each routed on its own state.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use kvgate_engine::{EngineLoad, KvEvent, KvEventBatch, Tier};
use kvgate_index::{
    choose_index, ApproxIndex, BlockIndex, CacheBlocks, CacheId, InFlightBlocks, InFlightPrompt, IndexInputs,
    IndexKind, Namespace, PrefixIndex, ReadOnlyTree, Residency, StoredBlocks,
};
use kvgate_policy::{
    build_policy, Candidate, Candidates, Decision, LoadSample, NoRoute, Policy, PolicyConfig, PolicyKind,
    RouteRequest, Routed, RoutingKey, SelectContext,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

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

impl Prefix {
    fn index(&self) -> &dyn PrefixIndex {
        match self {
            Prefix::Approximate(tree) => &**tree,
            Prefix::Exact { index, .. } => &**index,
        }
    }
}

/// Engines `first_engine..first_engine + n_workers` of the simulation, routed by one policy.
/// Candidate ids (and the exact index's cache ids) are pool-local, `0..n_workers`.
pub(super) struct Pool {
    policy: Arc<dyn Policy>,
    needs_loads: bool,
    prefix: Prefix,
    pub(super) first_engine: usize,
    in_flight: Vec<u64>,
    loads: Vec<Option<LoadSample>>,
}

impl Pool {
    /// A fresh policy built from `config`, with the index it consults, chosen by the gateway's
    /// rule (`choose_index`): the simulated engines publish KV events when the policy matches
    /// on them, prompts are token ids and the events always flow, so `prefix_index=auto` is
    /// exact here; else the approximate tree.
    pub(super) fn new(config: &PolicyConfig, first_engine: usize, n_workers: usize) -> Pool {
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
        let policy = build_policy(config);
        Pool {
            needs_loads: policy.needs_loads(),
            policy,
            prefix,
            first_engine,
            in_flight: vec![0; n_workers],
            loads: vec![None; n_workers],
        }
    }

    /// The pool of an outside policy's run (`crate::outside`): kvgate's policy is never asked
    /// (a round_robin stands in, with the approximate tree it never consults); the load
    /// monitor's samples are kept for the outside policy's candidates.
    pub(super) fn for_outside(n_workers: usize) -> Pool {
        let config = PolicyConfig { policy: PolicyKind::RoundRobin, ..PolicyConfig::default() };
        let mut pool = Pool::new(&config, 0, n_workers);
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

    pub(super) fn n_workers(&self) -> usize {
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

    /// Asks the policy for a worker as the gateway does (every worker a candidate, with its
    /// in-flight count and last load sample) and, on a decision, counts request `id` in flight
    /// there (its prompt too, with the exact index) until `ended`.
    #[allow(clippy::too_many_arguments, reason = "the request's parts, the clock and the RNG, all used")]
    pub(super) fn route(
        &mut self,
        now_us: u64,
        prompt: &[u32],
        prompt_tokens: u32,
        load_poll_interval_ms: u64,
        rng: &mut StdRng,
        id: u64,
        session: &str,
    ) -> Result<Decision, NoRoute> {
        let candidates: Vec<Candidate> = (0..self.n_workers())
            .map(|worker| Candidate {
                id: worker as u32,
                in_flight: self.in_flight[worker],
                load: self.loads[worker],
            })
            .collect();
        let route = RouteRequest {
            key: RoutingKey::Tokens(prompt),
            prompt_tokens: u64::from(prompt_tokens),
            session: Some(session),
        };
        let mut ctx = SelectContext {
            now_ms: now_us / 1000,
            load_poll_interval_ms,
            rng,
            prefix_index: Some(self.prefix.index()),
        };
        let candidates = Candidates::new(&candidates)?;
        let decision = self.policy.decide(&route, candidates, &mut ctx)?;
        self.policy.on_routed(&Routed {
            request: &route,
            candidates,
            decision: &decision,
            now_ms: now_us / 1000,
            load_poll_interval_ms,
        });
        let worker = decision.worker as usize;
        self.in_flight[worker] += 1;
        if let Prefix::Exact { in_flight, prompts, .. } = &mut self.prefix {
            prompts.insert(id, in_flight.add(worker as u32, prompt, Namespace::BASE));
        }
        Ok(decision)
    }

    /// The prompt tokens the policy predicts cached where it would route the request now (the
    /// admission queue's locality score): a dry run, as the gateway's, that records nothing (in
    /// the index, the in-flight counts or the policy's state), its random draws from an RNG of
    /// its own so the run's draws stay as without it.
    pub(super) fn predicted_cached(
        &self,
        now_us: u64,
        prompt: &[u32],
        prompt_tokens: u32,
        load_poll_interval_ms: u64,
        id: u64,
        session: &str,
    ) -> u64 {
        let mut rng = StdRng::seed_from_u64(id);
        let decision =
            self.dry_run(now_us, prompt, prompt_tokens, load_poll_interval_ms, &mut rng, session, false);
        decision.map_or(0, |decision| kvgate_policy::cached_tokens(&decision, u64::from(prompt_tokens)))
    }

    /// The decision `route` would make now, recording nothing (no in-flight count, nothing
    /// learned by the tree), or `None` when the policy does not predict (see `Policy::predicts`).
    pub(super) fn preview(
        &self,
        now_us: u64,
        prompt: &[u32],
        prompt_tokens: u32,
        load_poll_interval_ms: u64,
        rng: &mut StdRng,
        session: &str,
    ) -> Option<Decision> {
        self.dry_run(now_us, prompt, prompt_tokens, load_poll_interval_ms, rng, session, true)
    }

    /// The policy's decision on the pool's current loads and a read-only index, never routed
    /// (`None` on no decision, or with `preview` when the policy does not predict).
    #[allow(clippy::too_many_arguments, reason = "the two dry runs' inputs, passed through")]
    fn dry_run(
        &self,
        now_us: u64,
        prompt: &[u32],
        prompt_tokens: u32,
        load_poll_interval_ms: u64,
        rng: &mut StdRng,
        session: &str,
        preview: bool,
    ) -> Option<Decision> {
        let candidates: Vec<Candidate> = (0..self.n_workers())
            .map(|worker| Candidate {
                id: worker as u32,
                in_flight: self.in_flight[worker],
                load: self.loads[worker],
            })
            .collect();
        let candidates = Candidates::new(&candidates).ok()?;
        let route = RouteRequest {
            key: RoutingKey::Tokens(prompt),
            prompt_tokens: u64::from(prompt_tokens),
            session: Some(session),
        };
        let read_only;
        let index: &dyn PrefixIndex = match &self.prefix {
            Prefix::Approximate(tree) => {
                read_only = ReadOnlyTree(tree);
                &read_only
            }
            Prefix::Exact { index, .. } => &**index,
        };
        let mut ctx =
            SelectContext { now_ms: now_us / 1000, load_poll_interval_ms, rng, prefix_index: Some(index) };
        if preview && !self.policy.predicts() {
            return None;
        }
        self.policy.decide(&route, candidates, &mut ctx).ok()
    }

    /// Requests in flight on the least busy worker (the conditional rule's prefill queue).
    pub(super) fn least_in_flight(&self) -> Option<u64> {
        self.in_flight.iter().copied().min()
    }

    /// Request `id` left `worker`: it no longer counts in flight (nor does its prompt).
    pub(super) fn ended(&mut self, worker: usize, id: u64) {
        self.in_flight[worker] -= 1;
        if let Prefix::Exact { in_flight, prompts, .. } = &mut self.prefix {
            if let Some(prompt) = prompts.remove(&id) {
                in_flight.remove(prompt);
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
    pub(super) fn maintain(&self, now_us: u64) {
        self.policy.maintain(now_us / 1000);
        if let Prefix::Approximate(tree) = &self.prefix {
            tree.maintain(now_us / 1000);
        }
    }

    /// Publishes `worker`'s load to the policy if it reads loads (as the gateway polls only then).
    pub(super) fn record_load(&mut self, worker: usize, load: &EngineLoad, now_us: u64) {
        if self.needs_loads {
            self.loads[worker] = Some(LoadSample {
                token_usage: load.token_usage,
                num_running_reqs: load.num_running_reqs,
                num_waiting_reqs: load.num_waiting_reqs,
                num_waiting_uncached_tokens: load.num_waiting_uncached_tokens,
                gen_throughput: load.gen_throughput,
                max_total_num_tokens: load.max_total_num_tokens,
                fetched_at_ms: now_us / 1000,
            });
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
