//! `cache_aware`: route to the worker already holding the longest prefix of the prompt while the
//! pool is balanced. The KV terms act per engine: an engine above the overload ceiling (while
//! another has room for the request: [`has_room`]) gets no new request, one more than the KV
//! spread above the coldest no new prefix (a miss goes elsewhere; it keeps serving the prefixes
//! it holds), and the others are routed as usual (prefix first, a miss to the shortest queue).
//! The count spread is pool-wide: it moves load toward the shortest queue, keeping prefix
//! affinity inside the acceptable load band when possible.

mod imbalance;

use std::sync::Mutex;

use kvgate_index::PrefixMatch;

pub use imbalance::{count_imbalanced, has_room, in_band, kv_exclusions, kv_usable, Imbalance, Thresholds};

use crate::config::{MissStrategy, PolicyConfig};
use crate::inflight::RoutedLog;
use crate::pick::pick_min_by;
use crate::{
    Candidate, Candidates, Decision, MatchInfo, NoRoute, Policy, PrefixIndex, Reason, RouteRequest, Routed,
    SelectContext, WorkerId,
};

/// KV usages closer than this are a tie (broken by in-flight count, then at random).
const KV_TIE: f64 = 0.01;

#[derive(Clone, Copy, Debug)]
struct Settings {
    thresholds: Thresholds,
    cache_threshold: f64,
    kv_inflight_correction: bool,
    rebalance_affinity: bool,
    miss_strategy: MissStrategy,
    /// From [`PolicyConfig::needs_loads`], the one place that decides it.
    needs_loads: bool,
}

/// cache_aware's own state. The prefix index is not here: the host owns it (one per model) and
/// hands it in through [`SelectContext::prefix_index`].
pub struct CacheAwarePolicy {
    settings: Settings,
    /// Prompt tokens (uncached estimate) routed to each worker, by routing time, for the
    /// in-flight correction of its KV usage between load samples.
    routed: Mutex<RoutedLog>,
}

