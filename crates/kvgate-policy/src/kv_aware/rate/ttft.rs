//! Learning an engine's speed from the times to first token its answers took: each answered
//! request is a sample `ttft = base + tokens / prefill_rate + running x decode_s`, `tokens` the
//! prefill queued ahead of it at the decision (as predicted) plus its own uncached prompt as the
//! engine reported it, `running` the requests running there. A least-squares fit of relative
//! errors (each answer weighted by `(REFERENCE_S / expected)^2`, `expected` the time the fit in
//! use predicts for it (the answer's own until there is a fit): a time to first token's noise is
//! proportional to it, and short answers are what tells the fixed cost apart), with exponential
//! forgetting ([`MEMORY`] answers) and a weak ridge prior pulling each coefficient toward the
//! configured rates ([`PRIOR_WEIGHT`]: it decides only what the answers cannot, e.g. the decode
//! cost while nothing else runs) gives all three; `base` is what no rate explains: the engine's
//! server, a forward pass's fixed cost, the gateway's own hop.
//!
//! It is the source of the rates for engines whose load reports do not say what prefill is
//! queued (vLLM's `/metrics`), and of `base` for every engine.

/// Tokens are fitted in thousands, running requests in tens, so that the normal equations are
/// well conditioned and the prior's weight means the same on each coefficient.
const TOKENS_UNIT: f64 = 1000.0;
const RUNNING_UNIT: f64 = 10.0;
/// The fit remembers about this many answers (each one multiplies the sums so far by
/// `1 - 1 / MEMORY`).
pub(super) const MEMORY: f64 = 64.0;
/// An answer of this many seconds weighs 1 in the fit (a shorter one more, a longer one less).
const REFERENCE_S: f64 = 0.1;
/// The prior's weight on each coefficient, in answers of [`REFERENCE_S`].
const PRIOR_WEIGHT: f64 = 0.1;
/// Answers before the fit is used.
pub(super) const MIN_SAMPLES: u32 = 8;
/// One answer counts at most this factor from the fit's prediction either way (a time to first
/// token stretched by something else on the machine moves the fit little).
const MAX_SURPRISE: f64 = 2.0;

/// A fitted engine: fixed cost, prefill rate, decode cost per running request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Fitted {
    pub(super) base_s: f64,
    pub(super) prefill_tokens_per_sec: f64,
    pub(super) decode_s_per_request: f64,
}

impl Fitted {
    fn coefficients(&self) -> [f64; 3] {
        [self.base_s, TOKENS_UNIT / self.prefill_tokens_per_sec, self.decode_s_per_request * RUNNING_UNIT]
    }

    /// The time to first token this fit predicts.
    pub(super) fn ttft(&self, tokens: f64, running: f64) -> f64 {
        self.base_s + tokens / self.prefill_tokens_per_sec + running * self.decode_s_per_request
    }
}

/// The decayed normal equations of one engine's (or the fleet's) answers.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct TtftFit {
    xtx: [[f64; 3]; 3],
    xty: [f64; 3],
    pub(super) samples: u32,
}

impl TtftFit {
    /// One answer: `tokens` of prefill ahead of and in the request, `running` requests running,
    /// `ttft_s` measured. `current` is the fit in use (an answer far from it is bounded).
    pub(super) fn observe(&mut self, tokens: f64, running: f64, ttft_s: f64, current: Option<Fitted>) {
        if !(tokens.is_finite() && running.is_finite() && ttft_s.is_finite() && ttft_s > 0.0) {
            return;
        }
        let tokens = tokens.max(0.0);
        let running = running.max(0.0);
        // Weighted by what the fit in use expects, not by the answer itself: weighing each answer
        // by its own time would favour the fast ones and fit the lower edge of the noise.
        let (y, scale) = match current {
            Some(fit) => {
                let expected = fit.ttft(tokens, running).max(1e-4);
                (ttft_s.clamp(expected / MAX_SURPRISE, expected * MAX_SURPRISE), expected)
            }
            None => (ttft_s, ttft_s),
        };
        let x = [1.0, tokens / TOKENS_UNIT, running / RUNNING_UNIT];
        let weight = (REFERENCE_S / scale).powi(2);
        let keep = 1.0 - 1.0 / MEMORY;
        for i in 0..3 {
            for j in 0..3 {
                self.xtx[i][j] = self.xtx[i][j] * keep + weight * x[i] * x[j];
            }
            self.xty[i] = self.xty[i] * keep + weight * x[i] * y;
        }
        self.samples = self.samples.saturating_add(1);
    }

    /// The fit, once it has [`MIN_SAMPLES`] answers: the ridge solution around `prior`, each
    /// coefficient kept non-negative (a coefficient the data pushes below zero is fixed at zero
    /// and the others refitted), the prefill rate within `[min_rate, max_rate]`.
    pub(super) fn fitted(&self, prior: Fitted, min_rate: f64, max_rate: f64) -> Option<Fitted> {
        if self.samples < MIN_SAMPLES {
            return None;
        }
        let prior_c = prior.coefficients();
        let mut fixed = [false; 3];
        let mut solution = [0.0; 3];
        for _ in 0..3 {
            solution = self.solve(prior_c, fixed)?;
            match (0..3).find(|&i| !fixed[i] && solution[i] < 0.0) {
                Some(negative) => fixed[negative] = true,
                None => break,
            }
        }
        let per_thousand = solution[1].max(TOKENS_UNIT / max_rate).min(TOKENS_UNIT / min_rate);
        Some(Fitted {
            base_s: solution[0].max(0.0),
            prefill_tokens_per_sec: TOKENS_UNIT / per_thousand,
            decode_s_per_request: solution[2].max(0.0) / RUNNING_UNIT,
        })
    }

