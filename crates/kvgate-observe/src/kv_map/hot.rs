//! The hottest prefixes of one model: what requests found cached on the engine they were routed
//! to, by prefix. A prefix is named by the content hash of its last block; each request routed on
//! the exact index adds one hit to the prefixes of its served part at 1, 2, 4, ... blocks and at
//! its whole served length (so a shared system prompt and a long conversation both show, at
//! O(log n) entries a request). Hits decay with a half-life ([`HALF_LIFE_MS`]): "recent hits".
//! The table is bounded: past [`MAX_ENTRIES`] the least recently hit half goes.

use std::collections::HashMap;

/// Hits halve every this many milliseconds.
pub const HALF_LIFE_MS: f64 = 300_000.0;
/// Most prefixes kept per model.
pub const MAX_ENTRIES: usize = 4_096;

/// A ranked prefix: its last block's content hash, its entry, its hits now.
pub type Ranked = (u64, HotEntry, f64);

/// One prefix's hits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HotEntry {
    /// Its length in blocks.
    pub blocks: u32,
    /// Decayed hits as of `at_ms`.
    pub hits: f64,
    pub at_ms: u64,
    /// The prefix one sampled depth shorter on the same chain (none for the first block).
    pub parent: Option<u64>,
}

impl HotEntry {
    /// The hits decayed to `now_ms`.
    pub fn hits_at(&self, now_ms: u64) -> f64 {
        self.hits * decay(now_ms.saturating_sub(self.at_ms))
    }
}

fn decay(elapsed_ms: u64) -> f64 {
    (-(elapsed_ms as f64) / HALF_LIFE_MS * std::f64::consts::LN_2).exp()
}

/// The depths (in blocks) a hit of `served` blocks is counted at: powers of two below it, and
/// itself.
pub fn sampled_depths(served: u32) -> impl Iterator<Item = u32> {
    let powers = (0..32).map(|shift| 1u32 << shift).take_while(move |&depth| depth < served);
    powers.chain((served > 0).then_some(served))
}

/// One model's table.
#[derive(Debug, Default)]
pub struct HotTable {
    entries: HashMap<u64, HotEntry>,
}

impl HotTable {
    /// One request's hit: `chain` is its served part's (depth in blocks, content hash) at the
    /// sampled depths, shortest first.
    pub fn hit(&mut self, chain: &[(u32, u64)], now_ms: u64) {
        let mut parent = None;
        for &(blocks, hash) in chain {
            let entry =
                self.entries.entry(hash).or_insert(HotEntry { blocks, hits: 0.0, at_ms: now_ms, parent });
            entry.hits = entry.hits_at(now_ms) + 1.0;
            entry.at_ms = now_ms;
            parent = Some(hash);
        }
        if self.entries.len() > MAX_ENTRIES {
            self.trim(now_ms);
        }
    }

    /// Keeps the half with the most recent hits.
    fn trim(&mut self, now_ms: u64) {
        let mut scores: Vec<f64> = self.entries.values().map(|entry| entry.hits_at(now_ms)).collect();
        scores.sort_by(|a, b| b.total_cmp(a));
        let keep = scores[MAX_ENTRIES / 2 - 1];
        self.entries.retain(|_, entry| entry.hits_at(now_ms) >= keep);
    }

    /// The `n` hottest prefixes by `score(hits, blocks)`, each the longest of its chain with
    /// that many hits (a prefix whose longer one has 90% of its hits is that longer one).
    pub fn top(&self, n: usize, now_ms: u64, score: impl Fn(f64, u32) -> f64) -> Vec<(u64, HotEntry, f64)> {
        let mut longest_child: HashMap<u64, f64> = HashMap::new();
        for entry in self.entries.values() {
            if let Some(parent) = entry.parent {
                let hits = entry.hits_at(now_ms);
                let best = longest_child.entry(parent).or_default();
                *best = best.max(hits);
            }
        }
        let mut ranked: Vec<Ranked> = self
            .entries
            .iter()
            .filter_map(|(&hash, entry)| {
                let hits = entry.hits_at(now_ms);
                let extended = longest_child.get(&hash).is_some_and(|&child| child >= 0.9 * hits);
                (!extended && hits >= 0.5).then_some((hash, *entry, hits))
            })
            .collect();
        ranked.sort_by(|a, b| score(b.2, b.1.blocks).total_cmp(&score(a.2, a.1.blocks)).then(a.0.cmp(&b.0)));
        ranked.truncate(n);
        ranked
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depths_are_powers_of_two_then_the_whole_served_part() {
        assert_eq!(sampled_depths(11).collect::<Vec<_>>(), [1, 2, 4, 8, 11]);
        assert_eq!(sampled_depths(8).collect::<Vec<_>>(), [1, 2, 4, 8]);
        assert_eq!(sampled_depths(0).count(), 0);
    }

    #[test]
    fn a_shared_start_and_its_long_continuations_rank_by_hits_and_by_tokens() {
        let mut table = HotTable::default();
        // Ten conversations share a 4-block system prompt; one of them comes back 3 times with
        // 64 blocks served.
        for c in 0..10u64 {
            table.hit(&[(1, 1), (2, 2), (4, 4), (8, 100 + c)], 0);
        }
        for _ in 0..3 {
            table.hit(&[(1, 1), (2, 2), (4, 4), (8, 100), (16, 200), (32, 300), (64, 400)], 0);
        }
        let by_hits = table.top(2, 0, |hits, _| hits);
        assert_eq!(by_hits[0].0, 4, "the system prompt, at its longest: {by_hits:?}");
        assert_eq!(by_hits[0].2, 13.0);
        assert_eq!(
            (by_hits[1].0, by_hits[1].2),
            (100, 4.0),
            "then the conversation that came back: {by_hits:?}"
        );
        let by_tokens = table.top(1, 0, |hits, blocks| hits * f64::from(blocks));
        assert_eq!((by_tokens[0].0, by_tokens[0].2), (400, 3.0), "3 x 64 blocks over 13 x 4");
        // Five minutes later the hits count half.
        let later = table.top(1, 300_000, |hits, _| hits);
        assert!((later[0].2 - 6.5).abs() < 1e-9, "{later:?}");
    }

    #[test]
    fn the_table_stays_bounded() {
        let mut table = HotTable::default();
        for i in 0..(3 * MAX_ENTRIES as u64) {
            table.hit(&[(1, i)], i);
        }
        assert!(table.len() <= MAX_ENTRIES, "{}", table.len());
    }
}
