//! kvgate-policy: routing policies as pure functions of candidates, loads, time and an RNG.
//!
//! The gateway and the virtual-time simulator call the same [`Policy::decide`]: it never performs
//! I/O, never reads a clock and never spawns a thread. Everything it needs is in its arguments.
//! Deciding is not recording: `decide` changes nothing in the policy's state, however often it is
//! asked (a dry run, a locality score, a path's prediction); the host calls
//! [`Policy::on_routed`] for the requests it actually sends, and only then does the policy
//! remember anything (work routed, sessions bound, the next turn).

mod bucket;
mod cache_aware;
mod config;
mod consistent_hashing;
mod fair;
mod hashing;
mod inflight;
mod kv_aware;
mod kv_wait;
mod least_load;
mod manual;
mod overload;
mod pd;
mod pick;
mod power_of_two;
mod prefix_hash;
mod random;
mod round_robin;
mod slots;
pub mod tenants;

pub use bucket::BucketPolicy;
pub use cache_aware::{CacheAwarePolicy, Imbalance, Thresholds};
pub use config::{
    build_policy, MissStrategy, PolicyConfig, PolicyConfigBuilder, PolicyKind, PrefixIndexMode,
};
pub use consistent_hashing::ConsistentHashingPolicy;
pub use fair::{FairQueue, PriorityClass, LOCALITY_WINDOW};
pub use inflight::fresh_load;
pub use kv_aware::{KvAwarePolicy, PredictedTtft};
pub use kvgate_config::{FieldError, ValidationErrors};
pub use kvgate_index::{IndexKind, PrefixIndex, PromptKey};
/// The last load a worker's engine reported, as the load monitor publishes it: the wire's own
/// type, so a report goes from the engine to a policy without a copy of its fields.
pub use kvgate_protocol::LoadSample;
pub use least_load::{LeastLoadPolicy, LeastLoadSettings};
pub use manual::{AssignmentMode, ManualPolicy};
pub use overload::{admit as admit_under_overload, Admitted, OverloadSettings};
pub use pd::{cached_tokens, PathTtfts, PdChoice, PdInputs, PdPath, PdRule, PdWhy};
pub use power_of_two::PowerOfTwoPolicy;
pub use prefix_hash::PrefixHashPolicy;
pub use random::RandomPolicy;
pub use round_robin::RoundRobinPolicy;
pub use slots::ClassSlots;
pub use tenants::{ClassSettings, TenantLimits, TenantsConfig};

use rand::RngCore;

/// A worker as the host knows it. Ids are assigned by the host and never reused while it runs.
pub type WorkerId = u32;

/// A map keyed by worker, on a fast fixed hash (foldhash): a kv_aware decision on a 10,000-engine
/// pool looks workers up a few hundred times, and SipHash was 3-4 % of its CPU (issue 43).
pub type WorkerMap<V> = std::collections::HashMap<WorkerId, V, foldhash::fast::FixedState>;

/// One routable worker offered to a policy: healthy, circuit closed, serving the request's model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub id: WorkerId,
    /// Requests this gateway has in flight on the worker.
    pub in_flight: u64,
    /// The worker's entry in the load snapshot, if it has one.
    pub load: Option<LoadSample>,
}

/// The candidates of one decision: never empty. The host builds them once per decision
/// ([`Candidates::new`] refuses an empty list with [`NoRoute::NoCandidates`]), so no policy
/// checks for, or can be called with, an empty pool. Derefs to the slice.
///
/// In a large pool the host may offer a shortlist ([`Candidates::shortlisted`], for a policy
/// whose [`Policy::shortlists`] says the decision keeps): the candidates that can matter, out of
/// a pool of [`Candidates::pool_size`] workers, which a policy dividing something over the whole
/// pool (kv_aware's arrivals per engine) divides by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidates<'a> {
    list: &'a [Candidate],
    pool_size: usize,
}

impl<'a> Candidates<'a> {
    /// The candidates, or `NoCandidates` when there are none.
    pub fn new(candidates: &'a [Candidate]) -> Result<Self, NoRoute> {
        Self::shortlisted(candidates, candidates.len())
    }

    /// A shortlist of a pool of `pool_size` routable workers (at least as many as the list).
    pub fn shortlisted(candidates: &'a [Candidate], pool_size: usize) -> Result<Self, NoRoute> {
        if candidates.is_empty() {
            Err(NoRoute::NoCandidates)
        } else {
            Ok(Self { list: candidates, pool_size: pool_size.max(candidates.len()) })
        }
    }

    pub fn as_slice(self) -> &'a [Candidate] {
        self.list
    }

    /// The routable workers the candidates were chosen from (their number when all are offered).
    pub fn pool_size(self) -> usize {
        self.pool_size
    }
}

