//! The candidate search on a pool's kept [`LoadOrder`]: the same shortlist as the one pass over
//! an offer ([`crate::shortlist`]), found without looking at every worker. The prompt's best
//! holders come from the prefix match; the least loaded, the coldest and the least queued from
//! the front of their orders; the busiest from the back; samples gone stale from the front of
//! the oldest-sample order (keyed again as the one pass keys them: no load); those the policy
//! names ([`kvgate_policy::Policy::favoured`]); a few at random.
//! What it looks at grows with the holders and with the workers it skips (tried, not routable
//! now), not with the pool.
//!
//! Same as the one pass: wherever the pool's keys are distinct and at most [`STALE_KEPT`]
//! samples are stale, the shortlists' holders, least loaded, coldest, least queued and busiest
//! are the same workers (`tests::the_kept_order_finds_what_the_one_pass_finds`); among equal keys
//! each picks its own rotation.

use std::cmp::Reverse;
use std::collections::HashMap;

use foldhash::fast::FixedState;

use kvgate_policy::{fresh_load, Candidate, WorkerId};
use rand::RngCore;

use crate::order::{stale_keys, LoadOrder};
use crate::shortlist::{tie, Level, Search, Smallest, COLDEST, HOLDERS, LEAST_LOADED, SAMPLED};

/// Workers whose sample went stale kept as candidates of the search (keyed with no load).
pub const STALE_KEPT: usize = 8;

/// The shortlist of the workers of `order` that `lookup` finds routable now and that are not
/// in `tried`, in id order. `lookup` gives a worker's candidate as the decision is to see it.
pub(crate) fn shortlist_ordered(
    order: &LoadOrder,
    lookup: &dyn Fn(WorkerId) -> Option<Candidate>,
    tried: &[WorkerId],
    search: &Search,
    rng: &mut dyn RngCore,
) -> Vec<Candidate> {
    let (now_ms, interval_ms) = (search.now_ms, search.load_poll_interval_ms);
    let seed = rng.next_u64();
    let start = seed as WorkerId;
    // Each worker looked at is looked up once: `None` when it is not a candidate now.
    let mut seen: HashMap<WorkerId, Option<Candidate>, FixedState> =
        HashMap::with_capacity_and_hasher(256, FixedState::default());
    let mut look = |id: WorkerId| -> Option<Candidate> {
        *seen.entry(id).or_insert_with(|| lookup(id).filter(|c| c.id == id && !tried.contains(&id)))
    };
    let went_stale = |c: &Candidate| {
        c.load.is_some_and(|load| load.token_usage.is_finite())
            && fresh_load(c, now_ms, interval_ms).is_none()
    };
    let stale_before = now_ms.saturating_sub(interval_ms.saturating_mul(3));
    let stale: Vec<Candidate> = order
        .fetched_before(stale_before)
        .filter_map(|id| look(id).filter(went_stale))
        .take(STALE_KEPT)
        .collect();
    let mut kept: Vec<WorkerId> = stale.first().map(|c| c.id).into_iter().collect();

    kept.extend(best_holders(order, search, &mut look, start, seed));
    kept.extend(search.favoured.iter().copied().filter(|&id| look(id).is_some()));

    let mut fresh = |id: WorkerId| look(id).is_some_and(|c| !went_stale(&c));
    let rekeyed = |pick: fn(&Candidate) -> (u64, u64, u64)| {
        let mut keyed: Vec<((u64, u64, u64), WorkerId)> = stale.iter().map(|c| (pick(c), c.id)).collect();
        keyed.sort_unstable();
        keyed
    };
    let least = order.least_loaded(LEAST_LOADED, start, &mut fresh);
    kept.extend(merged(least, rekeyed(|c| stale_keys(c.in_flight).0), LEAST_LOADED));
    let coldest = order.coldest(COLDEST, start, &mut fresh);
    let stale_coldest = rekeyed(|c| pad(stale_keys(c.in_flight).1));
    kept.extend(merged(coldest.into_iter().map(|(k, id)| (pad(k), id)).collect(), stale_coldest, COLDEST));
    let queued = order.least_queued(COLDEST, start, &mut fresh);
    let stale_queued = rekeyed(|c| pad(stale_keys(c.in_flight).2));
    kept.extend(merged(queued.into_iter().map(|(k, id)| (pad(k), id)).collect(), stale_queued, COLDEST));
    let mut any = |id: WorkerId| look(id).is_some();
    kept.extend(order.busiest(&mut any));
    for _ in 0..SAMPLED {
        // A draw that falls on a worker tried or not routable draws again, a few times.
        if let Some(id) = (0..4).filter_map(|_| order.random(rng)).find(|&id| look(id).is_some()) {
            kept.push(id);
        }
    }
    kept.sort_unstable();
    kept.dedup();
    kept.into_iter().filter_map(&mut look).collect()
}

