//! The `kvgate` command line: `launch` (the gateway, optionally in front of in-process simulated
//! engines), `mock` (a fleet of simulated engines), `sim` (the virtual-time policy simulator),
//! `replay` (a trace sent as real HTTP requests) and `soak` (soak, burst and churn checks).
//!
//! The command line lives in this library so that the binary (`src/main.rs`) and the Python
//! package (`python -m kvgate launch ...`) run the same code: [`main_with_args`].

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use kvgate_gateway::GatewayConfig;
use kvgate_mock::MockArgs;
use tracing_subscriber::EnvFilter;

pub mod smg;
#[cfg(test)]
mod tidy;

#[derive(Parser)]
#[command(name = "kvgate", version, about = "An LLM inference gateway with KV-cache-aware routing")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway in front of SGLang/vLLM workers.
    Launch(Box<LaunchArgs>),
    /// Run a fleet of simulated SGLang/vLLM engines, one HTTP port each.
    Mock(Box<MockArgs>),
    /// Replay a trace through routing policies onto simulated engines, in virtual time.
    Sim(Box<kvgate_sim::SimArgs>),
    /// Send a trace as real HTTP requests to any OpenAI-compatible endpoint and measure it.
    Replay(Box<kvgate_replay::ReplayArgs>),
    /// Workload traces: `kvgate trace gen --shape hot-docs|bursts|long-prompts` writes a seeded
    /// synthetic trace (Mooncake jsonl) for `kvgate sim` and `kvgate replay`.
    Trace(TraceArgs),
    /// Soak, burst and churn the gateway in front of simulated engines, in-process: no request
    /// may be lost or answered twice, memory and file descriptors must stay flat.
    Soak(Box<kvgate_soak::SoakArgs>),
}

#[derive(clap::Args)]
struct TraceArgs {
    #[command(subcommand)]
    command: TraceCommand,
}

#[derive(Subcommand)]
enum TraceCommand {
    /// Write a seeded synthetic trace (docs/SCENARIOS.md: S5 hot-docs, S7 bursts, S8 long-prompts).
    Gen(Box<kvgate_trace::generate::GenArgs>),
}