    /// The base alone, the rates given: the mean of what they leave unexplained (the fit of
    /// an engine whose reports teach its rates).
    pub(super) fn base_given(&self, rates: Fitted) -> Option<f64> {
        if self.samples < MIN_SAMPLES || self.xtx[0][0] <= 0.0 {
            return None;
        }
        let c = rates.coefficients();
        let explained = c[1] * self.xtx[0][1] + c[2] * self.xtx[0][2];
        Some(((self.xty[0] - explained) / self.xtx[0][0]).max(0.0))
    }

    /// Solves `(XtX + k I) c = Xty + k prior` with the `fixed` coefficients at zero.
    fn solve(&self, prior: [f64; 3], fixed: [bool; 3]) -> Option<[f64; 3]> {
        let free: Vec<usize> = (0..3).filter(|&i| !fixed[i]).collect();
        let n = free.len();
        let mut a = vec![vec![0.0; n + 1]; n];
        for (r, &i) in free.iter().enumerate() {
            for (c, &j) in free.iter().enumerate() {
                a[r][c] = self.xtx[i][j] + if i == j { PRIOR_WEIGHT } else { 0.0 };
            }
            a[r][n] = self.xty[i] + PRIOR_WEIGHT * prior[i];
        }
        // Gaussian elimination with partial pivoting (3 unknowns at most).
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
        let mut solution = [0.0; 3];
        for (r, &i) in free.iter().enumerate() {
            solution[i] = a[r][n] / a[r][r];
        }
        solution.iter().all(|c| c.is_finite()).then_some(solution)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRUTH: Fitted =
        Fitted { base_s: 0.009, prefill_tokens_per_sec: 20_000.0, decode_s_per_request: 0.0001 };
    const CONFIGURED: Fitted =
        Fitted { base_s: 0.0, prefill_tokens_per_sec: 8_000.0, decode_s_per_request: 0.00035 };

    /// Answers of an engine that is `truth`, with deterministic noise of +-`noise` (a fraction).
    fn answers(fit: &mut TtftFit, truth: Fitted, n: u32, noise: f64) {
        for i in 0..n {
            let tokens = f64::from((i * 7919) % 4000) + 32.0;
            let running = f64::from((i * 31) % 12);
            let wobble = 1.0 + noise * (f64::from(i.wrapping_mul(2_654_435_761) % 1000) / 500.0 - 1.0);
            let current = fit.fitted(CONFIGURED, 800.0, 80_000.0);
            fit.observe(tokens, running, truth.ttft(tokens, running) * wobble, current);
        }
    }

    fn within(got: f64, want: f64, tolerance: f64) -> bool {
        (got / want - 1.0).abs() <= tolerance
    }

    #[test]
    fn exact_answers_give_the_engine_back() {
        let mut fit = TtftFit::default();
        answers(&mut fit, TRUTH, MIN_SAMPLES - 1, 0.0);
        assert_eq!(fit.fitted(CONFIGURED, 800.0, 80_000.0), None, "too few answers");
        answers(&mut fit, TRUTH, 40, 0.0);
        let got = fit.fitted(CONFIGURED, 800.0, 80_000.0).unwrap();
        assert!(within(got.prefill_tokens_per_sec, 20_000.0, 0.02), "{got:?}");
        assert!(within(got.base_s, 0.009, 0.05), "{got:?}");
        assert!((got.decode_s_per_request - 0.0001).abs() < 0.00005, "{got:?}");
    }

    #[test]
    fn thirty_two_noisy_answers_learn_the_rate_within_ten_percent() {
        let mut fit = TtftFit::default();
        answers(&mut fit, TRUTH, 32, 0.2);
        let got = fit.fitted(CONFIGURED, 800.0, 80_000.0).unwrap();
        assert!(within(got.prefill_tokens_per_sec, 20_000.0, 0.10), "{got:?}");
        // And its predictions of answers it has not seen are within the answers' own noise.
        for (tokens, running) in [(64.0, 0.0), (900.0, 3.0), (3_000.0, 8.0)] {
            let (p, t) = (got.ttft(tokens, running), TRUTH.ttft(tokens, running));
            assert!(within(p, t, 0.25), "{tokens} tokens, {running} running: {p} vs {t}");
        }
    }

    #[test]
    fn a_coefficient_never_goes_negative_and_one_outlier_moves_little() {
        let mut fit = TtftFit::default();
        // No decode cost at all: the fit's stays at zero or above, the rest is learned.
        let flat = Fitted { decode_s_per_request: 0.0, ..TRUTH };
        answers(&mut fit, flat, 40, 0.05);
        let before = fit.fitted(CONFIGURED, 800.0, 80_000.0).unwrap();
        assert!(before.decode_s_per_request >= 0.0 && before.base_s >= 0.0, "{before:?}");
        assert!(within(before.prefill_tokens_per_sec, 20_000.0, 0.1), "{before:?}");
        fit.observe(500.0, 0.0, 30.0, Some(before));
        let after = fit.fitted(CONFIGURED, 800.0, 80_000.0).unwrap();
        assert!(within(after.ttft(500.0, 0.0), before.ttft(500.0, 0.0), 0.25), "{before:?} {after:?}");
        // Bad samples are ignored.
        fit.observe(f64::NAN, 0.0, 0.1, None);
        fit.observe(100.0, 0.0, -1.0, None);
        assert_eq!(fit.fitted(CONFIGURED, 800.0, 80_000.0), Some(after));
    }

    #[test]
    fn the_base_alone_given_the_rates() {
        let mut fit = TtftFit::default();
        answers(&mut fit, TRUTH, 40, 0.0);
        let base = fit.base_given(TRUTH).unwrap();
        assert!(within(base, 0.009, 0.01), "{base}");
    }
}
