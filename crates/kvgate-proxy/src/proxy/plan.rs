//! Planning a request: which pools serve it (one regular pool, or a prefill and a decode pool),
//! and, per attempt, the route plan: one worker, or a (prefill, decode) pair, made by the one
//! routing plan of `kvgate_route` on the gateway's view of its pools (`choose.rs`), with the
//! gateway's clock and overload bounds and an RNG seeded from the prompt. A live plan is
//! recorded as sent (each policy's `on_routed`, the metrics, the peers); a dry run records
//! nothing.

use std::sync::Arc;

use kvgate_index::{prompt_hash, InFlightPrompt, Namespace, PromptHashes};
use kvgate_policy::{cached_tokens, Decision, IndexKind, PdChoice, PdPath, RouteRequest, RoutingKey};
use kvgate_route::{NoPlan, PlanContext, Planning, Pools, Side};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::choose::{Consulted, PoolView};
use crate::state::AppState;
use kvgate_fleet::registry::{ModelPool, ModelPools, ModelPrefix};
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::error::ApiError;
use kvgate_observe::accuracy::{Learn, Probe};
use kvgate_protocol::endpoint::Endpoint;

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
            // The conditional rule weighs the prompt's length, so it needs the prompt.
            Shape::Pair { prefill, decode } => {
                prefill.config.pd_conditional
                    || prefill.policy.needs_routing_key()
                    || decode.policy.needs_routing_key()
            }
        }
    }

    /// The worker an `x-kvgate-target-worker` header names, if it serves this request's model
    /// (on either side of a pair).
    pub(super) fn target(&self, value: &http::HeaderValue) -> Result<u32, ApiError> {
        // `URL` or, for one data-parallel rank (`--dp-aware`), `URL@RANK`.
        let named = value.to_str().ok().and_then(|name| match name.rsplit_once('@') {
            Some((url, rank)) if rank.parse::<u32>().is_ok() => {
                kvgate_gateway_core::worker_url::normalize_url(url).ok().map(|url| format!("{url}@{rank}"))
            }
            _ => kvgate_gateway_core::worker_url::normalize_url(name).ok(),
        });
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

    /// A route plan avoiding `tried` (and going to `target` where it serves), or why none exists;
    /// recorded as sent (the gateway sends it at once).
    pub(super) fn plan(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
        namespace: Namespace<'_>,
        tried: &[u32],
        target: Option<u32>,
    ) -> Result<RoutePlan, ApiError> {
        self.plan_as(state, request, namespace, Planning::Live, |pools, ctx| {
            pools.plan(request, tried, target, ctx).map_err(|no_plan| self.no_plan(state, no_plan))
        })
    }

    /// The plan a first attempt would follow, made without recording anything: no prefix index
    /// learns the choice, no policy records it, no metric counts it, no peer hears of it
    /// (`POST /v1/route`, the admission queue's locality score).
    pub(super) fn dry_run(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
        namespace: Namespace<'_>,
    ) -> Result<RoutePlan, ApiError> {
        self.plan_as(state, request, namespace, Planning::DryRun, |pools, ctx| {
            pools.plan(request, &[], None, ctx).map_err(|no_plan| self.no_plan(state, no_plan))
        })
    }

    /// The attempt after a pair whose KV transfer failed (`--pd-fallback-in-place`): in place on
    /// the decode engine the decode side's policy picks for the whole request (recorded and
    /// counted as any choice, so a kv_aware decode side queues the prefill there), with the
    /// pair's inputs and `why=transfer_failed`; `None` when no decode engine is left.
    pub(super) fn plan_in_place(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
        namespace: Namespace<'_>,
        tried: &[u32],
        pair: &PdChoice,
    ) -> Option<RoutePlan> {
        self.plan_as(state, request, namespace, Planning::Live, |pools, ctx| {
            pools.plan_in_place(request, tried, pair, ctx).ok_or(ApiError::NoHealthyWorker(String::new()))
        })
        .ok()
    }

    /// Whether every pool of the plan still has a routable worker that was not tried.
    pub(super) fn untried_left(&self, state: &AppState, tried: &[u32]) -> bool {
        self.with_pools(state, Namespace::BASE, |pools| pools.untried_left(tried))
    }

    /// `make` on the shape's pools with the clock, the loads' poll interval, the overload bounds
    /// and an RNG seeded from the prompt (replicas with the same state decide alike); a live
    /// plan is recorded as sent (`on_routed`, metrics, peers).
    fn plan_as<'r>(
        &self,
        state: &AppState,
        request: &RouteRequest<'r>,
        namespace: Namespace<'_>,
        planning: Planning,
        make: impl for<'p> FnOnce(
            &Pools<'p, PoolView<'p>>,
            &mut PlanContext<'_>,
        ) -> Result<kvgate_route::RoutePlan<'r, Consulted<'p>>, ApiError>,
    ) -> Result<RoutePlan, ApiError> {
        self.with_pools(state, namespace, |pools| {
            let mut rng = match request.key.prompt() {
                Some(key) => SmallRng::seed_from_u64(prompt_hash(key)),
                None => SmallRng::from_rng(&mut rand::rng()),
            };
            let mut ctx = PlanContext {
                now_ms: state.clock.now_ms(),
                load_poll_interval_ms: state.loads.poll_interval_ms,
                overload: state.overload,
                planning,
                rng: &mut rng,
            };
            let plan = make(pools, &mut ctx)?;
            if planning == Planning::Live {
                plan.on_routed(pools);
            }
            let now_ms = ctx.now_ms;
            self.adopt(state, plan, planning, now_ms)
        })
    }

    /// `use_pools` on the plan's view of the shape's pools.
    fn with_pools<R>(
        &self,
        state: &AppState,
        namespace: Namespace<'_>,
        use_pools: impl for<'p> FnOnce(&Pools<'p, PoolView<'p>>) -> R,
    ) -> R {
        match self {
            Shape::Single(pool) => use_pools(&Pools::Single(&PoolView { state, pool, namespace })),
            Shape::Pair { prefill, decode } => {
                let rule = prefill.config.pd_rule();
                let (prefill, decode) = (
                    PoolView { state, pool: prefill, namespace },
                    PoolView { state, pool: decode, namespace },
                );
                use_pools(&Pools::Pair { prefill: &prefill, decode: &decode, rule })
            }
        }
    }

    /// The gateway's plan of the route plan's picks (each counted and recorded when `live`).
    fn adopt(
        &self,
        state: &AppState,
        plan: kvgate_route::RoutePlan<'_, Consulted<'_>>,
        planning: Planning,
        now_ms: u64,
    ) -> Result<RoutePlan, ApiError> {
        let live = (planning == Planning::Live).then_some(now_ms);
        let adopt = |side, pick, path| Pick::adopt(state, self.pool(side), pick, path, live);
        Ok(match plan {
            kvgate_route::RoutePlan::Single(pick) => {
                RoutePlan::Single(adopt(Side::Regular, pick, PdPath::Pair)?)
            }
            kvgate_route::RoutePlan::Pair { prefill, decode, pd } => RoutePlan::Pair {
                prefill: adopt(Side::Prefill, prefill, PdPath::Pair)?,
                decode: adopt(Side::Decode, decode, PdPath::Pair)?,
                pd,
            },
            kvgate_route::RoutePlan::InPlace { decode, pd } => {
                RoutePlan::InPlace { decode: adopt(Side::Decode, decode, PdPath::InPlace)?, pd }
            }
        })
    }

    /// The pool of `side` (the one pool of a regular shape).
    fn pool(&self, side: Side) -> &Arc<ModelPool> {
        match (self, side) {
            (Shape::Single(pool), _) => pool,
            (Shape::Pair { prefill, .. }, Side::Prefill) => prefill,
            (Shape::Pair { decode, .. }, _) => decode,
        }
    }

    /// Why no plan was made, for the client.
    fn no_plan(&self, state: &AppState, no_plan: NoPlan) -> ApiError {
        let where_ = |side: Side| {
            let pool = self.pool(side);
            let side = match pool.role {
                kvgate_protocol::role::WorkerRole::Regular => String::new(),
                role => format!(" on the {} side", role.as_str()),
            };
            format!(" for model `{}`{side}", pool.model)
        };
        match no_plan {
            NoPlan::NoWorker { side } => ApiError::NoHealthyWorker(where_(side)),
            NoPlan::Shed { side } => ApiError::Overloaded {
                where_: where_(side),
                retry_after_secs: state.loads.poll_interval_ms.div_ceil(1000).max(1),
            },
            NoPlan::TargetUnavailable { worker } => {
                let url = match self {
                    Shape::Single(pool) => vec![pool],
                    Shape::Pair { prefill, decode } => vec![prefill, decode],
                }
                .into_iter()
                .flat_map(|pool| pool.workers.iter())
                .find(|w| w.id == worker)
                .map_or_else(|| worker.to_string(), |w| w.url.clone());
                ApiError::NoHealthyWorker(format!(": the target worker {url} is not available"))
            }
        }
    }
}

