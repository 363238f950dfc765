//! Planning a request: which pools serve it (one regular pool, or a prefill and a decode pool),
//! and, per attempt, the route plan: one worker, or a (prefill, decode) pair, each chosen by its
//! own pool's policy on its own candidates, loads and prefix index.

use std::sync::Arc;
use std::time::Instant;

use kvgate_index::{
    prompt_blocks, prompt_hash, ExactRecordingTree, InFlightPrompt, Namespace, PeerMerged, ReadOnlyTree,
};
use kvgate_policy::{
    Candidate, Decision, IndexKind, PrefixIndex, PrefixIndexMode, RouteRequest, RoutingKey, SelectContext,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::Endpoint;
use crate::error::ApiError;
use crate::registry::{ModelPool, ModelPools, ModelPrefix};
use crate::state::AppState;
use crate::worker::Worker;

/// The pools a request is planned on.
pub(super) enum Shape {
    Single(Arc<ModelPool>),
    Pair { prefill: Arc<ModelPool>, decode: Arc<ModelPool> },
}

impl Shape {
    /// Regular workers when the model has them and the request is not disaggregated; a prefill
    /// and a decode pool in a disaggregated fleet.
    pub(super) fn of(state: &AppState, pools: &ModelPools, endpoint: Endpoint) -> Result<Shape, ApiError> {
        let pd = state.config.pd_disaggregation && endpoint != Endpoint::Embeddings;
        if pd {
            if let (Some(prefill), Some(decode)) = (&pools.prefill, &pools.decode) {
                return Ok(Shape::Pair { prefill: prefill.clone(), decode: decode.clone() });
            }
        }
        if let Some(regular) = &pools.regular {
            return Ok(Shape::Single(regular.clone()));
        }
        let missing = match (&pools.prefill, &pools.decode) {
            _ if !pd => "regular workers (embeddings are not disaggregated)",
            (None, _) => "prefill workers",
            _ => "decode workers",
        };
        Err(ApiError::NoHealthyWorker(format!(" for model `{}`: it has no {missing}", pools.model())))
    }

    /// The pool whose prefix index keys the request: the regular one, or the prefill side.
    pub(super) fn key_pool(&self) -> &Arc<ModelPool> {
        match self {
            Shape::Single(pool) => pool,
            Shape::Pair { prefill, .. } => prefill,
        }
    }

    pub(super) fn needs_routing_key(&self) -> bool {
        match self {
            Shape::Single(pool) => pool.policy.needs_routing_key(),
            Shape::Pair { prefill, decode } => {
                prefill.policy.needs_routing_key() || decode.policy.needs_routing_key()
            }
        }
    }

    /// Whether every pool of the plan still has a routable worker that was not tried.
    pub(super) fn untried_left(&self, tried: &[u32]) -> bool {
        let now = Instant::now();
        let left =
            |pool: &ModelPool| pool.workers.iter().any(|w| !tried.contains(&w.id) && w.is_routable(now));
        match self {
            Shape::Single(pool) => left(pool),
            Shape::Pair { prefill, decode } => left(prefill) && left(decode),
        }
    }

    /// The worker an `x-kvgate-target-worker` header names, if it serves this request's model
    /// (on either side of a pair).
    pub(super) fn target(&self, value: &http::HeaderValue) -> Result<u32, ApiError> {
        let named = value.to_str().ok().and_then(|url| crate::worker::normalize_url(url).ok());
        let pools: Vec<&Arc<ModelPool>> = match self {
            Shape::Single(pool) => vec![pool],
            Shape::Pair { prefill, decode } => vec![prefill, decode],
        };
        pools
            .iter()
            .flat_map(|pool| pool.workers.iter())
            .find(|w| named.as_deref() == Some(w.url.as_str()))
            .map(|w| w.id)
            .ok_or_else(|| {
                ApiError::BadRequest(format!(
                    "x-kvgate-target-worker {:?} is not a worker of this request's model",
                    value.to_str().unwrap_or("<not text>")
                ))
            })
    }

    /// A route plan avoiding `tried` (and going to `target` where it serves), or why none exists.
    pub(super) fn plan(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
        tried: &[u32],
        target: Option<u32>,
    ) -> Result<RoutePlan, ApiError> {
        self.plan_as(state, request, tried, target, Planning::Live)
    }

    /// The plan a first attempt would follow, made without recording anything: no prefix index
    /// learns the choice, no metric counts it, no peer hears of it (`POST /v1/route`).
    pub(super) fn dry_run(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
    ) -> Result<RoutePlan, ApiError> {
        self.plan_as(state, request, &[], None, Planning::DryRun)
    }

    fn plan_as(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
        tried: &[u32],
        target: Option<u32>,
        planning: Planning,
    ) -> Result<RoutePlan, ApiError> {
        match self {
            Shape::Single(pool) => {
                Ok(RoutePlan::Single(pick(state, pool, request, tried, target, planning)?))
            }
            Shape::Pair { prefill, decode } => Ok(RoutePlan::Pair {
                prefill: pick(state, prefill, request, tried, target, planning)?,
                decode: pick(state, decode, request, tried, target, planning)?,
            }),
        }
    }
}

/// Whether a plan is for real or a dry run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Planning {
    /// The choice is recorded (prefix tree, metrics, peers).
    Live,
    /// Nothing is recorded (the policy's own state aside).
    DryRun,
}

