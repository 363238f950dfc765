//! The imbalance tests of cache_aware: which engines the KV terms keep from new requests
//! (overload, KV spread), the pool-wide count spread, the KV view they are computed on, and the
//! "acceptable load band" used to keep affinity while rebalancing.

use crate::inflight::fresh_load;
use crate::{Candidate, Reason};

/// The four thresholds of the imbalance test.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Thresholds {
    pub balance_abs: f64,
    pub balance_rel: f64,
    pub kv_spread: f64,
    pub overload: f64,
}

/// Why the pool is imbalanced; the order is the reporting priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imbalance {
    Overload,
    KvSpread,
    Count,
}

impl Imbalance {
    pub fn reason(self) -> Reason {
        match self {
            Imbalance::Overload => Reason::ImbalanceOverload,
            Imbalance::KvSpread => Reason::ImbalanceKvSpread,
            Imbalance::Count => Reason::ImbalanceCount,
        }
    }
}

/// A worker's KV usage is known only when every candidate has a fresh sample: a partial or stale
/// snapshot must not drive the KV terms.
pub fn kv_usable(candidates: &[Candidate], now_ms: u64, poll_interval_ms: u64) -> bool {
    !candidates.is_empty() && candidates.iter().all(|c| fresh_load(c, now_ms, poll_interval_ms).is_some())
}

fn min_max<T: Copy + PartialOrd>(values: impl Iterator<Item = T>) -> Option<(T, T)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((if v < lo { v } else { lo }, if v > hi { v } else { hi })),
    })
}

/// Whether an engine could start this request now without crossing the overload ceiling: no
/// request waits for admission there (as of its last sample) and its KV usage (`usage`, with the
/// in-flight correction) plus the request's prompt, as a share of its capacity, stays at or below
/// the ceiling. Overload moves a request only toward such an engine: one merely below the
/// ceiling, queueing like the rest, is no better a place (the saturated pools of S2, S3 and S7
/// moved hits between engines all near 0.9 and recomputed their prefixes for nothing;
/// docs/BENCHMARKS.md).
pub fn has_room(thresholds: &Thresholds, usage: f64, candidate: &Candidate, prompt_tokens: u64) -> bool {
    let Some(load) = candidate.load else { return false };
    let need = if load.max_total_num_tokens > 0 {
        prompt_tokens as f64 / load.max_total_num_tokens as f64
    } else {
        0.0
    };
    load.num_waiting_reqs == 0 && usage + need <= thresholds.overload
}

/// Which KV term, if any, keeps each candidate from new work (`kv` present only when
/// [`kv_usable`]; `room[i]`: [`has_room`] for candidate `i`; `waiting[i]`: the requests waiting
/// for admission there, as of its last sample):
/// - **overload**: the engine is above the ceiling while another has room for the request: no
///   new request;
/// - **KV spread**: the engine is more than the spread threshold above the coldest while an
///   engine the spread leaves in queues no more than it does: no new prefix (misses go elsewhere),
///   but it keeps serving the prefixes it holds.
///
/// The coldest engine is never kept out (when no engine has room the pool is saturated, not
/// imbalanced, and only the spread applies). The terms act per engine, and the engines they do
/// not keep out are routed as if the pool were balanced. (They used to switch the whole pool
/// to "route to the coldest", so one engine above the ceiling, a small one in an unequal fleet
/// or one holding a long prompt, sent every request of the pool to the least-used engine, prefix
/// or not: S6 and S8 lost a third to half of their hit rate and the TTFT p99 grew 1.8x and
/// 2.7x; then, as a filter on hits too, the spread still cost S6 and S8 a third of their hits:
/// a hit adds little KV where it lands, a recomputed prefix all of it; docs/BENCHMARKS.md.)
///
/// The spread's queue test: on a saturated pool every engine queues and KV usage says little
/// about where a request starts sooner; a miss moved off an engine with the shortest queue to
/// one with a longer queue waits longer for nothing (S2, S3). Where no engine queues (S1, S4,
/// S5, S8) the test always passes; where the hot engine is also the most queued (the small,
/// slow engine of S6) it passes too.
pub fn kv_exclusions(
    thresholds: &Thresholds,
    kv: Option<&[f64]>,
    room: &[bool],
    waiting: &[u64],
) -> Vec<Option<Imbalance>> {
    let Some(kv) = kv else { return Vec::new() };
    let kv_min = kv.iter().copied().fold(f64::INFINITY, f64::min);
    let somewhere_to_go = room.iter().any(|&room| room);
    let overloaded = |usage: f64| somewhere_to_go && usage > thresholds.overload;
    let spread_hot = |usage: f64| usage - kv_min > thresholds.kv_spread;
    // The shortest queue among the engines no KV term keeps out (the coldest is one of them).
    let open_waiting = kv
        .iter()
        .enumerate()
        .filter(|&(_, &usage)| !overloaded(usage) && !spread_hot(usage))
        .map(|(i, _)| waiting.get(i).copied().unwrap_or(0))
        .min()
        .unwrap_or(0);
    kv.iter()
        .enumerate()
        .map(|(i, &usage)| {
            if overloaded(usage) {
                Some(Imbalance::Overload)
            } else if spread_hot(usage) && open_waiting <= waiting.get(i).copied().unwrap_or(0) {
                Some(Imbalance::KvSpread)
            } else {
                None
            }
        })
        .collect()
}

