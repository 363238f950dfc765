//! Candidate search for a large pool: the candidates that can matter to a decision, so that a
//! policy's per-candidate work (its prediction, its imbalance terms, its prefix lookups) is
//! bounded however many workers the pool has. Applied above [`SHORTLIST_ABOVE`] candidates, for
//! a policy whose [`kvgate_policy::Policy::shortlists`] says its decision keeps; a smaller pool
//! is decided on whole, as before.
//!
//! The shortlist, from one pass over the offer with bounded top-k sets (no sort of the pool):
//! - the prefix's best holders (longest credited match, then fewest in flight), from one
//!   read-only match of the prompt on the decision's index;
//! - the least loaded: fewest in flight, then lowest KV usage, then least prefill queued;
//! - the coldest by KV usage and the least queued by waiting uncached tokens (kv_aware's queue);
//! - the busiest in flight (the count spread's maximum, so the pool's imbalance reads the same),
//!   and one candidate with no fresh load sample if any (a stale snapshot never drives the KV
//!   terms, on the shortlist as on the pool);
//! - the few the policy names as its cheapest whatever the prompt
//!   ([`kvgate_policy::Policy::favoured`]: kv_aware's predicted queue and learned rates);
//! - a few at random (power-of-d among the rest).
//!
//! Ties are broken by a per-decision random order, so equal workers outside the shortlist are
//! not starved.

use kvgate_index::PrefixMatch;
use kvgate_policy::{fresh_load, Candidate, WorkerId};
use rand::{Rng, RngCore};

/// Pools of more candidates than this are shortlisted (for a policy that shortlists).
pub const SHORTLIST_ABOVE: usize = 256;
/// Best holders of the prompt's prefix kept.
pub(crate) const HOLDERS: usize = 16;
/// Least loaded kept (in flight, KV usage, queued prefill).
pub(crate) const LEAST_LOADED: usize = 16;
/// Coldest by KV usage kept, and least queued prefill tokens kept.
pub(crate) const COLDEST: usize = 8;
/// Candidates drawn at random from the whole offer.
pub(crate) const SAMPLED: usize = 4;

/// What the search needs of the decision besides the offer.
pub(crate) struct Search {
    /// The length of the query the prompt was matched as (0: no prompt or no index).
    pub query_len: usize,
    /// The prompt's holders and the tokens each is credited with, by id (none without a match).
    pub credited: Vec<(WorkerId, usize)>,
    pub now_ms: u64,
    pub load_poll_interval_ms: u64,
    /// The workers the policy names ([`kvgate_policy::Policy::favoured`]), sorted by id.
    pub favoured: Vec<WorkerId>,
    /// The holders' credits with how many hold each, most credited first (`None`: more than
    /// [`LEVELS`] distinct credits).
    pub levels: Option<Vec<(usize, usize)>>,
}

/// Distinct credits counted in [`Search::levels`] at most.
pub(crate) const LEVELS: usize = 64;

impl Search {
    /// The search for a prompt matched as `prefix`: its holders credited once.
    pub(crate) fn new(prefix: Option<&PrefixMatch>, now_ms: u64, load_poll_interval_ms: u64) -> Self {
        let credited: Vec<(WorkerId, usize)> = prefix
            .filter(|prefix| prefix.best() > 0)
            .map(|prefix| prefix.iter_credited().filter(|&(_, credited)| credited > 0).collect())
            .unwrap_or_default();
        let levels = credit_levels(&credited);
        let query_len = prefix.map_or(0, PrefixMatch::query_len);
        Search { query_len, credited, now_ms, load_poll_interval_ms, favoured: Vec::new(), levels }
    }

    /// The credit of the holder after the best `k` (0 when there are no more than `k`): the
    /// most a holder not among the best `k` by credit is credited.
    pub(crate) fn credit_after(&self, k: usize) -> usize {
        if self.credited.len() <= k {
            return 0;
        }
        match &self.levels {
            Some(levels) => {
                let mut above = 0;
                for &(credit, count) in levels {
                    above += count;
                    if above > k {
                        return credit;
                    }
                }
                0
            }
            None => {
                let mut credits: Vec<usize> = self.credited.iter().map(|&(_, credit)| credit).collect();
                *credits.select_nth_unstable_by(k, |a, b| b.cmp(a)).1
            }
        }
    }
}

