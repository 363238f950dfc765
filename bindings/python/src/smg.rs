//! SMG's keyword names for `kvgate.Gateway` (SMG's Python entry point takes its `RouterArgs`
//! fields, named as its flags): the keywords and their flags (`_smg_keywords`), and what a set of
//! them means to kvgate (`_smg_settings`: the command line's own translation, refusals included).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Every SMG 1.13 option as a Python keyword: `{"keyword", "flag", "arity", "class"}` (arity `0`,
/// `1`, `*` or `+`; class `same`, `mapped` or `refused`, as docs/SMG.md).
#[pyfunction]
pub fn _smg_keywords(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let list = PyList::empty(py);
    for option in kvgate::smg::smg_options() {
        let flag = &option.names[0];
        let entry = PyDict::new(py);
        entry.set_item("keyword", flag.trim_start_matches('-').replace('-', "_"))?;
        entry.set_item("flag", flag)?;
        let arity = match option.arity {
            kvgate::smg::Arity::Zero => "0",
            kvgate::smg::Arity::One => "1",
            kvgate::smg::Arity::Any => "*",
            kvgate::smg::Arity::OneOrMore => "+",
        };
        entry.set_item("arity", arity)?;
        let class = match kvgate::smg::entry(flag).map(|entry| &entry.class) {
            Some(kvgate::smg::Class::Same { .. }) => "same",
            Some(kvgate::smg::Class::Mapped { .. }) => "mapped",
            Some(kvgate::smg::Class::Refused { .. }) | None => "refused",
        };
        entry.set_item("class", class)?;
        list.append(entry)?;
    }
    Ok(list)
}

/// The kvgate options (YAML keys, routing options flat) the SMG command line `argv` sets;
/// `ValueError` with the command line's messages when an option is refused or does not parse.
#[pyfunction]
pub fn _smg_settings(py: Python<'_>, argv: Vec<String>) -> PyResult<Bound<'_, PyAny>> {
    let settings = kvgate::smg_settings(&argv).map_err(PyValueError::new_err)?;
    pythonize::pythonize(py, &settings).map_err(|error| PyValueError::new_err(error.to_string()))
}
