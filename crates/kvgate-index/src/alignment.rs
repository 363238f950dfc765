//! Does the index describe the engine? The alignment probe's verdict: a short canary prompt (a
//! fixed text after a random salt, so no engine holds it yet) is sent to one worker twice,
//! once as a completion and once as a chat, and what the engine reported on the second send is
//! compared with what the index predicted for it (the closed loop's prediction: the prompt's
//! served overlap on that worker). The observations here are plain numbers the host gathered;
//! this module names the cause of a disagreement from their pattern, each cause by what only it
//! produces:
//!
//! - `events_not_flowing`: the worker's subscription is not connected, or no KV event batch
//!   arrived from it after the first answer while the engine serves the repeat from cache;
//! - `block_size`: the engine's stores were refused for their shape (tokens against the stated
//!   block size, a layout the index cannot add), or the engine serves a whole number of larger
//!   blocks than the index's (or a count that is no whole number of them);
//! - `hash`: stores arrived and applied, yet none names the prompt's blocks (the engine hashes
//!   keys the gateway cannot reproduce: extra keys, salts, lookahead), or a store's parent is a
//!   hash the engine never stored;
//! - `tokenizer`: on the completion, the engine counts another number of prompt tokens;
//! - `template_or_content_format`: the completion agrees, the chat does not (another prompt
//!   length, or a prediction the engine does not serve): the chat template, or the content
//!   format the engine renders messages with;
//! - `last_token_rule`: on a prompt of whole blocks held whole, the engine serves exactly one
//!   block more than predicted (it serves the last token from cache, the index assumes not);
//! - `stale_index`: the previous probe's prompt, still held in the index, is served less by the
//!   engine with no removal event since (an engine restarted or reset without publishing it);
//! - `no_cached_tokens_reported` and `no_prefix_caching`: the engine's answers carry no cached
//!   count, or it serves nothing from cache and publishes no store (prefix caching off): there
//!   is nothing to align.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The two prompt forms a probe sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeForm {
    /// `/v1/completions` with a text prompt: the tokenizer, the events, the blocks.
    Completion,
    /// `/v1/chat/completions`: the chat template and content format on top.
    Chat,
}

impl ProbeForm {
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeForm::Completion => "completion",
            ProbeForm::Chat => "chat",
        }
    }
}

/// Why a probe failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeCause {
    EventsNotFlowing,
    BlockSize,
    Hash,
    Tokenizer,
    TemplateOrContentFormat,
    LastTokenRule,
    StaleIndex,
    NoCachedTokensReported,
    NoPrefixCaching,
    /// A disagreement in none of the patterns above (the numbers are in the report).
    Unexplained,
}

impl ProbeCause {
    pub const ALL: [ProbeCause; 10] = [
        ProbeCause::EventsNotFlowing,
        ProbeCause::BlockSize,
        ProbeCause::Hash,
        ProbeCause::Tokenizer,
        ProbeCause::TemplateOrContentFormat,
        ProbeCause::LastTokenRule,
        ProbeCause::StaleIndex,
        ProbeCause::NoCachedTokensReported,
        ProbeCause::NoPrefixCaching,
        ProbeCause::Unexplained,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ProbeCause::EventsNotFlowing => "events_not_flowing",
            ProbeCause::BlockSize => "block_size",
            ProbeCause::Hash => "hash",
            ProbeCause::Tokenizer => "tokenizer",
            ProbeCause::TemplateOrContentFormat => "template_or_content_format",
            ProbeCause::LastTokenRule => "last_token_rule",
            ProbeCause::StaleIndex => "stale_index",
            ProbeCause::NoCachedTokensReported => "no_cached_tokens_reported",
            ProbeCause::NoPrefixCaching => "no_prefix_caching",
            ProbeCause::Unexplained => "unexplained",
        }
    }

    /// What to check, for the log and `/workers`.
    pub fn advice(self) -> &'static str {
        match self {
            ProbeCause::EventsNotFlowing => {
                "no KV event of the probe's prompt reached the gateway: check --kv-events-endpoints (and \
                 --kv-events-topic) against the engine's --kv-events-config (vLLM binds its publisher only \
                 for tcp://*:PORT)"
            }
            ProbeCause::BlockSize => {
                "the engine's KV events describe blocks of another size than it caches (or than they carry): \
                 check the engine's --block-size / page size and its event publisher"
            }
            ProbeCause::Hash => {
                "the engine's stores do not name the prompt's blocks: its block hashes cover keys the \
                 gateway cannot reproduce (extra keys, a cache salt, lookahead) or its parent hashes do not \
                 chain"
            }
            ProbeCause::Tokenizer => {
                "the engine counts another number of prompt tokens for the same text: --tokenizer-path is \
                 not the engine's tokenizer"
            }
            ProbeCause::TemplateOrContentFormat => {
                "completions agree but chat prompts do not: --chat-template or \
                 --chat-template-content-format differs from the engine's"
            }
            ProbeCause::LastTokenRule => {
                "the engine serves a whole prompt's last block from cache, which the gateway predicts it \
                 recomputes (vLLM and SGLang never serve the last prompt token from cache)"
            }
            ProbeCause::StaleIndex => {
                "the index holds blocks the engine no longer serves and no removal event said so: the \
                 engine restarted or reset its cache without the gateway hearing of it"
            }
            ProbeCause::NoCachedTokensReported => {
                "the engine's answers carry no cached-token count: start vLLM with \
                 --enable-prompt-tokens-details (SGLang: --enable-cache-report)"
            }
            ProbeCause::NoPrefixCaching => {
                "the engine serves nothing from cache and publishes no store: prefix caching is off \
                 (vLLM --enable-prefix-caching)"
            }
            ProbeCause::Unexplained => {
                "the engine serves another cached count than the index predicts, in no known pattern"
            }
        }
    }
}

