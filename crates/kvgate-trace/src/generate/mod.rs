//! `kvgate trace gen`: seeded generators of workload traces in the Mooncake jsonl form, for the
//! scenarios the conversation trace does not cover (docs/SCENARIOS.md): `hot-docs` (a few very
//! long shared documents, each asked in bursts, beside a steady background of short chats),
//! `bursts` (chat sessions whose arrival rate switches between a low and a high phase) and
//! `long-prompts` (a stream of distinct long documents, a few asked again later),
//! `tenants-flood` (interactive tenants' chat sessions beside one tenant flooding long prompts),
//! `agentic` (agents' tool loops on their applications' long tool prompts), `rollouts` (RL
//! training steps: batches of prompts, each sampled n times at once, long reasoning outputs) and
//! `reasoning` (questions on popular shared contexts with long reasoning answers) and
//! `conversations` (a fixed number of chats of a fixed length, carried on by a few clients).
//!
//! Chat sessions and agents' tool loops are written as sessions (`session_id`, and `think_ms`
//! on every later turn: the think or tool time after the previous answer), so the replayers send
//! each turn once the previous one is answered (closed loop); `--open-loop` leaves the session
//! fields out (every turn at its timestamp, the traces written before sessions existed). A later
//! turn's timestamp is its session's start plus the think times before it: when it would arrive
//! if every answer were instant.
//!
//! Loads are given as a fraction of the fleet's prefill capacity (`--capacity-tokens-per-sec`,
//! default 8 reference engines), counted in prompt tokens: the prefill offered if nothing were
//! cached (what the fleet computes is less, by its hit rate). The same options and seed give the
//! same file, byte for byte.

mod agents;
mod context;
mod shapes;

use std::io::Write;
use std::path::PathBuf;

use kvgate_config::{Checks, Range, ValidationErrors};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::trace::{Trace, TraceRequest};

/// The workload shapes `kvgate trace gen` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[clap(rename_all = "kebab-case")]
pub enum Shape {
    /// A few very long shared documents, each receiving bursts of follow-up questions, beside a
    /// steady background of short chat sessions (S5).
    HotDocs,
    /// Chat sessions whose arrival rate switches between `--low-load` and `--high-load` (S7).
    Bursts,
    /// Distinct long documents arriving steadily, some asked again later (S8).
    LongPrompts,
    /// `--interactive-tenants` tenants' chat sessions (their total load `--load`, each its own
    /// system prompts) beside the tenant `flood` sending `--flood-factor` times their request
    /// rate of long prompts (one of `--docs` documents and a question), every line naming its
    /// tenant (issue 26's scenario).
    TenantsFlood,
    /// Agents' tool loops (S9): `--apps` applications, each with a long tool-definition prompt
    /// shared by its sessions, popularity skewed (`--popularity-skew`); a session is
    /// `--calls-min`..`--calls-max` calls, each resending the whole context plus the previous
    /// answer and a tool result, `--tool-min-secs`..`--tool-max-secs` of tool time apart.
    Agentic,
    /// RL rollouts (S10): every `--step-secs` a batch of `--batch-prompts` prompts (a task
    /// family's shared prefix and a problem), each sampled `--samples-min`..`--samples-max`
    /// times at once, reasoning outputs log-normal (`--reasoning-*`).
    Rollouts,
    /// Reasoning on shared contexts (S11): questions on one of `--docs` contexts (popularity
    /// skewed) at `--load`, each answered at reasoning length (`--reasoning-*`).
    Reasoning,
    /// A fixed conversation workload, closed loop: `--conversations` chats of exactly
    /// `--session-max-turns` turns, each its own `--system-prompt-tokens` system prompt, held by
    /// `--clients` clients; a client carries its conversations on in rotation (turn 1 of each,
    /// then turn 2 of each, ...), one request in flight, `--think-secs` (exponential) after each
    /// answer. So `--clients` requests are in flight at once and every conversation stays live to
    /// its last turn (issue 39's 20 conversations x 10 turns at concurrency 4).
    Conversations,
}

