//! Learning an engine's speed from the times to first token its answers took: each answered
//! request is a sample `ttft = base + tokens / prefill_rate + context x pairs + running x
//! decode_s`, `tokens` the prefill queued ahead of it at the decision (as predicted) plus its own
//! uncached prompt as the engine reported it, `pairs` the (new token, context token) pairs its
//! own prefill computes attention over ([`attention_pairs`]: a prefill step's cost grows with
//! the context its tokens attend to, ~25 ns a pair on vLLM's CPU build, docs/BENCHMARKS.md),
//! `running` the requests running there.
//!
//! The last [`MEMORY`] answers are kept and refitted after each one: a robust least-squares fit
//! of relative errors (iteratively reweighted: each answer weighted by `(REFERENCE_S /
//! expected)^2`, `expected` the previous iteration's prediction for it, and down-weighted past
//! [`HUBER`] relative error, so a time to first token stretched by something else on the machine
//! moves the fit little). Each refit starts from the answers alone (weighted by their own
//! times), never from the fit in use: a low start cannot hold the fit down by bounding what
//! the answers may say (it did: a fit that bounded each answer to 2x its own prediction put
//! cold prompts' time into `base` and kept its start's prefill rate). A weak ridge prior pulls
//! each coefficient toward the configured rates ([`PRIOR_WEIGHT`]; the context cost toward 0):
//! it decides only what the answers cannot, e.g. the decode cost while nothing else runs.
//! `base` is what no rate explains: the engine's server, a forward pass's fixed cost, the
//! gateway's own hop.
//!
//! It is the source of the rates for engines whose load reports do not say what prefill is
//! queued (vLLM's `/metrics`), and of `base` for every engine.

use std::collections::VecDeque;

/// Tokens are fitted in thousands, pairs in millions, running requests in tens, so that the
/// normal equations are well conditioned and the prior's weight means the same on each
/// coefficient.
const UNITS: [f64; 4] = [1.0, 1000.0, 1e6, 10.0];
/// Answers the fit is made of (the newest).
pub(super) const MEMORY: usize = 64;
/// An answer of this many seconds weighs 1 in the fit (a shorter one more, a longer one less).
const REFERENCE_S: f64 = 0.1;
/// The prior's weight on each coefficient, in answers of [`REFERENCE_S`].
const PRIOR_WEIGHT: f64 = 0.01;
/// Answers before the fit is used.
pub(super) const MIN_SAMPLES: u32 = 8;
/// Relative error past which an answer's weight falls as its inverse (Huber's loss): the fit
/// follows the bulk of the answers, not the few a busy machine stretched.
const HUBER: f64 = 0.25;
/// Reweighting passes of one refit.
const PASSES: usize = 8;

/// The (new token, context token) pairs a prefill of `new` tokens after `context` cached ones
/// computes attention over: each new token attends to the context and to the new tokens before
/// it.
pub fn attention_pairs(new: f64, context: f64) -> f64 {
    new.max(0.0) * (context.max(0.0) + new.max(0.0) / 2.0)
}

/// A fitted engine: fixed cost, prefill rate, context cost, decode cost per running request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Fitted {
    pub(super) base_s: f64,
    pub(super) prefill_tokens_per_sec: f64,
    /// Seconds per (new token, context token) pair.
    pub(super) context_s_per_pair: f64,
    pub(super) decode_s_per_request: f64,
}

impl Fitted {
    /// The coefficients in the fit's units.
    fn coefficients(&self) -> [f64; 4] {
        [
            self.base_s,
            UNITS[1] / self.prefill_tokens_per_sec,
            self.context_s_per_pair * UNITS[2],
            self.decode_s_per_request * UNITS[3],
        ]
    }

    /// The time to first token this fit predicts.
    pub(super) fn ttft(&self, answer: &Answer) -> f64 {
        self.base_s
            + answer.tokens / self.prefill_tokens_per_sec
            + answer.pairs * self.context_s_per_pair
            + answer.running * self.decode_s_per_request
    }
}

/// One measured answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Answer {
    /// Prefill tokens ahead of and in the request.
    pub(super) tokens: f64,
    /// Its own prefill's attention pairs ([`attention_pairs`]).
    pub(super) pairs: f64,
    /// Requests running.
    pub(super) running: f64,
    /// Measured time to first token.
    pub(super) ttft_s: f64,
}

impl Answer {
    fn x(&self) -> [f64; 4] {
        [1.0, self.tokens / UNITS[1], self.pairs / UNITS[2], self.running / UNITS[3]]
    }
}

/// What the fit starts from and the rates it may give.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Bounds {
    pub(super) prior: Fitted,
    pub(super) min_rate: f64,
    pub(super) max_rate: f64,
}

/// One engine's (or the fleet's) last answers and their fit.
#[derive(Clone, Debug, Default)]
pub(super) struct TtftFit {
    answers: VecDeque<Answer>,
    pub(super) samples: u32,
    fit: Option<Fitted>,
}

