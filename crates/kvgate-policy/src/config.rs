//! Policy configuration: the one declaration of every policy option (CLI flag, YAML key, default,
//! range, help), its validation, and the factory that builds a policy from it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{Policy, RandomPolicy, RoundRobinPolicy};

/// The routing policies kvgate knows, by their configuration names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each request to the next worker in turn.
    RoundRobin,
    /// Each request to a uniformly random worker.
    Random,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
        }
    }
}

/// Every policy option. Flattened into `kvgate launch` and `kvgate sim`, read from YAML.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Routing policy.
    #[arg(long = "policy", value_enum, default_value = "round_robin")]
    pub policy: PolicyKind,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self { policy: PolicyKind::RoundRobin }
    }
}

/// One invalid option: which field, and what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {message}")]
pub struct ConfigError {
    pub field: &'static str,
    pub message: String,
}

impl PolicyConfig {
    /// Check every option; returns all problems at once.
    pub fn validate(&self) -> Result<(), Vec<ConfigError>> {
        Ok(())
    }
}

/// Build a fresh policy instance (one per model) from a validated configuration.
pub fn build_policy(config: &PolicyConfig) -> Arc<dyn Policy> {
    match config.policy {
        PolicyKind::RoundRobin => Arc::new(RoundRobinPolicy::new()),
        PolicyKind::Random => Arc::new(RandomPolicy),
    }
}