/// Options of `kvgate trace gen`. Each shape reads the options its help names; the others are
/// ignored.
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct GenArgs {
    /// The workload shape.
    #[arg(long, value_enum)]
    pub shape: Shape,
    /// Seed of every random draw (the same options and seed give the same trace).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the trace here (default: standard output).
    #[arg(long, short = 'o', value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Seconds of arrivals.
    #[arg(long, default_value_t = 1200.0)]
    pub duration_secs: f64,
    /// The fleet prefill capacity loads are relative to, in tokens per second (default: 8
    /// reference engines of 8,000).
    #[arg(long, default_value_t = 64_000.0)]
    pub capacity_tokens_per_sec: f64,

    /// Chat sessions (all shapes' background, bursts' only traffic): system prompts shared by
    /// the sessions (each session uses one).
    #[arg(long, default_value_t = 8)]
    pub system_prompts: usize,
    /// Tokens of each shared system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_prompt_tokens: u32,
    /// Most turns of a chat session (uniform in 1..=N); conversations: every conversation's turns.
    #[arg(long, default_value_t = 6)]
    pub session_max_turns: u32,
    /// Mean seconds between a session's turns (exponential).
    #[arg(long, default_value_t = 8.0)]
    pub think_secs: f64,
    /// Fewest tokens of a user message.
    #[arg(long, default_value_t = 100)]
    pub user_min_tokens: u32,
    /// Most tokens of a user message.
    #[arg(long, default_value_t = 2000)]
    pub user_max_tokens: u32,
    /// Fewest tokens of an answer (every request's output length).
    #[arg(long, default_value_t = 50)]
    pub output_min_tokens: u32,
    /// Most tokens of an answer.
    #[arg(long, default_value_t = 500)]
    pub output_max_tokens: u32,

    /// hot-docs: the shared documents.
    #[arg(long, default_value_t = 4)]
    pub docs: usize,
    /// hot-docs, long-prompts: fewest tokens of a document.
    #[arg(long, default_value_t = 40_000)]
    pub doc_min_tokens: u32,
    /// hot-docs, long-prompts: most tokens of a document.
    #[arg(long, default_value_t = 120_000)]
    pub doc_max_tokens: u32,
    /// hot-docs: mean seconds between two bursts of questions on one document (exponential).
    #[arg(long, default_value_t = 5.0)]
    pub burst_interval_secs: f64,
    /// hot-docs: mean questions per burst (uniform in 1..=2N-1).
    #[arg(long, default_value_t = 4)]
    pub burst_questions: u32,
    /// hot-docs: the questions of a burst arrive within this many seconds (uniformly).
    #[arg(long, default_value_t = 1.0)]
    pub burst_spread_secs: f64,
    /// hot-docs, long-prompts: most tokens of a question after a document (uniform from 50).
    #[arg(long, default_value_t = 1000)]
    pub question_max_tokens: u32,

    /// hot-docs: the background chats' load; long-prompts: the documents' load (prompt tokens
    /// over the capacity).
    #[arg(long, default_value_t = 0.3)]
    pub load: f64,
    /// tenants-flood: the interactive tenants (`interactive-1` ...).
    #[arg(long, default_value_t = 3)]
    pub interactive_tenants: usize,
    /// tenants-flood: the flood's request rate over the interactive tenants' total.
    #[arg(long, default_value_t = 10.0)]
    pub flood_factor: f64,
    /// bursts: load of the low phase.
    #[arg(long, default_value_t = 0.3)]
    pub low_load: f64,
    /// bursts: load of the high phase.
    #[arg(long, default_value_t = 3.0)]
    pub high_load: f64,
    /// bursts: seconds of each low phase (the trace starts with one).
    #[arg(long, default_value_t = 240.0)]
    pub low_secs: f64,
    /// bursts: seconds of each high phase.
    #[arg(long, default_value_t = 60.0)]
    pub high_secs: f64,
    /// long-prompts: mean times a document is asked again after its first ask (geometric).
    #[arg(long, default_value_t = 1.0)]
    pub reasks: f64,
    /// long-prompts: mean seconds from a document's ask to its next one (exponential).
    #[arg(long, default_value_t = 60.0)]
    pub reask_secs: f64,
    /// conversations: the conversations (each its own system prompt).
    #[arg(long, default_value_t = 20)]
    pub conversations: u32,
    /// conversations: the clients, each with one request in flight at most; conversation i
    /// belongs to client i mod N. A client is the trace's session (`session_id` `client-K`).
    #[arg(long, default_value_t = 4)]
    pub clients: u32,
    /// Write no session fields (`session_id`, `think_ms`): every request is sent at its
    /// timestamp (open loop), as in traces written before sessions existed.
    #[arg(long)]
    pub open_loop: bool,

    /// agentic: the applications, each with its own tool-definition prompt.
    #[arg(long, default_value_t = 6)]
    pub apps: usize,
    /// agentic, reasoning: the k-th most popular application (context) is chosen in proportion
    /// to 1 / k^this (0: all alike).
    #[arg(long, default_value_t = 1.1)]
    pub popularity_skew: f64,
    /// agentic: fewest tokens of an application's tool-definition prompt.
    #[arg(long, default_value_t = 4000)]
    pub tool_prompt_min_tokens: u32,
    /// agentic: most tokens of an application's tool-definition prompt (uniform).
    #[arg(long, default_value_t = 15_000)]
    pub tool_prompt_max_tokens: u32,
    /// agentic: fewest calls of a session.
    #[arg(long, default_value_t = 2)]
    pub calls_min: u32,
    /// agentic: most calls of a session (uniform).
    #[arg(long, default_value_t = 28)]
    pub calls_max: u32,
    /// agentic: fewest tokens of a tool result.
    #[arg(long, default_value_t = 300)]
    pub tool_result_min_tokens: u32,
    /// agentic: most tokens of a tool result (uniform).
    #[arg(long, default_value_t = 6000)]
    pub tool_result_max_tokens: u32,
    /// agentic: fewest seconds of tool time after an answer.
    #[arg(long, default_value_t = 0.2)]
    pub tool_min_secs: f64,
    /// agentic: most seconds of tool time after an answer (uniform).
    #[arg(long, default_value_t = 3.0)]
    pub tool_max_secs: f64,
    /// agentic: a session ends before a call whose context would exceed this many tokens.
    #[arg(long, default_value_t = 110_000)]
    pub context_max_tokens: u32,

    /// rollouts: seconds between training steps (the first at 0).
    #[arg(long, default_value_t = 45.0)]
    pub step_secs: f64,
    /// rollouts: prompts per step.
    #[arg(long, default_value_t = 28)]
    pub batch_prompts: u32,
    /// rollouts: a step's prompts arrive within this many seconds of it (uniformly); the
    /// samples of one prompt all at once.
    #[arg(long, default_value_t = 1.0)]
    pub batch_spread_secs: f64,
    /// rollouts: task families, each with a shared prefix (instructions, examples); a prompt's
    /// family is drawn uniformly.
    #[arg(long, default_value_t = 5)]
    pub families: usize,
    /// rollouts: fewest tokens of a family's shared prefix.
    #[arg(long, default_value_t = 1500)]
    pub family_prefix_min_tokens: u32,
    /// rollouts: most tokens of a family's shared prefix (uniform).
    #[arg(long, default_value_t = 9000)]
    pub family_prefix_max_tokens: u32,
    /// rollouts: fewest tokens of a problem after its family's prefix.
    #[arg(long, default_value_t = 200)]
    pub problem_min_tokens: u32,
    /// rollouts: most tokens of a problem (uniform).
    #[arg(long, default_value_t = 2500)]
    pub problem_max_tokens: u32,
    /// rollouts: fewest samples of a prompt (all sent at once, sharing the whole prompt).
    #[arg(long, default_value_t = 8)]
    pub samples_min: u32,
    /// rollouts: most samples of a prompt (uniform).
    #[arg(long, default_value_t = 16)]
    pub samples_max: u32,
    /// rollouts, reasoning: median tokens of a reasoning output (log-normal).
    #[arg(long, default_value_t = 1000)]
    pub reasoning_median_tokens: u32,
    /// rollouts, reasoning: the log-normal's sigma (of the log of the length): the tail's weight.
    #[arg(long, default_value_t = 0.9)]
    pub reasoning_sigma: f64,
    /// rollouts, reasoning: most tokens of a reasoning output (longer draws are cut there).
    #[arg(long, default_value_t = 7000)]
    pub reasoning_max_tokens: u32,
}

