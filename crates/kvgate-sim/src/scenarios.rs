//! The routing scenarios S1-S11 of docs/SCENARIOS.md as data: each one's trace (the Mooncake
//! conversation trace, or a `kvgate trace gen` command line) and its `kvgate sim` flags (fleet,
//! rate), at full size (the documented commands) or shortened for the routing guard
//! (`crate::guard`): the conversation trace's first requests, generated traces over fewer
//! seconds.

use clap::{Parser, ValueEnum};
use kvgate_policy::PolicyKind;
use kvgate_trace::generate::{generate, GenArgs};

use crate::SimArgs;
use kvgate_trace::Trace;

/// Where a scenario's trace comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceSource {
    /// The Mooncake conversation trace (`shared/bench/SCENARIOS.md`).
    Conversation,
    /// `kvgate trace gen` with these flags (seeded by the run's `--seed`).
    Generated(&'static [&'static str]),
}

/// One scenario: its trace, its fleet and rate, and its size in the guard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scenario {
    pub id: &'static str,
    pub source: TraceSource,
    /// `kvgate sim` flags besides `--trace` and `--policies`.
    pub sim_flags: &'static [&'static str],
    /// The guard's size: the conversation trace's first this many requests, or this many
    /// seconds of a generated trace (`--duration-secs`).
    pub guard_size: u32,
}

const UNEQUAL_FLEET: [&str; 6] = [
    "--rate-scale",
    "2",
    "--worker-speeds",
    "2,2,2,2,1,1,1,1",
    "--worker-kv-capacity-tokens",
    "262144,262144,262144,262144,262144,262144,262144,131072",
];

/// S9's agents: `kvgate trace gen --shape agentic` at its defaults (6 applications, tool prompts
/// of 4K-15K tokens, popularity 1 / k^1.1, sessions of 2-28 calls, tool results of 0.3K-6K
/// tokens, 0.2-3 s of tool time, contexts up to 110K tokens), answers of 30-400 tokens, at twice
/// the fleet's prefill capacity in prompt tokens (93% of them servable from cache).
const S9_GEN: [&str; 8] =
    ["--shape", "agentic", "--output-min-tokens", "30", "--output-max-tokens", "400", "--load", "2"];

/// S10's rollouts: `kvgate trace gen --shape rollouts` at its defaults (a step every 45 s of 28
/// prompts from 5 task families, 8-16 samples each, reasoning outputs of median 1,000 tokens cut
/// at 7,000).
const S10_GEN: [&str; 2] = ["--shape", "rollouts"];

/// S11's reasoning: 8 shared contexts of 12K-40K tokens (popularity 1 / k^1.2), questions of up
/// to 1,000 tokens at 1.5 times the prefill capacity in prompt tokens (98% servable from cache),
/// answers of median 2,000 tokens (sigma 1.0, cut at 16,000).
const S11_GEN: [&str; 18] = [
    "--shape",
    "reasoning",
    "--docs",
    "8",
    "--doc-min-tokens",
    "12000",
    "--doc-max-tokens",
    "40000",
    "--popularity-skew",
    "1.2",
    "--load",
    "1.5",
    "--reasoning-median-tokens",
    "2000",
    "--reasoning-sigma",
    "1.0",
    "--reasoning-max-tokens",
    "16000",
];

/// S1-S11, in order.
pub const SCENARIOS: [Scenario; 11] = [
    Scenario { id: "S1", source: TraceSource::Conversation, sim_flags: &[], guard_size: 1500 },
    Scenario {
        id: "S2",
        source: TraceSource::Conversation,
        sim_flags: &["--rate-scale", "2"],
        guard_size: 1500,
    },
    Scenario {
        id: "S3",
        source: TraceSource::Conversation,
        sim_flags: &["--rate-scale", "2", "--kv-capacity-tokens", "131072"],
        guard_size: 1500,
    },
    Scenario {
        id: "S4",
        source: TraceSource::Conversation,
        sim_flags: &["--rate-scale", "1.5", "--kv-capacity-tokens", "1048576"],
        guard_size: 1500,
    },
    Scenario {
        id: "S5",
        source: TraceSource::Generated(&["--shape", "hot-docs", "--open-loop"]),
        sim_flags: &["--kv-capacity-tokens", "1048576"],
        guard_size: 300,
    },
    Scenario { id: "S6", source: TraceSource::Conversation, sim_flags: &UNEQUAL_FLEET, guard_size: 1500 },
    Scenario {
        id: "S7",
        source: TraceSource::Generated(&["--shape", "bursts", "--open-loop"]),
        sim_flags: &[],
        guard_size: 600,
    },
    Scenario {
        id: "S8",
        source: TraceSource::Generated(&[
            "--shape",
            "long-prompts",
            "--doc-min-tokens",
            "8000",
            "--doc-max-tokens",
            "100000",
            "--load",
            "0.6",
        ]),
        sim_flags: &[],
        guard_size: 400,
    },
    Scenario { id: "S9", source: TraceSource::Generated(&S9_GEN), sim_flags: &[], guard_size: 300 },
    // S10 whole (1,200 s, its default): its first steps alone (180 s) missed a change that made
    // kv_aware 1.28x cache_aware's mean over the whole run (the samples' KV, 2026-12-05), and
    // the whole run costs the guard about 3 s a policy.
    Scenario { id: "S10", source: TraceSource::Generated(&S10_GEN), sim_flags: &[], guard_size: 1200 },
    Scenario { id: "S11", source: TraceSource::Generated(&S11_GEN), sim_flags: &[], guard_size: 600 },
];

