//! The gateway's pools as the routing plan sees them (`kvgate_route::Pool`): the candidates
//! (routable, not tried, with the peers' requests in flight), and the index a decision consults
//! (the tree or the exact index, as `kvgate_index::choose_index` says; learning for a live plan,
//! read only for a dry run; merged with the peers' blocks under replica sync). And, for a live
//! plan the gateway sends, the decisions recorded: metrics, the worker's counts, the decision log,
//! the peers told of a choice made on the tree. A large pool's candidate search reads the load
//! order the pool keeps (`kvgate_fleet::pool_order`) instead of an offer of every worker.

use std::sync::Arc;
use std::time::Instant;

use kvgate_index::{
    prompt_blocks, ExactRecordingTree, IndexKind, IndexView, Namespace, NamespacedExact, PeerMerged,
    PrefixIndexMode, PromptBlocks, PromptHashes, ReadOnlyTree,
};
use kvgate_policy::{Candidate, Decision, PdPath, Policy, PrefixIndex, RouteRequest, RoutingKey, WorkerId};
use kvgate_route::{IndexMode, KeptOrder, Offer, Planning};

use crate::replica_sync::Routed as PeerRouted;
use crate::state::AppState;
use kvgate_fleet::registry::ModelPool;
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::decisions::DecisionRecord;

/// One of the request's pools, for one plan.
pub(super) struct PoolView<'a> {
    pub state: &'a AppState,
    pub pool: &'a Arc<ModelPool>,
    /// The request's namespace in the exact index (its LoRA adapter, its cache salt).
    pub namespace: Namespace<'a>,
}

impl kvgate_route::Pool for PoolView<'_> {
    type Index<'b>
        = Consulted<'b>
    where
        Self: 'b;

    fn policy(&self) -> &dyn Policy {
        &*self.pool.policy
    }

    /// The routable workers not tried yet; in-flight counts include the peers' (replica sync).
    fn offer(&self, tried: &[WorkerId]) -> Offer {
        let now = Instant::now();
        let loads = self.state.loads.load();
        let peer_in_flight = self.state.replica_sync.as_ref().map(|sync| sync.peer_in_flight());
        let peers_on =
            |url: &str| peer_in_flight.as_ref().and_then(|counts| counts.get(url)).copied().unwrap_or(0);
        let mut events_flowing = true;
        let candidates = self
            .pool
            .workers
            .iter()
            .filter(|w| !tried.contains(&w.id) && w.is_routable(now))
            .map(|w| {
                events_flowing &= w.kv_events_trusted();
                Candidate {
                    id: w.id,
                    in_flight: w.in_flight() + peers_on(&w.url),
                    load: loads.get(&w.id).copied(),
                }
            })
            .collect();
        Offer { candidates, events_flowing }
    }

    fn member(&self, worker: WorkerId) -> Option<bool> {
        self.pool.worker(worker).map(|w| w.is_routable(Instant::now()))
    }

    /// A large pool's kept order: its healthy workers (a worker whose circuit is open is counted
    /// among them, and left out by the lookup), each looked up as the offer would give it. Not
    /// under replica sync: the order knows this gateway's requests in flight, not the peers'.
    fn with_order(&self, search: &mut dyn FnMut(KeptOrder<'_>)) -> bool {
        let Some(order) = &self.pool.order else { return false };
        if self.state.replica_sync.is_some() {
            return false;
        }
        let now = Instant::now();
        let loads = self.state.loads.load();
        let lookup = |id: WorkerId| {
            let w = self.pool.worker(id).filter(|w| w.is_routable(now))?;
            Some(Candidate { id, in_flight: w.in_flight(), load: loads.get(&id).copied() })
        };
        // Whether every routable worker's KV events flow: a walk over the pool, only when some
        // worker publishes them (the flag is false at once otherwise).
        let events_flowing = self.pool.has_kv_events
            && self.pool.workers.iter().filter(|w| w.is_routable(now)).all(|w| w.kv_events_trusted());
        order.with(|order| {
            search(KeptOrder { order, lookup: &lookup, routable: order.len(), events_flowing })
        });
        true
    }

    /// The pool's `--prefix-index`, except that a pool with a quarantined worker (its holdings
    /// set aside by the index repair) is routed as under `auto`: on the tree while any
    /// candidate's holdings are not trusted, also when the exact index is forced.
    fn index_mode(&self) -> IndexMode {
        let mut mode = self.pool.config.prefix_index;
        if mode == PrefixIndexMode::Exact && self.pool.workers.iter().any(|w| w.index_health.quarantined()) {
            mode = PrefixIndexMode::Auto;
        }
        IndexMode { mode, has_kv_events: self.pool.has_kv_events }
    }

    /// On the exact index, the prompt's block hashes, computed once for the query, the closed
    /// loop's probe and the in-flight record; on the tree with replica sync, the prompt's blocks,
    /// to match against the peers' and to publish with the choice.
    fn prefix_index(&self, kind: IndexKind, planning: Planning, request: &RouteRequest<'_>) -> Consulted<'_> {
        let hashes = match (kind, request.key) {
            (IndexKind::Exact, RoutingKey::Tokens(tokens)) => {
                Some(self.pool.prefix.exact.prompt_hashes(tokens, self.namespace))
            }
            _ => None,
        };
        let peers = match (&self.state.replica_sync, kind, request.key.prompt()) {
            (Some(_), IndexKind::Approximate, Some(key)) => {
                Some(prompt_blocks(key, self.pool.prefix.tree.block_size()))
            }
            _ => None,
        };
        Consulted { pool: self.pool, namespace: self.namespace, kind, planning, hashes, peers }
    }
}

/// The index one decision consults. A live plan's learns the choice (the tree learns it; the
/// exact index routes and the tree learns it too, so the fallback stays warm); a dry run's only
/// reads. What it computed for the query stays with the plan.
pub(super) struct Consulted<'a> {
    pool: &'a ModelPool,
    namespace: Namespace<'a>,
    kind: IndexKind,
    planning: Planning,
    /// The prompt's block hashes, on the exact index.
    pub hashes: Option<PromptHashes>,
    /// The prompt's blocks, on the tree with replica sync (matched against the peers' too).
    pub peers: Option<PromptBlocks>,
}

