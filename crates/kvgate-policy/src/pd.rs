//! Conditional disaggregation: per request, whether a prefill/decode fleet prefills on a
//! separate prefill engine (a pair) or in place on the decode engine the decode side's policy
//! chose first. One pure rule, called by the gateway and the simulator alike.
//!
//! The rule follows Dynamo's: moving a prompt's KV from a prefill engine only pays when the
//! part the decode engine does not hold is long, both in tokens and as a share of the prompt,
//! and when the prefill side has room for it. So a request goes in place when the prompt's part
//! not cached on the chosen decode engine is under `--pd-max-local-prefill-tokens` (Dynamo's
//! default: 2,048) or under `--pd-max-local-prefill-fraction` of the prompt (70%), or when
//! every prefill engine already has more than `--pd-max-prefill-queue` requests in flight.
//!
//! With kv_aware on both sides the thresholds give way to kv_aware's prediction across the pair
//! ([`PdRule::predict_paths`]): in place, the time to first token kv_aware predicts on the
//! chosen decode engine (its own queue, the uncached part, its running requests, its KV
//! pressure); through a pair, the prefill side's predicted time to first token on the prefill
//! engine its policy would choose (that engine's queue and prefill of its own uncached part),
//! the transfer (prompt tokens x `--kv-bytes-per-token` / `--kv-transfer-gbps`), and the decode
//! engine's wait for its first decode step (its queued prefill, since an engine's prefill steps
//! run before its decode steps, its running requests and KV pressure). As kv_aware chooses an
//! engine, the path with the lower time plus cost to others wins (the prefill's delay to the
//! requests queued behind it and the running decodes it stalls: in place, those of a decode
//! engine, which runs many), the costs to others scaled by `--pd-cost-to-others-weight`.
//!
//! A pair has a deadline: the decode engine holds its slot for the KV only so long (SGLang's
//! decode side aborts a request whose KV has not arrived within
//! `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s by default), so a pair whose predicted prefill
//! (the prefill engine's queue and prefill) plus transfer exceeds `--pd-kv-hold-secs` is not
//! taken: the request goes in place (`why=pair_past_deadline`).

use crate::PredictedTtft;

/// The thresholds of the rule (from `PolicyConfig`'s `pd_*` options).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdRule {
    /// An uncached part shorter than this many tokens is prefilled in place.
    pub max_local_prefill_tokens: u64,
    /// An uncached part under this share of the prompt is prefilled in place, in [0, 1].
    pub max_local_prefill_fraction: f64,
    /// A prefill side whose least busy engine has more requests in flight than this is busy:
    /// the request is prefilled in place.
    pub max_prefill_queue: u64,
    /// Seconds a pair's transfer takes per prompt token (`--kv-bytes-per-token` /
    /// `--kv-transfer-gbps`).
    pub transfer_secs_per_token: f64,
    /// The weight of each path's cost to the other requests against the time to first token
    /// (kv_aware on both sides), >= 0.
    pub others_weight: f64,
    /// Seconds a decode engine holds a pair's slot for its KV: a pair predicted to deliver its
    /// KV later (prefill side's prediction + transfer) is not taken (kv_aware on both sides).
    pub kv_hold_s: f64,
}

/// What the rule looks at, for one request and the decode engine chosen for it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdInputs {
    /// The prompt's length in tokens (the host's estimate).
    pub prompt_tokens: u64,
    /// The part of it the chosen decode engine holds, by the decode side's prefix index (0 when
    /// its policy does not match prefixes).
    pub cached_tokens: u64,
    /// Requests in flight on the least busy routable prefill engine (`None`: none is routable).
    pub prefill_queue: Option<u64>,
    /// Both paths' predicted times to first token, when both sides predict (kv_aware): the rule
    /// then compares them instead of applying the thresholds.
    pub predicted: Option<PathTtfts>,
}

