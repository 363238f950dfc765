//! The pure part of a KV-event subscription: classifying each batch's sequence number (next,
//! duplicate, gap, engine restart) and applying a batch's events to the cache's index writer.

use kvgate_index::{ApplyError, CacheBlocks, StoredBlocks};
use kvgate_kv_events::{EventBatch, KvEvent};

/// What to do with a batch, given the last one applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The next batch (or the first one): apply it.
    Apply,
    /// Already applied (delivered again by a replay or by the live stream after one): skip.
    Duplicate,
    /// Batches `expected..seq` were lost.
    Gap { expected: u64 },
    /// The sequence went backwards with a newer timestamp: the engine restarted.
    Restart,
}

/// The last applied batch of one publisher.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Sequence {
    last: Option<(u64, f64)>,
}

impl Sequence {
    pub(crate) fn check(&self, seq: u64, ts: f64) -> Verdict {
        let Some((last, last_ts)) = self.last else { return Verdict::Apply };
        if seq == last.wrapping_add(1) {
            Verdict::Apply
        } else if seq > last {
            Verdict::Gap { expected: last + 1 }
        } else if ts > last_ts {
            // A batch numbered at or below the last one but stamped later: a new publisher.
            Verdict::Restart
        } else {
            Verdict::Duplicate
        }
    }

    pub(crate) fn accept(&mut self, seq: u64, ts: f64) {
        self.last = Some((seq, ts));
    }

    pub(crate) fn reset(&mut self) {
        self.last = None;
    }

    /// The sequence number a replay should start from to fill in after the last applied batch.
    pub(crate) fn next(&self) -> u64 {
        self.last.map_or(0, |(last, _)| last + 1)
    }
}

/// Why an event of a well-formed batch was not applied (the `reason` label of the metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The parent block is unknown (its store was missed, or it was removed since).
    UnknownParent,
    /// The event's shape is inconsistent (token count, zero or changed block size).
    Inconsistent,
    /// Blocks of a LoRA adapter: requests are matched against base-model blocks only.
    Lora,
    /// A KV-cache group other than the first (hybrid models): the first group stands for all.
    OtherGroup,
    /// An event type this gateway does not know.
    UnknownEvent,
    /// Its blocks would take the cache past what its engine can hold.
    OverCapacity,
}

impl Refusal {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Refusal::UnknownParent => "unknown_parent",
            Refusal::Inconsistent => "inconsistent",
            Refusal::Lora => "lora",
            Refusal::OtherGroup => "other_group",
            Refusal::UnknownEvent => "unknown_event",
            Refusal::OverCapacity => "over_capacity",
        }
    }
}

/// Applies every event of `batch` in order; calls `refused` for each event not applied.
pub(crate) fn apply_batch(cache: &mut CacheBlocks, batch: &EventBatch, refused: &mut dyn FnMut(Refusal)) {
    for event in &batch.events {
        match event {
            KvEvent::BlockStored(stored) => {
                if stored.lora_id.is_some() || stored.lora_name.is_some() {
                    refused(Refusal::Lora);
                    continue;
                }
                if stored.group_idx.is_some_and(|group| group != 0) {
                    refused(Refusal::OtherGroup);
                    continue;
                }
                let result = cache.apply_stored(StoredBlocks {
                    block_hashes: &stored.block_hashes,
                    parent_block_hash: stored.parent_block_hash,
                    token_ids: &stored.token_ids,
                    block_size: stored.block_size,
                    medium: stored.medium.as_deref(),
                });
                match result {
                    Ok(()) => {}
                    Err(ApplyError::UnknownParent(_)) => refused(Refusal::UnknownParent),
                    Err(ApplyError::OverCapacity { .. }) => refused(Refusal::OverCapacity),
                    Err(_) => refused(Refusal::Inconsistent),
                }
            }
            KvEvent::BlockRemoved(removed) => {
                if removed.group_idx.is_some_and(|group| group != 0) {
                    refused(Refusal::OtherGroup);
                    continue;
                }
                // Hashes the index never held (LoRA blocks, missed stores) are nothing to remove.
                cache.apply_removed(&removed.block_hashes, removed.medium.as_deref());
            }
            KvEvent::AllBlocksCleared => cache.clear(),
            KvEvent::Unknown(_) => refused(Refusal::UnknownEvent),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvgate_index::{BlockIndex, CacheId, PrefixMatch};
    use kvgate_kv_events::{BlockRemoved, BlockStored};

    use super::*;

    #[test]
    fn sequence_verdicts() {
        let mut sequence = Sequence::default();
        assert_eq!(sequence.check(5, 1.0), Verdict::Apply, "the first batch is the baseline");
        sequence.accept(5, 1.0);
        assert_eq!(sequence.next(), 6);
        assert_eq!(sequence.check(6, 1.1), Verdict::Apply);
        assert_eq!(sequence.check(9, 1.1), Verdict::Gap { expected: 6 });
        assert_eq!(sequence.check(5, 1.0), Verdict::Duplicate, "same batch again");
        assert_eq!(sequence.check(3, 0.5), Verdict::Duplicate, "an older batch replayed");
        assert_eq!(sequence.check(0, 2.0), Verdict::Restart, "numbered from 0 again, stamped later");
        assert_eq!(sequence.check(5, 2.0), Verdict::Restart);
        sequence.reset();
        assert_eq!((sequence.check(0, 0.0), sequence.next()), (Verdict::Apply, 0));
    }

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: 2,
            lora_id: None,
            lora_name: None,
            medium: None,
            group_idx: None,
        })
    }

    #[test]
    fn batches_apply_in_order_and_refusals_are_named() {
        let index = Arc::new(BlockIndex::new());
        let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 4, rank: 0 });
        let lora = match stored(vec![9], None, vec![7, 7]) {
            KvEvent::BlockStored(mut event) => {
                event.lora_name = Some("adapter".into());
                KvEvent::BlockStored(event)
            }
            _ => unreachable!(),
        };
        let batch = EventBatch {
            ts: 0.0,
            events: vec![
                stored(vec![1, 2], None, vec![1, 2, 3, 4]),
                stored(vec![3], Some(2), vec![5, 6]),
                stored(vec![8], Some(77), vec![5, 6]),
                stored(vec![4], None, vec![1]),
                lora,
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![3, 55],
                    medium: None,
                    group_idx: None,
                }),
                KvEvent::Unknown("Future".into()),
            ],
            data_parallel_rank: None,
        };
        let mut refusals = Vec::new();
        apply_batch(&mut cache, &batch, &mut |refusal| refusals.push(refusal));
        assert_eq!(
            refusals,
            [Refusal::UnknownParent, Refusal::Inconsistent, Refusal::Lora, Refusal::UnknownEvent]
        );
        let mut matched = PrefixMatch::default();
        index.overlap(&[1, 2, 3, 4, 5, 6], &mut matched);
        assert_eq!(matched.matched(4), 4, "blocks 1-2 held, block 3 stored then removed");
        let clear = EventBatch { ts: 0.0, events: vec![KvEvent::AllBlocksCleared], data_parallel_rank: None };
        apply_batch(&mut cache, &clear, &mut |_| {});
        assert!(index.is_empty());
    }
}