impl CacheAwarePolicy {
    pub fn new(config: &PolicyConfig) -> Self {
        Self {
            settings: Settings {
                thresholds: Thresholds {
                    balance_abs: config.balance_abs_threshold,
                    balance_rel: config.balance_rel_threshold,
                    kv_spread: config.balance_token_usage_threshold,
                    overload: config.overload_token_usage_threshold,
                },
                cache_threshold: config.cache_threshold,
                kv_inflight_correction: config.kv_inflight_correction,
                rebalance_affinity: config.rebalance_affinity,
                miss_strategy: config.cache_miss_strategy,
                needs_loads: config.needs_loads(),
            },
            routed: Mutex::new(RoutedLog::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RoutedLog> {
        self.routed.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Everything the decision needs, computed before the tree descent.
struct Inputs<'a> {
    settings: &'a Settings,
    candidates: &'a [Candidate],
    in_flight: Vec<u64>,
    kv: Option<Vec<f64>>,
    /// Per candidate, the KV term keeping it from new requests (empty: none does).
    excluded: Vec<Option<Imbalance>>,
    /// The count spread is beyond both thresholds.
    count_imbalanced: bool,
    tree_sizes: Vec<usize>,
    /// What each engine holds in the prefix index, for the candidates tied on in-flight count
    /// and KV usage across the pool (0 for the others, or without an index).
    held: Vec<usize>,
}

struct Outcome {
    index: usize,
    reason: Reason,
    matches: Option<MatchInfo>,
}

impl Inputs<'_> {
    fn all(&self) -> std::ops::Range<usize> {
        0..self.candidates.len()
    }

    fn excluded(&self, i: usize) -> Option<Imbalance> {
        self.excluded.get(i).copied().flatten()
    }

    /// Candidates no KV term keeps from new prefixes (never empty: the coldest engine is one).
    fn eligible(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        self.all().filter(|&i| self.excluded(i).is_none())
    }

    /// Candidates that may serve a prefix they hold: all but those above the overload ceiling.
    /// An engine kept out by the KV spread alone still serves its prefixes (a hit adds little KV
    /// there, and recomputing the prefix elsewhere adds all of it to a colder engine).
    fn may_hit(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        self.all().filter(|&i| self.excluded(i) != Some(Imbalance::Overload))
    }

    /// Fewest in-flight requests among `indices`; ties by KV usage when known, then by what each
    /// holds in the prefix index (an idle pool spreads new prompts by the engines' holdings:
    /// vLLM's KV usage leaves out the cached blocks no request uses), then at random.
    fn least_in_flight(&self, indices: impl Iterator<Item = usize>, rng: &mut dyn rand::RngCore) -> usize {
        let held = |i: usize| self.held.get(i).copied().unwrap_or(0);
        pick_min_by(indices, |i| (self.in_flight[i], self.kv_bucket(i), held(i)), rng)
            .expect("candidates are not empty")
    }

    fn kv_bucket(&self, i: usize) -> i64 {
        self.kv.as_ref().map_or(0, |kv| (kv[i] / KV_TIE) as i64)
    }

    /// What each candidate tied on (in-flight count, KV usage) with the pool's least loaded holds
    /// in `index` (0 for the others; empty when none is tied).
    fn held_where_tied(&self, index: &dyn PrefixIndex) -> Vec<usize> {
        let key = |i: usize| (self.in_flight[i], self.kv_bucket(i));
        let Some(least) = self.all().map(key).min() else { return Vec::new() };
        let tied: Vec<usize> = self.all().filter(|&i| key(i) == least).collect();
        if tied.len() < 2 {
            return Vec::new();
        }
        let mut held = vec![0; self.candidates.len()];
        for i in tied {
            held[i] = index.tenant_size(self.candidates[i].id);
        }
        held
    }

    /// Lowest KV usage (ties within 1%: fewer in-flight, then at random). A tie never admits an
    /// engine above the overload ceiling while the coldest is below it.
    fn coldest(&self, rng: &mut dyn rand::RngCore) -> usize {
        let Some(kv) = &self.kv else { return self.least_in_flight(self.all(), rng) };
        let coldest = kv.iter().copied().fold(f64::INFINITY, f64::min);
        let ceiling = self.settings.thresholds.overload;
        let allowed = |i: usize| kv[i] <= ceiling || coldest > ceiling;
        let near = self.all().filter(|&i| kv[i] - coldest < KV_TIE && allowed(i));
        pick_min_by(near, |i| self.in_flight[i], rng).expect("the coldest is near itself")
    }

    /// Best prefix match among `indices` if it clears the cache threshold (ties: fewer in-flight,
    /// then at random).
    fn best_match(
        &self,
        indices: impl Iterator<Item = usize> + Clone,
        matched: &[usize],
        query_len: usize,
        rng: &mut dyn rand::RngCore,
    ) -> Option<usize> {
        let best = indices.clone().map(|i| matched[i]).max()?;
        if query_len == 0 || best as f64 / query_len as f64 <= self.settings.cache_threshold {
            return None;
        }
        pick_min_by(indices.filter(|&i| matched[i] == best), |i| self.in_flight[i], rng)
    }

    /// The KV term that took the request off its prefix: the best match clears the cache
    /// threshold only on engines above the overload ceiling.
    fn affinity_lost_to(&self, matched: &[usize], query_len: usize) -> Option<Imbalance> {
        let best = matched.iter().copied().max().filter(|&best| {
            query_len > 0 && best as f64 / query_len as f64 > self.settings.cache_threshold
        })?;
        let holders = || self.all().filter(|&i| matched[i] == best);
        if holders().any(|i| self.excluded(i) != Some(Imbalance::Overload)) {
            return None;
        }
        Some(Imbalance::Overload)
    }

    /// The KV term that moved a miss: an engine a KV term keeps out has the miss strategy's best
    /// value (alone, or tied with others it could have gone to); the coldest engine is never
    /// kept out, so `most_free_kv` is never moved.
    fn miss_moved_by(&self) -> Option<Imbalance> {
        if matches!(self.settings.miss_strategy, MissStrategy::MostFreeKv) {
            return None;
        }
        let key = |i: usize| match self.settings.miss_strategy {
            MissStrategy::LeastLoad | MissStrategy::MostFreeKv => (self.in_flight[i], 0),
            MissStrategy::SmallestTree => (self.tree_sizes[i] as u64, self.in_flight[i]),
        };
        let best = self.all().map(key).min()?;
        self.all()
            .filter(|&i| key(i) == best)
            .filter_map(|i| self.excluded(i))
            .min_by_key(|k| *k != Imbalance::Overload)
    }

    fn decide(&self, prefix: &PrefixMatch, rng: &mut dyn rand::RngCore) -> Outcome {
        let query_len = prefix.query_len();
        // A hit in a slower tier (host memory, disk) counts at its tier's weight.
        let matched: Vec<usize> = self.candidates.iter().map(|c| prefix.credited(c.id)).collect();
        let kv_active = self.excluded.iter().any(Option::is_some);
        let lost_to = self.affinity_lost_to(&matched, query_len);
        let (index, reason) = if !self.settings.rebalance_affinity && (kv_active || self.count_imbalanced) {
            // Rebalancing without affinity: the coldest engine (KV) or the shortest queue.
            match self.excluded.iter().flatten().min_by_key(|kind| **kind != Imbalance::Overload) {
                Some(kind) => (self.coldest(rng), kind.reason()),
                None => (self.least_in_flight(self.all(), rng), Reason::ImbalanceCount),
            }
        } else if self.count_imbalanced {
            let thresholds = &self.settings.thresholds;
            let band = self.may_hit().filter(|&i| in_band(thresholds, i, &self.in_flight, None));
            let index = self
                .best_match(band, &matched, query_len, rng)
                .unwrap_or_else(|| self.least_in_flight(self.eligible(), rng));
            (index, lost_to.map_or(Reason::ImbalanceCount, Imbalance::reason))
        } else {
            match self.best_match(self.may_hit(), &matched, query_len, rng) {
                Some(index) => (index, Reason::CacheHit),
                None => {
                    let moved = lost_to.or_else(|| self.miss_moved_by());
                    (self.on_miss(rng), moved.map_or(Reason::CacheMiss, Imbalance::reason))
                }
            }
        };
        // Reported as matched (every tier): what the engine will count as cached.
        let raw = |i: usize| prefix.matched(self.candidates[i].id);
        let matches = (query_len > 0).then(|| MatchInfo {
            best_match_rate: self.all().map(raw).max().unwrap_or(0) as f64 / query_len as f64,
            chosen_match_rate: raw(index) as f64 / query_len as f64,
        });
        Outcome { index, reason, matches }
    }

    /// Where a miss goes, among the engines no KV term keeps out.
    fn on_miss(&self, rng: &mut dyn rand::RngCore) -> usize {
        match self.settings.miss_strategy {
            MissStrategy::LeastLoad => self.least_in_flight(self.eligible(), rng),
            MissStrategy::MostFreeKv => self.coldest(rng),
            MissStrategy::SmallestTree => {
                pick_min_by(self.eligible(), |i| (self.tree_sizes[i], self.in_flight[i]), rng)
                    .expect("not empty")
            }
        }
    }
}

/// KV usage estimate: the engine's last sample plus the uncached prompt tokens routed to it since.
fn kv_estimate(routed: &RoutedLog, candidate: &Candidate, correction: bool) -> f64 {
    let Some(load) = candidate.load else { return 0.0 };
    let mut usage = load.token_usage;
    if correction && load.max_total_num_tokens > 0 {
        usage += routed.since(candidate.id, load.fetched_at_ms) / load.max_total_num_tokens as f64;
    }
    usage.clamp(0.0, 1.0)
}

impl Policy for CacheAwarePolicy {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn needs_loads(&self) -> bool {
        self.settings.needs_loads
    }

    fn needs_routing_key(&self) -> bool {
        true
    }

    /// A hit goes to a best holder, a miss to the least loaded or coldest eligible engine, and
    /// the imbalance terms read the pool's extremes: all on the shortlist. `smallest_tree` reads
    /// every engine's holdings, so it is offered the whole pool.
    fn shortlists(&self) -> bool {
        !matches!(self.settings.miss_strategy, MissStrategy::SmallestTree)
    }

    fn decide(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let settings = &self.settings;
        let routed = self.lock();
        let kv = kv_usable(&candidates, ctx.now_ms, ctx.load_poll_interval_ms).then(|| {
            candidates
                .iter()
                .map(|c| kv_estimate(&routed, c, settings.kv_inflight_correction))
                .collect::<Vec<_>>()
        });
        let in_flight: Vec<u64> = candidates.iter().map(|c| c.in_flight).collect();
        let index = ctx.prefix_index;
        let tree_sizes = match (settings.miss_strategy, index) {
            (MissStrategy::SmallestTree, Some(index)) => {
                candidates.iter().map(|c| index.tenant_size(c.id)).collect()
            }
            (MissStrategy::SmallestTree, None) => vec![0; candidates.len()],
            _ => Vec::new(),
        };
        // One candidate cannot be out of balance with anyone: route it as balanced.
        let (excluded, count_imbalanced) = if candidates.len() > 1 {
            let room: Vec<bool> = match &kv {
                Some(kv) => candidates
                    .iter()
                    .zip(kv)
                    .map(|(c, &usage)| has_room(&settings.thresholds, usage, c, request.prompt_tokens))
                    .collect(),
                None => Vec::new(),
            };
            let waiting: Vec<u64> =
                candidates.iter().map(|c| c.load.map_or(0, |load| load.num_waiting_reqs)).collect();
            (
                kv_exclusions(&settings.thresholds, kv.as_deref(), &room, &waiting),
                count_imbalanced(&settings.thresholds, &in_flight),
            )
        } else {
            (Vec::new(), false)
        };
        let mut inputs = Inputs {
            settings,
            candidates: &candidates,
            excluded,
            count_imbalanced,
            in_flight,
            kv,
            tree_sizes,
            held: Vec::new(),
        };
        // Asked before the index's descent (a tree holds its lock through it), and only for the
        // candidates tied on the first keys: an index's holdings cost a look each.
        if let Some(index) = index {
            inputs.held = inputs.held_where_tied(index);
        }

        let mut outcome = None;
        let rng = &mut *ctx.rng;
        let mut decide = |prefix: &PrefixMatch| {
            let decided = inputs.decide(prefix, rng);
            let id = candidates[decided.index].id;
            outcome = Some(decided);
            Some(id)
        };
        let now = ctx.now_ms;
        match (index, request.key.prompt()) {
            (Some(index), Some(key)) => {
                index.route(key, now, &mut decide);
            }
            _ => {
                decide(&PrefixMatch::default());
            }
        }
        let outcome = outcome.expect("the index calls the chooser exactly once");
        let uncached =
            request.prompt_tokens as f64 * (1.0 - outcome.matches.map_or(0.0, |m| m.chosen_match_rate));
        Ok(Decision {
            worker: candidates[outcome.index].id,
            reason: outcome.reason,
            matches: outcome.matches,
            index: index.map(|index| index.kind()),
            predicted: None,
            uncached_tokens: Some(uncached),
        })
    }

    /// The request's uncached prompt tokens count toward its worker's KV usage until the next
    /// load sample (the in-flight correction).
    fn on_routed(&self, routed: &Routed<'_>) {
        let uncached = routed.decision.uncached_tokens.unwrap_or(0.0);
        let keep_ms = routed.load_poll_interval_ms.saturating_mul(4);
        self.lock().record(routed.decision.worker, routed.now_ms, uncached, keep_ms);
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.lock().forget(worker);
    }
}

#[cfg(test)]
mod tests;