/// The distinct credits of `credited` with how many hold each, most credited first; `None` past
/// [`LEVELS`] of them. A widely held prompt has a few levels (its opening, held by many, and
/// the turns after it, by a few), so the count costs a read of each holder.
fn credit_levels(credited: &[(WorkerId, usize)]) -> Option<Vec<(usize, usize)>> {
    let mut levels: Vec<(usize, usize)> = Vec::new();
    let mut last = 0;
    for &(_, credit) in credited {
        if let Some(level) = levels.get_mut(last).filter(|level| level.0 == credit) {
            level.1 += 1;
            continue;
        }
        match levels.iter().position(|level| level.0 == credit) {
            Some(at) => {
                levels[at].1 += 1;
                last = at;
            }
            None if levels.len() == LEVELS => return None,
            None => {
                last = levels.len();
                levels.push((credit, 1));
            }
        }
    }
    levels.sort_unstable_by_key(|&(credit, _)| std::cmp::Reverse(credit));
    Some(levels)
}

/// The `k` smallest keys seen, with their positions (the worst replaced in place).
pub(crate) struct Smallest<K> {
    k: usize,
    kept: Vec<(K, usize)>,
    /// Position in `kept` of its largest key, once full.
    worst: usize,
}

impl<K: PartialOrd + Copy> Smallest<K> {
    pub(crate) fn new(k: usize) -> Self {
        Self { k, kept: Vec::with_capacity(k), worst: 0 }
    }

    pub(crate) fn offer(&mut self, key: K, at: usize) {
        if self.kept.len() < self.k {
            self.kept.push((key, at));
            if self.kept.len() == self.k {
                self.find_worst();
            }
        } else if key < self.kept[self.worst].0 {
            self.kept[self.worst] = (key, at);
            self.find_worst();
        }
    }

    fn find_worst(&mut self) {
        let mut worst = 0;
        for (i, (key, _)) in self.kept.iter().enumerate() {
            if *key > self.kept[worst].0 {
                worst = i;
            }
        }
        self.worst = worst;
    }

    pub(crate) fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        self.kept.iter().map(|&(_, at)| at)
    }
}

/// A candidate's place in this decision's random order of ties.
pub(crate) fn tie(id: WorkerId, seed: u64) -> u64 {
    (u64::from(id) ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29)
}