impl GenArgs {
    /// Defaults for everything but the shape (as an empty command line would give).
    pub fn new(shape: Shape) -> GenArgs {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: GenArgs,
        }
        let mut args = <Command as clap::Parser>::parse_from(["gen", "--shape", "hot-docs"]).args;
        args.shape = shape;
        args
    }

    /// Every problem with the options at once.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        for (field, value, range) in [
            ("duration_secs", self.duration_secs, Range::POSITIVE),
            ("capacity_tokens_per_sec", self.capacity_tokens_per_sec, Range::POSITIVE),
            ("think_secs", self.think_secs, Range::POSITIVE),
            ("burst_interval_secs", self.burst_interval_secs, Range::POSITIVE),
            ("burst_spread_secs", self.burst_spread_secs, Range::NON_NEGATIVE),
            ("load", self.load, Range::POSITIVE),
            ("low_load", self.low_load, Range::POSITIVE),
            ("high_load", self.high_load, Range::POSITIVE),
            ("low_secs", self.low_secs, Range::POSITIVE),
            ("high_secs", self.high_secs, Range::POSITIVE),
            ("reasks", self.reasks, Range::NON_NEGATIVE),
            ("flood_factor", self.flood_factor, Range::NON_NEGATIVE),
            ("reask_secs", self.reask_secs, Range::POSITIVE),
            ("popularity_skew", self.popularity_skew, Range::NON_NEGATIVE),
            ("tool_min_secs", self.tool_min_secs, Range::NON_NEGATIVE),
            ("tool_max_secs", self.tool_max_secs, Range::NON_NEGATIVE),
            ("step_secs", self.step_secs, Range::POSITIVE),
            ("batch_spread_secs", self.batch_spread_secs, Range::NON_NEGATIVE),
            ("reasoning_sigma", self.reasoning_sigma, Range::NON_NEGATIVE),
        ] {
            checks.in_range(field, value, range);
        }
        for (field, value) in [
            ("system_prompts", self.system_prompts as u64),
            ("system_prompt_tokens", self.system_prompt_tokens.into()),
            ("session_max_turns", self.session_max_turns.into()),
            ("conversations", self.conversations.into()),
            ("clients", self.clients.into()),
            ("user_min_tokens", self.user_min_tokens.into()),
            ("output_min_tokens", self.output_min_tokens.into()),
            ("docs", self.docs as u64),
            ("interactive_tenants", self.interactive_tenants as u64),
            ("doc_min_tokens", self.doc_min_tokens.into()),
            ("burst_questions", self.burst_questions.into()),
            ("question_max_tokens", self.question_max_tokens.into()),
            ("apps", self.apps as u64),
            ("tool_prompt_min_tokens", self.tool_prompt_min_tokens.into()),
            ("calls_min", self.calls_min.into()),
            ("tool_result_min_tokens", self.tool_result_min_tokens.into()),
            ("context_max_tokens", self.context_max_tokens.into()),
            ("batch_prompts", self.batch_prompts.into()),
            ("families", self.families as u64),
            ("family_prefix_min_tokens", self.family_prefix_min_tokens.into()),
            ("problem_min_tokens", self.problem_min_tokens.into()),
            ("samples_min", self.samples_min.into()),
            ("reasoning_median_tokens", self.reasoning_median_tokens.into()),
        ] {
            checks.at_least(field, value, 1);
        }
        for (field, low, high) in [
            ("user_max_tokens", self.user_min_tokens, self.user_max_tokens),
            ("output_max_tokens", self.output_min_tokens, self.output_max_tokens),
            ("doc_max_tokens", self.doc_min_tokens, self.doc_max_tokens),
            ("tool_prompt_max_tokens", self.tool_prompt_min_tokens, self.tool_prompt_max_tokens),
            ("calls_max", self.calls_min, self.calls_max),
            ("tool_result_max_tokens", self.tool_result_min_tokens, self.tool_result_max_tokens),
            ("family_prefix_max_tokens", self.family_prefix_min_tokens, self.family_prefix_max_tokens),
            ("problem_max_tokens", self.problem_min_tokens, self.problem_max_tokens),
            ("samples_max", self.samples_min, self.samples_max),
            ("reasoning_max_tokens", self.reasoning_median_tokens, self.reasoning_max_tokens),
        ] {
            checks.at_least(field, high.into(), low.into());
        }
        checks.ensure(
            self.tool_max_secs >= self.tool_min_secs,
            "tool_max_secs",
            format!("must be at least tool_min_secs ({})", self.tool_min_secs),
        );
        checks.finish()
    }
}