/// The predicted time to first token of each path, in seconds, the pair's terms, and what each
/// path costs the other requests (kv_aware's cost: the prefill delays the requests queued
/// behind it and stalls the engine's running decodes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PathTtfts {
    /// In place on the decode engine: kv_aware's prediction there.
    pub in_place_s: f64,
    /// In place: the prefill's cost to the decode engine's other requests.
    pub in_place_others_s: f64,
    /// The prefill side's predicted time to first token on its engine (queue, prefill, ...).
    pub prefill_s: f64,
    /// The pair: the prefill's cost to the prefill engine's other requests.
    pub prefill_others_s: f64,
    /// Moving the prompt's KV.
    pub transfer_s: f64,
    /// The decode engine's wait for its next decode step: its queued prefill, running requests
    /// and KV pressure (not its prefill of this prompt, which the pair spares it).
    pub decode_wait_s: f64,
}

impl PathTtfts {
    /// Through the pair: prefill, transfer, then the decode engine's first decode step.
    pub fn pair_s(&self) -> f64 {
        self.prefill_s + self.transfer_s + self.decode_wait_s
    }

    /// What the rule minimises in place: the time to first token plus the cost to others
    /// (already scaled by the rule's `others_weight`).
    pub fn in_place_cost_s(&self) -> f64 {
        self.in_place_s + self.in_place_others_s
    }

    /// What the rule minimises through the pair.
    pub fn pair_cost_s(&self) -> f64 {
        self.pair_s() + self.prefill_others_s
    }

    /// When the pair's KV is predicted to reach the decode engine: the prefill engine's queue
    /// and prefill, then the transfer (what the decode engine's hold deadline bounds).
    pub fn kv_arrival_s(&self) -> f64 {
        self.prefill_s + self.transfer_s
    }
}

impl PdInputs {
    /// The prompt's tokens the decode engine would have to compute.
    pub fn uncached_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }

    /// The uncached share of the prompt, 0..1 (0 for an empty prompt).
    pub fn uncached_fraction(&self) -> f64 {
        match self.prompt_tokens {
            0 => 0.0,
            n => self.uncached_tokens() as f64 / n as f64,
        }
    }
}

/// Where the prompt is prefilled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PdPath {
    /// On a prefill engine, its KV then moved to the decode engine.
    Pair,
    /// On the decode engine itself (the plain request, no bootstrap fields or transfer params).
    InPlace,
}

impl PdPath {
    pub const ALL: [PdPath; 2] = [PdPath::Pair, PdPath::InPlace];

    /// The `path` label of `kvgate_pd_decisions_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            PdPath::Pair => "pair",
            PdPath::InPlace => "in_place",
        }
    }
}

/// Which clause of the rule decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PdWhy {
    /// Always a pair (`--pd-conditional` off).
    Always,
    /// In place: the uncached part is under the token threshold.
    ShortUncached,
    /// In place: the uncached part is under the fraction threshold (the decode engine holds most).
    MostlyCached,
    /// In place: every prefill engine is past the queue threshold (or none is routable).
    PrefillBusy,
    /// A pair: the uncached part is long on both counts and the prefill side has room.
    LongUncached,
    /// In place: predicted no later than through the pair (kv_aware on both sides).
    InPlaceSooner,
    /// A pair: predicted sooner than in place (kv_aware on both sides).
    PairSooner,
    /// In place: the pair's KV is predicted to arrive after the decode engine's hold deadline
    /// (`--pd-kv-hold-secs`; kv_aware on both sides).
    PairPastDeadline,
    /// In place after a pair failed: its decode engine answered a server error other than 503
    /// (the KV transfer failed or never came), and the request was sent again, plain, to the
    /// decode engine the decode side's policy picks for it (the gateway's
    /// `--pd-fallback-in-place`).
    TransferFailed,
}

impl PdWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            PdWhy::Always => "always",
            PdWhy::ShortUncached => "short_uncached",
            PdWhy::MostlyCached => "mostly_cached",
            PdWhy::PrefillBusy => "prefill_busy",
            PdWhy::LongUncached => "long_uncached",
            PdWhy::InPlaceSooner => "in_place_sooner",
            PdWhy::PairSooner => "pair_sooner",
            PdWhy::PairPastDeadline => "pair_past_deadline",
            PdWhy::TransferFailed => "transfer_failed",
        }
    }
}

/// The rule's verdict, with its inputs (for the route reason, the metrics and the dry run).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdChoice {
    pub path: PdPath,
    pub why: PdWhy,
    pub inputs: PdInputs,
}

