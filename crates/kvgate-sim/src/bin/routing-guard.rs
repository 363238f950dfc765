//! `routing-guard`: runs every scenario under every built-in policy in `kvgate sim` and compares
//! the figures with the committed baseline (`kvgate_sim::guard`); exits 1 when one is more than
//! the tolerance worse, 2 when it cannot run. `scripts/routing_guard.sh` builds and runs it.

use std::process::ExitCode;

use clap::Parser;
use kvgate_sim::guard::{run, GuardArgs};

fn main() -> ExitCode {
    let args = GuardArgs::parse();
    match run(&args) {
        Ok(report) => {
            print!("{}", report.markdown(args.tolerance_pct, args.update));
            if args.update {
                println!("\nBaseline written to {}.", args.baseline.display());
                ExitCode::SUCCESS
            } else if report.failed() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(error) => {
            eprintln!("routing guard: {error}");
            ExitCode::from(2)
        }
    }
}
