//! Is the index right? The closed loop between what the index predicted cached on the worker a
//! request went to and what that worker's engine then reported cached, over a sliding window of
//! requests, with the likely cause when the two disagree persistently.
//!
//! A wrong chat template or tokenizer, another block size or a stalled event stream all turn
//! exact routing into noise without any error: the index still answers, just about the wrong
//! blocks. The engines' own usage reports (`usage.prompt_tokens_details.cached_tokens`, SGLang's
//! `meta_info.cached_tokens`) are the ground truth that catches it.

use std::collections::VecDeque;
use std::fmt;

/// One request's outcome: its prompt, the tokens the index predicted cached on the chosen worker,
/// and the tokens the engine reported cached (`None`: its answer said nothing about it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccuracySample {
    pub prompt_tokens: u32,
    pub predicted: u32,
    pub engine_cached: Option<u32>,
    /// The worker's engine's events flowed into the exact index the prediction came from (false:
    /// the index knew nothing of that engine's cache).
    pub exact: bool,
}

/// When a disagreement is raised: the window is full and either the error exceeds its share of
/// the prompt tokens, or too many of the requests where either side claims a cache hit are
/// wrong.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AccuracySettings {
    /// Requests in the window.
    pub window: usize,
    /// Raised when the error (sum of |predicted - reported| over the window's prompt tokens)
    /// exceeds this share; cleared when it is back under half of it.
    pub max_error_share: f64,
    /// Raised when more than this share of the window's claimed requests (predicted or reported
    /// cached tokens) are wrong (off by more than half of the larger claim), given at least
    /// `min_claimed` of them; cleared under half of it. Where few prompt tokens are cached at
    /// all (a 5% hit rate), a blind index is never 10% of the prompt tokens off, but most of
    /// its claims are wrong.
    pub max_wrong_share: f64,
    pub min_claimed: usize,
    /// Raised when the cached tokens the engine served beyond what the index predicted exceed
    /// this share of all the engine served cached, over at least `min_underclaimed` requests
    /// that it under-predicted; cleared under half of it. This catches an index that matches a
    /// shared start (a common system prompt both sides hold) but misses what follows (the
    /// earlier turns of each conversation, under a chat template that differs after the first
    /// message): its error is small against the prompt tokens and its claims look right, but a
    /// large part of the engine's hits is invisible to it.
    pub max_missed_share: f64,
    pub min_underclaimed: usize,
}

impl Default for AccuracySettings {
    /// 10% of prompt tokens, or a quarter of at least 10 claims, or 10% of the engine's cached
    /// tokens missed over at least 5 under-predicted requests, over 100 requests: far above
    /// the noise of an index that agrees (a request in flight, a block evicted between routing
    /// and admission: one claim in a hundred on the trace replays), far below what a wrong
    /// template gives (most of the prompt, or most of the claims).
    fn default() -> Self {
        AccuracySettings {
            window: 100,
            max_error_share: 0.10,
            max_wrong_share: 0.25,
            min_claimed: 10,
            max_missed_share: 0.10,
            min_underclaimed: 5,
        }
    }
}

/// What most likely makes the index and the engine disagree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LikelyCause {
    /// The engine's answers carry no cached-token count.
    EngineReportsNothing,
    /// The predictions were made without the worker's engine's events (its subscription not
    /// flowing).
    EventsNotFlowing,
    /// The index matched nothing where the engine served cached tokens: the gateway's token ids
    /// differ from the engine's from the start.
    TokenizerOrTemplate,
    /// The index predicts more than the engine serves.
    IndexOverclaims,
    /// The engine serves more than the index predicts (part of the prompt matched).
    IndexUnderclaims,
}

impl LikelyCause {
    pub fn as_str(self) -> &'static str {
        match self {
            LikelyCause::EngineReportsNothing => "engine_reports_no_cached_tokens",
            LikelyCause::EventsNotFlowing => "events_not_flowing",
            LikelyCause::TokenizerOrTemplate => "tokenizer_or_template",
            LikelyCause::IndexOverclaims => "index_overclaims",
            LikelyCause::IndexUnderclaims => "index_underclaims",
        }
    }

    /// What an operator should check.
    pub fn advice(self) -> &'static str {
        match self {
            LikelyCause::EngineReportsNothing => {
                "the engine reports no cached tokens: start vLLM with --enable-prompt-tokens-details \
                 (SGLang's OpenAI API: --enable-cache-report)"
            }
            LikelyCause::EventsNotFlowing => {
                "the engines' KV events are not flowing, so the index knows nothing of their caches: \
                 check --kv-events-endpoints and the engines' --kv-events-config"
            }
            LikelyCause::TokenizerOrTemplate => {
                "the index matches none of what the engine caches: the gateway's tokenizer or chat \
                 template differs from the engine's (--tokenizer-path, --chat-template)"
            }
            LikelyCause::IndexOverclaims => {
                "the index predicts more cached tokens than the engine serves: another block size \
                 or hash, lost removal events, or a cache the engine resets"
            }
            LikelyCause::IndexUnderclaims => {
                "the engine serves more cached tokens than the index predicts: token ids that \
                 differ after a common start (chat template), or missed store events"
            }
        }
    }
}

