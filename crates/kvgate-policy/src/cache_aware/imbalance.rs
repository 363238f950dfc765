//! The imbalance test of cache_aware (overload OR KV spread OR count spread), the KV view it is
//! computed on, and the "acceptable load band" used to keep affinity while rebalancing.

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

    pub fn is_kv(self) -> bool {
        matches!(self, Imbalance::Overload | Imbalance::KvSpread)
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

/// The imbalance test over the candidates (healthy workers only). `kv` is the per-candidate KV
/// usage estimate, present only when [`kv_usable`].
///
/// Overload means the hottest engine is above the ceiling *while another is below it*: when
/// every engine is above the ceiling the pool is saturated, not imbalanced, and moving load to
/// the least-hot engine only throws the prefix affinity away (on the saturated scenarios S2/S3
/// that halved the hit rate and made TTFT worse; see docs/BENCHMARKS.md).
pub fn imbalance(thresholds: &Thresholds, in_flight: &[u64], kv: Option<&[f64]>) -> Option<Imbalance> {
    if let Some((kv_min, kv_max)) = kv.and_then(|kv| min_max(kv.iter().copied())) {
        if kv_max > thresholds.overload && kv_min <= thresholds.overload {
            return Some(Imbalance::Overload);
        }
        if kv_max - kv_min > thresholds.kv_spread {
            return Some(Imbalance::KvSpread);
        }
    }
    let (lo, hi) = min_max(in_flight.iter().copied())?;
    let count = (hi - lo) as f64 > thresholds.balance_abs && hi as f64 > thresholds.balance_rel * lo as f64;
    count.then_some(Imbalance::Count)
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

    #[track_caller]
    fn check(thresholds: Thresholds, in_flight: &[u64], kv: Option<&[f64]>, expected: Option<Imbalance>) {
        assert_eq!(imbalance(&thresholds, in_flight, kv), expected, "in_flight={in_flight:?} kv={kv:?}");
    }

    #[test]
    fn uniformly_high_kv_is_not_a_spread() {
        check(KV_AWARE, &[10, 10, 10], Some(&[0.85, 0.8, 0.88]), None);
    }

    #[test]
    fn one_hot_engine_with_idle_neighbours_is_a_spread() {
        check(KV_AWARE, &[10, 10, 10], Some(&[0.7, 0.1, 0.05]), Some(Imbalance::KvSpread));
    }

    #[test]
    fn above_the_ceiling_is_overload_even_without_spread() {
        check(KV_AWARE, &[10, 10, 10], Some(&[0.95, 0.9, 0.9]), Some(Imbalance::Overload));
    }

    #[test]
    fn a_pool_saturated_everywhere_is_not_overloaded() {
        // Nowhere to move the load: keep routing on the prefix (and the count term).
        check(KV_AWARE, &[10, 10, 10], Some(&[0.95, 0.97, 0.91]), None);
        check(KV_AWARE, &[200, 100, 100], Some(&[0.95, 0.97, 0.91]), Some(Imbalance::Count));
    }

    #[test]
    fn count_spread_needs_both_absolute_and_relative() {
        check(KV_AWARE, &[200, 100, 100], Some(&[0.2, 0.2, 0.2]), Some(Imbalance::Count));
        check(DEFAULTS, &[100, 40], None, None); // abs 60 <= 64
        check(DEFAULTS, &[300, 230], None, None); // abs 70 but rel 1.3 <= 1.5
        check(DEFAULTS, &[100, 0], None, Some(Imbalance::Count));
    }

    #[test]
    fn defaults_are_count_only() {
        check(DEFAULTS, &[10, 10], Some(&[1.0, 0.0]), None);
        check(DEFAULTS, &[100, 0], Some(&[0.0, 0.0]), Some(Imbalance::Count));
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
        /// Monotone: widening the hottest engine's KV usage never turns an imbalanced pool balanced.
        #[test]
        fn kv_trigger_is_monotone_in_the_spread(base in 0.0f64..0.5, hot in 0.0f64..0.5, extra in 0.0f64..0.5) {
            let in_flight = [5, 5, 5];
            let before = imbalance(&KV_AWARE, &in_flight, Some(&[base + hot, base, base]));
            let after = imbalance(&KV_AWARE, &in_flight, Some(&[base + hot + extra, base, base]));
            proptest::prop_assert!(before.is_none() || after.is_some());
        }

        #[test]
        fn count_trigger_is_monotone(lo in 0u64..500, gap in 0u64..500, extra in 0u64..500) {
            let before = imbalance(&DEFAULTS, &[lo + gap, lo], None);
            let after = imbalance(&DEFAULTS, &[lo + gap + extra, lo], None);
            proptest::prop_assert!(before.is_none() || after.is_some());
        }
    }
}