impl PdChoice {
    /// The verdict of the attempt after a pair whose KV transfer failed: in place on a decode
    /// engine, with the pair's inputs.
    pub fn transfer_failed(&self) -> PdChoice {
        PdChoice { path: PdPath::InPlace, why: PdWhy::TransferFailed, inputs: self.inputs }
    }

    /// The verdict as one header value: `in_place; why=mostly_cached; uncached_tokens=812;
    /// uncached_fraction=0.12; prefill_queue=3`.
    pub fn describe(&self) -> String {
        let queue = self.inputs.prefill_queue.map_or_else(|| "none".to_string(), |q| q.to_string());
        let mut described = format!(
            "{}; why={}; prompt_tokens={}; uncached_tokens={}; uncached_fraction={:.3}; prefill_queue={queue}",
            self.path.as_str(),
            self.why.as_str(),
            self.inputs.prompt_tokens,
            self.inputs.uncached_tokens(),
            self.inputs.uncached_fraction(),
        );
        if let Some(p) = self.inputs.predicted {
            described.push_str(&format!(
                "; in_place_s={:.4}; pair_s={:.4}; prefill_s={:.4}; transfer_s={:.4}; decode_wait_s={:.4}; \
                 in_place_cost_s={:.4}; pair_cost_s={:.4}",
                p.in_place_s,
                p.pair_s(),
                p.prefill_s,
                p.transfer_s,
                p.decode_wait_s,
                p.in_place_cost_s(),
                p.pair_cost_s(),
            ));
        }
        described
    }
}

impl PdRule {
    /// The predicted time to move a prompt's KV from the prefill to the decode engine.
    pub fn transfer_s(&self, prompt_tokens: u64) -> f64 {
        prompt_tokens as f64 * self.transfer_secs_per_token
    }

    /// kv_aware's prediction across the pair: `in_place` is the decode side's prediction for the
    /// request on the decode engine it would prefill on (its queue, the uncached part, decode
    /// and KV terms), `prefill` the prefill side's on the engine its policy would choose, and
    /// `pair_decode` the decode side's for a request bringing its KV (no prompt to prefill) on
    /// the decode engine it would choose for the pair: the decode pressure there. Non-finite or
    /// negative terms count as 0 (a prediction never runs backwards).
    pub fn predict_paths(
        &self,
        prompt_tokens: u64,
        in_place: &PredictedTtft,
        prefill: &PredictedTtft,
        pair_decode: &PredictedTtft,
    ) -> PathTtfts {
        let sane = |s: f64| if s.is_finite() { s.max(0.0) } else { 0.0 };
        let total = |p: &PredictedTtft| sane(p.queue_s) + sane(p.prefill_s) + sane(p.decode_s) + sane(p.kv_s);
        let weight = sane(self.others_weight);
        let others = |p: &PredictedTtft| weight * (sane(p.recompute_s) + sane(p.stall_s));
        PathTtfts {
            in_place_s: total(in_place),
            in_place_others_s: others(in_place),
            prefill_s: total(prefill),
            prefill_others_s: others(prefill),
            transfer_s: sane(self.transfer_s(prompt_tokens)),
            decode_wait_s: sane(pair_decode.queue_s) + sane(pair_decode.decode_s) + sane(pair_decode.kv_s),
        }
    }

    /// Decides where the request is prefilled: by the predicted times to first token plus the
    /// costs to others (kv_aware's cost, on each side) when the inputs carry them (ties go in
    /// place: no transfer, no second engine; a pair whose KV would arrive past the hold
    /// deadline is never taken), else by the thresholds.
    pub fn decide(&self, inputs: PdInputs) -> PdChoice {
        if let Some(predicted) = inputs.predicted {
            let (path, why) = if predicted.kv_arrival_s() > self.kv_hold_s {
                (PdPath::InPlace, PdWhy::PairPastDeadline)
            } else if predicted.pair_cost_s() < predicted.in_place_cost_s() {
                (PdPath::Pair, PdWhy::PairSooner)
            } else {
                (PdPath::InPlace, PdWhy::InPlaceSooner)
            };
            return PdChoice { path, why, inputs };
        }
        let why = if inputs.uncached_tokens() < self.max_local_prefill_tokens {
            PdWhy::ShortUncached
        } else if inputs.uncached_fraction() < self.max_local_prefill_fraction {
            PdWhy::MostlyCached
        } else if inputs.prefill_queue.is_none_or(|queue| queue > self.max_prefill_queue) {
            PdWhy::PrefillBusy
        } else {
            PdWhy::LongUncached
        };
        let path = if why == PdWhy::LongUncached { PdPath::Pair } else { PdPath::InPlace };
        PdChoice { path, why, inputs }
    }

