//! Runs one scenario of docs/SCENARIOS.md by its id at full size (or the routing guard's, with
//! `--guard`), its trace generated in-process: the markdown report of `kvgate sim` on it.
//!
//! ```sh
//! cargo run --release -p kvgate-sim --example scenario -- S9 --seed 1 --policies round_robin,kv_aware
//! ```

use anyhow::Context;
use clap::Parser;
use kvgate_sim::scenarios::{built_in_policies, scenario};
use kvgate_trace::{Trace, TraceFormat};

#[derive(Parser)]
struct Command {
    /// S1..S11.
    id: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Comma-separated `kvgate sim --policies` entries (default: every built-in policy).
    #[arg(long)]
    policies: Option<String>,
    /// The guard's size instead of the full one.
    #[arg(long)]
    guard: bool,
    /// The conversation trace (S1-S4, S6).
    #[arg(long, default_value = "../shared/traces/conversation_trace.jsonl")]
    conversation_trace: std::path::PathBuf,
    /// More `kvgate trace gen` flags (space-separated): they replace the scenario's.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    gen: String,
    /// More `kvgate sim` flags (space-separated): they replace the scenario's.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    sim: String,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let command = Command::parse();
    let scenario = scenario(&command.id).with_context(|| format!("no scenario {}", command.id))?;
    let conversation = match scenario.gen_args(0, None) {
        Some(_) => None,
        None => Some(Trace::load(&command.conversation_trace, TraceFormat::Mooncake)?),
    };
    let mut scenario = *scenario;
    // Extra flags: leaked into the scenario's static flag lists (a one-shot process).
    // A flag given again replaces the scenario's (and its value).
    let extend = |flags: &'static [&'static str], extra: &str| -> &'static [&'static str] {
        let extra: Vec<&'static str> =
            extra.split_whitespace().map(|f| &*Box::leak(f.to_string().into_boxed_str())).collect();
        let mut all: Vec<&'static str> = Vec::new();
        let mut i = 0;
        while i < flags.len() {
            let takes_value = flags.get(i + 1).is_some_and(|next| !next.starts_with("--"));
            let width = if takes_value { 2 } else { 1 };
            if !extra.contains(&flags[i]) {
                all.extend(&flags[i..i + width]);
            }
            i += width;
        }
        all.extend(extra);
        Box::leak(all.into_boxed_slice())
    };
    if let kvgate_sim::scenarios::TraceSource::Generated(flags) = scenario.source {
        scenario.source = kvgate_sim::scenarios::TraceSource::Generated(extend(flags, &command.gen));
    }
    scenario.sim_flags = extend(scenario.sim_flags, &command.sim);
    let trace =
        scenario.trace(conversation.as_ref(), command.seed, command.guard).map_err(anyhow::Error::msg)?;
    let policies: Vec<String> = match &command.policies {
        Some(list) => list.split(',').map(str::to_string).collect(),
        None => built_in_policies().iter().map(|p| p.to_string()).collect(),
    };
    let entries: Vec<&str> = policies.iter().map(String::as_str).collect();
    let mut args = scenario.sim_args(&entries, command.seed);
    args.json = command.json;
    let report = kvgate_sim::run_on_trace(&args, &trace, true)?;
    print!("{}", report.markdown());
    kvgate_sim::write_outputs(&args, &report)?;
    Ok(())
}