impl std::ops::Deref for Candidates<'_> {
    type Target = [Candidate];

    fn deref(&self) -> &[Candidate] {
        self.list
    }
}

/// What a policy may look at in a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutingKey<'a> {
    /// No prompt was extracted (the policy did not ask for one).
    None,
    /// The prompt text (chat conversations rendered in order with role markers).
    Text(&'a str),
    /// Token ids: given by the request (`input_ids`) or computed by the host's tokenizer.
    Tokens(&'a [u32]),
}

impl<'a> RoutingKey<'a> {
    /// The key as a prefix index takes it (`None` for no prompt or an empty one).
    pub fn prompt(self) -> Option<PromptKey<'a>> {
        match self {
            RoutingKey::Text(text) if !text.is_empty() => Some(PromptKey::Text(text)),
            RoutingKey::Tokens(ids) if !ids.is_empty() => Some(PromptKey::Tokens(ids)),
            _ => None,
        }
    }
}

/// A request as a policy sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteRequest<'a> {
    pub key: RoutingKey<'a>,
    /// Estimated prompt tokens (0 when unknown).
    pub prompt_tokens: u64,
    /// The request's session key: the routing-key header, else the body's `user` field (what
    /// `consistent_hashing` and `manual` route by).
    pub session: Option<&'a str>,
}

impl RouteRequest<'_> {
    pub const EMPTY: RouteRequest<'static> =
        RouteRequest { key: RoutingKey::None, prompt_tokens: 0, session: None };
}

/// The inputs that are not about the request: the time, a source of randomness, and the
/// model's prefix index (which worker holds how much of a prompt).
pub struct SelectContext<'r> {
    /// The host's millisecond clock (wall time in the gateway, virtual time in the simulator).
    pub now_ms: u64,
    /// How often the load snapshot is refreshed; samples older than three intervals are stale.
    pub load_poll_interval_ms: u64,
    pub rng: &'r mut dyn RngCore,
    /// The index prefix-aware policies match the request against: the approximate tree or the
    /// exact event-fed index, as the host decides (`None`: every prompt is a miss).
    pub prefix_index: Option<&'r dyn PrefixIndex>,
}

/// Why a worker was chosen. Every decision carries one; hosts count them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    RoundRobin,
    Random,
    CacheHit,
    CacheMiss,
    ImbalanceOverload,
    ImbalanceKvSpread,
    ImbalanceCount,
    PowerOfTwo,
    LeastLoad,
    KvAware,
    /// kv_aware: the request recomputes a prefix another engine holds, because waiting there
    /// costs more than the margin allows (`--kv-aware-wait-margin`): a hot prefix is replicated.
    KvAwareReplicate,
    /// prefix_hash: the ring owner of the prompt's prefix (or the next within the load bound).
    PrefixHash,
    /// consistent_hashing: the ring owner of the session key.
    ConsistentHash,
    /// manual: the worker the session is bound to.
    Sticky,
    /// manual: a new (or orphaned) session bound by the assignment mode.
    SessionAssigned,
    /// bucket: the owner of the prompt length's bucket.
    Bucket,
    /// The client named the worker (`x-kvgate-target-worker`, when allowed).
    TargetWorker,
}

