//! The `tenants:` section of the gateway's configuration (YAML, or the Python package's
//! `tenants=`), read by `kvgate sim --tenants` too: the quotas and weights every tenant gets
//! (`defaults`), those of named tenants (`named`, laid over the defaults field by field) and the
//! priority classes' settings (`classes`: queue timeouts, reserved concurrency).

use std::collections::BTreeMap;

use kvgate_config::{Checks, FieldError, Range};
use serde::{Deserialize, Serialize};

pub use crate::fair::PriorityClass;

/// Longest tenant name.
pub const MAX_TENANT_NAME: usize = 128;

/// A tenant name: 1 to 128 printable ASCII characters without spaces.
pub fn check_tenant_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_TENANT_NAME {
        return Err(format!("a tenant name has 1 to {MAX_TENANT_NAME} characters"));
    }
    if !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("a tenant name is printable ASCII without spaces".into());
    }
    Ok(())
}

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
    /// Share of the fleet's distinct cached tokens (the exact index's) the tenant's recent
    /// requests may occupy before they lose their locality priority in the admission queue
    /// (`--fairness-locality-bound`): over it, its waiting requests are served in fair order
    /// only, so other tenants' requests that would hit the cache go first. In (0, 1].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_kv_share: Option<f64>,
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
            max_kv_share: self.max_kv_share.or(under.max_kv_share),
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
        if let Some(share) = self.max_kv_share {
            if !(share > 0.0 && share <= 1.0) {
                checks.push(
                    FieldError::new(field("max_kv_share"), "must be a share in (0, 1]")
                        .with_flag(None)
                        .got(share),
                );
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
    /// Concurrency slots (of --max-concurrent-requests) that lower classes may not take: a
    /// request of this class (or a higher one) arriving while lower classes hold the rest is
    /// admitted at once instead of waiting for one of their answers to end. Reservations nest:
    /// `high: 2, normal: 2` keeps 2 slots from `normal` and `low`, and 4 from `low`. Unset: 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_concurrency: Option<usize>,
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

    /// Each class's `reserved_concurrency`, by rank (0 where unset).
    pub fn reserved_concurrency(&self) -> [usize; 3] {
        PriorityClass::ALL.map(|class| {
            self.classes.get(&class).and_then(|settings| settings.reserved_concurrency).unwrap_or(0)
        })
    }

    /// Checks every field (`max_concurrent`: --max-concurrent-requests, which reserved
    /// concurrency needs and must leave room under).
    pub fn validate(&self, max_concurrent: Option<usize>, checks: &mut Checks) {
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
        self.validate_reservations(max_concurrent, checks);
    }

    fn validate_reservations(&self, max_concurrent: Option<usize>, checks: &mut Checks) {
        let reserved = self.reserved_concurrency();
        let field = |class: PriorityClass| format!("tenants.classes.{}.reserved_concurrency", class.as_str());
        if reserved[PriorityClass::Low.rank()] > 0 {
            checks.push(
                FieldError::new(
                    field(PriorityClass::Low),
                    "low is the lowest class: no class below it to keep out",
                )
                .with_flag(None)
                .got(reserved[PriorityClass::Low.rank()]),
            );
        }
        let total: usize = reserved.iter().sum();
        if total == 0 {
            return;
        }
        match max_concurrent {
            None => checks.push(
                FieldError::new("tenants.classes", "reserved_concurrency needs --max-concurrent-requests")
                    .with_flag(None)
                    .got(total),
            ),
            Some(limit) if total >= limit => checks.push(
                FieldError::new(
                    "tenants.classes",
                    format!(
                        "the reserved_concurrency of the classes must add up to less than \
                         --max-concurrent-requests ({limit}), so the lowest class keeps a slot"
                    ),
                )
                .with_flag(None)
                .got(total),
            ),
            Some(_) => {}
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
        config.validate(None, &mut checks);
        assert!(checks.finish().is_ok());
    }

    #[test]
    fn bad_limits_are_all_reported() {
        let config: TenantsConfig = serde_norway::from_str(
            "defaults: {weight: 0, max_kv_share: 1.5}\nnamed: {a: {max_concurrent: 0, tokens_per_minute: .nan}}",
        )
        .unwrap();
        let mut checks = Checks::new();
        config.validate(None, &mut checks);
        let text = checks.finish().unwrap_err().to_string();
        for field in [
            "tenants.defaults.weight",
            "tenants.defaults.max_kv_share",
            "tenants.named.a.max_concurrent",
            "tenants.named.a.tokens_per_minute",
        ] {
            assert!(text.contains(field), "{text}");
        }
    }

    #[test]
    fn reserved_concurrency_needs_the_cap_and_leaves_the_lowest_class_room() {
        let check = |yaml: &str, max_concurrent: Option<usize>| {
            let config: TenantsConfig = serde_norway::from_str(yaml).unwrap();
            let mut checks = Checks::new();
            config.validate(max_concurrent, &mut checks);
            checks.finish().map_err(|errors| errors.to_string())
        };
        let nested = "classes: {high: {reserved_concurrency: 2}, normal: {reserved_concurrency: 2}}";
        assert!(check(nested, Some(5)).is_ok());
        assert_eq!(
            serde_norway::from_str::<TenantsConfig>(nested).unwrap().reserved_concurrency(),
            [0, 2, 2]
        );
        for (max_concurrent, expected) in [(Some(4), "add up to less than"), (None, "needs --max-concurrent")]
        {
            let text = check(nested, max_concurrent).unwrap_err();
            assert!(text.contains(expected), "{text}");
        }
        let text = check("classes: {low: {reserved_concurrency: 1}}", Some(8)).unwrap_err();
        assert!(text.contains("tenants.classes.low.reserved_concurrency"), "{text}");
    }
}