impl RoutePlan {
    /// The prompt tokens its policy predicts cached where the prompt is computed: the chosen
    /// worker's, a pair's prefill side's, or the decode worker prefilling in place.
    pub(super) fn predicted_cached_tokens(&self, prompt_tokens: u64) -> u64 {
        let pick = match self {
            RoutePlan::Single(pick) | RoutePlan::Pair { prefill: pick, .. } => pick,
            RoutePlan::InPlace { decode, .. } => decode,
        };
        cached_tokens(&pick.decision, prompt_tokens)
    }
}

/// One worker chosen by its pool's policy.
pub(super) struct Pick {
    pub worker: Arc<Worker>,
    pub decision: Decision,
    pub pool: Arc<ModelPool>,
    /// The prompt's block hashes, when the decision matched on the exact index.
    pub hashes: Option<PromptHashes>,
}

impl Pick {
    /// The gateway's pick of a route plan's pick on `pool`: its worker, and the prompt's hashes
    /// the decision computed; when `live` (the plan's time, in the gateway's milliseconds),
    /// counted by `path` and recorded (`choose::record_sent`).
    fn adopt(
        state: &AppState,
        pool: &Arc<ModelPool>,
        mut pick: kvgate_route::Pick<'_, Consulted<'_>>,
        path: PdPath,
        live: Option<u64>,
    ) -> Result<Pick, ApiError> {
        let worker = pool.workers.iter().find(|w| w.id == pick.decision.worker).ok_or_else(|| {
            ApiError::NoHealthyWorker(format!(" for model `{}`: the chosen worker left", pool.model))
        })?;
        if let Some(now_ms) = live {
            super::choose::record_sent(state, pool, worker, &mut pick, path, now_ms);
        }
        let hashes = pick.index.and_then(|consulted| consulted.hashes);
        Ok(Pick { worker: worker.clone(), decision: pick.decision, pool: pool.clone(), hashes })
    }

