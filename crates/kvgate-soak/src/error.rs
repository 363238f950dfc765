//! Why a soak could not run, or why it failed its verdict.

use kvgate_config::ValidationErrors;

#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    #[error(transparent)]
    Invalid(#[from] ValidationErrors),
    /// A simulated engine could not be started, killed or restarted (`what`: which, and how).
    #[error("{what}: {message}")]
    Engine { what: String, message: String },
    #[error("starting the gateway: {0}")]
    Gateway(String),
    /// The client or a task of the run itself failed.
    #[error("{what}: {message}")]
    Run { what: String, message: String },
    #[error("writing {path}: {message}")]
    Output { path: String, message: String },
    /// The run completed, but requests were lost or answered twice, or a stream's text was not
    /// its uncut answer.
    #[error("soak failed: {lost} lost, {duplicated} duplicated, {wrong_text} wrong texts (details under \"incidents\" in --json)")]
    Failed { lost: usize, duplicated: usize, wrong_text: usize },
}

impl SoakError {
    pub(crate) fn engine(what: impl Into<String>, error: impl std::fmt::Display) -> SoakError {
        SoakError::Engine { what: what.into(), message: error.to_string() }
    }

    pub(crate) fn run(what: impl Into<String>, error: impl std::fmt::Display) -> SoakError {
        SoakError::Run { what: what.into(), message: error.to_string() }
    }
}