/// Every built-in policy, by name (`--policy`'s values).
pub fn built_in_policies() -> Vec<&'static str> {
    PolicyKind::value_variants().iter().map(|kind| kind.as_str()).collect()
}

/// The scenario named `id` (`S1`..`S11`, any case).
pub fn scenario(id: &str) -> Option<&'static Scenario> {
    SCENARIOS.iter().find(|scenario| scenario.id.eq_ignore_ascii_case(id))
}

impl Scenario {
    /// `kvgate trace gen`'s options for this scenario at `seed`, shortened to `duration_secs`
    /// when given (`None` for the conversation trace).
    pub fn gen_args(&self, seed: u64, duration_secs: Option<u32>) -> Option<GenArgs> {
        let TraceSource::Generated(flags) = self.source else { return None };
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            args: GenArgs,
        }
        let mut args = Command::try_parse_from(std::iter::once("gen").chain(flags.iter().copied()))
            .expect("a scenario's trace gen flags parse")
            .args;
        args.seed = seed;
        if let Some(duration) = duration_secs {
            args.duration_secs = f64::from(duration);
        }
        Some(args)
    }

    /// The scenario's trace: generated at `seed` (shortened to the guard's size with `guard`),
    /// or `conversation` (its first `guard_size` requests with `guard`).
    pub fn trace(&self, conversation: Option<&Trace>, seed: u64, guard: bool) -> Result<Trace, String> {
        match self.gen_args(seed, guard.then_some(self.guard_size)) {
            Some(args) => generate(&args).map_err(|error| format!("{}: {error}", self.id)),
            None => {
                let trace =
                    conversation.ok_or_else(|| format!("{} needs the conversation trace", self.id))?;
                Ok(trace.truncated(guard.then_some(self.guard_size as usize)))
            }
        }
    }

    /// `kvgate sim`'s options for this scenario (the trace is given separately): its flags,
    /// `policies` and `seed`.
    pub fn sim_args(&self, policies: &[&str], seed: u64) -> SimArgs {
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            args: SimArgs,
        }
        let argv = ["sim", "--trace", self.id].into_iter().chain(self.sim_flags.iter().copied());
        let mut args = Command::try_parse_from(argv).expect("a scenario's sim flags parse").args;
        args.policies = policies.iter().map(|policy| policy.to_string()).collect();
        args.seed = seed;
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_parses_and_generated_ones_shorten() {
        for scenario in &SCENARIOS {
            let args = scenario.sim_args(&["round_robin"], 1);
            assert_eq!((args.seed, args.policies.len()), (1, 1), "{}", scenario.id);
            assert!(args.runs().is_ok(), "{}", scenario.id);
            if let Some(gen) = scenario.gen_args(3, Some(60)) {
                assert_eq!((gen.seed, gen.duration_secs), (3, 60.0), "{}", scenario.id);
                assert!(gen.validate().is_ok(), "{}", scenario.id);
            }
        }
        assert_eq!(scenario("s10").map(|s| s.id), Some("S10"));
        assert!(built_in_policies().contains(&"kv_aware") && built_in_policies().len() >= 10);
        let s6 = scenario("S6").unwrap().sim_args(&["kv_aware"], 0);
        assert_eq!((s6.rate_scale, s6.engine.worker_speeds.len()), (2.0, 8));
    }
}