/// One worker chosen by its pool's policy.
pub(super) struct Pick {
    pub worker: Arc<Worker>,
    pub decision: Decision,
    pub pool: Arc<ModelPool>,
}

impl Pick {
    /// A request routed on the exact index: its prompt's blocks count as held by the chosen
    /// worker until the request ends.
    pub(super) fn in_flight_prompt(
        &self,
        request: &RouteRequest<'_>,
    ) -> Option<(Arc<ModelPrefix>, InFlightPrompt)> {
        match (self.decision.index, request.key) {
            (Some(IndexKind::Exact), RoutingKey::Tokens(tokens)) => Some((
                self.pool.prefix.clone(),
                self.pool.prefix.in_flight.add(self.decision.worker, tokens, Namespace::BASE),
            )),
            _ => None,
        }
    }
}

/// Where one attempt goes.
pub(super) enum RoutePlan {
    Single(Pick),
    Pair { prefill: Pick, decode: Pick },
}

fn pick(
    state: &AppState,
    pool: &Arc<ModelPool>,
    request: &RouteRequest<'_>,
    tried: &[u32],
    target: Option<u32>,
    planning: Planning,
) -> Result<Pick, ApiError> {
    if let Some(worker) = target.and_then(|id| pool.workers.iter().find(|w| w.id == id)) {
        if tried.contains(&worker.id) || !worker.is_routable(Instant::now()) {
            return Err(ApiError::NoHealthyWorker(format!(
                ": the target worker {} is not available",
                worker.url
            )));
        }
        let decision = Decision::plain(worker.id, kvgate_policy::Reason::TargetWorker);
        if planning == Planning::Live {
            state.metrics.count_decision(&pool.model, pool.role, &pool.series, &decision);
        }
        return Ok(Pick { worker: worker.clone(), decision, pool: pool.clone() });
    }
    choose(state, pool, request, tried, planning)
        .map(|(worker, decision)| Pick { worker, decision, pool: pool.clone() })
        .ok_or_else(|| {
            let side = match pool.role {
                crate::role::WorkerRole::Regular => String::new(),
                role => format!(" on the {} side", role.as_str()),
            };
            ApiError::NoHealthyWorker(format!(" for model `{}`{side}", pool.model))
        })
}