    /// What the model's exact index predicts cached on the chosen worker, for a request keyed by
    /// token ids on a pool whose engines publish KV events (the closed loop, `accuracy.rs`).
    pub(super) fn probe(&self, request: &RouteRequest<'_>, namespace: Namespace<'_>) -> Option<Probe> {
        let RoutingKey::Tokens(tokens) = request.key else { return None };
        if !self.pool.has_kv_events {
            return None;
        }
        // The prediction comes from the exact index whichever index decided: it is the worker's
        // engine's own view while its events flow (a quarantine routes on the tree, its events
        // still flowing: the window goes on judging the index, and a wrong template is named as
        // such, not as events that do not flow).
        let exact = self.worker.kv_events_flowing();
        let index = &self.pool.prefix.exact;
        let probe =
            Probe::predict(index, tokens, namespace, self.hashes.as_ref(), self.decision.worker, exact);
        let model_window = Some(self.pool.prefix.accuracy.clone());
        // Routed on the start of a longer prompt: its estimated length is past the tokens.
        let cut = request.prompt_tokens > tokens.len() as u64;
        Some(Probe { model_window, removed_at: self.worker.kv_removed_blocks(), cut, ..probe })
    }

    /// What kv_aware predicted for the request on the chosen worker, for its policy to learn
    /// from the answer's time to first token (`accuracy::Learn`), timed from the decision,
    /// `decided_s` seconds after the request arrived.
    pub(super) fn learn(&self, request: &RouteRequest<'_>, decided_s: f64) -> Option<Learn> {
        let predicted = self.decision.predicted?;
        Some(Learn {
            policy: self.pool.policy.clone(),
            worker: self.decision.worker,
            predicted,
            prompt_tokens: u32::try_from(request.prompt_tokens).unwrap_or(u32::MAX),
            decided_s,
        })
    }

    /// A request routed on the exact index: its prompt's blocks count as held by the chosen
    /// worker until the request ends.
    pub(super) fn in_flight_prompt(
        &self,
        request: &RouteRequest<'_>,
        namespace: Namespace<'_>,
    ) -> Option<(Arc<ModelPrefix>, InFlightPrompt)> {
        match (self.decision.index, request.key) {
            (Some(IndexKind::Exact), RoutingKey::Tokens(tokens)) => {
                let in_flight = &self.pool.prefix.in_flight;
                let prompt = match &self.hashes {
                    Some(hashes) => in_flight.add_hashed(self.decision.worker, hashes),
                    None => in_flight.add(self.decision.worker, tokens, namespace),
                };
                Some((self.pool.prefix.clone(), prompt))
            }
            _ => None,
        }
    }
}

/// Where one attempt goes.
// One plan per attempt, moved once (as kvgate-route's): boxing the pair's picks would add an
// allocation to every disaggregated request to save a copy of a few hundred bytes.
#[allow(clippy::large_enum_variant)]
pub(super) enum RoutePlan {
    Single(Pick),
    /// A disaggregated pair, and the rule's verdict (`why=always` without --pd-conditional).
    Pair {
        prefill: Pick,
        decode: Pick,
        pd: PdChoice,
    },
    /// The decode engine prefills the request itself: the plain request, no PD fields.
    InPlace {
        decode: Pick,
        pd: PdChoice,
    },
}

#[cfg(test)]
mod large_pool_tests;
#[cfg(test)]
mod tests;
