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
    pub levels: Option<Vec<Level>>,
    /// Each holder's place in `levels`, by id ([`NO_LEVEL`]: not a holder), when the ids are
    /// dense enough (else empty, and a holder's credit is found by a binary search).
    level_of: Vec<u8>,
}

/// Not a holder, in [`Search::level_of`].
const NO_LEVEL: u8 = u8::MAX;

/// Distinct credits counted in [`Search::levels`] at most.
pub(crate) const LEVELS: usize = 64;
/// A level's holders are listed when they are at most this many: the policy's search for its
/// cheapest then costs each of them rather than walking its orders (at most 128 steps of five
/// fronts each, where a level held by a few of 10,000 engines is rarely met).
pub(crate) const LISTED: usize = 512;

/// The holders of the prompt credited with one number of its elements.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Level {
    pub credit: usize,
    /// How many hold it.
    pub count: usize,
    /// Its holders by id, when they are at most [`LISTED`] (else empty).
    pub listed: Vec<WorkerId>,
}

impl Search {
    /// The search for a prompt matched as `prefix`: its holders credited once.
    pub(crate) fn new(prefix: Option<&PrefixMatch>, now_ms: u64, load_poll_interval_ms: u64) -> Self {
        let credited: Vec<(WorkerId, usize)> = prefix
            .filter(|prefix| prefix.best() > 0)
            .map(|prefix| prefix.iter_credited().filter(|&(_, credited)| credited > 0).collect())
            .unwrap_or_default();
        let (levels, level_of) = match credit_levels(&credited) {
            Some((levels, level_of)) => (Some(levels), level_of),
            None => (None, Vec::new()),
        };
        let query_len = prefix.map_or(0, PrefixMatch::query_len);
        Search { query_len, credited, now_ms, load_poll_interval_ms, favoured: Vec::new(), levels, level_of }
    }

    /// The tokens `id` is credited with, if it holds some of the prompt.
    pub(crate) fn credit_of(&self, id: WorkerId) -> Option<usize> {
        match (&self.levels, self.level_of.is_empty()) {
            (Some(levels), false) => {
                let at = *self.level_of.get(id as usize)?;
                (at != NO_LEVEL).then(|| levels[at as usize].credit)
            }
            _ => {
                let credited = &self.credited;
                credited.binary_search_by_key(&id, |&(id, _)| id).ok().map(|at| credited[at].1)
            }
        }
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
                for level in levels {
                    above += level.count;
                    if above > k {
                        return level.credit;
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

/// The distinct credits of `credited` with how many hold each (and which, up to [`LISTED`]),
/// most credited first, and each holder's place among them by id when the ids are dense (at
/// most four times as many as the holders, plus 4,096: a byte per id); `None` past [`LEVELS`] of
/// them. A widely held prompt has a few levels (its opening, held by many, and the turns after
/// it, by a few), so the count costs a read of each holder.
fn credit_levels(credited: &[(WorkerId, usize)]) -> Option<(Vec<Level>, Vec<u8>)> {
    let dense = credited.last().is_some_and(|&(id, _)| (id as usize) < 4 * credited.len() + 4096);
    let mut level_of = match dense {
        true => vec![NO_LEVEL; credited.last().map_or(0, |&(id, _)| id as usize + 1)],
        false => Vec::new(),
    };
    let mut levels: Vec<Level> = Vec::new();
    let mut last = 0;
    for &(id, credit) in credited {
        let at = match levels.get(last).is_some_and(|level| level.credit == credit) {
            true => last,
            false => match levels.iter().position(|level| level.credit == credit) {
                Some(at) => at,
                None if levels.len() == LEVELS => return None,
                None => {
                    levels.push(Level { credit, count: 0, listed: Vec::new() });
                    levels.len() - 1
                }
            },
        };
        let level = &mut levels[at];
        level.count += 1;
        match level.count.cmp(&LISTED) {
            std::cmp::Ordering::Greater if level.count == LISTED + 1 => level.listed = Vec::new(),
            std::cmp::Ordering::Greater => {}
            _ => level.listed.push(id),
        }
        if dense {
            level_of[id as usize] = at as u8;
        }
        last = at;
    }
    // Most credited first, and each holder's place moved with its level.
    let mut by_credit: Vec<usize> = (0..levels.len()).collect();
    by_credit.sort_unstable_by_key(|&at| std::cmp::Reverse(levels[at].credit));
    let mut moved_to = vec![0u8; levels.len()];
    for (to, &from) in by_credit.iter().enumerate() {
        moved_to[from] = to as u8;
    }
    for at in level_of.iter_mut().filter(|at| **at != NO_LEVEL) {
        *at = moved_to[*at as usize];
    }
    let mut sorted: Vec<Level> = Vec::with_capacity(levels.len());
    let mut levels: Vec<Option<Level>> = levels.into_iter().map(Some).collect();
    for from in by_credit {
        sorted.extend(levels[from].take());
    }
    Some((sorted, level_of))
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

    proptest::proptest! {
        /// The credit levels count every holder, list the holders of a level of at most
        /// [`LISTED`], and find each holder's credit (by its place, for dense ids; by a binary
        /// search, else) as the match says it.
        #[test]
        fn the_levels_count_list_and_find_every_holder(
            holders in proptest::collection::btree_map(0u32..5_000, 1usize..6, 1..1500),
            spread in 1u32..4,
        ) {
            let credited: Vec<(WorkerId, usize)> =
                holders.iter().map(|(&id, &level)| (id * spread, level * 100 + (id % 3) as usize)).collect();
            let (levels, level_of) = credit_levels(&credited).expect("at most 15 levels");
            let search = Search {
                query_len: 600,
                credited: credited.clone(),
                now_ms: 0,
                load_poll_interval_ms: 1000,
                favoured: Vec::new(),
                levels: Some(levels.clone()),
                level_of,
            };
            proptest::prop_assert!(levels.windows(2).all(|w| w[0].credit > w[1].credit));
            proptest::prop_assert_eq!(levels.iter().map(|l| l.count).sum::<usize>(), credited.len());
            for level in &levels {
                let ids: Vec<WorkerId> =
                    credited.iter().filter(|&&(_, c)| c == level.credit).map(|&(id, _)| id).collect();
                proptest::prop_assert_eq!(level.count, ids.len());
                let listed: &[WorkerId] = if ids.len() <= LISTED { &ids } else { &[] };
                proptest::prop_assert_eq!(&level.listed[..], listed);
            }
            for id in 0..5_000 * spread + 10 {
                let want = credited.binary_search_by_key(&id, |&(id, _)| id).ok().map(|at| credited[at].1);
                proptest::prop_assert_eq!(search.credit_of(id), want);
            }
        }
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
