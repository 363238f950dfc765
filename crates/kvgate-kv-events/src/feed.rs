//! One publisher's feed into its cache's writer: every live message and replay reply, classified
//! by sequence number and applied, as a pure state machine. The host owns the sockets: it sends a
//! replay request when [`Live::ReplayFrom`] asks, hands each reply to [`Feed::on_replay`], and
//! closes the replay with [`Feed::end_replay`].
//!
//! What the feed guarantees: each batch is applied once, in order; a gap a replay fills is
//! recovered without losing anything; only a hole nothing fills (no replay socket, a buffer that
//! no longer reaches back, a failed replay) or an engine restart starts the cache over. A batch
//! that cannot be decoded is skipped and counted, never a reason to clear: its sequence number
//! still counts, so the next batch is not a gap.

use kvgate_index::CacheBlocks;

use crate::frames::{message_parts, replay_parts, ReplayParts};
use crate::sequence::{Sequence, Verdict};
use crate::{apply_batch, decode_batch, DecodeError, EventBatch, Refusal};

/// What a live message did.
#[derive(Clone, Debug, PartialEq)]
pub enum Live {
    /// The next batch: applied (or, when its payload could not be decoded, skipped).
    Applied,
    /// A batch applied already.
    Duplicate,
    /// Frames without a usable sequence number: dropped (counted as malformed).
    Dropped(DecodeError),
    /// Batches are missing before this one (a gap), or the engine restarted (the cache was
    /// cleared): replay from this sequence number, then call [`Feed::end_replay`]. The batch is
    /// held until then.
    ReplayFrom(u64),
}

/// One reply of a replay.
#[derive(Clone, Debug, PartialEq)]
pub enum Replayed {
    /// A buffered batch, applied unless it was applied already.
    Batch { seq: u64 },
    /// The end marker: call [`Feed::end_replay`] with `completed`.
    End,
}

/// How a gap ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// The replay filled it: nothing was lost.
    Replayed,
    /// Nothing filled it: the cache started over from the next batch.
    Cleared,
}

impl Recovery {
    pub const ALL: [Recovery; 2] = [Recovery::Replayed, Recovery::Cleared];

    pub fn as_str(self) -> &'static str {
        match self {
            Recovery::Replayed => "replay",
            Recovery::Cleared => "cleared",
        }
    }
}

/// What the feed did since the counts were last taken ([`Feed::take_counts`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FeedCounts {
    /// Batches applied.
    pub batches: u64,
    /// Events refused, by reason.
    pub refused: Vec<(Refusal, u64)>,
    /// Messages or replies that could not be decoded (skipped, or dropped without a sequence
    /// number).
    pub malformed: u64,
    pub gaps: Vec<(Recovery, u64)>,
    /// Engine restarts seen (the cache started over).
    pub restarts: u64,
}

impl FeedCounts {
    fn refuse(&mut self, refusal: Refusal) {
        bump(&mut self.refused, refusal);
    }
}

fn bump<K: PartialEq>(counts: &mut Vec<(K, u64)>, key: K) {
    match counts.iter_mut().find(|(known, _)| *known == key) {
        Some((_, n)) => *n += 1,
        None => counts.push((key, 1)),
    }
}

/// Why a replay is running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    /// At start or after a reconnection: the publisher's history.
    Resync,
    Gap,
    Restart,
}

/// A replay in progress.
#[derive(Debug)]
struct Replay {
    cause: Cause,
    /// No hole so far between what was applied and what the replay sent.
    joined: bool,
    /// The live batch that asked for it, applied when it ends (`None` inside: undecodable).
    held: Option<(u64, Option<EventBatch>)>,
}

/// One publisher's (one data-parallel rank's) feed into its cache.
#[derive(Debug)]
pub struct Feed {
    cache: CacheBlocks,
    sequence: Sequence,
    /// The timestamp of the last batch applied (kept for undecodable batches, which have none).
    last_ts: f64,
    replay: Option<Replay>,
    counts: FeedCounts,
}

impl Feed {
    pub fn new(cache: CacheBlocks) -> Self {
        Feed {
            cache,
            sequence: Sequence::default(),
            last_ts: 0.0,
            replay: None,
            counts: FeedCounts::default(),
        }
    }

    pub fn cache(&self) -> &CacheBlocks {
        &self.cache
    }

    /// Bounds the blocks the cache may hold (`CacheBlocks::set_max_blocks`: its engine's
    /// capacity, as the host knows it; a store past it is refused alone).
    pub fn set_max_blocks(&mut self, max_blocks: usize) {
        self.cache.set_max_blocks(max_blocks);
    }

    pub fn sequence(&self) -> &Sequence {
        &self.sequence
    }

