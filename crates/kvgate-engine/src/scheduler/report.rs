//! What an engine reports about itself: the load snapshot, and (in tests) the check of its internal accounting.

use super::Engine;
#[cfg(test)]
use super::Phase;
use crate::load::EngineLoad;

impl Engine {
    /// A load snapshot at `now` (call after `advance(now)` for an up-to-date view).
    pub fn load(&self, now: u64) -> EngineLoad {
        let block_size = u64::from(self.config.block_size);
        let capacity_blocks = self.pool.capacity_blocks();
        let used_blocks = self.pool.used_blocks();
        EngineLoad {
            num_running_reqs: (self.prefilling.len() + self.decoding.len()) as u64,
            num_waiting_reqs: self.waiting.len() as u64,
            num_waiting_uncached_tokens: self.waiting_uncached_tokens + self.admitted_prefill_tokens,
            num_used_tokens: used_blocks * block_size,
            max_total_num_tokens: capacity_blocks * block_size,
            token_usage: if capacity_blocks == 0 { 0.0 } else { used_blocks as f64 / capacity_blocks as f64 },
            gen_throughput: self.throughput.rate(now),
            cache_hit_rate: if self.total_prompt_tokens == 0 {
                0.0
            } else {
                self.total_cached_tokens as f64 / self.total_prompt_tokens as f64
            },
            max_running_requests: u64::from(self.config.max_running_requests),
            total_prompt_tokens: self.total_prompt_tokens,
            total_cached_tokens: self.total_cached_tokens,
            total_generated_tokens: self.total_generated_tokens,
            num_evictable_blocks: self.pool.evictable_blocks(),
        }
    }

    /// Panics if internal accounting is inconsistent (tests only).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        self.pool.check_invariants();
        let load = self.load(0);
        assert!((0.0..=1.0).contains(&load.token_usage), "{load:?}");
        assert!(self.running() <= self.config.max_running_requests as usize);
        assert_eq!(
            self.slot_by_id.len(),
            self.arriving.len() + self.waiting.len() + self.prefilling.len() + self.decoding.len()
        );
        for (position, &slot) in self.decoding.iter().enumerate() {
            let phase = self.slots[slot].as_ref().unwrap().phase;
            assert!(matches!(phase, Phase::Decoding { position: p, .. } if p == position));
        }
        if self.slot_by_id.is_empty() {
            assert!(self.pending_blocks.is_empty(), "no request, yet blocks pending");
        }
        if self.running() > 0 {
            assert!(self.step.is_some(), "running requests but no running step");
        }
        if !self.waiting.is_empty() && self.step.is_none() {
            // Only KV held for transfer can keep an idle engine from admitting its queue head.
            assert!(!self.held.is_empty(), "queued requests but no running step");
        }
    }
}