impl Reason {
    pub const ALL: [Reason; 17] = [
        Reason::RoundRobin,
        Reason::Random,
        Reason::CacheHit,
        Reason::CacheMiss,
        Reason::ImbalanceOverload,
        Reason::ImbalanceKvSpread,
        Reason::ImbalanceCount,
        Reason::PowerOfTwo,
        Reason::LeastLoad,
        Reason::KvAware,
        Reason::KvAwareReplicate,
        Reason::PrefixHash,
        Reason::ConsistentHash,
        Reason::Sticky,
        Reason::SessionAssigned,
        Reason::Bucket,
        Reason::TargetWorker,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
            Reason::CacheHit => "cache_hit",
            Reason::CacheMiss => "cache_miss",
            Reason::ImbalanceOverload => "imbalance_overload",
            Reason::ImbalanceKvSpread => "imbalance_kv_spread",
            Reason::ImbalanceCount => "imbalance_count",
            Reason::PowerOfTwo => "power_of_two",
            Reason::LeastLoad => "least_load",
            Reason::KvAware => "kv_aware",
            Reason::KvAwareReplicate => "kv_aware_replicate",
            Reason::PrefixHash => "prefix_hash",
            Reason::ConsistentHash => "consistent_hash",
            Reason::Sticky => "sticky",
            Reason::SessionAssigned => "session_assigned",
            Reason::Bucket => "bucket",
            Reason::TargetWorker => "target_worker",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Prefix-match bookkeeping for regret metrics: the best match on any candidate vs the chosen one.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MatchInfo {
    /// Best matched fraction of the prompt over all candidates, 0..1.
    pub best_match_rate: f64,
    /// Matched fraction of the prompt on the chosen worker, 0..1.
    pub chosen_match_rate: f64,
}

/// A routing decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub worker: WorkerId,
    pub reason: Reason,
    /// Present for prefix-aware policies.
    pub matches: Option<MatchInfo>,
    /// The prefix index the decision consulted (prefix-aware policies with an index).
    pub index: Option<IndexKind>,
    /// The chosen worker's predicted time to first token, term by term (kv_aware).
    pub predicted: Option<PredictedTtft>,
    /// The prompt tokens the chosen engine is expected to compute (the prompt less the prefix
    /// it holds, a slower tier's hit weighed), when the policy estimated it (cache_aware,
    /// kv_aware): what [`Policy::on_routed`] records as work routed there.
    pub uncached_tokens: Option<f64>,
}

impl Decision {
    /// A decision with a worker and a reason only (no prefix index, no prediction).
    pub fn plain(worker: WorkerId, reason: Reason) -> Self {
        Self { worker, reason, matches: None, index: None, predicted: None, uncached_tokens: None }
    }
}

/// A request the host sent where the policy's decision said, for [`Policy::on_routed`] to
/// record: the request, the candidates the decision was made on, the decision, and the host's
/// clock when it decided.
#[derive(Clone, Copy, Debug)]
pub struct Routed<'a> {
    pub request: &'a RouteRequest<'a>,
    pub candidates: Candidates<'a>,
    pub decision: &'a Decision,
    /// The decision's `SelectContext::now_ms`.
    pub now_ms: u64,
    /// The decision's `SelectContext::load_poll_interval_ms`.
    pub load_poll_interval_ms: u64,
}

/// A request the worker a decision chose has answered, for [`Policy::on_answered`]: what the
/// decision predicted and what the host then measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Answered {
    pub worker: WorkerId,
    /// The decision's prediction (kv_aware's; [`Decision::predicted`]).
    pub predicted: PredictedTtft,
    /// The prompt's tokens and those the engine reported cached (`usage`).
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    /// The time to first token the host measured, in seconds: from the decision (the request
    /// sent on to its engine) to the first byte of a streamed answer. What the prediction, made
    /// at the decision, predicts: the time before it (the gateway's tokenizer queue, admission)
    /// is the same wherever the request goes, and left in it read as the engine's fixed cost
    /// (`PredictedTtft::base_s`), which then moved with the bursts the tokenizer queued.
    pub ttft_s: f64,
}

/// Why no worker could be chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoRoute {
    #[error("no healthy worker is available")]
    NoCandidates,
}

/// A group of workers [`Policy::favoured`] is asked about, with the request's uncached prompt
/// tokens on each.
#[derive(Clone, Copy)]
pub struct FavouredAsk<'a> {
    /// The fewest uncached prompt tokens any worker of the group has (what bounds the search).
    pub least_uncached: f64,
    /// The request's uncached prompt tokens on a worker (`None`: not in the group).
    pub uncached: &'a dyn Fn(WorkerId) -> Option<f64>,
    /// The group's workers, when they are few and known (`None`: every worker is looked at
    /// through `uncached`).
    pub listed: Option<&'a [WorkerId]>,
}

/// A routing policy. Implementations keep their own state behind interior mutability so that one
/// instance can serve concurrent requests; they never do I/O, read clocks or spawn threads.
///
/// Deciding is not recording: [`Policy::decide`] reads the policy's state and changes nothing in
/// it, so any number of decisions that are not followed by [`Policy::on_routed`] (dry runs,
/// locality scores, predictions of paths not taken) change no later decision. A host calls
/// `on_routed` once per request it sends where the policy decided.
pub trait Policy: Send + Sync {
    /// The policy's configuration name (`round_robin`, `cache_aware`, ...).
    fn name(&self) -> &'static str;