impl fmt::Display for ProbeCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the host saw of one form: the two sends, and the worker's event feed in between.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FormObservation {
    /// The prompt's length in the gateway's token ids.
    pub prompt_tokens: u32,
    /// The engine's `usage.prompt_tokens` on the first send (`None`: not reported).
    pub engine_prompt_tokens: Option<u32>,
    /// KV event batches applied from the worker between the first answer and the prediction.
    pub batches: u64,
    /// Stores refused in that time for their shape (token count against the stated block size,
    /// per-block lists, a layout the index cannot add).
    pub refused_shape: u64,
    /// Stores refused in that time because their parent hash is unknown.
    pub refused_parent: u64,
    /// Tokens of the prompt the index holds on the worker once the events arrived (its whole
    /// overlap, before the last-token rule).
    pub held: u32,
    /// The prediction for the second send: the closed loop's (the served overlap).
    pub predicted: u32,
    /// The engine's cached tokens on the second send (`None`: not reported).
    pub cached: Option<u32>,
    /// Blocks removed from the worker's caches between the prediction and the second answer.
    pub removed: u64,
    /// Tokens per block of the index's layout (0: none known).
    pub block_size: u32,
}

/// A form's or a sentinel's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", content = "cause", rename_all = "snake_case")]
pub enum Verdict {
    Passed,
    Failed(ProbeCause),
    /// Nothing to conclude this time (blocks evicted meanwhile); the next probe tries again.
    Inconclusive,
}

impl Verdict {
    pub fn cause(self) -> Option<ProbeCause> {
        match self {
            Verdict::Failed(cause) => Some(cause),
            _ => None,
        }
    }
}

/// Tokens an engine serves from cache of a prompt of `n` tokens held whole, in blocks of
/// `block_size`: whole blocks of its first `n - 1` tokens.
pub fn served_tokens(n: u32, block_size: u32) -> u32 {
    match block_size {
        0 => 0,
        size => n.saturating_sub(1) / size * size,
    }
}

