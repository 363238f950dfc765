//! The sequence numbers of one publisher: each batch classified against the last one applied
//! (the next one, a duplicate, a gap, an engine restart).

/// What to do with a batch, given the last one applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
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
pub struct Sequence {
    last: Option<(u64, f64)>,
}

impl Sequence {
    pub fn check(&self, seq: u64, ts: f64) -> Verdict {
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

    /// Records `seq` as applied (or as skipped for good: a batch that could not be decoded).
    pub fn accept(&mut self, seq: u64, ts: f64) {
        self.last = Some((seq, ts));
    }

    pub fn reset(&mut self) {
        self.last = None;
    }

    /// The last applied sequence number.
    pub fn last(&self) -> Option<u64> {
        self.last.map(|(seq, _)| seq)
    }

    /// The sequence number a replay should start from to fill in after the last applied batch.
    pub fn next(&self) -> u64 {
        self.last.map_or(0, |(last, _)| last + 1)
    }
}

#[cfg(test)]
mod tests {
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
}
