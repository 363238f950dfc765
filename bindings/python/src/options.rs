//! The option schemas as Python data: every option of `kvgate launch` (`GatewayConfig`, its
//! routing options included) and of `kvgate sim` (`SimArgs`), read from their clap declarations,
//! so keyword checking and the generated `.pyi` stubs come from the one declaration.

use std::any::TypeId;
use std::collections::HashSet;
use std::path::PathBuf;

use clap::{ArgAction, Args, Command};
use kvgate_gateway::GatewayConfig;
use kvgate_policy::PolicyConfig;
use kvgate_sim::SimArgs;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// The Python type of an option's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValueKind {
    Bool,
    Int,
    Float,
    Str,
    Path,
    Choice,
}

impl ValueKind {
    fn name(self) -> &'static str {
        match self {
            ValueKind::Bool => "bool",
            ValueKind::Int => "int",
            ValueKind::Float => "float",
            ValueKind::Str => "str",
            ValueKind::Path => "path",
            ValueKind::Choice => "choice",
        }
    }

    fn of(arg: &clap::Arg) -> ValueKind {
        if !arg.get_possible_values().is_empty() && !is_bool(arg) {
            return ValueKind::Choice;
        }
        let id = arg.get_value_parser().type_id();
        let ints = [
            TypeId::of::<u8>(),
            TypeId::of::<u16>(),
            TypeId::of::<u32>(),
            TypeId::of::<u64>(),
            TypeId::of::<usize>(),
            TypeId::of::<i32>(),
            TypeId::of::<i64>(),
        ];
        if is_bool(arg) {
            ValueKind::Bool
        } else if ints.iter().any(|int| id == *int) {
            ValueKind::Int
        } else if id == TypeId::of::<f64>() || id == TypeId::of::<f32>() {
            ValueKind::Float
        } else if id == TypeId::of::<PathBuf>() {
            ValueKind::Path
        } else {
            ValueKind::Str
        }
    }
}

fn is_bool(arg: &clap::Arg) -> bool {
    matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse)
        || arg.get_value_parser().type_id() == TypeId::of::<bool>()
}

/// A clap argument takes a list of values (repeated flag or several values per flag).
fn is_list(arg: &clap::Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Append)
        || arg.get_num_args().is_some_and(|range| range.max_values() > 1)
}

/// A default value as the Python value it stands for.
fn default_value<'py>(py: Python<'py>, kind: ValueKind, text: &str) -> PyResult<Bound<'py, PyAny>> {
    let bad = || PyValueError::new_err(format!("default {text:?} is not a valid {}", kind.name()));
    Ok(match kind {
        ValueKind::Bool => text.parse::<bool>().map_err(|_| bad())?.into_pyobject(py)?.to_owned().into_any(),
        ValueKind::Int => text.parse::<i64>().map_err(|_| bad())?.into_pyobject(py)?.into_any(),
        ValueKind::Float => text.parse::<f64>().map_err(|_| bad())?.into_pyobject(py)?.into_any(),
        ValueKind::Str | ValueKind::Path | ValueKind::Choice => text.into_pyobject(py)?.into_any(),
    })
}

/// One option as a dict: `name` (the keyword and YAML key), `flag` (`--the-flag`), `group`,
/// `type` (bool, int, float, str, path, choice), `choices`, `list`, `takes_value`, `default`
/// (None when unset), `help`.
fn describe<'py>(py: Python<'py>, arg: &clap::Arg, group: &str) -> PyResult<Bound<'py, PyDict>> {
    let kind = ValueKind::of(arg);
    let list = is_list(arg);
    let takes_value = !matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
    let texts: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|value| value.to_string_lossy().into_owned())
        .flat_map(|text| match arg.get_value_delimiter() {
            Some(delimiter) => text.split(delimiter).map(str::to_string).collect(),
            None => vec![text],
        })
        .collect();
    let default = if list {
        let items = texts.iter().map(|text| default_value(py, kind, text)).collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)?.into_any()
    } else if let Some(text) = texts.first() {
        default_value(py, kind, text)?
    } else if kind == ValueKind::Bool {
        false.into_pyobject(py)?.to_owned().into_any()
    } else {
        py.None().into_bound(py)
    };
    let help = arg.get_long_help().or(arg.get_help()).map(|help| help.to_string()).unwrap_or_default();
    let choices: Vec<String> = if kind == ValueKind::Choice {
        arg.get_possible_values().iter().map(|value| value.get_name().to_string()).collect()
    } else {
        Vec::new()
    };
    let option = PyDict::new(py);
    option.set_item("name", arg.get_id().as_str())?;
    option.set_item("flag", arg.get_long().map(|long| format!("--{long}")))?;
    option.set_item("group", group)?;
    option.set_item("type", kind.name())?;
    option.set_item("choices", choices)?;
    option.set_item("list", list)?;
    option.set_item("takes_value", takes_value)?;
    option.set_item("default", default)?;
    option.set_item("help", help)?;
    Ok(option)
}

/// `_options(schema)`: the options of `"gateway"` (`kvgate launch`'s configuration) or `"sim"`
/// (`kvgate sim`), in declaration order; the policy options (YAML: under `routing:`) are in
/// group `routing`, the others in group `gateway` or `sim`.
#[pyfunction]
pub fn _options<'py>(py: Python<'py>, schema: &str) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let command = match schema {
        "gateway" => GatewayConfig::augment_args(Command::new("kvgate")),
        "sim" => SimArgs::augment_args(Command::new("kvgate")),
        other => return Err(PyValueError::new_err(format!("no option schema {other:?} (gateway, sim)"))),
    };
    let routing: HashSet<String> = PolicyConfig::augment_args(Command::new("kvgate"))
        .get_arguments()
        .map(|arg| arg.get_id().to_string())
        .collect();
    command
        .get_arguments()
        .filter(|arg| arg.get_long().is_some())
        .map(|arg| {
            let group = if routing.contains(arg.get_id().as_str()) { "routing" } else { schema };
            describe(py, arg, group)
        })
        .collect()
}
