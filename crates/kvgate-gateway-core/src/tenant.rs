//! Who a request is for: its tenant and its priority class, and the one rule that decides them.
//! The tenant is the client key's (when client keys are configured, the tenant header is never
//! trusted), else the tenant header's, else the body's `user` field, else `default`; the class
//! is the priority header's (with keys, never above the tenant's own class), else the tenant's.

use std::time::Duration;

/// The tenant of a plain key, and of a request naming none.
pub const DEFAULT_TENANT: &str = "default";

pub use kvgate_policy::tenants::check_tenant_name;
pub use kvgate_policy::PriorityClass;

/// Whether and how the gateway tells the engine a request's priority class
/// (`--forward-priority`): as the body's `priority` field, in the engine's convention.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum ForwardPriority {
    /// The body is sent as the client wrote it.
    #[default]
    Off,
    /// vLLM's convention, lower values first (`--scheduling-policy priority`): `high` -1,
    /// `normal` 0, `low` 1. vLLM refuses a priority other than 0 without that policy.
    Vllm,
    /// SGLang's default convention, higher values first (`--enable-priority-scheduling`):
    /// `high` 1, `normal` 0, `low` -1 (with `--schedule-low-priority-values-first`, use `vllm`).
    Sglang,
}

impl ForwardPriority {
    /// The `priority` value for `class`, or `None` when nothing is forwarded.
    pub fn value(self, class: PriorityClass) -> Option<i64> {
        let lower_first = i64::from(class.lower_first_priority());
        match self {
            ForwardPriority::Off => None,
            ForwardPriority::Vllm => Some(lower_first),
            ForwardPriority::Sglang => Some(-lower_first),
        }
    }
}

/// Which quota refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quota {
    RequestsPerMinute,
    TokensPerMinute,
    MaxConcurrent,
}

impl Quota {
    /// The `tenants:` key, the metric's reason and the error's code stem.
    pub fn as_str(self) -> &'static str {
        match self {
            Quota::RequestsPerMinute => "requests_per_minute",
            Quota::TokensPerMinute => "tokens_per_minute",
            Quota::MaxConcurrent => "max_concurrent",
        }
    }
}

/// A request over one of its tenant's quotas.
#[derive(Clone, Debug, PartialEq)]
pub struct OverQuota {
    pub quota: Quota,
    /// The quota's value.
    pub limit: f64,
    /// When the request would pass (`None`: never, it alone exceeds the quota).
    pub retry_after: Option<Duration>,
}

/// What the request says about itself, for [`identify`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Claims<'a> {
    /// The client key presented, when keys are configured: its tenant and class.
    pub key: Option<(&'a str, Option<PriorityClass>)>,
    /// The tenant header's value.
    pub tenant_header: Option<&'a str>,
    /// The body's `user` field.
    pub user: Option<&'a str>,
    /// The priority header's value.
    pub priority_header: Option<&'a str>,
}

/// A request's tenant and class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub class: PriorityClass,
}

/// The tenant and class of a request: `keys_required` means client keys are configured (the
/// headers and `user` cannot name a tenant then, and the priority header can only lower the
/// class); `class_of` gives a tenant's configured class. A bad header is refused (a 400).
pub fn identify(
    claims: Claims<'_>,
    keys_required: bool,
    class_of: impl Fn(&str) -> Option<PriorityClass>,
) -> Result<Identity, String> {
    let (tenant, key_class) = match claims.key {
        Some((tenant, class)) => (tenant.to_string(), class),
        None if keys_required => (DEFAULT_TENANT.to_string(), None),
        None => {
            let named = claims.tenant_header.map(str::trim).filter(|t| !t.is_empty()).or(claims.user);
            match named {
                Some(name) => {
                    check_tenant_name(name)
                        .map_err(|message| format!("invalid tenant {name:?}: {message}"))?;
                    (name.to_string(), None)
                }
                None => (DEFAULT_TENANT.to_string(), None),
            }
        }
    };
    let own = key_class.or_else(|| class_of(&tenant)).unwrap_or_default();
    let class = match claims.priority_header {
        Some(text) => {
            let asked = PriorityClass::parse(text)
                .ok_or_else(|| format!("unknown priority class {text:?} (high, normal, low)"))?;
            if keys_required {
                asked.min(own)
            } else {
                asked
            }
        }
        None => own,
    };
    Ok(Identity { tenant, class })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(claims: Claims<'_>, keys_required: bool, expected: (&str, PriorityClass)) {
        let class_of = |tenant: &str| (tenant == "batch").then_some(PriorityClass::Low);
        let identity = identify(claims, keys_required, class_of).unwrap();
        assert_eq!((identity.tenant.as_str(), identity.class), expected, "{claims:?}");
    }

    #[test]
    fn identity_precedence() {
        use PriorityClass::*;
        let all = Claims {
            key: Some(("from-key", None)),
            tenant_header: Some("from-header"),
            user: Some("from-user"),
            priority_header: None,
        };
        check(all, true, ("from-key", Normal));
        // With keys configured the header and the user field never name the tenant.
        check(Claims { key: None, ..all }, true, (DEFAULT_TENANT, Normal));
        check(Claims { key: None, ..all }, false, ("from-header", Normal));
        check(Claims { key: None, tenant_header: None, ..all }, false, ("from-user", Normal));
        check(Claims::default(), false, (DEFAULT_TENANT, Normal));
        // The class: the header's, else the key's, else the tenant's configured one.
        check(Claims { tenant_header: Some("batch"), ..Claims::default() }, false, ("batch", Low));
        check(Claims { key: Some(("batch", Some(High))), ..Claims::default() }, true, ("batch", High));
        let asks_high = Claims { priority_header: Some("high"), ..Claims::default() };
        check(Claims { tenant_header: Some("batch"), ..asks_high }, false, ("batch", High));
        // Under keys the header only lowers the class.
        check(Claims { key: Some(("batch", None)), ..asks_high }, true, ("batch", Low));
        let asks_low = Claims { priority_header: Some("low"), ..Claims::default() };
        check(Claims { key: Some(("chat", Some(High))), ..asks_low }, true, ("chat", Low));
    }

    #[test]
    fn bad_headers_are_refused() {
        let none = |_: &str| None;
        let bad_class = Claims { priority_header: Some("urgent"), ..Claims::default() };
        assert!(identify(bad_class, false, none).is_err());
        let long = "t".repeat(kvgate_policy::tenants::MAX_TENANT_NAME + 1);
        let bad_tenant = Claims { tenant_header: Some(&long), ..Claims::default() };
        assert!(identify(bad_tenant, false, none).is_err());
    }

    #[test]
    fn classes_parse_by_name_and_rank() {
        assert_eq!(PriorityClass::parse("HIGH"), Some(PriorityClass::High));
        assert_eq!(PriorityClass::parse("0"), Some(PriorityClass::Low));
        assert_eq!(PriorityClass::parse("urgent"), None);
        assert!(PriorityClass::High > PriorityClass::Normal);
    }
}