    /// The counts since the last call.
    pub fn take_counts(&mut self) -> FeedCounts {
        std::mem::take(&mut self.counts)
    }

    /// Starts over: the cache is cleared and the next batch is the first (a reconnection to a
    /// publisher that may have changed while we were away).
    pub fn reset(&mut self) {
        self.cache.clear();
        self.sequence.reset();
        self.replay = None;
    }

    /// Begins a replay of the publisher's history (at start, after a reconnection); returns the
    /// sequence number to ask from.
    pub fn begin_resync(&mut self) -> u64 {
        self.replay = Some(Replay { cause: Cause::Resync, joined: true, held: None });
        self.sequence.next()
    }

    /// A live PUB message `[topic, seq, payload]`.
    pub fn on_live<F: AsRef<[u8]>>(&mut self, frames: &[F]) -> Live {
        let (seq, payload) = match message_parts(frames) {
            Ok(parts) => parts,
            Err(error) => {
                self.counts.malformed += 1;
                return Live::Dropped(error);
            }
        };
        let batch = self.decode(payload);
        let ts = batch.as_ref().map_or(self.last_ts, |batch| batch.ts);
        match self.sequence.check(seq, ts) {
            Verdict::Apply => {
                self.apply(seq, batch.as_ref());
                Live::Applied
            }
            Verdict::Duplicate => Live::Duplicate,
            Verdict::Gap { expected } => {
                self.replay = Some(Replay { cause: Cause::Gap, joined: true, held: Some((seq, batch)) });
                Live::ReplayFrom(expected)
            }
            Verdict::Restart => {
                self.counts.restarts += 1;
                self.reset();
                self.replay = Some(Replay { cause: Cause::Restart, joined: true, held: Some((seq, batch)) });
                Live::ReplayFrom(0)
            }
        }
    }

    /// One reply of the replay in progress.
    pub fn on_replay<F: AsRef<[u8]>>(&mut self, frames: &[F]) -> Result<Replayed, DecodeError> {
        let (seq, payload) = match replay_parts(frames) {
            Ok(ReplayParts::End) => return Ok(Replayed::End),
            Ok(ReplayParts::Batch { seq, payload }) => (seq, payload),
            Err(error) => {
                self.counts.malformed += 1;
                return Err(error);
            }
        };
        let batch = self.decode(payload);
        self.apply_or_start_over(seq, batch, true);
        Ok(Replayed::Batch { seq })
    }

    /// Ends the replay in progress: `completed` when its end marker arrived (false: it failed,
    /// timed out, or there is no replay socket). Applies the live batch held for it; for a gap,
    /// says whether it was recovered.
    pub fn end_replay(&mut self, completed: bool) -> Option<Recovery> {
        let replay = self.replay.take()?;
        let mut joined = replay.joined && completed;
        if let Some((seq, batch)) = replay.held {
            let ts = batch.as_ref().map_or(self.last_ts, |batch| batch.ts);
            joined &= matches!(self.sequence.check(seq, ts), Verdict::Apply | Verdict::Duplicate);
            self.apply_or_start_over(seq, batch, false);
        }
        if replay.cause != Cause::Gap {
            return None;
        }
        let recovery = if joined { Recovery::Replayed } else { Recovery::Cleared };
        bump(&mut self.counts.gaps, recovery);
        Some(recovery)
    }

    fn decode(&mut self, payload: &[u8]) -> Option<EventBatch> {
        match decode_batch(payload) {
            Ok(batch) => Some(batch),
            Err(_) => {
                self.counts.malformed += 1;
                None
            }
        }
    }

    /// Applies the batch if it is the next one, skips it if it was applied already, and
    /// otherwise (a hole nothing filled) clears the cache and starts over from it.
    fn apply_or_start_over(&mut self, seq: u64, batch: Option<EventBatch>, in_replay: bool) {
        let ts = batch.as_ref().map_or(self.last_ts, |batch| batch.ts);
        match self.sequence.check(seq, ts) {
            Verdict::Apply => self.apply(seq, batch.as_ref()),
            Verdict::Duplicate => {}
            Verdict::Gap { .. } | Verdict::Restart => {
                if in_replay {
                    if let Some(replay) = &mut self.replay {
                        replay.joined = false;
                    }
                }
                self.cache.clear();
                self.sequence.reset();
                self.apply(seq, batch.as_ref());
            }
        }
    }

    fn apply(&mut self, seq: u64, batch: Option<&EventBatch>) {
        if let Some(batch) = batch {
            let counts = &mut self.counts;
            apply_batch(&mut self.cache, batch, &mut |refusal| counts.refuse(refusal));
            self.counts.batches += 1;
            self.last_ts = batch.ts;
        }
        self.sequence.accept(seq, self.last_ts);
    }
}
