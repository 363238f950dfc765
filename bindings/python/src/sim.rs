//! `kvgate._kvgate._simulate`: `kvgate sim` from Python. The arguments are `kvgate sim` flags
//! (built from keywords by `kvgate.simulate`), parsed by the same clap declaration, so every
//! option is reachable and validated as on the command line; the result is the report's JSON,
//! byte for byte what `kvgate sim --json` writes.

use clap::{CommandFactory, FromArgMatches};
use kvgate_sim::{SimArgs, SimError, Trace, TraceError};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyValueError};
use pyo3::prelude::*;

#[derive(clap::Parser)]
#[command(name = "kvgate sim", color = clap::ColorChoice::Never)]
struct SimCommand {
    #[command(flatten)]
    args: SimArgs,
}

/// clap's message without its `error: ` prefix and `--help` hint.
fn parse_error(error: clap::Error) -> PyErr {
    let text = error.to_string();
    let lines: Vec<&str> = text.lines().filter(|line| !line.contains("'--help'")).collect();
    let message = lines.join("\n");
    PyValueError::new_err(message.trim().trim_start_matches("error: ").to_string())
}

fn sim_error(error: SimError) -> PyErr {
    match error {
        SimError::Trace(TraceError::Io { path, source }) => {
            let message = format!("reading trace {}: {source}", path.display());
            if source.kind() == std::io::ErrorKind::NotFound {
                PyFileNotFoundError::new_err(message)
            } else {
                PyOSError::new_err(message)
            }
        }
        SimError::Output { .. } => PyOSError::new_err(error.to_string()),
        // `tokenizer_path` that does not load, or a trace prompt it cannot render: a bad value.
        SimError::InvalidOptions(_) | SimError::Trace(_) | SimError::Tokenizer { .. } => {
            PyValueError::new_err(error.to_string())
        }
    }
}

/// Run `kvgate sim` with these arguments (the first is the program name) and return the report
/// as JSON; `--json` and `--plot` files are written as by the command line.
#[pyfunction]
pub fn _simulate(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let matches = SimCommand::command().try_get_matches_from(argv).map_err(parse_error)?;
    let args = SimCommand::from_arg_matches(&matches).map_err(parse_error)?.args;
    py.detach(|| {
        args.runs().map_err(sim_error)?;
        let trace = Trace::load(&args.trace, args.trace_format).map_err(|e| sim_error(e.into()))?;
        let report = kvgate_sim::run_on_trace(&args, &trace, false).map_err(sim_error)?;
        kvgate_sim::write_outputs(&args, &report).map_err(sim_error)?;
        Ok(report.to_json())
    })
}