#[derive(clap::Args)]
struct LaunchArgs {
    /// YAML file with any of the options below (keys are the snake_case field names of
    /// docs/CONFIG.md, routing options under `routing:`); flags on the command line override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    gateway: GatewayConfig,
    /// Also start this many simulated engines in-process on free loopback ports and route to
    /// them (the demo: no GPU needed).
    #[arg(long, value_name = "N")]
    mock_workers: Option<usize>,
    /// With --pd-disaggregation: also start this many simulated prefill engines (SGLang and
    /// vLLM protocols, KV events on) and route to them.
    #[arg(long, value_name = "N")]
    mock_prefill: Option<usize>,
    /// With --pd-disaggregation: also start this many simulated decode engines.
    #[arg(long, value_name = "M")]
    mock_decode: Option<usize>,
    /// Print the effective configuration (defaults, the --config file and the flags merged) as
    /// YAML, in the --config file's format, and exit.
    #[arg(long)]
    print_config: bool,
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

/// `launch`'s logging: stderr, and with `--log-dir DIR` also `DIR/kvgate.log` (appended, no
/// colour codes).
fn init_launch_logging(config: &GatewayConfig) -> anyhow::Result<()> {
    use tracing_subscriber::fmt::writer::MakeWriterExt;
    let Some(dir) = &config.log_dir else {
        init_logging(&config.log_level, config.log_json);
        return Ok(());
    };
    std::fs::create_dir_all(dir).with_context(|| format!("creating the log directory {}", dir.display()))?;
    let path = dir.join("kvgate.log");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening the log file {}", path.display()))?;
    let filter = EnvFilter::try_new(&config.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let writer = std::io::stderr.and(std::sync::Mutex::new(file));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer).with_ansi(false);
    if config.log_json {
        builder.json().init();
    } else {
        builder.init();
    }
    Ok(())
}

/// The mock fleet options for the demos: reference engines of `role`, default model name, KV
/// events and their replay on free ports (and, for prefill engines, bootstrap ports). Public for
/// the Python package's `Gateway(mock_workers=N)`.
pub fn demo_fleet(count: usize, role: kvgate_mock::WorkerRole) -> MockArgs {
    MockArgs {
        count,
        role,
        kv_events_base_port: Some(0),
        kv_events_replay_base_port: Some(0),
        bootstrap_base_port: (role == kvgate_mock::WorkerRole::Prefill).then_some(0),
        ..MockArgs::default()
    }
}

/// Routes to the in-process fleets: their URLs (by role), KV event endpoints in the gateway's
/// worker order (--worker-urls, --prefill, --decode), and (unless the user gave a tokenizer) the
/// engines' own tokenizer.
pub fn wire_fleets(config: &mut GatewayConfig, fleets: &[kvgate_mock::MockFleet]) {
    use kvgate_mock::WorkerRole;
    let of_role = |role: WorkerRole| fleets.iter().filter(move |fleet| fleet.role() == role);
    // Workers given on the command line have no KV events (unless given).
    let given = config.initial_workers();
    let mut events = std::mem::take(&mut config.kv_events_endpoints);
    let mut replays = std::mem::take(&mut config.kv_events_replay_endpoints);
    events.resize(given.len(), kvgate_gateway::NO_ENDPOINT.to_string());
    replays.resize(given.len(), kvgate_gateway::NO_ENDPOINT.to_string());
    let (mut regular, mut prefill, mut decode) = (Vec::new(), Vec::new(), Vec::new());
    for (worker, endpoints) in given.into_iter().zip(events.into_iter().zip(replays)) {
        match worker.role {
            kvgate_gateway::WorkerRole::Regular => regular.push(endpoints),
            kvgate_gateway::WorkerRole::Prefill => prefill.push(endpoints),
            kvgate_gateway::WorkerRole::Decode => decode.push(endpoints),
        }
    }
    let endpoints = |fleet: &kvgate_mock::MockFleet| {
        fleet.kv_event_endpoints().into_iter().zip(fleet.kv_event_replay_endpoints()).collect::<Vec<_>>()
    };
    for fleet in of_role(WorkerRole::Regular) {
        config.worker_urls.extend(fleet.urls());
        regular.extend(endpoints(fleet));
    }
    for fleet in of_role(WorkerRole::Prefill) {
        for (url, port) in fleet.urls().into_iter().zip(fleet.bootstrap_ports()) {
            config.prefill.extend([url, port.to_string()]);
        }
        prefill.extend(endpoints(fleet));
    }
    for fleet in of_role(WorkerRole::Decode) {
        config.decode.extend(fleet.urls());
        decode.extend(endpoints(fleet));
    }
    (config.kv_events_endpoints, config.kv_events_replay_endpoints) =
        regular.into_iter().chain(prefill).chain(decode).unzip();
    if config.tokenizer_path.is_none() {
        config.mock_tokenizer = true;
    }
}

/// The demo fleets asked for: `--mock-workers`, `--mock-prefill` with `--mock-decode`.
fn wanted_fleets(args: &LaunchArgs) -> anyhow::Result<Vec<(usize, kvgate_mock::WorkerRole)>> {
    use kvgate_mock::WorkerRole;
    let mut wanted = Vec::new();
    if let Some(count) = args.mock_workers.filter(|&n| n > 0) {
        wanted.push((count, WorkerRole::Regular));
    }
    match (args.mock_prefill.unwrap_or(0), args.mock_decode.unwrap_or(0)) {
        (0, 0) => {}
        (prefill, decode) if prefill > 0 && decode > 0 => {
            anyhow::ensure!(
                args.gateway.pd_disaggregation,
                "--mock-prefill and --mock-decode need --pd-disaggregation"
            );
            wanted.push((prefill, WorkerRole::Prefill));
            wanted.push((decode, WorkerRole::Decode));
        }
        _ => anyhow::bail!("give both --mock-prefill N and --mock-decode M (each at least 1)"),
    }
    Ok(wanted)
}

async fn launch(args: LaunchArgs) -> anyhow::Result<()> {
    if args.print_config {
        print!(
            "{}",
            args.gateway.to_yaml().map_err(|e| anyhow::anyhow!("rendering the configuration: {e}"))?
        );
        return Ok(());
    }
    let wanted = wanted_fleets(&args)?;
    let mut config = args.gateway;
    let mut fleets = Vec::new();
    for (count, role) in wanted {
        let fleet = kvgate_mock::spawn_fleet(demo_fleet(count, role))
            .await
            .with_context(|| format!("starting the mock {role:?} engines"))?;
        fleets.push(fleet);
    }
    if !fleets.is_empty() {
        wire_fleets(&mut config, &fleets);
    }
    let handle = kvgate_gateway::start(config).await?;
    let url = handle.url();
    let admin = handle.admin_url();
    if !fleets.is_empty() {
        for fleet in &fleets {
            let role = match fleet.role() {
                kvgate_mock::WorkerRole::Regular => "",
                kvgate_mock::WorkerRole::Prefill => " prefill",
                kvgate_mock::WorkerRole::Decode => " decode",
            };
            println!(
                "kvgate is routing to {} simulated{role} engines: {}",
                fleet.urls().len(),
                fleet.urls().join(" ")
            );
        }
        println!("gateway: {url}   (metrics: {url}/metrics)");
        println!("admin: {admin}   (workers: {admin}/workers; loopback only unless --admin-api-key)");
        if let Some(metrics) = handle.metrics_addr {
            println!("metrics listener: http://{metrics}/metrics");
        }
        println!("try:");
        println!(
            "  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n    \
             -d '{{\"model\": \"mock-model\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello there\"}}], \"max_tokens\": 16}}'"
        );
    } else {
        match handle.metrics_addr {
            Some(metrics) => {
                println!("kvgate listening on {url} (admin API: {admin}; metrics: http://{metrics}/metrics)")
            }
            None => println!("kvgate listening on {url} (admin API: {admin})"),
        }
    }
    kvgate_gateway::shutdown_signal().await;
    tracing::info!("shutting down: no new connections, waiting for in-flight requests");
    handle.shutdown().await;
    for fleet in fleets {
        fleet.shutdown().await;
    }
    Ok(())
}

/// Apply `--config FILE` under the flags given explicitly on the command line.
fn apply_config_file(args: &mut LaunchArgs, matches: &ArgMatches) -> anyhow::Result<()> {
    let Some(path) = &args.config else { return Ok(()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let explicit: Vec<String> = matches
        .ids()
        .map(|id| id.as_str().to_string())
        .filter(|id| matches.value_source(id) == Some(ValueSource::CommandLine))
        .collect();
    args.gateway = GatewayConfig::with_file(&text, &args.gateway, &explicit)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(())
}

/// Every long flag (and alias) `kvgate launch` takes, with its leading `--`.
pub fn launch_flags() -> Vec<String> {
    let command = Cli::command();
    let Some(launch) = command.find_subcommand("launch") else { return Vec::new() };
    launch
        .get_arguments()
        .flat_map(|arg| arg.get_long().into_iter().chain(arg.get_all_aliases().unwrap_or_default()))
        .map(|name| format!("--{name}"))
        .collect()
}

/// The arguments with a `launch` command line's SMG options translated (`smg::translate`);
/// other subcommands, and arguments that are not UTF-8, pass unchanged.
fn smg_translated(args: Vec<std::ffi::OsString>) -> Result<Vec<std::ffi::OsString>, smg::Refusals> {
    if args.get(1).and_then(|arg| arg.to_str()) != Some("launch") {
        return Ok(args);
    }
    let Some(text) = args.iter().map(|arg| arg.to_str().map(str::to_string)).collect::<Option<Vec<_>>>()
    else {
        return Ok(args);
    };
    let translated = smg::translate(&text[2..], &launch_flags())?;
    Ok(text[..2].iter().cloned().chain(translated).map(Into::into).collect())
}

/// The gateway configuration of a `kvgate launch` command line (the arguments after `launch`,
/// SMG's options included), as `kvgate launch` would start it; no `--config` file is read.
pub fn launch_config(args: &[&str]) -> Result<GatewayConfig, String> {
    let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
    let translated = smg::translate(&args, &launch_flags()).map_err(|refusals| refusals.to_string())?;
    let all = ["kvgate".to_string(), "launch".to_string()].into_iter().chain(translated);
    let cli = Cli::try_parse_from(all).map_err(|error| error.to_string())?;
    match cli.command {
        Command::Launch(args) => Ok(args.gateway),
        _ => Err("not a launch command line".into()),
    }
}

/// The kvgate options an SMG command line sets (the arguments after `launch`), by their YAML
/// keys, routing options among them (flat): what the Python package's SMG keywords become.
/// Refused SMG options and parse errors are the `Err`, with the command line's messages.
pub fn smg_settings(args: &[String]) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let translated = smg::translate(args, &launch_flags()).map_err(|refusals| refusals.to_string())?;
    let all = ["kvgate".to_string(), "launch".to_string()].into_iter().chain(translated);
    let matches = Cli::command().try_get_matches_from(all).map_err(|error| error.to_string())?;
    let Some(launch) = matches.subcommand_matches("launch") else {
        return Err("not a launch command line".into());
    };
    let given: Vec<String> = launch
        .ids()
        .map(|id| id.as_str().to_string())
        .filter(|id| launch.value_source(id) == Some(ValueSource::CommandLine))
        .collect();
    let cli = Cli::from_arg_matches(&matches).map_err(|error| error.to_string())?;
    let Command::Launch(args) = cli.command else { return Err("not a launch command line".into()) };
    let value = serde_json::to_value(&args.gateway).map_err(|error| error.to_string())?;
    let mut settings = serde_json::Map::new();
    for id in given {
        if let Some(found) = value.get(&id).or_else(|| value["routing"].get(&id)) {
            settings.insert(id, found.clone());
        }
    }
    Ok(settings)
}

/// The whole command line (every subcommand and flag), for documentation checks and generators.
pub fn command() -> clap::Command {
    Cli::command()
}

/// Run the command line with these arguments (the first is the program name); parse errors and
/// `--help` print and exit the process, as a command line does.
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    let args = match smg_translated(args) {
        Ok(args) => args,
        Err(refusals) => {
            eprintln!("kvgate: {refusals}");
            return ExitCode::from(2);
        }
    };
    let matches = Cli::command().get_matches_from(args);
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    if let (Command::Launch(args), Some(launch)) = (&mut cli.command, matches.subcommand_matches("launch")) {
        if let Err(error) = apply_config_file(args, launch) {
            eprintln!("kvgate: {error:#}");
            return ExitCode::FAILURE;
        }
    }
    // A large fleet (`mock --count 1000`, a gateway in front of it) needs a descriptor per
    // listener and connection: take the hard limit rather than the often small soft one.
    if let Err(error) = rlimit::increase_nofile_limit(u64::MAX) {
        eprintln!("kvgate: could not raise the open file limit: {error}");
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Command::Launch(args) = &cli.command {
        if let Some(threads) = args.gateway.worker_threads.filter(|&n| n > 0) {
            builder.worker_threads(threads);
        }
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvgate: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Launch(args) => match init_launch_logging(&args.gateway) {
            Ok(()) => runtime.block_on(launch(*args)),
            Err(error) => Err(error),
        },
        Command::Mock(args) => {
            init_logging("info", false);
            runtime.block_on(kvgate_mock::run_fleet(*args)).map_err(anyhow::Error::from)
        }
        Command::Sim(args) => kvgate_sim::run_cli(*args).map_err(anyhow::Error::from),
        Command::Replay(args) => runtime.block_on(kvgate_replay::run_cli(*args)).map_err(anyhow::Error::from),
        Command::Trace(TraceArgs { command: TraceCommand::Gen(args) }) => {
            kvgate_trace::generate::run_cli(&args).map_err(anyhow::Error::from)
        }
        Command::Soak(args) => {
            init_logging(&args.log_level, false);
            runtime.block_on(kvgate_soak::run_cli(*args)).map_err(anyhow::Error::from)
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