/// Why `kvgate trace gen` failed.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error("invalid trace gen options: {0}")]
    InvalidOptions(#[from] ValidationErrors),
    #[error("writing {path}: {source}")]
    Output { path: String, source: std::io::Error },
}

/// The trace the options describe, in arrival order.
pub fn generate(args: &GenArgs) -> Result<Trace, GenError> {
    args.validate()?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut requests = match args.shape {
        Shape::HotDocs => shapes::hot_docs(args, &mut rng),
        Shape::Bursts => shapes::bursts(args, &mut rng),
        Shape::LongPrompts => shapes::long_prompts(args, &mut rng),
        Shape::TenantsFlood => shapes::tenants_flood(args, &mut rng),
        Shape::Agentic => agents::agentic(args, &mut rng),
        Shape::Rollouts => agents::rollouts(args, &mut rng),
        Shape::Reasoning => agents::reasoning(args, &mut rng),
        Shape::Conversations => shapes::conversations(args, &mut rng),
    };
    if args.open_loop {
        for request in &mut requests {
            (request.session_id, request.think_ms) = (None, None);
        }
    }
    requests.sort_by(|a, b| a.timestamp_ms.total_cmp(&b.timestamp_ms));
    Ok(Trace { requests })
}

/// One trace line in the Mooncake form `Trace::parse_mooncake` reads.
pub fn mooncake_line(request: &TraceRequest) -> String {
    let mut line = serde_json::json!({
        "timestamp": (request.timestamp_ms * 1000.0).round() / 1000.0,
        "input_length": request.input_length,
        "output_length": request.output_length,
        "hash_ids": request.hash_ids,
    });
    for (key, value) in
        [("tenant", &request.tenant), ("priority", &request.priority), ("session_id", &request.session_id)]
    {
        if let Some(value) = value {
            line[key] = value.as_str().into();
        }
    }
    if let Some(think_ms) = request.think_ms {
        line["think_ms"] = ((think_ms * 1000.0).round() / 1000.0).into();
    }
    line.to_string()
}

