//! The `tenants:` section of the configuration (YAML, or the Python package's `tenants=`): the
//! quotas and weights every tenant gets (`defaults`), those of named tenants (`named`, laid over
//! the defaults field by field) and the priority classes' queue timeouts (`classes`).

use std::collections::BTreeMap;

use kvgate_config::{Checks, FieldError, Range};
use serde::{Deserialize, Serialize};

use crate::tenant::check_tenant_name;
pub use crate::tenant::PriorityClass;

/// One tenant's quotas and share; an unset field takes the `defaults` entry's (and, unset
/// there too, means no limit, weight 1, class `normal`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantLimits {
    /// Requests admitted per minute (a token bucket holding one minute's worth); over it: 429.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<f64>,
    /// Tokens admitted per minute: each request is charged its prompt's tokens plus its
    /// `max_tokens` (`max_completion_tokens`, `sampling_params.max_new_tokens`) at admission.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<f64>,
    /// Requests of the tenant proxied at once; over it: 429.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<usize>,
    /// The tenant's share within its class when the admission queue is contended (weighted
    /// fair queuing on tokens): a tenant of weight 2 gets twice the tokens of one of weight 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// The tenant's priority class (`high`, `normal`, `low`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class: Option<PriorityClass>,
}

impl TenantLimits {
    /// `self` laid over `under`, field by field.
    pub fn over(&self, under: &TenantLimits) -> TenantLimits {
        TenantLimits {
            requests_per_minute: self.requests_per_minute.or(under.requests_per_minute),
            tokens_per_minute: self.tokens_per_minute.or(under.tokens_per_minute),
            max_concurrent: self.max_concurrent.or(under.max_concurrent),
            weight: self.weight.or(under.weight),
            class: self.class.or(under.class),
        }
    }

    fn validate(&self, parent: &str, checks: &mut Checks) {
        let field = |name: &str| format!("{parent}.{name}");
        for (name, value) in [
            ("requests_per_minute", self.requests_per_minute),
            ("tokens_per_minute", self.tokens_per_minute),
            ("weight", self.weight),
        ] {
            if let Some(value) = value {
                if !(Range::POSITIVE.contains(value)) {
                    checks.push(
                        FieldError::new(field(name), "must be a finite number in (0, inf)")
                            .with_flag(None)
                            .got(value),
                    );
                }
            }
        }
        if self.max_concurrent == Some(0) {
            checks.push(
                FieldError::new(field("max_concurrent"), "must be at least 1 (leave unset for no limit)")
                    .with_flag(None)
                    .got(0),
            );
        }
    }
}

/// A priority class's own settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClassSettings {
    /// Longest wait of this class's requests in the admission queue, in seconds (then 408);
    /// unset: --queue-timeout-secs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_timeout_secs: Option<f64>,
}

/// `tenants:`: per-tenant quotas, weights and classes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantsConfig {
    /// What every tenant gets unless `named` says otherwise.
    #[serde(skip_serializing_if = "is_default")]
    pub defaults: TenantLimits,
    /// Tenants by name, each laid over `defaults`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub named: BTreeMap<String, TenantLimits>,
    /// Priority classes by name (`high`, `normal`, `low`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub classes: BTreeMap<PriorityClass, ClassSettings>,
}

fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

impl TenantsConfig {
    pub fn is_empty(&self) -> bool {
        *self == TenantsConfig::default()
    }

    /// The limits of `tenant`.
    pub fn limits(&self, tenant: &str) -> TenantLimits {
        match self.named.get(tenant) {
            Some(named) => named.over(&self.defaults),
            None => self.defaults.clone(),
        }
    }

    pub(crate) fn validate(&self, checks: &mut Checks) {
        self.defaults.validate("tenants.defaults", checks);
        for (name, limits) in &self.named {
            if let Err(message) = check_tenant_name(name) {
                checks
                    .push(FieldError::new("tenants.named", message).with_flag(None).got(format!("{name:?}")));
            }
            limits.validate(&format!("tenants.named.{name}"), checks);
        }
        for (class, settings) in &self.classes {
            if let Some(secs) = settings.queue_timeout_secs {
                if !Range::POSITIVE.contains(secs) {
                    checks.push(
                        FieldError::new(
                            format!("tenants.classes.{}.queue_timeout_secs", class.as_str()),
                            "must be a finite number in (0, inf)",
                        )
                        .with_flag(None)
                        .got(secs),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_tenants_are_laid_over_the_defaults_field_by_field() {
        let config: TenantsConfig = serde_norway::from_str(
            "defaults: {requests_per_minute: 60, weight: 1}\nnamed: {batch: {weight: 3, class: low}}\nclasses: {high: {queue_timeout_secs: 2}}",
        )
        .unwrap();
        let batch = config.limits("batch");
        assert_eq!(batch.requests_per_minute, Some(60.0));
        assert_eq!(batch.weight, Some(3.0));
        assert_eq!(batch.class, Some(PriorityClass::Low));
        assert_eq!(config.limits("other").weight, Some(1.0));
        assert_eq!(config.classes[&PriorityClass::High].queue_timeout_secs, Some(2.0));
        let mut checks = Checks::new();
        config.validate(&mut checks);
        assert!(checks.finish().is_ok());
    }

    #[test]
    fn bad_limits_are_all_reported() {
        let config: TenantsConfig = serde_norway::from_str(
            "defaults: {weight: 0}\nnamed: {a: {max_concurrent: 0, tokens_per_minute: .nan}}",
        )
        .unwrap();
        let mut checks = Checks::new();
        config.validate(&mut checks);
        let text = checks.finish().unwrap_err().to_string();
        for field in
            ["tenants.defaults.weight", "tenants.named.a.max_concurrent", "tenants.named.a.tokens_per_minute"]
        {
            assert!(text.contains(field), "{text}");
        }
    }
}
