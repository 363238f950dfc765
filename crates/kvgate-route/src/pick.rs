//! One pool's decision for one attempt, in its four steps: the candidates (routable, not tried),
//! less those the overload protection leaves out, the prefix index the decision matches on
//! (`kvgate_index::choose_index`), and the pool's policy decision on them. A worker the request
//! names, where it serves, is taken as it is (no decision). A large pool's candidates are a
//! shortlist: found on the load order its host keeps, else by one pass over its offer.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use kvgate_index::{choose_index, IndexInputs, IndexKind, PrefixIndex, PrefixMatch};
use kvgate_policy::{
    admit_under_overload, Admitted, Candidate, Candidates, Decision, FavouredAsk, Reason, RouteRequest,
    RoutingKey, SelectContext, WorkerId,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::ordered::shortlist_ordered;
use crate::shortlist::{shortlist, Level, Search, HOLDERS, LISTED, SHORTLIST_ABOVE};
use crate::{NoPlan, Pick, PlanContext, Planning, Pool, Side};

/// The worker `pool`'s policy chooses for `request` among the routable workers not in `tried`
/// (or `target`, when the request names one of the pool's workers), recording nothing.
pub fn pick<'p, 'r, P: Pool>(
    pool: &'p P,
    side: Side,
    request: &RouteRequest<'r>,
    tried: &[WorkerId],
    target: Option<WorkerId>,
    ctx: &mut PlanContext<'_>,
) -> Result<Pick<'r, P::Index<'p>>, NoPlan> {
    let (now_ms, load_poll_interval_ms) = (ctx.now_ms, ctx.load_poll_interval_ms);
    if let Some((worker, routable)) = target.and_then(|id| pool.member(id).map(|routable| (id, routable))) {
        if tried.contains(&worker) || !routable {
            return Err(NoPlan::TargetUnavailable { worker });
        }
        return Ok(Pick {
            decision: Decision::plain(worker, Reason::TargetWorker),
            request: *request,
            candidates: Vec::new(),
            left_out: 0,
            pool_size: 0,
            index: None,
            now_ms,
            load_poll_interval_ms,
        });
    }
    let (candidates, left_out, pool_size, kind) = match ordered(pool, request, tried, ctx) {
        Some(found) => found,
        None => offered(pool, side, request, tried, ctx)?,
    };
    let index = pool.prefix_index(kind, ctx.planning, request);
    let decision = {
        let candidates =
            Candidates::shortlisted(&candidates, pool_size).map_err(|_| NoPlan::NoWorker { side })?;
        let mut select =
            SelectContext { now_ms, load_poll_interval_ms, rng: &mut *ctx.rng, prefix_index: Some(&index) };
        pool.policy().decide(request, candidates, &mut select).map_err(|_| NoPlan::NoWorker { side })?
    };
    Ok(Pick {
        decision,
        request: *request,
        candidates,
        left_out,
        pool_size,
        index: Some(index),
        now_ms,
        load_poll_interval_ms,
    })
}

/// The candidates a large pool whose host keeps a load order offers (a shortlist found on the
/// order: [`crate::ordered`]), with those left out (none), the routable workers they were found
/// among and the index to match on; `None` when the plan takes the offer instead: a small pool,
/// no order kept, a policy that does not shortlist, or the overload protection on (it looks at
/// every candidate to know whether all are overloaded).
fn ordered<P: Pool>(
    pool: &P,
    request: &RouteRequest<'_>,
    tried: &[WorkerId],
    ctx: &mut PlanContext<'_>,
) -> Option<(Vec<Candidate>, usize, usize, IndexKind)> {
    if ctx.overload.enabled() || !pool.policy().shortlists() {
        return None;
    }
    let (now_ms, load_poll_interval_ms) = (ctx.now_ms, ctx.load_poll_interval_ms);
    let mut found = None;
    let kept = pool.with_order(&mut |kept| {
        let mut tried_routable: Vec<WorkerId> =
            tried.iter().copied().filter(|&id| pool.member(id) == Some(true)).collect();
        tried_routable.sort_unstable();
        tried_routable.dedup();
        let tried_routable = tried_routable.len();
        let pool_size = kept.routable.saturating_sub(tried_routable);
        if pool_size <= SHORTLIST_ABOVE {
            return;
        }
        let kind = index_kind(pool, request, kept.events_flowing);
        let mut search = search_of(pool, kind, request, now_ms, load_poll_interval_ms);
        search.favoured = favoured(pool, request, &search);
        let candidates = shortlist_ordered(kept.order, kept.lookup, tried, &search, &mut *ctx.rng);
        found = Some((candidates, 0, pool_size, kind));
    });
    found.filter(|_| kept)
}

/// The candidates of the pool's offer, less those the overload protection leaves out (a large
/// pool's shortlist of them for a policy that shortlists), with how many it left out, the
/// routable workers they were chosen among and the index to match on.
fn offered<P: Pool>(
    pool: &P,
    side: Side,
    request: &RouteRequest<'_>,
    tried: &[WorkerId],
    ctx: &mut PlanContext<'_>,
) -> Result<(Vec<Candidate>, usize, usize, IndexKind), NoPlan> {
    let (now_ms, load_poll_interval_ms) = (ctx.now_ms, ctx.load_poll_interval_ms);
    let offer = pool.offer(tried);
    let offered = offer.candidates.len();
    let candidates =
        match admit_under_overload(&offer.candidates, &ctx.overload, now_ms, load_poll_interval_ms) {
            Admitted::All => offer.candidates,
            Admitted::Only(kept) => kept,
            Admitted::Shed => return Err(NoPlan::Shed { side }),
        };
    let left_out = offered - candidates.len();
    let kind = index_kind(pool, request, offer.events_flowing);
    // A large pool is shortlisted for a policy whose decision keeps on the candidates that can
    // matter: the prompt's best holders (one read-only match first), the least loaded, the
    // coldest, the busiest, a few at random.
    let pool_size = candidates.len();
    let candidates = if pool_size > SHORTLIST_ABOVE && pool.policy().shortlists() {
        let mut search = search_of(pool, kind, request, now_ms, load_poll_interval_ms);
        search.favoured = favoured(pool, request, &search);
        shortlist(candidates, &search, &mut *ctx.rng)
    } else {
        candidates
    };
    Ok((candidates, left_out, pool_size, kind))
}

/// The index a decision on `pool` matches `request` on.
fn index_kind<P: Pool>(pool: &P, request: &RouteRequest<'_>, events_flowing: bool) -> IndexKind {
    let mode = pool.index_mode();
    choose_index(&IndexInputs {
        mode: mode.mode,
        has_kv_events: mode.has_kv_events,
        key_is_tokens: matches!(request.key, RoutingKey::Tokens(_)),
        events_flowing,
    })
}

/// The workers the pool's policy names for the shortlist, sorted by id: its cheapest, and its
/// cheapest among the prompt's holders that are not its best few (a holder of the prompt's
/// opening alone, say, beyond the holders of more: its cost is a non-holder's less what it holds),
/// asked level by level of their credit, most credited first, each level with what it does not
/// hold (so that the policy's search for a level held by most of the pool is bound by that
/// level's own uncached tokens, and a level that cannot come near a more credited one is left
/// at once).
fn favoured<P: Pool>(pool: &P, request: &RouteRequest<'_>, search: &Search) -> Vec<WorkerId> {
    let policy = pool.policy();
    let (now_ms, prompt) = (search.now_ms, request.prompt_tokens as f64);
    let every = |_: WorkerId| Some(prompt);
    let mut favoured =
        policy.favoured(now_ms, &[FavouredAsk { least_uncached: prompt, uncached: &every, listed: None }]);
    let credited = &search.credited;
    if credited.len() > HOLDERS {
        // Holders credited no more than the one after the best `HOLDERS` (kept by the search),
        // each with what it does not hold.
        let below = search.credit_after(HOLDERS);
        let per_token = prompt / search.query_len.max(1) as f64;
        let uncached_at = |credit: usize| (prompt - per_token * credit as f64).max(0.0);
        let credit_of = |id: WorkerId| search.credit_of(id);
        match &search.levels {
            Some(levels) => {
                let levels: Vec<&Level> = levels.iter().filter(|level| level.credit <= below).collect();
                let uncached: Vec<Box<dyn Fn(WorkerId) -> Option<f64> + '_>> = levels
                    .iter()
                    .map(|level| {
                        let (credit, tokens) = (level.credit, uncached_at(level.credit));
                        Box::new(move |id| match level.count <= LISTED {
                            true => Some(tokens),
                            false => (credit_of(id) == Some(credit)).then_some(tokens),
                        }) as Box<dyn Fn(WorkerId) -> Option<f64>>
                    })
                    .collect();
                let asks: Vec<FavouredAsk<'_>> = levels
                    .iter()
                    .zip(&uncached)
                    .map(|(level, uncached)| FavouredAsk {
                        least_uncached: uncached_at(level.credit),
                        uncached: &**uncached,
                        listed: (level.count <= LISTED).then_some(&level.listed[..]),
                    })
                    .collect();
                favoured.extend(policy.favoured(now_ms, &asks));
            }
            None => {
                let uncached =
                    |id: WorkerId| credit_of(id).filter(|&credit| credit <= below).map(uncached_at);
                let ask =
                    FavouredAsk { least_uncached: uncached_at(below), uncached: &uncached, listed: None };
                favoured.extend(policy.favoured(now_ms, &[ask]));
            }
        }
    }
    favoured.sort_unstable();
    favoured.dedup();
    favoured
}

/// The search of a large pool for `request`: the prompt's holders on the decision's index,
/// from a read-only match (none without a prompt), read where the index hands the match over
/// (a copy of a match held by every worker of a 10,000-worker pool cost more than the search).
fn search_of<P: Pool>(
    pool: &P,
    kind: IndexKind,
    request: &RouteRequest<'_>,
    now_ms: u64,
    load_poll_interval_ms: u64,
) -> Search {
    let mut search = None;
    if let Some(key) = request.key.prompt() {
        pool.prefix_index(kind, Planning::DryRun, request).route(key, now_ms, &mut |prefix| {
            search = Some(Search::new(Some(prefix), now_ms, load_poll_interval_ms));
            None
        });
    }
    search.unwrap_or_else(|| {
        let matched = request.key.prompt().map(|_| PrefixMatch::default());
        Search::new(matched.as_ref(), now_ms, load_poll_interval_ms)
    })
}

/// `pick` as a dry run, whatever the plan is (a path the plan weighs but may not take): its
/// decision only. Its random draws (a large pool's shortlist, a policy's ties) come from an RNG
/// of its own, so the plan's RNG is where it was for the live decisions that follow.
pub(crate) fn preview<P: Pool>(
    pool: &P,
    side: Side,
    request: &RouteRequest<'_>,
    tried: &[WorkerId],
    ctx: &PlanContext<'_>,
) -> Option<Decision> {
    let mut rng = dry_run_rng(ctx.now_ms, side, request, tried);
    let mut dry = PlanContext {
        now_ms: ctx.now_ms,
        load_poll_interval_ms: ctx.load_poll_interval_ms,
        overload: ctx.overload,
        planning: Planning::DryRun,
        rng: &mut rng,
    };
    pick(pool, side, request, tried, None, &mut dry).ok().map(|pick| pick.decision)
}

/// A dry run's RNG, seeded from what it decides on (the clock, the side, the request's length and
/// session, the workers tried) rather than drawn from the live RNG, which a draw would advance.
fn dry_run_rng(now_ms: u64, side: Side, request: &RouteRequest<'_>, tried: &[WorkerId]) -> SmallRng {
    let mut hasher = DefaultHasher::new();
    (now_ms, side.as_str(), request.prompt_tokens, request.session, tried).hash(&mut hasher);
    SmallRng::seed_from_u64(hasher.finish())
}