/// A credit held by more holders than this (a widely held opening), when some of the best
/// holders are among them, may be searched on the least-loaded order rather than holder by holder.
const GROUP_SCANNED: usize = 64;

/// The prompt's best [`HOLDERS`] holders that `look` finds: the most credited, then the fewest
/// in flight, as the one pass keeps them. The credits are taken level by level, most credited
/// first, until that many are found; a level held by many (a system prompt held by a quarter of
/// the pool, the first words of a chat template held by all) is not looked at holder by holder
/// when walking the least-loaded order from its front meets the few needed sooner: that walk
/// stops after about 4 times the workers it should take (ties in flight: the order's, not the
/// one pass's random rotation), and then the level is looked at whole, as before.
fn best_holders(
    order: &LoadOrder,
    search: &Search,
    look: &mut dyn FnMut(WorkerId) -> Option<Candidate>,
    start: WorkerId,
    seed: u64,
) -> Vec<WorkerId> {
    let credited = &search.credited;
    let mut holders = Smallest::new(HOLDERS);
    let offer =
        |holders: &mut Smallest<_>, look: &mut dyn FnMut(WorkerId) -> Option<Candidate>, id, credit| {
            let found = look(id);
            if let Some(c) = found {
                holders.offer((Reverse(credit), c.in_flight, tie(id, seed)), id as usize);
            }
            usize::from(found.is_some())
        };
    let levels = search.levels.as_deref().filter(|_| credited.len() > HOLDERS + GROUP_SCANNED);
    let Some(levels) = levels else {
        for &(id, credit) in credited {
            offer(&mut holders, look, id, credit);
        }
        return holders.positions().map(|at| at as WorkerId).collect();
    };
    // The levels above the one the best `HOLDERS` end on hold fewer than that: each looked at.
    let mut above = 0;
    let first = levels
        .iter()
        .position(|level| {
            above += level.count;
            above >= HOLDERS
        })
        .unwrap_or(levels.len());
    let mut taken = 0;
    // Fewer than `HOLDERS` hold them, so they are listed.
    for above in &levels[..first] {
        for &id in &above.listed {
            taken += offer(&mut holders, look, id, above.credit);
        }
    }
    for &Level { credit: level, count, .. } in &levels[first..] {
        if taken >= HOLDERS {
            break;
        }
        let need = HOLDERS - taken;
        let limit = 4 * need * order.len() / count.max(1) + 64;
        let holds_level = |id: WorkerId| search.credit_of(id) == Some(level);
        let walked = (count > GROUP_SCANNED && limit < count)
            .then(|| {
                order.least_loaded_within(need, start, limit, &mut |id| holds_level(id) && look(id).is_some())
            })
            .flatten()
            .filter(|found| found.len() == need);
        match walked {
            Some(found) => {
                for (_, id) in found {
                    taken += offer(&mut holders, look, id, level);
                }
            }
            None => {
                for &(id, credit) in credited.iter().filter(|&&(_, credit)| credit == level) {
                    taken += offer(&mut holders, look, id, credit);
                }
            }
        }
    }
    holders.positions().map(|at| at as WorkerId).collect()
}

/// A two-part key as the three-part keys it merges with.
fn pad((a, b): (u64, u64)) -> (u64, u64, u64) {
    (a, b, 0)
}

/// The `k` smallest of two lists each sorted by key.
fn merged<K: Ord + Copy>(
    walked: Vec<(K, WorkerId)>,
    stale: Vec<(K, WorkerId)>,
    k: usize,
) -> impl Iterator<Item = WorkerId> {
    let mut both = walked;
    both.extend(stale);
    both.sort_by_key(|&(key, _)| key);
    both.into_iter().take(k).map(|(_, id)| id)
}

#[cfg(test)]
mod tests;
