//! kvgate-route: the routing plan, one for every host. Which worker (or prefill/decode pair) one
//! attempt of a request goes to: the candidates a pool offers, the per-worker overload filter,
//! the prefix index the decision matches on, the pool's policy decision, and, for a
//! disaggregated fleet, the sequencing of the two sides and the prediction across the pair.
//!
//! The gateway and the simulator each implement [`Pool`] for their pools (workers, loads and
//! indexes as they keep them) and call the same [`Pools::plan`]: what is benchmarked is what
//! ships. The crate is a pure core like kvgate-policy: no I/O, no clock, no threads; time and
//! the RNG come in [`PlanContext`].
//!
//! Deciding is not recording. A plan only decides ([`kvgate_policy::Policy::decide`]); the host
//! calls [`RoutePlan::on_routed`] for a live plan it sends, and only then do the policies record
//! it. A dry run ([`Planning::DryRun`]: `POST /v1/route`, the admission queue's locality score,
//! a path's prediction) matches on read-only indexes and records nothing anywhere.

mod fixed;
mod order;
mod ordered;
mod pick;
mod plan;
mod shortlist;

#[cfg(test)]
mod tests;

use kvgate_index::{IndexKind, PrefixIndexMode};
use kvgate_policy::{
    Candidate, Decision, OverloadSettings, PdChoice, PdRule, Policy, RouteRequest, WorkerId,
};
use rand::RngCore;

pub use fixed::{FixedPool, TreeView};
pub use order::LoadOrder;
pub use ordered::STALE_KEPT;
pub use pick::pick;
pub use shortlist::SHORTLIST_ABOVE;

/// One pool of workers (one model's regular workers, or one side of a disaggregated fleet) as
/// its host keeps it: what the plan reads.
pub trait Pool {
    /// The prefix index one decision consults, which the host may keep with the plan (the
    /// gateway keeps the prompt's block hashes it computed).
    type Index<'a>: kvgate_index::PrefixIndex
    where
        Self: 'a;

    fn policy(&self) -> &dyn Policy;

    /// The routable workers not in `tried`, as candidates (requests in flight, last load
    /// sample), and whether every one's KV events flow.
    fn offer(&self, tried: &[WorkerId]) -> Offer;

    /// Whether `worker` is one of the pool's: `Some(routable now)`, `None` when it is not.
    fn member(&self, worker: WorkerId) -> Option<bool>;

    /// For a pool whose host keeps a [`LoadOrder`] of its workers (updated as their loads
    /// change): runs `search` on it and returns true. A large pool's candidate search then reads
    /// the order instead of an offer of every worker. `false` (the default): no order is kept,
    /// the plan takes the offer.
    fn with_order(&self, _search: &mut dyn FnMut(KeptOrder<'_>)) -> bool {
        false
    }

    /// The pool's `prefix_index` mode and whether some worker of it publishes KV events.
    fn index_mode(&self) -> IndexMode;

    /// The index a decision on `kind` matches `request` against: for a live plan one that may
    /// learn the choice (the tree, in the same descent), for a dry run one that only reads.
    fn prefix_index(
        &self,
        kind: IndexKind,
        planning: Planning,
        request: &RouteRequest<'_>,
    ) -> Self::Index<'_>;
}

/// What a pool offers one decision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Offer {
    pub candidates: Vec<Candidate>,
    /// Every candidate's KV events flow (the exact index is current for all of them).
    pub events_flowing: bool,
}

/// A pool's kept order, as its host hands it to the candidate search.
#[derive(Clone, Copy)]
pub struct KeptOrder<'a> {
    pub order: &'a LoadOrder,
    /// A worker as a candidate if it is routable now (its requests in flight and load sample as
    /// the decision is to see them), else `None`.
    pub lookup: &'a dyn Fn(WorkerId) -> Option<Candidate>,
    /// The pool's routable workers, tried or not.
    pub routable: usize,
    /// Every routable worker's KV events flow (the exact index is current for all of them).
    pub events_flowing: bool,
}

/// What the choice of index depends on in a pool, besides the request and the candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexMode {
    pub mode: PrefixIndexMode,
    pub has_kv_events: bool,
}

/// Whether a plan is for real or a dry run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Planning {
    /// The plan will be sent: its decisions match on indexes that learn them, and the host
    /// records them ([`RoutePlan::on_routed`], metrics, peers) when it sends it.
    Live,
    /// Nothing is recorded anywhere: read-only indexes, no `on_routed`.
    DryRun,
}

/// The inputs of a plan that are not about the request or the pools.
pub struct PlanContext<'r> {
    /// The host's millisecond clock (wall time in the gateway, virtual time in the simulator).
    pub now_ms: u64,
    /// How often loads are polled; samples older than three intervals are stale.
    pub load_poll_interval_ms: u64,
    /// Per-worker overload protection, applied to every decision's candidates.
    pub overload: OverloadSettings,
    pub planning: Planning,
    /// Every random draw of the plan's decisions.
    pub rng: &'r mut dyn RngCore,
}

