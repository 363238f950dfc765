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
}

impl PdWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            PdWhy::Always => "always",
            PdWhy::ShortUncached => "short_uncached",
            PdWhy::MostlyCached => "mostly_cached",
            PdWhy::PrefillBusy => "prefill_busy",
            PdWhy::LongUncached => "long_uncached",
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
    /// The verdict as one header value: `in_place; why=mostly_cached; uncached_tokens=812;
    /// uncached_fraction=0.12; prefill_queue=3`.
    pub fn describe(&self) -> String {
        let queue = self.inputs.prefill_queue.map_or_else(|| "none".to_string(), |q| q.to_string());
        format!(
            "{}; why={}; prompt_tokens={}; uncached_tokens={}; uncached_fraction={:.3}; prefill_queue={queue}",
            self.path.as_str(),
            self.why.as_str(),
            self.inputs.prompt_tokens,
            self.inputs.uncached_tokens(),
            self.inputs.uncached_fraction(),
        )
    }
}

impl PdRule {
    /// Decides where the request is prefilled.
    pub fn decide(&self, inputs: PdInputs) -> PdChoice {
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

    const DYNAMO: PdRule =
        PdRule { max_local_prefill_tokens: 2048, max_local_prefill_fraction: 0.7, max_prefill_queue: 4 };

    fn check(prompt_tokens: u64, cached_tokens: u64, prefill_queue: Option<u64>, expected: (PdPath, PdWhy)) {
        let choice = DYNAMO.decide(PdInputs { prompt_tokens, cached_tokens, prefill_queue });
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
            PdInputs { prompt_tokens: 0, cached_tokens: 0, prefill_queue: None }.uncached_fraction(),
            0.0
        );
    }

    #[test]
    fn the_verdict_names_its_clause_and_inputs() {
        let choice =
            DYNAMO.decide(PdInputs { prompt_tokens: 20_000, cached_tokens: 8000, prefill_queue: Some(2) });
        assert_eq!(
            choice.describe(),
            "in_place; why=mostly_cached; prompt_tokens=20000; uncached_tokens=12000; uncached_fraction=0.600; prefill_queue=2"
        );
        let always = PdRule::always(PdInputs { prompt_tokens: 10, cached_tokens: 0, prefill_queue: None });
        assert_eq!(always.describe(), "pair; why=always; prompt_tokens=10; uncached_tokens=10; uncached_fraction=1.000; prefill_queue=none");
    }

    #[test]
    fn cached_tokens_come_from_the_chosen_match_rate() {
        let mut decision = crate::Decision::plain(0, crate::Reason::LeastLoad);
        assert_eq!(cached_tokens(&decision, 1000), 0);
        decision.matches = Some(crate::MatchInfo { best_match_rate: 0.9, chosen_match_rate: 0.5 });
        assert_eq!(cached_tokens(&decision, 1000), 500);
    }
}
