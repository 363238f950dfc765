//! The engine's side of prefill/decode disaggregation: the KV of finished `PdStage::Prefill` requests held until the host releases it, and `PdStage::Decode` requests admitted with their prompt KV transferred in.

use std::cmp::Reverse;

use super::{Engine, Phase};
use crate::events::EngineOutput;

/// The blocks a finished `PdStage::Prefill` request still holds.
#[derive(Debug)]
pub(super) struct HeldBlocks {
    /// Cached blocks it references (its prompt's full blocks).
    referenced: Vec<u64>,
    /// Blocks it holds outside the cache (the prompt's partial block, the output).
    private: u64,
}

impl Engine {
    /// Advances to `now`, then releases the KV held by the finished `PdStage::Prefill`
    /// request `id` (its transfer is done, or the host gave up on it): its prompt blocks stay
    /// in the prefix cache, evictable; its other blocks are freed, and queued requests may be
    /// admitted at `now`. Returns whether `id` held KV.
    pub fn release_held(&mut self, now: u64, id: u64, out: &mut Vec<EngineOutput>) -> bool {
        self.advance(now, out);
        let Some(held) = self.held.remove(&id) else {
            return false;
        };
        self.pool.release(&held.referenced, held.private);
        self.admission_pending = true;
        if self.step.is_none() {
            // Held KV may have been all that kept the queue head out.
            self.schedule(now);
        }
        true
    }

    /// KV blocks held by the finished `PdStage::Prefill` request `id` (`None` when it holds
    /// none: unknown, still running, or released). These are the blocks a transfer moves:
    /// `ceil((prompt + output) / block_size)`.
    pub fn held_blocks(&self, id: u64) -> Option<u64> {
        self.held.get(&id).map(|held| held.referenced.len() as u64 + held.private)
    }

    /// Finished `PdStage::Prefill` requests whose KV is held.
    pub fn num_held(&self) -> usize {
        self.held.len()
    }

    /// Keeps a finished request's blocks allocated under its id.
    pub(super) fn hold(&mut self, id: u64, referenced: Vec<u64>, private: u64) {
        self.held.insert(id, HeldBlocks { referenced, private });
    }

    /// Admission of a `PdStage::Decode` request (blocks already allocated): its transferred
    /// prompt enters the prefix cache at once and it starts decoding without a prefill; its
    /// first token comes from the next decode step, its last `output_tokens` steps from now.
    pub(super) fn start_transferred(&mut self, slot: usize) {
        self.store_prompt_blocks(slot);
        let request = self.slots[slot].as_mut().expect("admitted slots are live");
        request.awaiting_first_token = true;
        let finish_step = self.decode_steps + u64::from(request.output_tokens);
        request.phase = Phase::Decoding { finish_step, position: self.decoding.len() };
        self.finish_queue.push(Reverse((finish_step, request.id, slot)));
        self.decoding.push(slot);
        self.transferred_awaiting_first_token = true;
    }

    /// A decode step's token outputs when some request in the batch awaits its first token:
    /// `FirstToken` for those, `Token` (if enabled) for the others.
    pub(super) fn emit_decode_tokens_with_first(&mut self, at_us: u64, out: &mut Vec<EngineOutput>) {
        self.transferred_awaiting_first_token = false;
        for &slot in &self.decoding {
            let request = self.slots[slot].as_mut().expect("decoding slots are live");
            if request.awaiting_first_token {
                request.awaiting_first_token = false;
                request.first_token_us = at_us;
                out.push(EngineOutput::FirstToken { id: request.id, at: at_us });
            } else if self.config.emit_token_events {
                out.push(EngineOutput::Token { id: request.id, at: at_us });
            }
        }
    }
}