/// The verdict on one form. A chat form is judged after the completion passed, so whatever
/// goes wrong with it alone is the rendering.
pub fn judge_form(form: ProbeForm, seen: &FormObservation) -> Verdict {
    use ProbeCause::*;
    let rendering = match form {
        ProbeForm::Completion => Tokenizer,
        ProbeForm::Chat => TemplateOrContentFormat,
    };
    if seen.engine_prompt_tokens.is_some_and(|n| n != seen.prompt_tokens) {
        return Verdict::Failed(rendering);
    }
    let Some(cached) = seen.cached else { return Verdict::Failed(NoCachedTokensReported) };
    if seen.batches == 0 && seen.held == 0 {
        return Verdict::Failed(if cached == 0 { NoPrefixCaching } else { EventsNotFlowing });
    }
    if seen.held == 0 {
        return Verdict::Failed(if seen.refused_shape > 0 {
            BlockSize
        } else if seen.refused_parent > 0 {
            Hash
        } else if form == ProbeForm::Chat {
            TemplateOrContentFormat
        } else {
            Hash
        });
    }
    let predicted = seen.predicted;
    if cached == predicted {
        return Verdict::Passed;
    }
    if cached < predicted && seen.removed > 0 {
        return Verdict::Inconclusive;
    }
    if form == ProbeForm::Chat {
        return Verdict::Failed(TemplateOrContentFormat);
    }
    let (n, size) = (seen.prompt_tokens, seen.block_size);
    if size == 0 {
        return Verdict::Failed(Unexplained);
    }
    let held_whole = seen.held == n;
    if held_whole && n % size == 0 && cached == predicted + size {
        return Verdict::Failed(LastTokenRule);
    }
    let coarser = (1..=6).map(|shift| size << shift).any(|larger| cached == served_tokens(n, larger));
    if cached % size != 0 || (cached > 0 && cached < predicted && coarser) {
        return Verdict::Failed(BlockSize);
    }
    Verdict::Failed(Unexplained)
}

/// A probe's verdict from its parts' (forms, then the sentinel): the first failure, else
/// inconclusive when any part was (or there was none), else passed.
pub fn overall_verdict(parts: impl IntoIterator<Item = Verdict>) -> Verdict {
    let mut overall = None;
    for verdict in parts {
        match verdict {
            Verdict::Failed(_) => return verdict,
            Verdict::Inconclusive => overall = Some(Verdict::Inconclusive),
            Verdict::Passed => {
                overall.get_or_insert(Verdict::Passed);
            }
        }
    }
    overall.unwrap_or(Verdict::Inconclusive)
}

/// What the previous probe's prompt, re-sent, showed: predicted (from the index) against served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SentinelObservation {
    pub predicted: u32,
    pub cached: Option<u32>,
    /// Blocks removed from the worker's caches between the prediction and the answer.
    pub removed: u64,
    /// The engine's event sequence restarted in that time (its cache was gone: the index's
    /// holdings were cleared on its first event since, which counts as removals too).
    pub restarted: bool,
}

/// The verdict on the sentinel: the index still claims the previous probe's prompt; does the
/// engine still serve it?
pub fn judge_sentinel(seen: &SentinelObservation) -> Verdict {
    match seen.cached {
        _ if seen.predicted == 0 => Verdict::Inconclusive,
        None => Verdict::Failed(ProbeCause::NoCachedTokensReported),
        Some(cached) if cached >= seen.predicted => Verdict::Passed,
        Some(_) if seen.removed > 0 && !seen.restarted => Verdict::Inconclusive,
        Some(_) => Verdict::Failed(ProbeCause::StaleIndex),
    }
}

/// What the gateway does when the probe or the closed loop finds a worker's index wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum IndexRepair {
    /// Drop the worker's holdings from the exact index and replay them from its engine's replay
    /// endpoint (without one, they start again from the engine's next events).
    Resync,
    /// Route the worker's pool on the approximate tree until a probe of the worker passes.
    Quarantine,
    /// Only log and count it.
    Warn,
}

impl IndexRepair {
    pub const ALL: [IndexRepair; 3] = [IndexRepair::Resync, IndexRepair::Quarantine, IndexRepair::Warn];