/// Ask the pool's policy for a routable worker that has not been tried yet. Candidates count
/// the peers' requests in flight as well as this replica's; ties are broken by an RNG seeded
/// from the prompt, so replicas with the same state decide alike.
fn choose(
    state: &AppState,
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    tried: &[u32],
    planning: Planning,
) -> Option<(Arc<Worker>, Decision)> {
    let now = Instant::now();
    let loads = state.loads.load();
    let peer_in_flight = state.replica_sync.as_ref().map(|sync| sync.peer_in_flight());
    let peers_on =
        |url: &str| peer_in_flight.as_ref().and_then(|counts| counts.get(url)).copied().unwrap_or(0);
    let mut events_flowing = true;
    let candidates: Vec<Candidate> = pool
        .workers
        .iter()
        .filter(|w| !tried.contains(&w.id) && w.is_routable(now))
        .map(|w| {
            events_flowing &= w.kv_events_flowing();
            Candidate {
                id: w.id,
                in_flight: w.in_flight() + peers_on(&w.url),
                load: loads.get(&w.id).copied(),
            }
        })
        .collect();
    if candidates.is_empty() {
        return None;
    }
    let live = planning == Planning::Live;
    let exact_index = use_exact_index(pool, request, events_flowing);
    let recording =
        ExactRecordingTree { exact: &pool.prefix.exact, namespace: Namespace::BASE, tree: &pool.prefix.tree };
    let read_only = ReadOnlyTree(&pool.prefix.tree);
    let local: &dyn PrefixIndex = match (exact_index, live) {
        (true, true) => &recording,
        (true, false) => &*pool.prefix.exact,
        (false, true) => &pool.prefix.tree,
        (false, false) => &read_only,
    };
    // Approximate routing across replicas: the tree merged with what the peers routed.
    let sync = state.replica_sync.as_deref().filter(|_| !exact_index);
    let blocks = match (sync, request.key.prompt()) {
        (Some(_), Some(key)) => Some(prompt_blocks(key, pool.prefix.tree.block_size())),
        _ => None,
    };
    let merged;
    let prefix_index: &dyn PrefixIndex = match &blocks {
        Some(blocks) => {
            merged = PeerMerged { local, peers: &pool.prefix.peers, blocks };
            &merged
        }
        None => local,
    };
    let mut rng = match request.key.prompt() {
        Some(key) => SmallRng::seed_from_u64(prompt_hash(key)),
        None => SmallRng::from_rng(&mut rand::rng()),
    };
    let mut ctx = SelectContext {
        now_ms: state.now_ms(),
        load_poll_interval_ms: state.load_poll_interval_ms,
        rng: &mut rng,
        prefix_index: Some(prefix_index),
    };
    let decision = pool.policy.select(request, &candidates, &mut ctx).ok()?;
    let worker = pool.workers.iter().find(|w| w.id == decision.worker)?.clone();
    if live {
        state.metrics.count_decision(&pool.model, pool.role, &pool.series, &decision);
        if let (Some(sync), Some(blocks)) = (sync, blocks) {
            if decision.index == Some(IndexKind::Approximate) && !blocks.hashes.is_empty() {
                sync.publish(crate::replica_sync::Routed {
                    model: pool.model.clone(),
                    role: pool.role,
                    worker: worker.url.clone(),
                    hashes: blocks.hashes,
                });
            }
        }
    }
    Some((worker, decision))
}

/// Whether to match against the exact index: the pool's workers publish KV events, the request
/// has token ids, and the mode allows it (`auto`: every candidate's events flow).
fn use_exact_index(pool: &ModelPool, request: &RouteRequest<'_>, events_flowing: bool) -> bool {
    if !pool.has_kv_events || !matches!(request.key, RoutingKey::Tokens(_)) {
        return false;
    }
    match pool.config.prefix_index {
        PrefixIndexMode::Auto => events_flowing,
        PrefixIndexMode::Exact => true,
        PrefixIndexMode::Approximate => false,
    }
}