/// Whether the in-flight counts are spread beyond both count thresholds.
pub fn count_imbalanced(thresholds: &Thresholds, in_flight: &[u64]) -> bool {
    min_max(in_flight.iter().copied()).is_some_and(|(lo, hi)| {
        (hi - lo) as f64 > thresholds.balance_abs && hi as f64 > thresholds.balance_rel * lo as f64
    })
}

/// Whether candidate `i` is inside the acceptable load band: paired with the least-loaded worker
/// it would not make the pool imbalanced, and it is below the KV ceiling.
pub fn in_band(thresholds: &Thresholds, i: usize, in_flight: &[u64], kv: Option<&[f64]>) -> bool {
    let lo = in_flight.iter().copied().min().unwrap_or(0);
    let mine = in_flight[i];
    let count_ok =
        !((mine - lo) as f64 > thresholds.balance_abs && mine as f64 > thresholds.balance_rel * lo as f64);
    let kv_ok = match kv {
        Some(kv) => {
            let kv_min = kv.iter().copied().fold(f64::INFINITY, f64::min);
            kv[i] <= thresholds.overload && kv[i] - kv_min <= thresholds.kv_spread
        }
        None => true,
    };
    count_ok && kv_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULTS: Thresholds =
        Thresholds { balance_abs: 64.0, balance_rel: 1.5, kv_spread: 1.0, overload: 1.0 };
    const KV_AWARE: Thresholds =
        Thresholds { balance_abs: 64.0, balance_rel: 1.5, kv_spread: 0.3, overload: 0.9 };

    use Imbalance::{KvSpread, Overload};

    /// Room as for an empty queue and a tiny prompt: at or below the ceiling.
    fn room(thresholds: &Thresholds, kv: &[f64]) -> Vec<bool> {
        kv.iter().map(|&usage| usage <= thresholds.overload).collect()
    }

    #[track_caller]
    fn check(thresholds: Thresholds, kv: &[f64], expected: &[Option<Imbalance>]) {
        let waiting = vec![0; kv.len()];
        assert_eq!(
            kv_exclusions(&thresholds, Some(kv), &room(&thresholds, kv), &waiting),
            expected,
            "kv={kv:?}"
        );
    }

    #[test]
    fn uniformly_high_kv_is_not_a_spread() {
        check(KV_AWARE, &[0.85, 0.8, 0.88], &[None, None, None]);
    }

    #[test]
    fn one_hot_engine_with_idle_neighbours_is_kept_out_by_the_spread() {
        check(KV_AWARE, &[0.7, 0.1, 0.05], &[Some(KvSpread), None, None]);
    }

    #[test]
    fn above_the_ceiling_is_overload_even_without_spread() {
        check(KV_AWARE, &[0.95, 0.9, 0.9], &[Some(Overload), None, None]);
    }

    #[test]
    fn a_pool_saturated_everywhere_is_not_overloaded() {
        // Nowhere to move the load: only the spread keeps anyone out.
        check(KV_AWARE, &[0.95, 0.97, 0.91], &[None, None, None]);
        let tight = Thresholds { kv_spread: 0.05, ..KV_AWARE };
        check(tight, &[0.95, 0.99, 0.91], &[None, Some(KvSpread), None]);
    }

    #[test]
    fn overload_needs_an_engine_with_room_not_just_one_below_the_ceiling() {
        // 0.89 is below the ceiling, but it queues (or the prompt would take it past 0.9): no
        // better a place than the hot engine, so nobody is moved.
        let kv = [0.95, 0.89, 0.93];
        assert_eq!(kv_exclusions(&KV_AWARE, Some(&kv), &[false, false, false], &[0; 3]), [None, None, None]);
        assert_eq!(
            kv_exclusions(&KV_AWARE, Some(&kv), &[false, true, false], &[0; 3]),
            [Some(Overload), None, Some(Overload)]
        );
    }

    #[test]
    fn room_is_an_empty_queue_and_the_prompt_below_the_ceiling() {
        let engine = |waiting: u64| Candidate {
            id: 0,
            in_flight: 0,
            load: Some(crate::LoadSample {
                num_waiting_reqs: waiting,
                max_total_num_tokens: 100_000,
                ..crate::LoadSample::default()
            }),
        };
        assert!(has_room(&KV_AWARE, 0.8, &engine(0), 10_000), "0.8 + 0.1 is at the ceiling");
        assert!(!has_room(&KV_AWARE, 0.8, &engine(0), 10_001), "the prompt would cross it");
        assert!(!has_room(&KV_AWARE, 0.1, &engine(1), 10), "a request waits there");
        assert!(!has_room(&KV_AWARE, 0.0, &Candidate { id: 0, in_flight: 0, load: None }, 0));
    }

    #[test]
    fn the_spread_keeps_an_engine_out_only_toward_a_queue_no_longer_than_its_own() {
        let kv = [0.7, 0.1, 0.05];
        let room = room(&KV_AWARE, &kv);
        let spread = |waiting: &[u64]| kv_exclusions(&KV_AWARE, Some(&kv), &room, waiting);
        // Nothing queues anywhere (S1, S4, S5, S8): the spread as before.
        assert_eq!(spread(&[0, 0, 0]), [Some(KvSpread), None, None]);
        // The hot engine also queues the most (S6's small, slow engine): kept out.
        assert_eq!(spread(&[5, 2, 3]), [Some(KvSpread), None, None]);
        // Its queue is the shortest (a saturated pool, S2, S3): a miss moved off it would wait
        // longer elsewhere for nothing.
        assert_eq!(spread(&[1, 2, 3]), [None, None, None]);
        // An equal queue somewhere colder: kept out.
        assert_eq!(spread(&[3, 4, 3]), [Some(KvSpread), None, None]);
    }

    #[test]
    fn without_a_usable_snapshot_nobody_is_kept_out() {
        assert!(kv_exclusions(&KV_AWARE, None, &[], &[]).is_empty());
    }

    #[test]
    fn count_spread_needs_both_absolute_and_relative() {
        assert!(count_imbalanced(&KV_AWARE, &[200, 100, 100]));
        assert!(!count_imbalanced(&DEFAULTS, &[100, 40])); // abs 60 <= 64
        assert!(!count_imbalanced(&DEFAULTS, &[300, 230])); // abs 70 but rel 1.3 <= 1.5
        assert!(count_imbalanced(&DEFAULTS, &[100, 0]));
    }

    #[test]
    fn defaults_keep_nobody_out() {
        check(DEFAULTS, &[1.0, 0.0], &[None, None]);
    }

    #[test]
    fn band_excludes_the_hot_and_the_overloaded() {
        let kv = [0.95, 0.5, 0.1];
        assert!(!in_band(&KV_AWARE, 0, &[1, 1, 1], Some(&kv)), "above the ceiling");
        assert!(!in_band(&KV_AWARE, 1, &[1, 1, 1], Some(&kv)), "0.4 above the coldest");
        assert!(in_band(&KV_AWARE, 2, &[1, 1, 1], Some(&kv)));
        assert!(!in_band(&DEFAULTS, 0, &[200, 10], None));
        assert!(in_band(&DEFAULTS, 0, &[70, 10], None));
    }

    proptest::proptest! {
        /// Monotone: a hotter engine is never let back in, and the coldest is never kept out.
        #[test]
        fn kv_terms_are_monotone_and_spare_the_coldest(
            kv in proptest::collection::vec(0.0f64..1.0, 2..8),
            hot in 0usize..8,
            extra in 0.0f64..0.5,
        ) {
            let hot = hot % kv.len();
            let before = kv_exclusions(&KV_AWARE, Some(&kv), &room(&KV_AWARE, &kv), &vec![0; kv.len()]);
            let mut hotter = kv.clone();
            hotter[hot] = (hotter[hot] + extra).min(1.0);
            let after = kv_exclusions(&KV_AWARE, Some(&hotter), &room(&KV_AWARE, &hotter), &vec![0; kv.len()]);
            proptest::prop_assert!(before[hot].is_none() || after[hot].is_some());
            let coldest = (0..kv.len()).min_by(|&a, &b| kv[a].total_cmp(&kv[b])).unwrap();
            proptest::prop_assert!(before[coldest].is_none());
        }

        /// The spread's queue test: an engine the spread keeps out always has an engine no KV
        /// term keeps out whose queue is no longer than its own, and the coldest is never kept out.
        #[test]
        fn the_spread_never_moves_a_miss_toward_a_longer_queue(
            engines in proptest::collection::vec((0.0f64..1.0, 0u64..6), 2..8),
        ) {
            let kv: Vec<f64> = engines.iter().map(|&(k, _)| k).collect();
            let waiting: Vec<u64> = engines.iter().map(|&(_, w)| w).collect();
            let out = kv_exclusions(&KV_AWARE, Some(&kv), &room(&KV_AWARE, &kv), &waiting);
            for (i, kind) in out.iter().enumerate() {
                if *kind == Some(KvSpread) {
                    let shorter = (0..kv.len()).any(|j| out[j].is_none() && waiting[j] <= waiting[i]);
                    proptest::prop_assert!(shorter, "{i} kept out: kv {kv:?}, waiting {waiting:?}, {out:?}");
                }
            }
            let coldest = (0..kv.len()).min_by(|&a, &b| kv[a].total_cmp(&kv[b])).unwrap();
            proptest::prop_assert!(out[coldest].is_none());
        }

        #[test]
        fn count_trigger_is_monotone(lo in 0u64..500, gap in 0u64..500, extra in 0u64..500) {
            let before = count_imbalanced(&DEFAULTS, &[lo + gap, lo]);
            let after = count_imbalanced(&DEFAULTS, &[lo + gap + extra, lo]);
            proptest::prop_assert!(!before || after);
        }
    }
}
