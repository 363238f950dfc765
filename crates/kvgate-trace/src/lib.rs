//! kvgate-trace: what `kvgate sim` and `kvgate replay` share without the one pulling in the
//! other: workload traces ([`trace`]: Mooncake jsonl, the prompt tokens and text built from a
//! line), the seeded generators of `kvgate trace gen` ([`generate`]: hot documents, bursts, long
//! prompts), the trace's cache references ([`CacheReference`]: infinite ceiling, pooled LRU,
//! pooled Belady) and the percentile every report uses.

pub mod generate;
mod reference;
pub mod trace;

pub use reference::CacheReference;
pub use trace::{CacheCeiling, Trace, TraceError, TraceFormat, TraceRequest};

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 50.0), 50.0);
        assert_eq!(percentile(&values, 99.0), 99.0);
        assert_eq!(percentile(&values, 100.0), 100.0);
        assert_eq!(percentile(&[7.0], 1.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
