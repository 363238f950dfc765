//! `kvgate._kvgate._Gateway`: a gateway configured from Python values (checked by the same serde
//! declaration and validation as the YAML file), run on a tokio runtime of its own, optionally in
//! front of simulated engines started in-process.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kvgate_gateway::{GatewayConfig, GatewayHandle, StartError};
use kvgate_mock::{MockFleet, WorkerRole};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// How often a blocking `start()` checks for Ctrl-C and for `stop()` from another thread.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Longest wait for the runtime's remaining tasks after a graceful stop.
const RUNTIME_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a stop waits beyond the configured grace period for the drain to end.
const DRAIN_MARGIN: Duration = Duration::from_secs(10);

/// A started gateway: its runtime, handle, the simulated engines in front of which it runs.
struct Running {
    runtime: tokio::runtime::Runtime,
    handle: GatewayHandle,
    fleets: Vec<MockFleet>,
    url: String,
    admin_url: String,
    metrics_url: Option<String>,
    /// The configured drain (`shutdown_grace_period_secs`).
    grace: Duration,
}

/// The gateway behind `kvgate.Gateway` (the keyword handling is in `kvgate/__init__.py`).
#[pyclass(module = "kvgate._kvgate", name = "_Gateway", frozen)]
pub struct PyGateway {
    config: GatewayConfig,
    mock_workers: usize,
    running: Mutex<Option<Running>>,
}

/// Python values (a dict of YAML keys, routing options under `routing`) as a configuration:
/// NaN and infinities are carried as numbers and refused by validation.
pub fn config_from_python(options: &Bound<'_, PyAny>) -> PyResult<GatewayConfig> {
    let value: serde_norway::Value = pythonize::depythonize(options)
        .map_err(|error| PyValueError::new_err(format!("invalid configuration: {error}")))?;
    let config: GatewayConfig = serde_path_to_error::deserialize(value)
        .map_err(|error| PyValueError::new_err(format!("invalid {}: {}", error.path(), error.inner())))?;
    config.validate().map_err(|errors| PyValueError::new_err(StartError::Config(errors).to_string()))?;
    Ok(config)
}

impl PyGateway {
    fn lock(&self) -> MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Log through Python's `logging` (pyo3-log): the gateway's events are records of the loggers
/// under `kvgate` named after their Rust modules (`kvgate.kvgate_gateway.server`, ...), so the
/// application's logging configuration decides what is shown and where (by default, Python
/// shows WARNING and above on stderr); `log_level` caps what is passed on (the last gateway
/// started sets it). The first gateway of the process installs the bridge; each start re-reads
/// the Python loggers' levels.
fn init_logging(config: &GatewayConfig) {
    static BRIDGE: std::sync::OnceLock<Option<pyo3_log::ResetHandle>> = std::sync::OnceLock::new();
    let bridge = BRIDGE.get_or_init(|| {
        Python::attach(|py| {
            let logger = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels).ok()?;
            // An error only means another logger is installed (then it gets the records).
            logger.set_prefix("kvgate").filter(log::LevelFilter::Trace).install().ok()
        })
    });
    if let Some(handle) = bridge {
        handle.reset();
    }
    log::set_max_level(level_filter(&config.log_level));
}

/// The most verbose level a `log_level` (a level, or a tracing filter directive) lets through.
fn level_filter(log_level: &str) -> log::LevelFilter {
    let words = log_level.split([',', '=', ' ']).map(str::trim);
    let levels = words.filter_map(|word| word.parse::<log::LevelFilter>().ok());
    levels.max().unwrap_or(log::LevelFilter::Info)
}

/// Start the runtime, the simulated engines and the gateway; returns once it listens.
fn launch(mut config: GatewayConfig, mock_workers: usize) -> Result<Running, PyErr> {
    init_logging(&config);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = config.worker_threads.filter(|&n| n > 0) {
        builder.worker_threads(threads);
    }
    let runtime = builder
        .enable_all()
        .thread_name("kvgate")
        .build()
        .map_err(|error| PyOSError::new_err(format!("cannot start the async runtime: {error}")))?;
    let grace = Duration::try_from_secs_f64(config.shutdown_grace_period_secs).unwrap_or(Duration::ZERO);
    let (handle, fleets) = runtime.block_on(async {
        let mut fleets = Vec::new();
        if mock_workers > 0 {
            let fleet = kvgate_mock::spawn_fleet(kvgate::demo_fleet(mock_workers, WorkerRole::Regular))
                .await
                .map_err(|error| PyOSError::new_err(format!("starting the mock engines: {error:#}")))?;
            fleets.push(fleet);
            kvgate::wire_fleets(&mut config, &fleets);
        }
        match kvgate_gateway::start(config).await {
            Ok(handle) => Ok((handle, fleets)),
            Err(error) => {
                for fleet in fleets {
                    fleet.shutdown().await;
                }
                Err(match error {
                    StartError::Config(_) => PyValueError::new_err(error.to_string()),
                    StartError::Bind { .. } => PyOSError::new_err(error.to_string()),
                    StartError::State(_) => PyRuntimeError::new_err(error.to_string()),
                })
            }
        }
    })?;
    let (url, admin_url) = (handle.url(), handle.admin_url());
    let metrics_url = handle.metrics_addr.map(|addr| format!("http://{addr}"));
    Ok(Running { runtime, handle, fleets, url, admin_url, metrics_url, grace })
}

