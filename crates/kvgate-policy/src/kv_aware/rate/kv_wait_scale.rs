//! The closed loop on kv_aware's wait for KV: the waits the answers took over those the model
//! predicted ([`crate::kv_wait::KvView::wait_s`]: the KV short over the rate running requests
//! free it), which the prediction's wait is multiplied by when the model says too little.
//!
//! The model says too little where an engine frees KV slower than the pool's finished share
//! says: on S11's holders of 12K-40K-token contexts (at the guard's size, seed 1, without the
//! KV-pressure term), the 58 answers routed to a predicted wait for KV were predicted 4.0 s and
//! took 7.9 s beyond their queue and prefill, 69% of the run's whole time to first token. The
//! simulated engines reserve an answer's KV when they admit it, so nothing grows there; those
//! holders ran 48-62 reasoning answers of thousands of tokens in 23-27 ms decode steps, about
//! twice the pool's, so their requests finish slower than the pool's share says (a per-engine
//! rate measured instead cost S2, S3 and S7: docs/BENCHMARKS.md). Learned, S11's TTFT mean fell from 483 to 287 ms and its p99
//! from 11.3 to 5.7 s (seed 0); no other scenario moved. Where the model says too much (S7's
//! bursts of short chats: 10.8 s predicted, 3.6 s taken) a scale below 1 changed no choice that
//! mattered (S7 within 1%) and cost S6 23% of its p99 and S10 3% of its mean, so the scale is
//! never below 1 (docs/BENCHMARKS.md).

use std::collections::VecDeque;

/// The last [`KvWaitScale::MEMORY`] answers whose decision predicted a wait for KV: what each
/// took beyond its predicted queue, prefill, decode and fixed cost, and the model's wait.
#[derive(Clone, Debug, Default)]
pub struct KvWaitScale {
    answers: VecDeque<(f64, f64)>,
    measured: f64,
    predicted: f64,
}

impl KvWaitScale {
    /// Answers kept.
    pub const MEMORY: usize = 64;
    /// Answers before the scale moves from 1.
    pub const MIN_ANSWERS: usize = 8;
    /// The scale stays within [1, LIMIT].
    pub const LIMIT: f64 = 8.0;

    /// One answer: the wait it took and the model's wait (unscaled), both in seconds. An answer
    /// with no predicted wait, or a measure that is not a number, teaches nothing.
    pub fn observe(&mut self, measured_s: f64, predicted_s: f64) {
        if !(measured_s.is_finite() && predicted_s.is_finite() && predicted_s > 0.0) {
            return;
        }
        let measured_s = measured_s.max(0.0);
        if self.answers.len() == Self::MEMORY {
            if let Some((measured, predicted)) = self.answers.pop_front() {
                self.measured -= measured;
                self.predicted -= predicted;
            }
        }
        self.answers.push_back((measured_s, predicted_s));
        self.measured += measured_s;
        self.predicted += predicted_s;
    }

    /// The scale: the measured waits' sum over the predicted ones', within [1, LIMIT]; 1 until
    /// [`KvWaitScale::MIN_ANSWERS`] answers.
    pub fn scale(&self) -> f64 {
        if self.answers.len() < Self::MIN_ANSWERS || self.predicted <= 0.0 {
            return 1.0;
        }
        (self.measured.max(0.0) / self.predicted).clamp(1.0, Self::LIMIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_taken_twice_as_long_as_predicted_double_the_prediction_once_enough_are_seen() {
        let mut scale = KvWaitScale::default();
        for _ in 0..KvWaitScale::MIN_ANSWERS - 1 {
            scale.observe(8.0, 4.0);
        }
        assert_eq!(scale.scale(), 1.0, "too few answers");
        scale.observe(8.0, 4.0);
        assert_eq!(scale.scale(), 2.0);
        scale.observe(f64::NAN, 4.0);
        scale.observe(5.0, 0.0);
        scale.observe(f64::INFINITY, 1.0);
        assert_eq!(scale.answers.len(), KvWaitScale::MIN_ANSWERS, "none of those teaches");
    }

    #[test]
    fn only_the_newest_answers_count_and_the_scale_stays_within_its_bounds() {
        let mut scale = KvWaitScale::default();
        for _ in 0..KvWaitScale::MEMORY {
            scale.observe(100.0, 1.0);
        }
        assert_eq!(scale.scale(), KvWaitScale::LIMIT);
        for _ in 0..KvWaitScale::MEMORY {
            scale.observe(1.0, 3.0);
        }
        assert_eq!(scale.answers.len(), KvWaitScale::MEMORY);
        assert!((scale.measured - 64.0).abs() < 1e-9 && (scale.predicted - 192.0).abs() < 1e-9);
        assert_eq!(scale.scale(), 1.0, "a model that says too much is left as it is");
        scale.observe(-5.0, 3.0);
        assert!(scale.measured >= 63.0, "a negative wait counts as none");
    }
}