/// Which side of a fleet a pool is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Regular,
    Prefill,
    Decode,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Regular => "regular",
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
}

/// Why no plan was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoPlan {
    /// No routable worker is left on a side (or its policy found none).
    #[error("no routable worker is left on the {} side", side.as_str())]
    NoWorker { side: Side },
    /// Every worker of a side is over the overload bounds, and the protection sheds.
    #[error("every worker of the {} side is overloaded", side.as_str())]
    Shed { side: Side },
    /// The worker the request names is tried already, or not routable.
    #[error("the target worker {worker} is not available")]
    TargetUnavailable { worker: WorkerId },
}

/// The pools a request is planned on.
pub enum Pools<'p, P> {
    Single(&'p P),
    /// A disaggregated fleet, and its conditional rule (`None`: always a pair).
    Pair {
        prefill: &'p P,
        decode: &'p P,
        rule: Option<PdRule>,
    },
}

/// One worker chosen on one pool.
#[derive(Debug)]
pub struct Pick<'r, I> {
    pub decision: Decision,
    /// What the decision was made for: the request, or for a pair's decode side a request
    /// bringing its KV (no prompt to prefill there).
    pub request: RouteRequest<'r>,
    /// The candidates the policy decided among (after the overload filter; empty for a worker
    /// the request named).
    pub candidates: Vec<Candidate>,
    /// Candidates the overload protection left out of the decision.
    pub left_out: usize,
    /// The routable workers the candidates were chosen from: more than `candidates` when a large
    /// pool was shortlisted ([`SHORTLIST_ABOVE`]).
    pub pool_size: usize,
    /// The index the decision consulted (`None`: the worker the request named, no decision).
    pub index: Option<I>,
    pub now_ms: u64,
    pub load_poll_interval_ms: u64,
}

/// Where one attempt goes.
#[derive(Debug)]
// One plan per attempt, moved once from the plan to the attempt: boxing the pair's picks would
// add an allocation to every disaggregated request to save a copy of a few hundred bytes.
#[allow(clippy::large_enum_variant)]
pub enum RoutePlan<'r, I> {
    Single(Pick<'r, I>),
    /// A disaggregated pair, and the rule's verdict (`why=always` without a rule).
    Pair {
        prefill: Pick<'r, I>,
        decode: Pick<'r, I>,
        pd: PdChoice,
    },
    /// The decode engine prefills the request itself.
    InPlace {
        decode: Pick<'r, I>,
        pd: PdChoice,
    },
}

impl<I> RoutePlan<'_, I> {
    /// The picks of the plan with the side of each (prefill first).
    pub fn picks(&self) -> impl Iterator<Item = (Side, &Pick<'_, I>)> {
        let (first, second) = match self {
            RoutePlan::Single(pick) => ((Side::Regular, pick), None),
            RoutePlan::Pair { prefill, decode, .. } => {
                ((Side::Prefill, prefill), Some((Side::Decode, decode)))
            }
            RoutePlan::InPlace { decode, .. } => ((Side::Decode, decode), None),
        };
        std::iter::once(first).chain(second)
    }

    /// The verdict of a disaggregated plan.
    pub fn pd(&self) -> Option<&PdChoice> {
        match self {
            RoutePlan::Single(_) => None,
            RoutePlan::Pair { pd, .. } | RoutePlan::InPlace { pd, .. } => Some(pd),
        }
    }

    /// The prompt tokens its policy predicts cached where the prompt is computed: the chosen
    /// worker's, a pair's prefill side's, or the decode worker prefilling in place.
    pub fn predicted_cached_tokens(&self, prompt_tokens: u64) -> u64 {
        let pick = match self {
            RoutePlan::Single(pick) | RoutePlan::Pair { prefill: pick, .. } => pick,
            RoutePlan::InPlace { decode, .. } => decode,
        };
        kvgate_policy::cached_tokens(&pick.decision, prompt_tokens)
    }

    /// The host sends this live plan: each side's policy records its decision
    /// ([`Policy::on_routed`]; a worker the request named was not the policy's decision).
    pub fn on_routed<P: Pool>(&self, pools: &Pools<'_, P>) {
        for (side, pick) in self.picks() {
            let pool = match (pools, side) {
                (Pools::Single(pool), _) => *pool,
                (Pools::Pair { prefill, .. }, Side::Prefill) => *prefill,
                (Pools::Pair { decode, .. }, _) => *decode,
            };
            pick.on_routed(pool.policy());
        }
    }
}

impl<I> Pick<'_, I> {
    /// The host sent the request where this pick says: `policy` records its decision.
    pub fn on_routed(&self, policy: &dyn Policy) {
        if self.index.is_none() {
            return;
        }
        let Ok(candidates) = kvgate_policy::Candidates::shortlisted(&self.candidates, self.pool_size) else {
            return;
        };
        policy.on_routed(&kvgate_policy::Routed {
            request: &self.request,
            candidates,
            decision: &self.decision,
            now_ms: self.now_ms,
            load_poll_interval_ms: self.load_poll_interval_ms,
        });
    }
}
