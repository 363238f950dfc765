//! Stand-alone `kvgate sim` until the CLI wires it in: parses `SimArgs` and runs the simulator.

use clap::Parser;

#[derive(Parser)]
#[command(name = "kvgate-sim", about = "Replay a trace in virtual time through kvgate's routing policies")]
struct Command {
    #[command(flatten)]
    args: kvgate_sim::SimArgs,
}

fn main() -> anyhow::Result<()> {
    Ok(kvgate_sim::run_cli(Command::parse().args)?)
}
