//! The `kvgate` command line: `launch` (the gateway) and the other subcommands.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvgate_gateway::GatewayConfig;
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(name = "kvgate", version, about = "An LLM inference gateway with KV-cache-aware routing")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway in front of SGLang/vLLM workers.
    Launch(Box<GatewayConfig>),
}

fn init_logging(level: &str, json: bool) {
    let filter = EnvFilter::try_new(level).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvgate: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Launch(config) => {
            init_logging(&config.log_level, config.log_json);
            runtime.block_on(kvgate_gateway::run(*config)).map_err(anyhow::Error::from)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvgate: {error:#}");
            ExitCode::FAILURE
        }
    }
}