/// The shortlist of `offer` (returned as it is when it is not above [`SHORTLIST_ABOVE`]), in
/// the offer's order.
pub(crate) fn shortlist(offer: Vec<Candidate>, search: &Search, rng: &mut dyn RngCore) -> Vec<Candidate> {
    let n = offer.len();
    if n <= SHORTLIST_ABOVE {
        return offer;
    }
    let seed = rng.next_u64();
    let mut holders = Smallest::new(HOLDERS);
    let mut least = Smallest::new(LEAST_LOADED);
    let mut coldest = Smallest::new(COLDEST);
    let mut least_queued = Smallest::new(COLDEST);
    let mut busiest: Option<(u64, u64, usize)> = None;
    let mut stale = None;
    let mut favoured = Vec::with_capacity(search.favoured.len());
    // The prefix's holders by tenant id, walked beside an offer in id order (a host's usual
    // order; a binary search where it is not).
    let entries = &search.credited;
    let (mut next_entry, mut last_id) = (0, WorkerId::MIN);
    for (at, candidate) in offer.iter().enumerate() {
        let tie = tie(candidate.id, seed);
        if !entries.is_empty() {
            // The cursor stands at the first holder not below `last_id`: it serves any id from there.
            let credited = if candidate.id >= last_id {
                last_id = candidate.id;
                while entries.get(next_entry).is_some_and(|&(id, _)| id < candidate.id) {
                    next_entry += 1;
                }
                entries.get(next_entry).filter(|&&(id, _)| id == candidate.id).map(|&(_, credited)| credited)
            } else {
                entries.binary_search_by_key(&candidate.id, |&(id, _)| id).ok().map(|i| entries[i].1)
            };
            if let Some(credited) = credited.filter(|&credited| credited > 0) {
                holders.offer((std::cmp::Reverse(credited), candidate.in_flight, tie), at);
            }
        }
        if !search.favoured.is_empty() && search.favoured.binary_search(&candidate.id).is_ok() {
            favoured.push(at);
        }
        let load = fresh_load(candidate, search.now_ms, search.load_poll_interval_ms);
        if load.is_none() && stale.is_none() {
            stale = Some(at);
        }
        let usage = load.map_or(0.0, |load| load.token_usage);
        let queued = load.map_or(0, |load| load.num_waiting_uncached_tokens);
        least.offer((candidate.in_flight, usage, queued, tie), at);
        coldest.offer((usage, candidate.in_flight, tie), at);
        least_queued.offer((queued, candidate.in_flight, tie), at);
        if busiest.is_none_or(|(in_flight, t, _)| (candidate.in_flight, tie) > (in_flight, t)) {
            busiest = Some((candidate.in_flight, tie, at));
        }
    }
    let mut kept: Vec<usize> = holders.positions().chain(least.positions()).collect();
    kept.extend(coldest.positions().chain(least_queued.positions()));
    kept.extend(busiest.map(|(_, _, at)| at).into_iter().chain(stale).chain(favoured));
    kept.extend((0..SAMPLED).map(|_| rng.random_range(0..n)));
    kept.sort_unstable();
    kept.dedup();
    kept.into_iter().map(|at| offer[at]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_policy::LoadSample;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn search(prefix: Option<&PrefixMatch>) -> Search {
        Search::new(prefix, 10_000, 1000)
    }

    fn pool(n: u32) -> Vec<Candidate> {
        (0..n)
            .map(|id| Candidate {
                id,
                in_flight: 5 + u64::from(id % 7),
                load: Some(LoadSample {
                    token_usage: 0.3 + f64::from(id % 11) / 100.0,
                    num_waiting_uncached_tokens: 1000 + u64::from(id % 13),
                    fetched_at_ms: 9_800,
                    ..LoadSample::default()
                }),
            })
            .collect()
    }

    #[test]
    fn a_small_pool_is_offered_whole() {
        let offer = pool(SHORTLIST_ABOVE as u32);
        let kept = shortlist(offer.clone(), &search(None), &mut SmallRng::seed_from_u64(1));
        assert_eq!(kept, offer);
    }

    #[test]
    fn keeps_the_least_loaded_the_coldest_the_least_queued_and_the_busiest() {
        let mut offer = pool(5000);
        offer[4321].in_flight = 0;
        offer[17].load.as_mut().unwrap().token_usage = 0.01;
        offer[2500].load.as_mut().unwrap().num_waiting_uncached_tokens = 0;
        offer[99].in_flight = 1000;
        offer[3000].load.as_mut().unwrap().fetched_at_ms = 0;
        let kept = shortlist(offer, &search(None), &mut SmallRng::seed_from_u64(2));
        let bound = HOLDERS + LEAST_LOADED + 2 * COLDEST + SAMPLED + 2;
        assert!(kept.len() <= bound, "{} kept", kept.len());
        let ids: Vec<WorkerId> = kept.iter().map(|c| c.id).collect();
        for id in [4321, 17, 2500, 99, 3000] {
            assert!(ids.contains(&id), "{id} not in {ids:?}");
        }
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "the offer's order is kept");
        // The least loaded are the 16 with the fewest in flight: 4321 (0), then id % 7 == 0 (5).
        let least_kept = kept.iter().filter(|c| c.in_flight <= 5).count();
        assert!(least_kept >= LEAST_LOADED, "{least_kept}");
    }

    #[test]
    fn ties_rotate_between_decisions() {
        let offer: Vec<Candidate> = (0..1000).map(|id| Candidate { id, in_flight: 0, load: None }).collect();
        let mut rng = SmallRng::seed_from_u64(3);
        let first = shortlist(offer.clone(), &search(None), &mut rng);
        let second = shortlist(offer, &search(None), &mut rng);
        assert_ne!(first, second);
    }

    /// The prompt's holders are kept whatever the offer's order (in id order, walked beside the
    /// match; reversed, each looked up), although every one is busier than the least loaded.
    #[test]
    fn keeps_the_holders_in_any_order_of_the_offer() {
        use kvgate_index::{ApproxIndex, PrefixIndex, PromptKey};
        let tree = ApproxIndex::new(kvgate_policy::PolicyConfig::default().tree_settings());
        let prompt = PromptKey::Text("a long shared prompt the holders hold");
        for holder in [17, 2500, 4321] {
            tree.route(prompt, 1, &mut |_| Some(holder));
        }
        let mut matched = PrefixMatch::default();
        tree.route(prompt, 2, &mut |prefix| {
            matched = prefix.clone();
            None
        });
        let mut offer = pool(5000);
        for holder in [17, 2500, 4321] {
            offer[holder].in_flight = 99;
        }
        for reversed in [false, true] {
            if reversed {
                offer.reverse();
            }
            let kept = shortlist(offer.clone(), &search(Some(&matched)), &mut SmallRng::seed_from_u64(4));
            for holder in [17, 2500, 4321] {
                assert!(kept.iter().any(|c| c.id == holder), "{holder} (reversed: {reversed})");
            }
        }
    }
}
