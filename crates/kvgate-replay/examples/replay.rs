//! Stand-alone `kvgate replay` until the CLI wires it in: parses `ReplayArgs` and replays a trace.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "kvgate-replay",
    about = "Replay a trace as streaming requests to an OpenAI-compatible endpoint"
)]
struct Command {
    #[command(flatten)]
    args: kvgate_replay::ReplayArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Ok(kvgate_replay::run_cli(Command::parse().args).await?)
}
