//! `kvgate._kvgate`, the native half of the `kvgate` Python package (PyO3, abi3): the gateway
//! ([`gateway`]), the simulator ([`sim`]), the option schemas the stubs are generated from
//! ([`options`]), SMG's keywords ([`smg`]) and the command line (`python -m kvgate ...`). The Python API itself, keyword
//! handling included, is `python/kvgate/__init__.py`.

use pyo3::prelude::*;

mod gateway;
mod options;
mod sim;
mod smg;

/// Run the `kvgate` command line with these arguments (the first is the program name), without
/// the GIL; returns the exit status. Parse errors and `--help` exit the process, as on the
/// command line.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| {
        let code = kvgate::main_with_args(argv);
        // Printed output must be out before Python exits (no Rust runtime flushes it here).
        use std::io::Write;
        let _ = std::io::stdout().flush();
        if code == std::process::ExitCode::SUCCESS {
            0
        } else {
            1
        }
    })
}

#[pymodule]
fn _kvgate(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<gateway::PyGateway>()?;
    module.add_function(wrap_pyfunction!(options::_options, module)?)?;
    module.add_function(wrap_pyfunction!(sim::_simulate, module)?)?;
    module.add_function(wrap_pyfunction!(smg::_smg_keywords, module)?)?;
    module.add_function(wrap_pyfunction!(smg::_smg_settings, module)?)?;
    module.add_function(wrap_pyfunction!(main, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