impl fmt::Display for LikelyCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A persistent disagreement, as raised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Disagreement {
    /// The window's error as a share of its prompt tokens.
    pub error_share: f64,
    /// The share of the window's claimed requests that were wrong.
    pub wrong_share: f64,
    /// The share of the engine's cached tokens the index did not predict.
    pub missed_share: f64,
    pub cause: LikelyCause,
    pub requests: usize,
}

/// What one sample changed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AccuracyChange {
    Raised(Disagreement),
    Cleared,
}

/// The window of one (model, worker).
#[derive(Clone, Debug)]
pub struct IndexAccuracy {
    settings: AccuracySettings,
    window: VecDeque<AccuracySample>,
    raised: Option<Disagreement>,
}

impl IndexAccuracy {
    pub fn new(settings: AccuracySettings) -> Self {
        IndexAccuracy { settings, window: VecDeque::with_capacity(settings.window), raised: None }
    }

    /// The disagreement in force, if any.
    pub fn disagreement(&self) -> Option<Disagreement> {
        self.raised
    }

    /// The window's error as a share of its prompt tokens (over the reported samples).
    pub fn error_share(&self) -> f64 {
        let (error, prompt) = self.reported().fold((0u64, 0u64), |(error, prompt), (sample, cached)| {
            (error + u64::from(sample.predicted.abs_diff(cached)), prompt + u64::from(sample.prompt_tokens))
        });
        if prompt == 0 {
            0.0
        } else {
            error as f64 / prompt as f64
        }
    }

    pub fn requests(&self) -> usize {
        self.window.len()
    }

    /// The share of the claimed requests (either side says something is cached) that are wrong
    /// (off by more than half of the larger claim), and how many were claimed.
    pub fn wrong_share(&self) -> (f64, usize) {
        let (mut claimed, mut wrong) = (0usize, 0usize);
        for (sample, cached) in self.reported() {
            let claim = sample.predicted.max(cached);
            if claim > 0 {
                claimed += 1;
                wrong += usize::from(sample.predicted.abs_diff(cached) * 2 > claim);
            }
        }
        (if claimed == 0 { 0.0 } else { wrong as f64 / claimed as f64 }, claimed)
    }

    /// The share of the engine-reported cached tokens the index did not predict (the tokens the
    /// engine served beyond each prediction, over all it served cached), and how many requests
    /// it under-predicted.
    pub fn missed_share(&self) -> (f64, usize) {
        let (mut missed, mut cached_total, mut underclaimed) = (0u64, 0u64, 0usize);
        for (sample, cached) in self.reported() {
            cached_total += u64::from(cached);
            if cached > sample.predicted {
                missed += u64::from(cached - sample.predicted);
                underclaimed += 1;
            }
        }
        (if cached_total == 0 { 0.0 } else { missed as f64 / cached_total as f64 }, underclaimed)
    }

    /// Adds a request's outcome; says when a disagreement was raised or cleared by it.
    pub fn record(&mut self, sample: AccuracySample) -> Option<AccuracyChange> {
        if self.window.len() == self.settings.window.max(1) {
            self.window.pop_front();
        }
        self.window.push_back(sample);
        if self.window.len() < self.settings.window.max(1) {
            return None;
        }
        let verdict = self.verdict();
        match (self.raised, verdict) {
            (None, Some(disagreement)) => {
                self.raised = Some(disagreement);
                Some(AccuracyChange::Raised(disagreement))
            }
            (Some(_), Some(disagreement)) => {
                self.raised = Some(disagreement);
                None
            }
            (Some(_), None)
                if self.error_share() < self.settings.max_error_share / 2.0
                    && self.wrong_share().0 < self.settings.max_wrong_share / 2.0
                    && self.missed_share().0 < self.settings.max_missed_share / 2.0 =>
            {
                self.raised = None;
                Some(AccuracyChange::Cleared)
            }
            _ => None,
        }
    }

    fn reported(&self) -> impl Iterator<Item = (&AccuracySample, u32)> {
        self.window.iter().filter_map(|sample| sample.engine_cached.map(|cached| (sample, cached)))
    }