    /// The verdict when the rule is off: always a pair.
    pub fn always(inputs: PdInputs) -> PdChoice {
        PdChoice { path: PdPath::Pair, why: PdWhy::Always, inputs }
    }
}

/// The prompt tokens a decision says its worker holds: the chosen match rate of a prefix-aware
/// decision times the prompt's length (0 for a policy that does not match prefixes).
pub fn cached_tokens(decision: &crate::Decision, prompt_tokens: u64) -> u64 {
    decision
        .matches
        .map_or(0, |m| (m.chosen_match_rate.clamp(0.0, 1.0) * prompt_tokens as f64).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DYNAMO: PdRule = PdRule {
        max_local_prefill_tokens: 2048,
        max_local_prefill_fraction: 0.7,
        max_prefill_queue: 4,
        transfer_secs_per_token: 131_072.0 / 25e9,
        others_weight: 1.0,
        kv_hold_s: 300.0,
    };

    fn check(prompt_tokens: u64, cached_tokens: u64, prefill_queue: Option<u64>, expected: (PdPath, PdWhy)) {
        let choice = DYNAMO.decide(PdInputs { prompt_tokens, cached_tokens, prefill_queue, predicted: None });
        assert_eq!((choice.path, choice.why), expected, "{}", choice.describe());
    }

    #[test]
    fn the_rule_prefills_in_place_unless_the_uncached_part_is_long_and_the_prefill_side_has_room() {
        use PdPath::*;
        use PdWhy::*;
        // Short prompts, or short uncached parts, stay on the decode engine.
        check(1000, 0, Some(0), (InPlace, ShortUncached));
        check(10_000, 8000, Some(0), (InPlace, ShortUncached));
        check(2047, 0, Some(0), (InPlace, ShortUncached));
        // A long uncached part that is still under 70% of the prompt: the decode engine holds most.
        check(20_000, 8000, Some(0), (InPlace, MostlyCached));
        // Long and mostly uncached: a pair, while a prefill engine has room.
        check(2048, 0, Some(0), (Pair, LongUncached));
        check(20_000, 5000, Some(4), (Pair, LongUncached));
        check(20_000, 0, Some(5), (InPlace, PrefillBusy));
        check(20_000, 0, None, (InPlace, PrefillBusy));
        // A cached part longer than the prompt (an estimate) counts as all cached.
        check(100, 500, Some(0), (InPlace, ShortUncached));
        assert_eq!(
            PdInputs { prompt_tokens: 0, cached_tokens: 0, prefill_queue: None, predicted: None }
                .uncached_fraction(),
            0.0
        );
    }

    #[test]
    fn the_verdict_names_its_clause_and_inputs() {
        let choice = DYNAMO.decide(PdInputs {
            prompt_tokens: 20_000,
            cached_tokens: 8000,
            prefill_queue: Some(2),
            predicted: None,
        });
        assert_eq!(
            choice.describe(),
            "in_place; why=mostly_cached; prompt_tokens=20000; uncached_tokens=12000; uncached_fraction=0.600; prefill_queue=2"
        );
        let always = PdRule::always(PdInputs {
            prompt_tokens: 10,
            cached_tokens: 0,
            prefill_queue: None,
            predicted: None,
        });
        assert_eq!(always.describe(), "pair; why=always; prompt_tokens=10; uncached_tokens=10; uncached_fraction=1.000; prefill_queue=none");
    }

    #[test]
    fn cached_tokens_come_from_the_chosen_match_rate() {
        let mut decision = crate::Decision::plain(0, crate::Reason::LeastLoad);
        assert_eq!(cached_tokens(&decision, 1000), 0);
        decision.matches = Some(crate::MatchInfo { best_match_rate: 0.9, chosen_match_rate: 0.5 });
        assert_eq!(cached_tokens(&decision, 1000), 500);
    }

    fn ttft(queue_s: f64, prefill_s: f64, decode_s: f64, kv_s: f64) -> PredictedTtft {
        PredictedTtft { queue_s, prefill_s, decode_s, kv_s, ..PredictedTtft::default() }
    }

    fn decide_predicted(prompt_tokens: u64, decode: PredictedTtft, prefill: PredictedTtft) -> PdChoice {
        let predicted = Some(DYNAMO.predict_paths(prompt_tokens, &decode, &prefill, &decode));
        // Thresholds that would say "in place" for every input: the prediction alone decides.
        DYNAMO.decide(PdInputs {
            prompt_tokens,
            cached_tokens: prompt_tokens,
            prefill_queue: None,
            predicted,
        })
    }

    #[test]
    fn with_predictions_the_sooner_path_wins_and_the_decode_engines_queue_counts_on_both() {
        // 10,000 tokens: 52 ms of transfer at 25 GB/s.
        let transfer = DYNAMO.transfer_s(10_000);
        assert!((transfer - 0.052_428_8).abs() < 1e-9, "{transfer}");
        // An idle decode engine that would prefill 2 s: a pair prefilling 0.5 s is sooner.
        let choice = decide_predicted(10_000, ttft(0.0, 2.0, 0.01, 0.0), ttft(0.0, 0.5, 0.0, 0.0));
        assert_eq!((choice.path, choice.why), (PdPath::Pair, PdWhy::PairSooner), "{}", choice.describe());
        // The decode engine holds the prompt (0.05 s left to prefill): in place.
        let choice = decide_predicted(10_000, ttft(0.0, 0.05, 0.01, 0.0), ttft(0.0, 0.5, 0.0, 0.0));
        assert_eq!(choice.why, PdWhy::InPlaceSooner);
        // The same, but 5 s of prefill queued on the decode engine: both paths wait for it, so it
        // does not tip the choice by itself...
        let choice = decide_predicted(10_000, ttft(5.0, 0.05, 0.01, 0.0), ttft(0.0, 0.5, 0.0, 0.0));
        assert_eq!(choice.why, PdWhy::InPlaceSooner);
        // ...but a busy prefill side does: 3 s queued there.
        let choice = decide_predicted(10_000, ttft(0.0, 2.0, 0.01, 0.0), ttft(3.0, 0.5, 0.0, 0.0));
        assert_eq!(choice.why, PdWhy::InPlaceSooner);
        assert_eq!(
            choice.describe(),
            "in_place; why=in_place_sooner; prompt_tokens=10000; uncached_tokens=0; uncached_fraction=0.000; \
             prefill_queue=none; in_place_s=2.0100; pair_s=3.5624; prefill_s=3.5000; transfer_s=0.0524; \
             decode_wait_s=0.0100; in_place_cost_s=2.0100; pair_cost_s=3.5624"
        );
        // In place sooner for this request (0.3 s vs 0.55 s), but its prefill would stall the 64
        // decodes running there (0.64 s of cost to others): the pair.
        let stalling = PredictedTtft { stall_s: 0.64, ..ttft(0.0, 0.3, 0.0, 0.0) };
        let choice = decide_predicted(10_000, stalling, ttft(0.0, 0.5, 0.0, 0.0));
        assert_eq!(choice.why, PdWhy::PairSooner, "{}", choice.describe());
        // A tie stays in place; garbage predictions count as nothing.
        let choice = decide_predicted(0, ttft(0.0, 0.0, 0.0, 0.0), ttft(0.0, 0.0, 0.0, 0.0));
        assert_eq!(choice.why, PdWhy::InPlaceSooner);
        let garbage = ttft(f64::NAN, 1.0, -1.0, f64::INFINITY);
        let paths = DYNAMO.predict_paths(100, &garbage, &ttft(f64::NAN, 0.0, 0.0, 0.0), &garbage);
        assert_eq!(paths.in_place_s, 1.0);
        assert_eq!((paths.prefill_s, paths.decode_wait_s), (0.0, 0.0));
    }

    #[test]
    fn the_pair_rule_never_picks_a_pair_whose_kv_arrives_past_the_hold_deadline() {
        // A 3 s hold (the mock's at time scale 10, in wall seconds). The pair is far sooner by
        // the prediction (0.5 s of prefill against 20 s in place), until the prefill engine's
        // queue pushes its KV's arrival past the deadline.
        let rule = PdRule { kv_hold_s: 3.0, ..DYNAMO };
        let decode = ttft(0.0, 20.0, 0.01, 0.0);
        let decide = |prefill_queue_s: f64| {
            let prefill = ttft(prefill_queue_s, 0.5, 0.0, 0.0);
            let predicted = Some(rule.predict_paths(10_000, &decode, &prefill, &decode));
            rule.decide(PdInputs { prompt_tokens: 10_000, cached_tokens: 0, prefill_queue: None, predicted })
        };
        assert_eq!(decide(0.0).why, PdWhy::PairSooner);
        // 2.4 s queued + 0.5 s prefill + 0.052 s transfer = 2.952 s: still within 3 s.
        assert_eq!(decide(2.4).why, PdWhy::PairSooner);
        // 2.5 s queued: 3.052 s, past the deadline: in place, however late in place is.
        let late = decide(2.5);
        assert_eq!((late.path, late.why), (PdPath::InPlace, PdWhy::PairPastDeadline), "{}", late.describe());
        assert!(late.describe().starts_with("in_place; why=pair_past_deadline;"));
        // The thresholds (no prediction) have no deadline to apply.
        let thresholds = rule.decide(PdInputs {
            prompt_tokens: 20_000,
            cached_tokens: 0,
            prefill_queue: Some(0),
            predicted: None,
        });
        assert_eq!(thresholds.why, PdWhy::LongUncached);
    }

    #[test]
    fn the_cost_to_others_weight_scales_both_paths_and_zero_compares_ttfts_alone() {
        // In place sooner (0.3 s vs 0.55 s) but stalling the decode engine's running decodes.
        let decode = PredictedTtft { stall_s: 0.64, recompute_s: 0.1, ..ttft(0.0, 0.3, 0.0, 0.0) };
        let prefill = PredictedTtft { recompute_s: 0.2, ..ttft(0.0, 0.5, 0.0, 0.0) };
        let decide = |others_weight: f64| {
            let rule = PdRule { others_weight, ..DYNAMO };
            let predicted = rule.predict_paths(10_000, &decode, &prefill, &decode);
            (
                predicted,
                rule.decide(PdInputs {
                    prompt_tokens: 10_000,
                    cached_tokens: 0,
                    prefill_queue: None,
                    predicted: Some(predicted),
                }),
            )
        };
        let (paths, choice) = decide(1.0);
        assert!((paths.in_place_others_s - 0.74).abs() < 1e-9 && (paths.prefill_others_s - 0.2).abs() < 1e-9);
        assert_eq!(choice.why, PdWhy::PairSooner);
        let (paths, choice) = decide(0.5);
        assert!((paths.in_place_others_s - 0.37).abs() < 1e-9 && (paths.prefill_others_s - 0.1).abs() < 1e-9);
        assert_eq!(choice.why, PdWhy::PairSooner, "0.67 s in place vs 0.65 s through the pair");
        let (paths, choice) = decide(0.0);
        assert_eq!((paths.in_place_others_s, paths.prefill_others_s), (0.0, 0.0));
        assert_eq!(choice.why, PdWhy::InPlaceSooner);
        // The TTFTs themselves do not depend on the weight.
        assert_eq!(decide(0.0).0.in_place_s, decide(1.0).0.in_place_s);
    }

    #[test]
    fn a_decision_records_nothing_until_it_is_routed() {
        use crate::test_support::{candidates, ctx_rng};
        use crate::{
            build_policy, Candidates, PolicyConfig, PolicyKind, RouteRequest, Routed, RoutingKey,
            SelectContext,
        };
        let kv_aware = build_policy(&PolicyConfig { policy: PolicyKind::KvAware, ..PolicyConfig::default() });
        let request = RouteRequest { key: RoutingKey::None, prompt_tokens: 4000, session: None };
        let pool = candidates(&[0, 0]);
        let ask = || {
            let mut rng = ctx_rng(7);
            let mut ctx = SelectContext {
                now_ms: 1000,
                load_poll_interval_ms: 1000,
                rng: &mut rng,
                prefix_index: None,
            };
            kv_aware.decide(&request, Candidates::new(&pool).unwrap(), &mut ctx).unwrap()
        };
        let first = ask();
        assert_eq!(ask(), first, "deciding changes nothing");
        kv_aware.on_routed(&Routed {
            request: &request,
            candidates: Candidates::new(&pool).unwrap(),
            decision: &first,
            now_ms: 1000,
            load_poll_interval_ms: 1000,
        });
        // Routed: its 4,000 tokens are queued on the chosen engine, and the next prediction sees them.
        let after = ask();
        assert_ne!(after.worker, first.worker, "the other engine is now the idle one");
        let queued = |d: &crate::Decision| d.predicted.unwrap().queue_s;
        assert_eq!((queued(&first), queued(&after)), (0.0, 0.0));
        // Only kv_aware's decisions carry a prediction.
        assert!(kv_aware.predicts() && first.predicted.is_some());
        let round_robin =
            build_policy(&PolicyConfig { policy: PolicyKind::RoundRobin, ..PolicyConfig::default() });
        assert!(!round_robin.predicts());
    }

    mod prop {
        use proptest::prelude::*;

        use super::*;

        fn seconds() -> impl Strategy<Value = f64> {
            0.0..30.0f64
        }

        fn prediction() -> impl Strategy<Value = PredictedTtft> {
            (seconds(), seconds(), 0.0..0.5f64, 0.0..2.0f64, seconds(), seconds()).prop_map(
                |(q, p, d, k, r, st)| PredictedTtft { recompute_s: r, stall_s: st, ..ttft(q, p, d, k) },
            )
        }

        proptest! {
            /// The pair is taken exactly when it is predicted sooner, and the verdict's numbers are
            /// the inputs' (what the route reason and the dry run show).
            #[test]
            fn the_pair_is_taken_iff_predicted_sooner(
                prompt in 0u64..200_000, decode in prediction(), prefill in prediction(),
            ) {
                let choice = decide_predicted(prompt, decode, prefill);
                let paths = choice.inputs.predicted.unwrap();
                prop_assert_eq!(choice.path == PdPath::Pair, paths.pair_cost_s() < paths.in_place_cost_s());
                prop_assert!((paths.in_place_s - decode.total()).abs() < 1e-9);
                prop_assert!((paths.pair_s() - (prefill.total() + DYNAMO.transfer_s(prompt)
                    + decode.queue_s + decode.decode_s + decode.kv_s)).abs() < 1e-9);
            }

            /// Monotone: more prefill work on the decode engine (its own uncached part) never
            /// turns a pair into in place; a longer prefill-side queue never turns in place
            /// into a pair; the decode engine's queue weighs on both paths alike.
            #[test]
            fn the_choice_is_monotone_in_each_sides_work(
                prompt in 0u64..200_000, decode in prediction(), prefill in prediction(), more in seconds(),
            ) {
                let base = decide_predicted(prompt, decode, prefill).path;
                let heavier_in_place =
                    decide_predicted(prompt, PredictedTtft { prefill_s: decode.prefill_s + more, ..decode }, prefill).path;
                if base == PdPath::Pair {
                    prop_assert_eq!(heavier_in_place, PdPath::Pair);
                }
                let busier_prefill =
                    decide_predicted(prompt, decode, PredictedTtft { queue_s: prefill.queue_s + more, ..prefill }).path;
                if base == PdPath::InPlace {
                    prop_assert_eq!(busier_prefill, PdPath::InPlace);
                }
                let busier_decode = PredictedTtft { queue_s: decode.queue_s + more, ..decode };
                let paths = DYNAMO.predict_paths(prompt, &busier_decode, &prefill, &busier_decode);
                let base_paths = DYNAMO.predict_paths(prompt, &decode, &prefill, &decode);
                prop_assert!(((paths.in_place_s - base_paths.in_place_s) - more).abs() < 1e-9);
                prop_assert!(((paths.pair_s() - base_paths.pair_s()) - more).abs() < 1e-9);
            }
        }
    }
}
