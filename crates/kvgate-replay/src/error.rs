//! Why a replay could not run.

use kvgate_config::ValidationErrors;
use kvgate_trace::TraceError;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("invalid replay options: {0}")]
    Invalid(#[from] ValidationErrors),
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// An HTTP exchange the replay needs (model discovery, cache flush) failed.
    #[error("{what}: {message}")]
    Http { what: String, message: String },
    #[error("writing {path}: {message}")]
    Output { path: String, message: String },
}

impl ReplayError {
    pub(crate) fn http(what: impl Into<String>, message: impl std::fmt::Display) -> ReplayError {
        ReplayError::Http { what: what.into(), message: message.to_string() }
    }
}