    /// The window's disagreement, if its error is above the share (or the engine reports
    /// nothing while the index predicts hits).
    fn verdict(&self) -> Option<Disagreement> {
        let requests = self.window.len();
        let reported = self.reported().count();
        let predicted: u64 = self.window.iter().map(|s| u64::from(s.predicted)).sum();
        let prompt: u64 = self.window.iter().map(|s| u64::from(s.prompt_tokens)).sum();
        if reported * 2 < requests {
            // Most answers say nothing: a disagreement only if the index claims a lot.
            let share = if prompt == 0 { 0.0 } else { predicted as f64 / prompt as f64 };
            return (share > self.settings.max_error_share).then_some(Disagreement {
                error_share: share,
                wrong_share: 0.0,
                missed_share: 0.0,
                cause: LikelyCause::EngineReportsNothing,
                requests,
            });
        }
        let error_share = self.error_share();
        let (wrong_share, claimed) = self.wrong_share();
        let claims_wrong =
            claimed >= self.settings.min_claimed && wrong_share > self.settings.max_wrong_share;
        let (missed_share, underclaimed) = self.missed_share();
        let hits_missed =
            underclaimed >= self.settings.min_underclaimed && missed_share > self.settings.max_missed_share;
        if error_share <= self.settings.max_error_share && !claims_wrong && !hits_missed {
            return None;
        }
        let (mut over, mut under, mut blind, mut cached_total) = (0u64, 0u64, 0u64, 0u64);
        for (sample, cached) in self.reported() {
            let (predicted, cached) = (u64::from(sample.predicted), u64::from(cached));
            cached_total += cached;
            if predicted > cached {
                over += predicted - cached;
            } else {
                under += cached - predicted;
                if predicted == 0 {
                    blind += cached;
                }
            }
        }
        let approximate = self.window.iter().filter(|s| !s.exact).count();
        let cause = if approximate * 2 > requests {
            LikelyCause::EventsNotFlowing
        } else if cached_total == 0 && over > 0 {
            LikelyCause::EngineReportsNothing
        } else if over > under {
            LikelyCause::IndexOverclaims
        } else if blind * 2 > under {
            LikelyCause::TokenizerOrTemplate
        } else {
            LikelyCause::IndexUnderclaims
        };
        Some(Disagreement { error_share, wrong_share, missed_share, cause, requests })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(prompt: u32, predicted: u32, cached: Option<u32>) -> AccuracySample {
        AccuracySample { prompt_tokens: prompt, predicted, engine_cached: cached, exact: true }
    }

    fn feed(accuracy: &mut IndexAccuracy, n: usize, sample: AccuracySample) -> Vec<AccuracyChange> {
        (0..n).filter_map(|_| accuracy.record(sample)).collect()
    }

    #[test]
    fn agreement_raises_nothing_and_noise_stays_under_the_share() {
        let mut accuracy = IndexAccuracy::new(AccuracySettings::default());
        assert_eq!(feed(&mut accuracy, 150, sample(1000, 512, Some(512))), []);
        assert_eq!(feed(&mut accuracy, 100, sample(1000, 512, Some(480))), [], "3% off");
        assert_eq!(accuracy.wrong_share(), (0.0, 100));
        assert!((accuracy.error_share() - 0.032).abs() < 1e-9);
        assert_eq!(accuracy.requests(), 100);
    }

    #[test]
    fn a_wrong_template_is_raised_once_with_its_cause_then_cleared() {
        let mut accuracy = IndexAccuracy::new(AccuracySettings::default());
        // The engine serves 800 cached tokens of 1,000; the index matches nothing.
        let changes = feed(&mut accuracy, 200, sample(1000, 0, Some(800)));
        let [AccuracyChange::Raised(raised)] = changes[..] else { panic!("{changes:?}") };
        assert_eq!((raised.cause, raised.requests), (LikelyCause::TokenizerOrTemplate, 100));
        assert!((raised.error_share - 0.8).abs() < 1e-9);
        assert_eq!(feed(&mut accuracy, 100, sample(1000, 800, Some(800))), [AccuracyChange::Cleared]);
        assert_eq!(accuracy.disagreement(), None);
    }

    #[test]
    fn each_cause_from_its_pattern() {
        let cause = |samples: &[AccuracySample]| {
            let settings = AccuracySettings { window: 10, min_claimed: 5, ..AccuracySettings::default() };
            let mut accuracy = IndexAccuracy::new(settings);
            for _ in 0..10 {
                for &s in samples {
                    accuracy.record(s);
                }
            }
            accuracy.disagreement().map(|d| d.cause)
        };
        assert_eq!(cause(&[sample(100, 90, Some(0))]), Some(LikelyCause::EngineReportsNothing));
        assert_eq!(cause(&[sample(100, 90, None)]), Some(LikelyCause::EngineReportsNothing));
        assert_eq!(cause(&[sample(100, 0, None)]), None, "nothing claimed, nothing reported");
        assert_eq!(cause(&[sample(100, 90, Some(40))]), Some(LikelyCause::IndexOverclaims));
        assert_eq!(cause(&[sample(100, 30, Some(90))]), Some(LikelyCause::IndexUnderclaims));
        assert_eq!(cause(&[sample(100, 0, Some(90))]), Some(LikelyCause::TokenizerOrTemplate));
        let tree = AccuracySample { exact: false, ..sample(100, 80, Some(10)) };
        assert_eq!(cause(&[tree]), Some(LikelyCause::EventsNotFlowing));
    }

    #[test]
    fn where_little_is_cached_wrong_claims_are_raised_and_one_outlier_is_not() {
        // 5% of prompt tokens cached: a blind index is 5% off, under the 10% share, but every
        // one of its claims is wrong.
        let mut accuracy = IndexAccuracy::new(AccuracySettings::default());
        let mut changes = Vec::new();
        for i in 0..100 {
            let hit = if i % 5 == 0 { sample(1000, 0, Some(250)) } else { sample(1000, 0, Some(0)) };
            changes.extend(accuracy.record(hit));
        }
        let [AccuracyChange::Raised(raised)] = changes[..] else { panic!("{changes:?}") };
        assert_eq!(raised.cause, LikelyCause::TokenizerOrTemplate);
        assert!((raised.error_share - 0.05).abs() < 1e-9 && raised.wrong_share == 1.0, "{raised:?}");
        // An index that agrees, one block evicted before admission among 20 claims: nothing.
        let mut accuracy = IndexAccuracy::new(AccuracySettings::default());
        for i in 0..100 {
            let hit = match i {
                0 => sample(1000, 512, Some(0)),
                i if i % 5 == 0 => sample(1000, 256, Some(256)),
                _ => sample(1000, 0, Some(0)),
            };
            assert_eq!(accuracy.record(hit), None);
        }
        assert_eq!(accuracy.wrong_share(), (0.05, 20));
    }

    /// The trace's pattern under a wrong template (docs/BENCHMARKS.md, "Is the index right?"):
    /// every request's shared first block is predicted and served alike, the earlier turns some
    /// requests carry are served by the engine and missed by the index. The prompt-token error
    /// (1%) and the wrong claims (each miss is under half of its claim) stay under their bounds;
    /// the missed share of the engine's hits (16%) does not.
    #[test]
    fn a_matched_shared_start_does_not_hide_the_missed_turns() {
        let trace_like = |i: usize, missed_turns: u32| {
            let earlier = if i.is_multiple_of(4) { missed_turns } else { 0 };
            sample(10_000, 512, Some(512 + earlier))
        };
        let mut accuracy = IndexAccuracy::new(AccuracySettings::default());
        let mut changes = Vec::new();
        for i in 0..100 {
            changes.extend(accuracy.record(trace_like(i, 400)));
        }
        let [AccuracyChange::Raised(raised)] = changes[..] else { panic!("{changes:?}") };
        assert_eq!(raised.cause, LikelyCause::IndexUnderclaims);
        assert!(raised.error_share <= 0.01 && raised.wrong_share == 0.0, "the old bounds hold: {raised:?}");
        assert!((raised.missed_share - 10_000.0 / 61_200.0).abs() < 1e-9, "{raised:?}");
        // The right template on the same traffic: every hit predicted, one late store event
        // among them (a turn sent before its previous turn's events arrived): nothing.
        let mut accuracy = IndexAccuracy::new(AccuracySettings::default());
        for i in 0..100 {
            let served = trace_like(i, 400);
            let predicted = if i == 8 { 512 } else { served.engine_cached.unwrap() };
            assert_eq!(accuracy.record(AccuracySample { predicted, ..served }), None, "request {i}");
        }
        let (missed, underclaimed) = accuracy.missed_share();
        assert_eq!(underclaimed, 1);
        assert!(missed > 0.0 && missed < 0.01, "{missed}");
        // Recovered (the template fixed): cleared.
        let mut accuracy = IndexAccuracy::new(AccuracySettings::default());
        for i in 0..100 {
            accuracy.record(trace_like(i, 400));
        }
        let fixed = (0..100).filter_map(|i| {
            let served = trace_like(i, 400);
            accuracy.record(AccuracySample { predicted: served.engine_cached.unwrap(), ..served })
        });
        assert_eq!(fixed.collect::<Vec<_>>(), [AccuracyChange::Cleared]);
    }
}
