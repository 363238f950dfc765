//! The pieces every generated shape is made of: fresh block and session ids, a prompt context that grows by
//! tokens (filling its last block before opening a new one, so a longer prompt of the same
//! context extends the shorter one exactly as a conversation's next turn does), and the random
//! draws (uniform integers, exponential gaps, log-normal lengths, popularity ranks).

use rand::rngs::StdRng;
use rand::Rng;

use crate::trace::{TraceRequest, MOONCAKE_BLOCK_TOKENS};

/// Hands out block ids and session ids never used before in the trace.
#[derive(Debug, Default)]
pub(super) struct Blocks {
    next: u64,
    sessions: u64,
}

impl Blocks {
    pub(super) fn fresh(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// A new session id: `s1`, `s2`, ...
    pub(super) fn session(&mut self) -> String {
        self.sessions += 1;
        format!("s{}", self.sessions)
    }
}

/// A prompt prefix: its blocks and its length in tokens (the last block may be partial).
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Context {
    pub(super) hash_ids: Vec<u64>,
    pub(super) tokens: u32,
}

impl Context {
    /// `tokens` new tokens at the end: the partial last block is filled first (its id stays, so
    /// the shorter context is a prefix of the longer), then fresh blocks.
    pub(super) fn extend(&mut self, tokens: u32, blocks: &mut Blocks) {
        let block = MOONCAKE_BLOCK_TOKENS as u32;
        let mut left = tokens;
        let room = (block - self.tokens % block) % block;
        let fill = room.min(left);
        self.tokens += fill;
        left -= fill;
        while left > 0 {
            self.hash_ids.push(blocks.fresh());
            let take = left.min(block);
            self.tokens += take;
            left -= take;
        }
    }

    /// A context of `tokens` fresh tokens.
    pub(super) fn fresh(tokens: u32, blocks: &mut Blocks) -> Context {
        let mut context = Context::default();
        context.extend(tokens, blocks);
        context
    }

    /// This context started in a fresh block: `self` then `tokens` new tokens in new blocks only
    /// (what a question after a shared document is: the document's last block stays whole for
    /// every question to share, so it is rounded up to whole blocks).
    pub(super) fn then_fresh(&self, tokens: u32, blocks: &mut Blocks) -> Context {
        let block = MOONCAKE_BLOCK_TOKENS as u32;
        let mut context = self.clone();
        context.tokens = context.hash_ids.len() as u32 * block;
        context.extend(tokens, blocks);
        context
    }

    pub(super) fn request(&self, at_ms: f64, output_length: u32) -> TraceRequest {
        TraceRequest {
            timestamp_ms: at_ms,
            input_length: self.tokens,
            output_length: output_length.max(1),
            hash_ids: self.hash_ids.clone(),
            ..TraceRequest::default()
        }
    }

    /// A closed-loop session's request: sent at `at_s` by `session`, `think_s` after the
    /// previous answer (`None` for the session's first).
    pub(super) fn session_request(
        &self,
        at_s: f64,
        output_length: u32,
        session: &str,
        think_s: Option<f64>,
    ) -> TraceRequest {
        TraceRequest {
            session_id: Some(session.to_string()),
            think_ms: think_s.map(|s| s * 1000.0),
            ..self.request(at_s * 1000.0, output_length)
        }
    }
}

/// Whole blocks of at least `tokens` tokens (a shared prefix stays whole for all to share).
pub(super) fn whole_blocks(tokens: u32) -> u32 {
    let block = MOONCAKE_BLOCK_TOKENS as u32;
    tokens.div_ceil(block).max(1) * block
}

/// The mean of [`uniform`]`(low, high)`.
pub(super) fn mean(low: u32, high: u32) -> f64 {
    (f64::from(low) + f64::from(high.max(low))) / 2.0
}

/// `count` shared documents of `low..=high` tokens each, in whole blocks.
pub(super) fn documents(
    count: usize,
    (low, high): (u32, u32),
    rng: &mut StdRng,
    blocks: &mut Blocks,
) -> Vec<Context> {
    (0..count).map(|_| Context::fresh(whole_blocks(uniform(rng, low, high)), blocks)).collect()
}

/// Uniform in `low..=high`.
pub(super) fn uniform(rng: &mut StdRng, low: u32, high: u32) -> u32 {
    rng.random_range(low..=high.max(low))
}

/// Exponential with mean `mean`.
pub(super) fn exponential(rng: &mut StdRng, mean: f64) -> f64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    -u.ln() * mean
}

/// Log-normal with median `median` and log standard deviation `sigma`, cut to `1..=max`.
pub(super) fn log_normal(rng: &mut StdRng, median: u32, sigma: f64, max: u32) -> u32 {
    // Box-Muller: a standard normal from two uniforms.
    let (u, v): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random_range(0.0..1.0));
    let normal = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
    let length = f64::from(median) * (sigma * normal).exp();
    (length.round() as u32).clamp(1, max.max(1))
}

/// Draws ranks `0..n` with probability proportional to `1 / (rank + 1)^skew`.
pub(super) struct Popularity {
    cumulative: Vec<f64>,
}

impl Popularity {
    pub(super) fn new(n: usize, skew: f64) -> Popularity {
        let mut total = 0.0;
        let cumulative = (1..=n.max(1))
            .map(|rank| {
                total += (rank as f64).powf(-skew);
                total
            })
            .collect();
        Popularity { cumulative }
    }

    /// Each rank's probability.
    pub(super) fn shares(&self) -> Vec<f64> {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let mut previous = 0.0;
        self.cumulative
            .iter()
            .map(|&c| {
                let share = (c - previous) / total;
                previous = c;
                share
            })
            .collect()
    }

    pub(super) fn draw(&self, rng: &mut StdRng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let x = rng.random_range(0.0..total);
        self.cumulative.partition_point(|&c| c <= x).min(self.cumulative.len() - 1)
    }
}

/// Log-uniform in `low..=high` (every scale of length equally likely).
pub(super) fn log_uniform(rng: &mut StdRng, low: u32, high: u32) -> u32 {
    let (low, high) = (f64::from(low.max(1)), f64::from(high.max(low.max(1))));
    let x: f64 = rng.random_range(low.ln()..=high.ln());
    (x.exp().round() as u32).clamp(low as u32, high as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_fills_its_last_block_before_opening_another() {
        let mut blocks = Blocks::default();
        let mut context = Context::fresh(700, &mut blocks);
        assert_eq!((context.hash_ids.clone(), context.tokens), (vec![1, 2], 700));
        let before = context.clone();
        context.extend(400, &mut blocks);
        assert_eq!((context.hash_ids.clone(), context.tokens), (vec![1, 2, 3], 1100));
        assert_eq!(context.hash_ids[..2], before.hash_ids[..], "the shorter context is a prefix");
        let question = before.then_fresh(10, &mut blocks);
        assert_eq!((question.hash_ids, question.tokens), (vec![1, 2, 4], 1034));
    }
}