    /// Choose one of `candidates` (at least one) for `request`, recording nothing in the
    /// policy's state (the prefix index in `ctx` is the host's: a live plan may hand in one that
    /// learns the choice, a dry run one that only reads).
    fn decide(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute>;

    /// The host sent the request where this policy's [`Policy::decide`] chose: record it (work
    /// routed, the session bound, the next turn taken). Live plans only, once per request sent.
    fn on_routed(&self, _routed: &Routed<'_>) {}

    /// Load reports landed (the host's load monitor published them, each stamped with when it
    /// was fetched): a policy that learns from them does so here, once per report, so that a
    /// decision reads what it learned instead of learning on a copy. Called by the host for the
    /// pool's workers' reports as it publishes them, only while it polls loads.
    fn on_load_reports(
        &self,
        _reports: &[(WorkerId, LoadSample)],
        _now_ms: u64,
        _load_poll_interval_ms: u64,
    ) {
    }

    /// A request sent where this policy decided has answered: what the host measured (kv_aware
    /// learns its engines' speed from it). Called at most once per request, after `on_routed`.
    fn on_answered(&self, _answered: &Answered) {}

    /// Whether decisions carry a predicted time to first token ([`Decision::predicted`]; only
    /// kv_aware's do): the host weighs a disaggregated request's paths only when both sides'
    /// policies predict.
    fn predicts(&self) -> bool {
        false
    }

    /// Whether a decision on a shortlist of a large pool (the prefix's best holders, the least
    /// loaded, the coldest, the busiest, a random few: `kvgate_route`'s candidate search) is the
    /// decision on the whole pool, or as good: a policy whose choice is a holder or a least loaded
    /// engine by pool-wide terms it can see on the shortlist. `false` (the default): every
    /// routable worker is offered (ring and rotation policies, whose state spans the pool).
    fn shortlists(&self) -> bool {
        false
    }

    /// For a large pool's candidate search: up to a few workers the policy predicts cheapest for
    /// a request whatever its prompt, by terms the search's load orders do not see (kv_aware: its
    /// predicted queue, what was routed since the reports, its learned rates), cheapest first.
    /// The search adds them to the shortlist; it asks about the groups of workers in `asks`,
    /// each with the request's uncached prompt tokens there ([`FavouredAsk`]): every worker with
    /// the whole prompt, then the prompt's holders beyond its best few level by level, with what
    /// each level does not hold. The cheapest are taken over all the asks together. None by
    /// default.
    fn favoured(&self, _now_ms: u64, _asks: &[FavouredAsk<'_>]) -> Vec<WorkerId> {
        Vec::new()
    }

    /// Whether the policy reads [`Candidate::load`]; the host polls engines only when some policy does.
    fn needs_loads(&self) -> bool {
        false
    }

    /// Whether the policy reads [`RouteRequest::key`]; the host skips prompt extraction otherwise.
    fn needs_routing_key(&self) -> bool {
        false
    }

    /// A worker joined the pool; `name` is its stable identity (the gateway gives its URL), which
    /// hash-based policies place on their ring so that placement survives restarts.
    fn add_worker(&self, _worker: WorkerId, _name: &str) {}

    /// A worker left the pool for good: forget everything about it.
    fn remove_worker(&self, _worker: WorkerId) {}

    /// Periodic maintenance (e.g. prefix-tree eviction), driven by the host's clock.
    fn maintain(&self, _now_ms: u64) {}
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Small builders shared by the policy unit tests.
    use rand::{rngs::SmallRng, SeedableRng};

    use crate::Candidate;

    /// Candidates with ids 0.. and the given in-flight counts, no loads.
    pub fn candidates(in_flight: &[u64]) -> Vec<Candidate> {
        in_flight
            .iter()
            .enumerate()
            .map(|(id, &in_flight)| Candidate { id: id as u32, in_flight, load: None })
            .collect()
    }

    pub fn ctx_rng(seed: u64) -> SmallRng {
        SmallRng::seed_from_u64(seed)
    }

    /// `policy`'s decision for `request` among `pool` at `now_ms`, without a prefix index (the
    /// RNG seeded with `now_ms`), sent: recorded with `on_routed`.
    pub fn decide(
        policy: &dyn crate::Policy,
        request: &crate::RouteRequest<'_>,
        pool: &[Candidate],
        now_ms: u64,
    ) -> crate::Decision {
        let mut rng = ctx_rng(now_ms);
        let mut ctx =
            crate::SelectContext { now_ms, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        route(policy, request, crate::Candidates::new(pool).expect("a non-empty pool"), &mut ctx)
    }

    /// A live decision: `decide`, then `on_routed` for it (what a host does for a request it sends).
    pub fn route(
        policy: &dyn crate::Policy,
        request: &crate::RouteRequest<'_>,
        candidates: crate::Candidates<'_>,
        ctx: &mut crate::SelectContext<'_>,
    ) -> crate::Decision {
        let decision = policy.decide(request, candidates, ctx).expect("a decision");
        policy.on_routed(&crate::Routed {
            request,
            candidates,
            decision: &decision,
            now_ms: ctx.now_ms,
            load_poll_interval_ms: ctx.load_poll_interval_ms,
        });
        decision
    }
}

#[cfg(test)]
mod decide_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_candidates_is_no_route() {
        assert_eq!(Candidates::new(&[]), Err(NoRoute::NoCandidates));
        let one = [Candidate { id: 7, in_flight: 0, load: None }];
        assert_eq!(Candidates::new(&one).map(|c| c[0].id), Ok(7));
    }
}