impl IndexView for Consulted<'_> {
    fn kind(&self) -> IndexKind {
        self.kind
    }

    fn with<R>(&self, use_index: impl FnOnce(&dyn PrefixIndex) -> R) -> R {
        let prefix = &self.pool.prefix;
        let (namespace, hashes) = (self.namespace, self.hashes.as_ref());
        let recording = ExactRecordingTree { exact: &prefix.exact, namespace, hashes, tree: &prefix.tree };
        let exact = NamespacedExact { exact: &prefix.exact, namespace, hashes };
        let read_only = ReadOnlyTree(&prefix.tree);
        let local: &dyn PrefixIndex = match (self.kind, self.planning) {
            (IndexKind::Exact, Planning::Live) => &recording,
            (IndexKind::Exact, Planning::DryRun) => &exact,
            (IndexKind::Approximate, Planning::Live) => &prefix.tree,
            (IndexKind::Approximate, Planning::DryRun) => &read_only,
        };
        // Approximate routing across replicas: the tree merged with what the peers routed.
        match &self.peers {
            Some(blocks) => use_index(&PeerMerged { local, peers: &prefix.peers, blocks }),
            None => use_index(local),
        }
    }
}

/// One pick of a live plan the gateway sends: counted (decision metrics by path, workers the
/// overload protection left out), and, when its policy decided it, recorded (the worker's
/// counts, the decision log at the plan's time `now_ms`, the peers told of a choice made on the
/// tree).
pub(super) fn record_sent(
    state: &AppState,
    pool: &ModelPool,
    worker: &Worker,
    pick: &mut kvgate_route::Pick<'_, Consulted<'_>>,
    path: PdPath,
    now_ms: u64,
) {
    let decision: &Decision = &pick.decision;
    if pick.left_out > 0 {
        state.metrics.overload_left_out.with_label_values(&[&pool.model]).inc_by(pick.left_out as u64);
    }
    state.metrics.count_decision(&pool.model, pool.role, &pool.series, decision, path);
    let Some(consulted) = &mut pick.index else { return };
    worker.routed.record(decision);
    state.decisions.record(DecisionRecord { at_ms: now_ms, role: pool.role, decision: *decision });
    if let (Some(sync), Some(blocks)) = (&state.replica_sync, consulted.peers.take()) {
        if decision.index == Some(IndexKind::Approximate) && !blocks.hashes.is_empty() {
            sync.publish(PeerRouted {
                model: pool.model.clone(),
                role: pool.role,
                worker: worker.url.clone(),
                hashes: blocks.hashes,
            });
        }
    }
}
