//! Planning a request: which pools serve it (one regular pool, or a prefill and a decode pool),
//! and, per attempt, the route plan: one worker, or a (prefill, decode) pair, each chosen by its
//! own pool's policy on its own candidates, loads and prefix index.

use std::sync::Arc;
use std::time::Instant;

use kvgate_index::{InFlightPrompt, Namespace, PromptHashes};
use kvgate_policy::{
    cached_tokens, Decision, IndexKind, PdChoice, PdInputs, PdPath, PdRule, RouteRequest, RoutingKey,
};

use crate::accuracy::Probe;
use crate::endpoint::Endpoint;
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
            // The conditional rule weighs the prompt's length, so it needs the prompt.
            Shape::Pair { prefill, decode } => {
                prefill.config.pd_conditional
                    || prefill.policy.needs_routing_key()
                    || decode.policy.needs_routing_key()
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
            // In place needs the decode side only.
            Shape::Pair { prefill, decode } if prefill.config.pd_conditional => left(decode),
            Shape::Pair { prefill, decode } => left(prefill) && left(decode),
        }
    }

    /// The worker an `x-kvgate-target-worker` header names, if it serves this request's model
    /// (on either side of a pair).
    pub(super) fn target(&self, value: &http::HeaderValue) -> Result<u32, ApiError> {
        // `URL` or, for one data-parallel rank (`--dp-aware`), `URL@RANK`.
        let named = value.to_str().ok().and_then(|name| match name.rsplit_once('@') {
            Some((url, rank)) if rank.parse::<u32>().is_ok() => {
                crate::worker_url::normalize_url(url).ok().map(|url| format!("{url}@{rank}"))
            }
            _ => crate::worker_url::normalize_url(name).ok(),
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

    /// A route plan avoiding `tried` (and going to `target` where it serves), or why none exists.
    pub(super) fn plan(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
        namespace: Namespace<'_>,
        tried: &[u32],
        target: Option<u32>,
    ) -> Result<RoutePlan, ApiError> {
        self.plan_as(state, request, namespace, tried, target, Planning::Live)
    }

    /// The plan a first attempt would follow, made without recording anything: no prefix index
    /// learns the choice, no metric counts it, no peer hears of it (`POST /v1/route`).
    pub(super) fn dry_run(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
        namespace: Namespace<'_>,
    ) -> Result<RoutePlan, ApiError> {
        self.plan_as(state, request, namespace, &[], None, Planning::DryRun)
    }

    fn plan_as(
        &self,
        state: &AppState,
        request: &RouteRequest<'_>,
        namespace: Namespace<'_>,
        tried: &[u32],
        target: Option<u32>,
        planning: Planning,
    ) -> Result<RoutePlan, ApiError> {
        let on = |pool| pick(state, pool, request, namespace, tried, target, planning);
        let (prefill, decode) = match self {
            Shape::Single(pool) => return Ok(RoutePlan::Single(on(pool)?)),
            Shape::Pair { prefill, decode } => (prefill, decode),
        };
        let count = |pick: &Pick, path: PdPath| {
            if planning == Planning::Live {
                count_decision(state, pick, path);
            }
        };
        let Some(rule) = prefill.config.pd_rule() else {
            // Always a pair: both sides chosen, the prefill side first.
            let (prefill, decode) = (on(prefill)?, on(decode)?);
            count(&prefill, PdPath::Pair);
            count(&decode, PdPath::Pair);
            let inputs = pd_inputs(request, &decode, None);
            return Ok(RoutePlan::Pair { prefill, decode, pd: PdRule::always(inputs) });
        };
        // KV-aware: both sides predict (kv_aware), so the rule compares the paths' predicted
        // times to first token; the pair's decode engine is the one its side chooses for a
        // request bringing its KV (no prompt to prefill there).
        if let Some(inputs) =
            target.is_none().then(|| predict_paths(state, &rule, self, request, namespace, tried)).flatten()
        {
            let choice = rule.decide(inputs);
            if choice.path == PdPath::InPlace {
                let decode = on(decode)?;
                count(&decode, PdPath::InPlace);
                return Ok(RoutePlan::InPlace { decode, pd: choice });
            }
            let prefill = on(prefill)?;
            let bringing_kv =
                RouteRequest { key: RoutingKey::None, prompt_tokens: 0, session: request.session };
            let decode = pick(state, decode, &bringing_kv, namespace, tried, None, planning)?;
            count(&prefill, PdPath::Pair);
            count(&decode, PdPath::Pair);
            return Ok(RoutePlan::Pair { prefill, decode, pd: choice });
        }
        // Conditional: the decode engine first, by the decode side's policy on its own prefix
        // index; then the rule, on what that engine holds and the prefill side's queue. A
        // request naming its worker goes where that worker serves.
        let decode = on(decode)?;
        let queue = super::choose::least_in_flight(state, prefill, tried);
        let inputs = pd_inputs(request, &decode, queue);
        let targets_prefill = target.is_some_and(|id| prefill.workers.iter().any(|w| w.id == id));
        let choice = if targets_prefill { PdRule::always(inputs) } else { rule.decide(inputs) };
        match choice.path {
            PdPath::InPlace => {
                count(&decode, PdPath::InPlace);
                Ok(RoutePlan::InPlace { decode, pd: choice })
            }
            PdPath::Pair => {
                let prefill = on(prefill)?;
                count(&prefill, PdPath::Pair);
                count(&decode, PdPath::Pair);
                Ok(RoutePlan::Pair { prefill, decode, pd: choice })
            }
        }
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
        let Shape::Pair { decode, .. } = self else { return None };
        let decode = pick(state, decode, request, namespace, tried, None, Planning::Live).ok()?;
        count_decision(state, &decode, PdPath::InPlace);
        Some(RoutePlan::InPlace { decode, pd: pair.transfer_failed() })
    }
}

/// Counts a live choice in `kvgate_pd_decisions_total` (and the regular decision metrics).
fn count_decision(state: &AppState, pick: &Pick, path: PdPath) {
    state.metrics.count_decision(&pick.pool.model, pick.pool.role, &pick.pool.series, &pick.decision, path);
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

/// The conditional rule's inputs with both paths predicted, when both sides' policies predict
/// (kv_aware): the decode side's preview for the request in place and for a request bringing its
/// KV, and the prefill side's (nothing recorded; the simulator takes the same three).
fn predict_paths(
    state: &AppState,
    rule: &PdRule,
    shape: &Shape,
    request: &RouteRequest<'_>,
    namespace: Namespace<'_>,
    tried: &[u32],
) -> Option<PdInputs> {
    let Shape::Pair { prefill, decode } = shape else { return None };
    let preview = |pool: &ModelPool, request: &RouteRequest<'_>| {
        super::choose::preview(state, pool, request, namespace, tried)
    };
    let in_place = preview(decode, request)?;
    let on_prefill = preview(prefill, request)?;
    let bringing_kv = RouteRequest { key: RoutingKey::None, prompt_tokens: 0, session: request.session };
    let pair_decode = preview(decode, &bringing_kv)?;
    let prompt_tokens = request.prompt_tokens;
    let paths = rule.predict_paths(
        prompt_tokens,
        &in_place.predicted?,
        &on_prefill.predicted?,
        &pair_decode.predicted?,
    );
    Some(PdInputs {
        prompt_tokens,
        cached_tokens: cached_tokens(&in_place, prompt_tokens),
        prefill_queue: super::choose::least_in_flight(state, prefill, tried),
        predicted: Some(paths),
    })
}

/// The conditional rule's inputs: the prompt's length, what the chosen decode engine holds of
/// it (by the decode side's decision), and the prefill side's queue.
fn pd_inputs(request: &RouteRequest<'_>, decode: &Pick, prefill_queue: Option<u64>) -> PdInputs {
    let prompt_tokens = request.prompt_tokens;
    let cached_tokens = cached_tokens(&decode.decision, prompt_tokens);
    PdInputs { prompt_tokens, cached_tokens, prefill_queue, predicted: None }
}

/// Whether a plan is for real or a dry run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Planning {
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
    /// The prompt's block hashes, when the decision matched on the exact index.
    pub hashes: Option<PromptHashes>,
}

impl Pick {
    /// What the model's exact index predicts cached on the chosen worker, for a request keyed by
    /// token ids on a pool whose engines publish KV events (the closed loop, `accuracy.rs`).
    pub(super) fn probe(&self, request: &RouteRequest<'_>, namespace: Namespace<'_>) -> Option<Probe> {
        let RoutingKey::Tokens(tokens) = request.key else { return None };
        if !self.pool.has_kv_events {
            return None;
        }
        let exact = self.decision.index == Some(IndexKind::Exact);
        let index = &self.pool.prefix.exact;
        let probe =
            Probe::predict(index, tokens, namespace, self.hashes.as_ref(), self.decision.worker, exact);
        let model_window = Some(self.pool.prefix.accuracy.clone());
        Some(Probe { model_window, removed_at: self.worker.kv_removed_blocks(), ..probe })
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

#[allow(clippy::too_many_arguments, reason = "the plan's inputs, each used once")]
fn pick(
    state: &AppState,
    pool: &Arc<ModelPool>,
    request: &RouteRequest<'_>,
    namespace: Namespace<'_>,
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
        if planning == Planning::Live && pool.role == crate::role::WorkerRole::Regular {
            state.metrics.count_decision(&pool.model, pool.role, &pool.series, &decision, PdPath::Pair);
        }
        return Ok(Pick { worker: worker.clone(), decision, pool: pool.clone(), hashes: None });
    }
    super::choose::choose(state, pool, request, namespace, tried, planning)
        .map(|(worker, decision, hashes)| Pick { worker, decision, pool: pool.clone(), hashes })
        .map_err(|no_choice| {
            let side = match pool.role {
                crate::role::WorkerRole::Regular => String::new(),
                role => format!(" on the {} side", role.as_str()),
            };
            let where_ = format!(" for model `{}`{side}", pool.model);
            match no_choice {
                super::choose::NoChoice::NoWorker => ApiError::NoHealthyWorker(where_),
                super::choose::NoChoice::Shed => ApiError::Overloaded {
                    where_,
                    retry_after_secs: state.loads.poll_interval_ms.div_ceil(1000).max(1),
                },
            }
        })
}