impl TtftFit {
    /// One answer; refits.
    pub(super) fn observe(&mut self, answer: Answer, bounds: &Bounds) {
        let Answer { tokens, pairs, running, ttft_s } = answer;
        if !([tokens, pairs, running, ttft_s].iter().all(|v| v.is_finite()) && ttft_s > 0.0) {
            return;
        }
        let answer =
            Answer { tokens: tokens.max(0.0), pairs: pairs.max(0.0), running: running.max(0.0), ttft_s };
        if self.answers.len() == MEMORY {
            self.answers.pop_front();
        }
        self.answers.push_back(answer);
        self.samples = self.samples.saturating_add(1);
        if self.samples >= MIN_SAMPLES {
            self.fit = self.refit(bounds).or(self.fit);
        }
    }

    /// The fit, once it has [`MIN_SAMPLES`] answers.
    pub(super) fn fitted(&self) -> Option<Fitted> {
        self.fit
    }

    /// The robust fit of the kept answers (module doc): each coefficient non-negative (one the
    /// data pushes below zero is fixed at zero and the others refitted), the prefill rate within
    /// the bounds.
    fn refit(&self, bounds: &Bounds) -> Option<Fitted> {
        let prior = bounds.prior.coefficients();
        let mut expected: Vec<f64> = self.answers.iter().map(|a| a.ttft_s).collect();
        let mut fit = None;
        for pass in 0..PASSES {
            let weights: Vec<f64> = self
                .answers
                .iter()
                .zip(&expected)
                .map(|(answer, &expected)| {
                    let expected = expected.max(1e-4);
                    let error = ((answer.ttft_s - expected) / expected).abs();
                    let huber = if pass == 0 || error <= HUBER { 1.0 } else { HUBER / error };
                    (REFERENCE_S / expected).powi(2) * huber
                })
                .collect();
            let solution = self.solve_non_negative(&weights, prior)?;
            let per_thousand = solution[1].clamp(UNITS[1] / bounds.max_rate, UNITS[1] / bounds.min_rate);
            let next = Fitted {
                base_s: solution[0].max(0.0),
                prefill_tokens_per_sec: UNITS[1] / per_thousand,
                context_s_per_pair: solution[2].max(0.0) / UNITS[2],
                decode_s_per_request: solution[3].max(0.0) / UNITS[3],
            };
            expected = self.answers.iter().map(|a| next.ttft(a)).collect();
            fit = Some(next);
        }
        fit
    }

    fn solve_non_negative(&self, weights: &[f64], prior: [f64; 4]) -> Option<[f64; 4]> {
        let mut xtx = [[0.0; 4]; 4];
        let mut xty = [0.0; 4];
        for (answer, &w) in self.answers.iter().zip(weights) {
            let x = answer.x();
            for i in 0..4 {
                for j in 0..4 {
                    xtx[i][j] += w * x[i] * x[j];
                }
                xty[i] += w * x[i] * answer.ttft_s;
            }
        }
        let mut fixed = [false; 4];
        let mut solution = [0.0; 4];
        for _ in 0..4 {
            solution = solve(&xtx, &xty, prior, fixed)?;
            match (0..4).find(|&i| !fixed[i] && solution[i] < 0.0) {
                Some(negative) => fixed[negative] = true,
                None => break,
            }
        }
        Some(solution)
    }

    /// The base alone, the rates given: the median of what they leave unexplained (the fit of
    /// an engine whose reports teach its rates; they carry no context cost).
    pub(super) fn base_given(&self, rates: Fitted) -> Option<f64> {
        if self.samples < MIN_SAMPLES || self.answers.is_empty() {
            return None;
        }
        let rates = Fitted { base_s: 0.0, context_s_per_pair: 0.0, ..rates };
        let mut left: Vec<f64> = self.answers.iter().map(|a| a.ttft_s - rates.ttft(a)).collect();
        left.sort_by(f64::total_cmp);
        Some(left[left.len() / 2].max(0.0))
    }
}

/// Solves `(XtX + k I) c = Xty + k prior` with the `fixed` coefficients at zero.
fn solve(xtx: &[[f64; 4]; 4], xty: &[f64; 4], prior: [f64; 4], fixed: [bool; 4]) -> Option<[f64; 4]> {
    let free: Vec<usize> = (0..4).filter(|&i| !fixed[i]).collect();
    let n = free.len();
    let mut a = vec![vec![0.0; n + 1]; n];
    for (r, &i) in free.iter().enumerate() {
        for (c, &j) in free.iter().enumerate() {
            a[r][c] = xtx[i][j] + if i == j { PRIOR_WEIGHT } else { 0.0 };
        }
        a[r][n] = xty[i] + PRIOR_WEIGHT * prior[i];
    }
    // Gaussian elimination with partial pivoting (4 unknowns at most).
    for col in 0..n {
        let pivot = (col..n).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        a.swap(col, pivot);
        if a[col][col].abs() < 1e-12 {
            return None;
        }
        let pivot_row = a[col].clone();
        for (row, values) in a.iter_mut().enumerate() {
            if row != col {
                let factor = values[col] / pivot_row[col];
                for (value, pivot_value) in values.iter_mut().zip(&pivot_row).skip(col) {
                    *value -= factor * pivot_value;
                }
            }
        }
    }
    let mut solution = [0.0; 4];
    for (r, &i) in free.iter().enumerate() {
        solution[i] = a[r][n] / a[r][r];
    }
    solution.iter().all(|c| c.is_finite()).then_some(solution)
}

#[cfg(test)]
mod tests;
