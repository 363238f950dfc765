//! kvgate-trace: what the load tools (`kvgate sim`, `kvgate replay`, `kvgate soak`) share without
//! pulling in one another: workload traces ([`Trace`]: Mooncake jsonl; [`prompt_tokens`] and
//! [`prompt_text`]: a line's prompt), the seeded generators of `kvgate trace gen` ([`generate`]: hot documents,
//! bursts, long prompts), the trace's cache references ([`CacheReference`]: infinite ceiling,
//! pooled LRU, pooled Belady), the one percentile every report uses, when each request is sent
//! and what its session took ([`SessionSchedule`]: closed-loop sessions), and which endpoint a
//! line is sent to ([`Endpoint`]). (The reader of a streamed answer's SSE events at the client
//! is `kvgate_protocol::SseData`.)

mod endpoint;
pub mod generate;
mod reference;
mod sessions;
mod trace;

pub use endpoint::Endpoint;
pub use reference::CacheReference;
pub use sessions::{SessionFigures, SessionSchedule};
pub use trace::{
    block_word, extend_prompt_tokens, prompt_text, prompt_tokens, CacheCeiling, Trace, TraceError,
    TraceFormat, TraceRequest, MOONCAKE_BLOCK_TOKENS,
};

/// The nearest-rank `p`th percentile of sorted values, `p` in percent (50 for the median): the
/// smallest value with at least `p`% of the values at or below it. The default (0) when empty.
pub fn percentile<T: Copy + Default>(sorted: &[T], p: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 50.0), 50.0);
        assert_eq!(percentile(&values, 99.0), 99.0);
        assert_eq!(percentile(&values, 100.0), 100.0);
        assert_eq!(percentile(&[7.0], 1.0), 7.0);
        assert_eq!(percentile::<f64>(&[], 50.0), 0.0);
        // Any ordered copyable values: microseconds, durations.
        assert_eq!(percentile(&[10u32, 20, 30, 40], 50.0), 20);
        assert_eq!(percentile(&[10u32, 20, 30, 40], 51.0), 30);
        let times: Vec<Duration> = (1..=10).map(Duration::from_millis).collect();
        assert_eq!(percentile(&times, 90.0), Duration::from_millis(9));
        assert_eq!(percentile::<Duration>(&[], 99.0), Duration::ZERO);
    }
}
