//! One pool's choice for one attempt, in its four steps: the candidates (routable, not tried,
//! with the peers' requests in flight), the prefix index consulted (`kvgate_index::choose_index`),
//! the policy's decision on them, and, for a live plan, the decision recorded (metrics, and the
//! peers told of a choice made on the tree).

use std::sync::Arc;
use std::time::Instant;

use kvgate_index::{
    choose_index, prompt_blocks, prompt_hash, ExactRecordingTree, IndexInputs, Namespace, NamespacedExact,
    PeerMerged, PromptBlocks, PromptHashes, ReadOnlyTree,
};
use kvgate_policy::{
    admit_under_overload, Admitted, Candidate, Candidates, Decision, IndexKind, PdPath, PrefixIndex,
    RouteRequest, Routed, RoutingKey, SelectContext,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::plan::Planning;
use crate::decisions::DecisionRecord;
use crate::registry::ModelPool;
use crate::replica_sync::Routed as PeerRouted;
use crate::state::AppState;
use crate::worker::Worker;

/// A worker chosen, its decision, and the prompt's block hashes when the decision consulted the
/// exact index (hashed once, for the query, the closed loop's probe and the in-flight record).
pub(super) type Chosen = (Arc<Worker>, Decision, Option<PromptHashes>);

/// Ask the pool's policy for a routable worker that has not been tried yet. Candidates count
/// the peers' requests in flight as well as this replica's; ties are broken by an RNG seeded
/// from the prompt, so replicas with the same state decide alike.
pub(super) fn choose(
    state: &AppState,
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    namespace: Namespace<'_>,
    tried: &[u32],
    planning: Planning,
) -> Result<Chosen, NoChoice> {
    let (decision, peers, hashes) = decide(state, pool, request, namespace, tried, planning, Ask::Decide)?;
    let worker = pool.workers.iter().find(|w| w.id == decision.worker).ok_or(NoChoice::NoWorker)?.clone();
    if planning == Planning::Live {
        record(state, pool, &worker, &decision, peers);
    }
    Ok((worker, decision, hashes))
}

/// The decision the pool's policy would make now, with its prediction, recording nothing (read
/// only index, no metric, no peer, nothing in the policy's state): `None` when its policy does
/// not predict (`Policy::predicts`), or no worker is left. Conditional disaggregation weighs the
/// paths with it before choosing one.
pub(super) fn preview(
    state: &AppState,
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    namespace: Namespace<'_>,
    tried: &[u32],
) -> Option<Decision> {
    decide(state, pool, request, namespace, tried, Planning::DryRun, Ask::Preview)
        .ok()
        .map(|(decision, ..)| decision)
}

/// The policy's decision among the candidates `offer` leaves, on the index the pool's state
/// calls for, with the peers' blocks and the prompt's hashes it consulted (for `choose` to
/// record and pass on).
fn decide(
    state: &AppState,
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    namespace: Namespace<'_>,
    tried: &[u32],
    planning: Planning,
    ask: Ask,
) -> Result<(Decision, Option<PromptBlocks>, Option<PromptHashes>), NoChoice> {
    let (offered, events_flowing) = offer(state, pool, tried, planning)?;
    let candidates = Candidates::new(&offered).map_err(|_| NoChoice::NoWorker)?;
    let index = index_kind(pool, request, events_flowing);
    let peers = peer_blocks(state, pool, request, index);
    let hashes = prompt_hashes(pool, request, namespace, index);
    let inputs =
        SelectInputs { namespace, hashes: hashes.as_ref(), index, planning, peers: peers.as_ref(), ask };
    let (decision, now_ms) = select(state, pool, request, candidates, inputs).ok_or(NoChoice::NoWorker)?;
    if planning == Planning::Live && ask == Ask::Decide {
        pool.policy.on_routed(&Routed {
            request,
            candidates,
            decision: &decision,
            now_ms,
            load_poll_interval_ms: state.loads.poll_interval_ms,
        });
    }
    Ok((decision, peers, hashes))
}

/// The routable candidates not tried yet, less those the overload protection leaves out (counted
/// in `kvgate_overload_left_out_total` when live), and whether every one's KV events flow.
fn offer(
    state: &AppState,
    pool: &ModelPool,
    tried: &[u32],
    planning: Planning,
) -> Result<(Vec<Candidate>, bool), NoChoice> {
    let (offered, events_flowing) = candidates(state, pool, tried);
    let now_ms = state.clock.now_ms();
    match admit_under_overload(&offered, &state.overload, now_ms, state.loads.poll_interval_ms) {
        Admitted::All => Ok((offered, events_flowing)),
        Admitted::Only(kept) => {
            if planning == Planning::Live {
                let left_out = (offered.len() - kept.len()) as u64;
                state.metrics.overload_left_out.with_label_values(&[&pool.model]).inc_by(left_out);
            }
            Ok((kept, events_flowing))
        }
        Admitted::Shed => Err(NoChoice::Shed),
    }
}

/// On the exact index, the prompt's block hashes, computed once for the query, the closed
/// loop's probe and the in-flight record.
fn prompt_hashes(
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    namespace: Namespace<'_>,
    index: IndexKind,
) -> Option<PromptHashes> {
    match (index, request.key) {
        (IndexKind::Exact, RoutingKey::Tokens(tokens)) => {
            Some(pool.prefix.exact.prompt_hashes(tokens, namespace))
        }
        _ => None,
    }
}

/// Whether the policy decides for a plan, or previews a path (its decision only when it predicts,
/// `Policy::predicts`, never routed).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ask {
    Decide,
    Preview,
}