/// Graceful stop: no new connections, in-flight requests finish (up to the grace period).
fn shut_down(running: Running) {
    let Running { runtime, handle, fleets, grace, .. } = running;
    // The drain is bounded: past the grace period and a margin the rest is abandoned, so
    // `stop()` and Ctrl-C always return (a task that never ends cannot hold the caller).
    let bound = grace + DRAIN_MARGIN;
    let drained = runtime.block_on(async {
        tokio::time::timeout(bound, async {
            handle.shutdown().await;
            for fleet in fleets {
                fleet.shutdown().await;
            }
        })
        .await
    });
    if drained.is_err() {
        tracing::warn!(?bound, "the gateway did not finish draining in time; stopped anyway");
    }
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN_TIMEOUT);
}

#[pymethods]
impl PyGateway {
    /// `config`: a dict of configuration keys (routing options under `routing`);
    /// `mock_workers`: simulated engines to start in-process and route to.
    #[new]
    #[pyo3(signature = (config, mock_workers = 0))]
    fn new(config: &Bound<'_, PyAny>, mock_workers: usize) -> PyResult<Self> {
        Ok(PyGateway { config: config_from_python(config)?, mock_workers, running: Mutex::new(None) })
    }

    /// Start in the background; returns the URL once the gateway listens.
    fn start_background(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| {
            let mut running = self.lock();
            if running.is_some() {
                return Err(PyRuntimeError::new_err("the gateway is already running"));
            }
            let started = launch(self.config.clone(), self.mock_workers)?;
            let url = started.url.clone();
            *running = Some(started);
            Ok(url)
        })
    }

    /// Run until `stop()` (from another thread) or Ctrl-C, which stops gracefully and raises
    /// `KeyboardInterrupt`.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        self.start_background(py)?;
        loop {
            let stopped = py.detach(|| {
                std::thread::sleep(POLL_INTERVAL);
                self.lock().is_none()
            });
            if stopped {
                return Ok(());
            }
            if let Err(interrupt) = py.check_signals() {
                self.stop(py);
                return Err(interrupt);
            }
        }
    }

    /// Stop gracefully (a no-op when not running).
    fn stop(&self, py: Python<'_>) {
        py.detach(|| {
            let running = self.lock().take();
            if let Some(running) = running {
                shut_down(running);
            }
        });
    }

    /// The gateway's URL while it runs (`http://127.0.0.1:PORT`, the chosen port for port 0).
    #[getter]
    fn url(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| self.lock().as_ref().map(|running| running.url.clone()))
            .ok_or_else(|| PyRuntimeError::new_err("the gateway is not running: call start_background()"))
    }

    /// The admin API's URL while it runs (the admin listener, or the main one with an admin key).
    #[getter]
    fn admin_url(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| self.lock().as_ref().map(|running| running.admin_url.clone()))
            .ok_or_else(|| PyRuntimeError::new_err("the gateway is not running: call start_background()"))
    }

    /// The metrics listener's URL while it runs (`prometheus_port`), else `None`.
    #[getter]
    fn metrics_url(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| self.lock().as_ref().map(|running| running.metrics_url.clone()))
            .ok_or_else(|| PyRuntimeError::new_err("the gateway is not running: call start_background()"))
    }

    /// Whether the gateway is running.
    #[getter]
    fn running(&self, py: Python<'_>) -> bool {
        py.detach(|| self.lock().is_some())
    }

    /// The effective configuration as YAML, as `kvgate launch --print-config` prints it.
    fn to_yaml(&self) -> PyResult<String> {
        self.config.to_yaml().map_err(PyValueError::new_err)
    }

    /// The effective configuration as a dict: the YAML of `to_yaml()` (secrets shown as
    /// `<set>`), routing options under `routing`.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let yaml = self.to_yaml()?;
        let value: serde_norway::Value =
            serde_norway::from_str(&yaml).map_err(|error| PyValueError::new_err(error.to_string()))?;
        pythonize::pythonize(py, &value).map_err(|error| PyValueError::new_err(error.to_string()))
    }
}

impl Drop for PyGateway {
    /// A gateway garbage-collected while running is stopped at once, without waiting.
    fn drop(&mut self) {
        if let Some(running) = self.running.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            running.runtime.shutdown_background();
        }
    }
}