    pub fn as_str(self) -> &'static str {
        match self {
            IndexRepair::Resync => "resync",
            IndexRepair::Quarantine => "quarantine",
            IndexRepair::Warn => "warn",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ProbeCause::*;
    use ProbeForm::{Chat, Completion};

    /// A 128-token completion in blocks of 16 as a right configuration sees it: held whole,
    /// predicted and served 112 (the last block recomputed).
    fn agreeing() -> FormObservation {
        FormObservation {
            prompt_tokens: 128,
            engine_prompt_tokens: Some(128),
            batches: 1,
            held: 128,
            predicted: 112,
            cached: Some(112),
            block_size: 16,
            ..FormObservation::default()
        }
    }

    fn check(form: ProbeForm, change: impl FnOnce(&mut FormObservation), expected: Verdict) {
        let mut seen = agreeing();
        change(&mut seen);
        assert_eq!(judge_form(form, &seen), expected, "{form:?} {seen:?}");
    }

    #[test]
    fn each_cause_from_the_pattern_only_it_produces() {
        use Verdict::{Failed, Inconclusive, Passed};
        check(Completion, |_| {}, Passed);
        check(Chat, |_| {}, Passed);
        // Another prompt length: the tokenizer on a completion, the rendering on a chat.
        check(Completion, |s| s.engine_prompt_tokens = Some(131), Failed(Tokenizer));
        check(Chat, |s| s.engine_prompt_tokens = Some(131), Failed(TemplateOrContentFormat));
        // Same length, and the chat's tokens are not what the engine stored.
        check(Chat, |s| (s.held, s.predicted) = (0, 0), Failed(TemplateOrContentFormat));
        // A shared start, then different ids: the chat's prediction is not served.
        check(
            Chat,
            |s| (s.held, s.predicted, s.cached) = (32, 32, Some(112)),
            Failed(TemplateOrContentFormat),
        );
        check(Completion, |s| s.cached = None, Failed(NoCachedTokensReported));
        // Nothing arrived: the engine serves the repeat (events lost) or nothing (no caching).
        check(Completion, |s| (s.batches, s.held, s.predicted) = (0, 0, 0), Failed(EventsNotFlowing));
        check(
            Completion,
            |s| (s.batches, s.held, s.predicted, s.cached) = (0, 0, 0, Some(0)),
            Failed(NoPrefixCaching),
        );
        // Events arrived and none matches: refused for their shape, an unknown parent, or keys.
        check(Completion, |s| (s.held, s.predicted, s.refused_shape) = (0, 0, 1), Failed(BlockSize));
        check(Completion, |s| (s.held, s.predicted, s.refused_parent) = (0, 0, 2), Failed(Hash));
        check(Completion, |s| (s.held, s.predicted) = (0, 0), Failed(Hash));
        // The engine serves the last block too.
        check(Completion, |s| s.cached = Some(128), Failed(LastTokenRule));
        // The engine caches in blocks of 32 (serves 96 of 128) or of 8 (serves 120).
        check(Completion, |s| s.cached = Some(96), Failed(BlockSize));
        check(Completion, |s| s.cached = Some(120), Failed(BlockSize));
        // Less served, blocks evicted meanwhile: nothing to conclude.
        check(Completion, |s| (s.cached, s.removed) = (Some(64), 3), Inconclusive);
        check(Completion, |s| s.cached = Some(48), Failed(Unexplained));
    }

    #[test]
    fn the_sentinel_names_an_index_the_engine_no_longer_backs() {
        let seen =
            |predicted, cached, removed| SentinelObservation { predicted, cached, removed, restarted: false };
        assert_eq!(judge_sentinel(&seen(112, Some(112), 0)), Verdict::Passed);
        assert_eq!(judge_sentinel(&seen(112, Some(0), 0)), Verdict::Failed(StaleIndex));
        assert_eq!(judge_sentinel(&seen(112, Some(0), 5)), Verdict::Inconclusive, "evicted");
        // The engine's first event since its restart arrived before the answer was read: the
        // index cleared its holdings (removals), and the restart says why.
        let restarted = SentinelObservation { restarted: true, ..seen(112, Some(0), 7) };
        assert_eq!(judge_sentinel(&restarted), Verdict::Failed(StaleIndex));
        assert_eq!(judge_sentinel(&seen(0, Some(0), 0)), Verdict::Inconclusive, "not held any more");
    }

    #[test]
    fn a_probe_fails_on_its_first_failed_part() {
        use Verdict::{Failed, Inconclusive, Passed};
        assert_eq!(overall_verdict([Passed, Passed]), Passed);
        assert_eq!(overall_verdict([Passed, Inconclusive]), Inconclusive);
        assert_eq!(overall_verdict([Inconclusive, Failed(StaleIndex), Failed(Hash)]), Failed(StaleIndex));
        assert_eq!(overall_verdict([]), Inconclusive);
    }

    #[test]
    fn served_tokens_follow_the_last_token_rule() {
        assert_eq!(served_tokens(128, 16), 112);
        assert_eq!(served_tokens(129, 16), 128);
        assert_eq!(served_tokens(128, 0), 0);
        assert_eq!(served_tokens(0, 16), 0);
    }
}