/// Why a pool offered no worker.
pub(super) enum NoChoice {
    /// No routable worker is left (or the policy found none).
    NoWorker,
    /// Every one is over the overload bounds and `--worker-overload-shed` refuses the request.
    Shed,
}

/// Requests in flight (this replica's and the peers') on the pool's least busy routable worker
/// not tried yet (`None`: there is none): the prefill side's queue of the conditional rule.
pub(super) fn least_in_flight(state: &AppState, pool: &ModelPool, tried: &[u32]) -> Option<u64> {
    candidates(state, pool, tried).0.iter().map(|c| c.in_flight).min()
}

/// The pool's routable workers not tried yet, as policy candidates (in-flight counts include
/// the peers'), and whether every one's KV events flow.
fn candidates(state: &AppState, pool: &ModelPool, tried: &[u32]) -> (Vec<Candidate>, bool) {
    let now = Instant::now();
    let loads = state.loads.load();
    let peer_in_flight = state.replica_sync.as_ref().map(|sync| sync.peer_in_flight());
    let peers_on =
        |url: &str| peer_in_flight.as_ref().and_then(|counts| counts.get(url)).copied().unwrap_or(0);
    let mut events_flowing = true;
    let offered = pool
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
    (offered, events_flowing)
}

/// Which prefix index the decision consults: the one rule of `kvgate_index::choose_index`, on
/// the pool's mode and events, the request's key and whether every candidate's events flow.
fn index_kind(pool: &ModelPool, request: &RouteRequest<'_>, events_flowing: bool) -> IndexKind {
    choose_index(&IndexInputs {
        mode: pool.config.prefix_index,
        has_kv_events: pool.has_kv_events,
        key_is_tokens: matches!(request.key, RoutingKey::Tokens(_)),
        events_flowing,
    })
}

/// With replica sync, a decision on the tree also consults what the peers routed: the prompt's
/// block hashes, to match against the peers' blocks and to publish with the choice.
fn peer_blocks(
    state: &AppState,
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    index: IndexKind,
) -> Option<PromptBlocks> {
    state.replica_sync.as_ref().filter(|_| index == IndexKind::Approximate)?;
    Some(prompt_blocks(request.key.prompt()?, pool.prefix.tree.block_size()))
}

/// What a decision matches on: the request's namespace and, on the exact index, its prompt's
/// hashes; the index chosen; live or dry run; the peers' blocks (replica sync).
struct SelectInputs<'a> {
    namespace: Namespace<'a>,
    hashes: Option<&'a PromptHashes>,
    index: IndexKind,
    planning: Planning,
    peers: Option<&'a PromptBlocks>,
    /// Decide, or preview without recording.
    ask: Ask,
}

/// The policy's decision on `candidates`, matching on the chosen index: live plans record the
/// choice in it (the tree learns it; the exact index routes and the tree learns it too, so the
/// fallback stays warm); dry runs only read.
fn select(
    state: &AppState,
    pool: &ModelPool,
    request: &RouteRequest<'_>,
    candidates: Candidates<'_>,
    inputs: SelectInputs<'_>,
) -> Option<(Decision, u64)> {
    let SelectInputs { namespace, hashes, index, planning, peers, ask } = inputs;
    if ask == Ask::Preview && !pool.policy.predicts() {
        return None;
    }
    let recording =
        ExactRecordingTree { exact: &pool.prefix.exact, namespace, hashes, tree: &pool.prefix.tree };
    let exact = NamespacedExact { exact: &pool.prefix.exact, namespace, hashes };
    let read_only = ReadOnlyTree(&pool.prefix.tree);
    let local: &dyn PrefixIndex = match (index, planning) {
        (IndexKind::Exact, Planning::Live) => &recording,
        (IndexKind::Exact, Planning::DryRun) => &exact,
        (IndexKind::Approximate, Planning::Live) => &pool.prefix.tree,
        (IndexKind::Approximate, Planning::DryRun) => &read_only,
    };
    // Approximate routing across replicas: the tree merged with what the peers routed.
    let merged;
    let prefix_index: &dyn PrefixIndex = match peers {
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
    let now_ms = state.clock.now_ms();
    let mut ctx = SelectContext {
        now_ms,
        load_poll_interval_ms: state.loads.poll_interval_ms,
        rng: &mut rng,
        prefix_index: Some(prefix_index),
    };
    pool.policy.decide(request, candidates, &mut ctx).ok().map(|decision| (decision, now_ms))
}

/// A live decision is counted, and, made on the tree, queued for the peers (never waits).
fn record(
    state: &AppState,
    pool: &ModelPool,
    worker: &Worker,
    decision: &Decision,
    peers: Option<PromptBlocks>,
) {
    // The sides of a disaggregated plan are counted once its path is known (`plan.rs`).
    if pool.role == crate::role::WorkerRole::Regular {
        state.metrics.count_decision(&pool.model, pool.role, &pool.series, decision, PdPath::Pair);
    }
    worker.routed.record(decision);
    state.decisions.record(DecisionRecord {
        at_ms: state.clock.now_ms(),
        role: pool.role,
        decision: *decision,
    });
    if let (Some(sync), Some(blocks)) = (&state.replica_sync, peers) {
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
