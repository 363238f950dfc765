//! Why a mock fleet could not start, or could not do what a test asked of it.

use kvgate_config::ValidationErrors;

#[derive(Debug, thiserror::Error)]
pub enum MockError {
    #[error("invalid mock options: {0}")]
    Invalid(#[from] ValidationErrors),
    /// A listener or socket could not be bound (`what`: which one, where).
    #[error("binding {what}: {message}")]
    Bind { what: String, message: String },
    /// A fault-injection request that does not apply to this fleet.
    #[error("{0}")]
    Fault(String),
    #[error("waiting for ctrl-c: {0}")]
    Signal(std::io::Error),
}

impl MockError {
    pub(crate) fn bind(what: impl Into<String>, error: impl std::fmt::Display) -> MockError {
        MockError::Bind { what: what.into(), message: error.to_string() }
    }
}
