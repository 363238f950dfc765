//! The plan of one attempt on the request's pools: one pick on a regular pool, or a
//! disaggregated fleet's sides in their order. Always a pair without a rule (the prefill side
//! first); with `PdRule`, kv_aware's prediction across the pair when both sides predict (the
//! three decisions weighed, then the path's picks), else the decode engine first and the rule on
//! what it holds and the prefill side's queue.

use kvgate_policy::{
    cached_tokens, Decision, PdChoice, PdInputs, PdPath, PdRule, RouteRequest, RoutingKey, WorkerId,
};

use crate::pick::{pick, preview};
use crate::{NoPlan, PlanContext, Pool, Pools, RoutePlan, Side};

impl<'p, P: Pool> Pools<'p, P> {
    /// A route plan for `request` avoiding `tried` (and going to `target` where it serves), or
    /// why none exists. Nothing is recorded: a live plan is recorded when it is sent
    /// ([`RoutePlan::on_routed`]).
    pub fn plan<'r>(
        &self,
        request: &RouteRequest<'r>,
        tried: &[WorkerId],
        target: Option<WorkerId>,
        ctx: &mut PlanContext<'_>,
    ) -> Result<RoutePlan<'r, P::Index<'p>>, NoPlan> {
        let (prefill, decode, rule) = match *self {
            Pools::Single(pool) => {
                return Ok(RoutePlan::Single(pick(pool, Side::Regular, request, tried, target, ctx)?))
            }
            Pools::Pair { prefill, decode, rule } => (prefill, decode, rule),
        };
        let Some(rule) = rule else {
            // Always a pair: both sides chosen, the prefill side first.
            let prefill = pick(prefill, Side::Prefill, request, tried, target, ctx)?;
            let decode = pick(decode, Side::Decode, request, tried, target, ctx)?;
            let pd = PdRule::always(pd_inputs(request, &decode.decision, None));
            return Ok(RoutePlan::Pair { prefill, decode, pd });
        };
        // KV-aware: both sides predict (kv_aware), so the rule compares the paths' predicted
        // times to first token; the pair's decode engine is the one its side chooses for a
        // request bringing its KV (no prompt to prefill there).
        if let Some(inputs) =
            target.is_none().then(|| self.predict_paths(&rule, request, tried, ctx)).flatten()
        {
            let pd = rule.decide(inputs);
            if pd.path == PdPath::InPlace {
                let decode = pick(decode, Side::Decode, request, tried, None, ctx)?;
                return Ok(RoutePlan::InPlace { decode, pd });
            }
            let prefill = pick(prefill, Side::Prefill, request, tried, None, ctx)?;
            let decode = pick(decode, Side::Decode, &bringing_kv(request), tried, None, ctx)?;
            return Ok(RoutePlan::Pair { prefill, decode, pd });
        }
        // Conditional: the decode engine first, by the decode side's policy on its own prefix
        // index; then the rule, on what that engine holds and the prefill side's queue. A
        // request naming its worker goes where that worker serves.
        let decode = pick(decode, Side::Decode, request, tried, target, ctx)?;
        let inputs = pd_inputs(request, &decode.decision, least_in_flight(prefill, tried));
        let targets_prefill = target.is_some_and(|id| prefill.member(id).is_some());
        let pd = if targets_prefill { PdRule::always(inputs) } else { rule.decide(inputs) };
        match pd.path {
            PdPath::InPlace => Ok(RoutePlan::InPlace { decode, pd }),
            PdPath::Pair => {
                let prefill = pick(prefill, Side::Prefill, request, tried, target, ctx)?;
                Ok(RoutePlan::Pair { prefill, decode, pd })
            }
        }
    }

    /// The attempt after a pair whose KV transfer failed: in place on the decode engine the
    /// decode side's policy picks for the whole request, with the pair's inputs and
    /// `why=transfer_failed`; `None` when no decode engine is left (or the fleet is regular).
    pub fn plan_in_place<'r>(
        &self,
        request: &RouteRequest<'r>,
        tried: &[WorkerId],
        pair: &PdChoice,
        ctx: &mut PlanContext<'_>,
    ) -> Option<RoutePlan<'r, P::Index<'p>>> {
        let Pools::Pair { decode, .. } = *self else { return None };
        let decode = pick(decode, Side::Decode, request, tried, None, ctx).ok()?;
        Some(RoutePlan::InPlace { decode, pd: pair.transfer_failed() })
    }

    /// Whether every pool a plan needs still has a routable worker not in `tried` (in place
    /// needs the decode side only).
    pub fn untried_left(&self, tried: &[WorkerId]) -> bool {
        let left = |pool: &P| !pool.offer(tried).candidates.is_empty();
        match *self {
            Pools::Single(pool) => left(pool),
            Pools::Pair { decode, rule: Some(_), .. } => left(decode),
            Pools::Pair { prefill, decode, rule: None } => left(prefill) && left(decode),
        }
    }

    /// The conditional rule's inputs with both paths predicted, when both sides' policies
    /// predict (kv_aware): the decode side's decision for the request in place and for a request
    /// bringing its KV, and the prefill side's, all dry runs (nothing recorded, read-only
    /// indexes).
    fn predict_paths(
        &self,
        rule: &PdRule,
        request: &RouteRequest<'_>,
        tried: &[WorkerId],
        ctx: &PlanContext<'_>,
    ) -> Option<PdInputs> {
        let Pools::Pair { prefill, decode, .. } = *self else { return None };
        if !(prefill.policy().predicts() && decode.policy().predicts()) {
            return None;
        }
        let in_place = preview(decode, Side::Decode, request, tried, ctx)?;
        let on_prefill = preview(prefill, Side::Prefill, request, tried, ctx)?;
        let pair_decode = preview(decode, Side::Decode, &bringing_kv(request), tried, ctx)?;
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
            prefill_queue: least_in_flight(prefill, tried),
            predicted: Some(paths),
        })
    }
}

/// A pair's request as its decode side sees it: the KV comes from the prefill engine, so there
/// is no prompt to prefill (its session still keys session policies).
fn bringing_kv<'r>(request: &RouteRequest<'r>) -> RouteRequest<'r> {
    RouteRequest { key: RoutingKey::None, prompt_tokens: 0, session: request.session }
}

/// Requests in flight on the pool's least busy routable worker not tried yet (`None`: there is
/// none): the prefill side's queue of the conditional rule.
fn least_in_flight<P: Pool>(pool: &P, tried: &[WorkerId]) -> Option<u64> {
    pool.offer(tried).candidates.iter().map(|c| c.in_flight).min()
}

/// The conditional rule's inputs: the prompt's length, what the chosen decode engine holds of
/// it (by the decode side's decision), and the prefill side's queue.
fn pd_inputs(request: &RouteRequest<'_>, decode: &Decision, prefill_queue: Option<u64>) -> PdInputs {
    let prompt_tokens = request.prompt_tokens;
    PdInputs {
        prompt_tokens,
        cached_tokens: cached_tokens(decode, prompt_tokens),
        prefill_queue,
        predicted: None,
    }
}