/// `kvgate trace gen`: writes the generated trace (jsonl) to `--out` or standard output, and a
/// one-line summary on standard error.
pub fn run_cli(args: &GenArgs) -> Result<(), GenError> {
    let trace = generate(args)?;
    let mut text = String::new();
    for request in &trace.requests {
        text.push_str(&mooncake_line(request));
        text.push('\n');
    }
    let path = args.out.as_ref().map_or("standard output".to_string(), |p| p.display().to_string());
    let written = match &args.out {
        Some(path) => std::fs::write(path, text.as_bytes()),
        None => std::io::stdout().lock().write_all(text.as_bytes()),
    };
    written.map_err(|source| GenError::Output { path: path.clone(), source })?;
    let ceiling = trace.cache_ceiling();
    let span_s = trace.requests.last().map_or(0.0, |r| r.timestamp_ms / 1000.0);
    let (per_sec, new_per_sec) = (
        ceiling.prompt_tokens as f64 / span_s.max(1e-9),
        (ceiling.prompt_tokens - ceiling.cached_tokens) as f64 / span_s.max(1e-9),
    );
    eprintln!(
        "trace gen {:?}: {} requests over {span_s:.0} s, {} prompt tokens ({per_sec:.0} per second, \
         {:.2} of {} tok/s; {new_per_sec:.0} per second not seen before), infinite-cache ceiling \
         {:.1}%, to {path}",
        args.shape,
        trace.requests.len(),
        ceiling.prompt_tokens,
        per_sec / args.capacity_tokens_per_sec,
        args.capacity_tokens_per_sec,
        100.0 * ceiling.rate(),
    );
    Ok(())
}

#[cfg(test)]
mod tests;
