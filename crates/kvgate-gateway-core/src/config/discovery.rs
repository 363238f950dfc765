//! The Kubernetes service discovery options (`--service-discovery` and its selectors): the label
//! selector syntax and the checks of the options together, run with the rest of the configuration.

use kvgate_config::{Checks, FieldError};

use super::GatewayConfig;

/// The `key=value` pairs of a selector flag as one label selector; pairs may also be
/// comma-separated within one value.
pub fn label_selector(pairs: &[String]) -> Result<String, String> {
    let mut parts = Vec::new();
    for pair in pairs.iter().flat_map(|value| value.split(',')).map(str::trim).filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((key, value))
                if !key.is_empty()
                    && !key.ends_with('!')
                    && !value.contains('=')
                    && key.bytes().chain(value.bytes()).all(|b| b.is_ascii_graphic()) =>
            {
                parts.push(format!("{key}={value}"))
            }
            _ => return Err(format!("{pair:?} is not a `key=value` label pair")),
        }
    }
    if parts.is_empty() {
        return Err("needs at least one `key=value` label pair".into());
    }
    Ok(parts.join(","))
}

/// Check the discovery options (all problems at once).
pub fn validate(config: &GatewayConfig, errors: &mut Checks) {
    let selectors = [
        ("selector", &config.selector),
        ("prefill_selector", &config.prefill_selector),
        ("decode_selector", &config.decode_selector),
    ];
    if !config.service_discovery {
        for (field, given) in [
            ("selector", !config.selector.is_empty()),
            ("prefill_selector", !config.prefill_selector.is_empty()),
            ("decode_selector", !config.decode_selector.is_empty()),
            ("service_discovery_namespace", config.service_discovery_namespace.is_some()),
            ("service_discovery_kubeconfig", config.service_discovery_kubeconfig.is_some()),
        ] {
            if given {
                errors.push(FieldError::new(field, "needs service_discovery"));
            }
        }
        return;
    }
    for (field, pairs) in selectors {
        if !pairs.is_empty() {
            if let Err(message) = label_selector(pairs) {
                errors.push(FieldError::new(field, message));
            }
        }
    }
    if config.pd_disaggregation {
        if config.prefill_selector.is_empty() && config.decode_selector.is_empty() {
            errors.push(FieldError::new(
                "prefill_selector",
                "service_discovery with pd_disaggregation needs prefill_selector or decode_selector",
            ));
        }
    } else {
        if config.selector.is_empty() {
            errors.push(FieldError::new(
                "selector",
                "service_discovery needs a selector (the worker pods' labels)",
            ));
        }
        for (field, pairs) in &selectors[1..] {
            if !pairs.is_empty() {
                errors.push(FieldError::new(*field, "needs pd_disaggregation"));
            }
        }
    }
    if config.service_discovery_port == 0 {
        errors.push(FieldError::new("service_discovery_port", "must be a port number (1-65535)"));
    }
    if config.service_discovery_namespace.as_deref().is_some_and(|ns| ns.trim().is_empty()) {
        errors.push(FieldError::new(
            "service_discovery_namespace",
            "must not be empty (leave it unset for every namespace)",
        ));
    }
    for (field, name) in [
        ("bootstrap_port_annotation", &config.bootstrap_port_annotation),
        ("worker_port_annotation", &config.worker_port_annotation),
    ] {
        if name.trim().is_empty() {
            errors.push(FieldError::new(field, "must not be empty"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_are_key_value_pairs() {
        let pairs =
            |values: &[&str]| label_selector(&values.iter().map(|v| v.to_string()).collect::<Vec<_>>());
        assert_eq!(pairs(&["app=sglang", "role=worker"]), Ok("app=sglang,role=worker".into()));
        assert_eq!(pairs(&["app=sglang,role=worker"]), Ok("app=sglang,role=worker".into()));
        assert_eq!(pairs(&["app.kubernetes.io/name=x"]), Ok("app.kubernetes.io/name=x".into()));
        for bad in [&["app"][..], &["=x"], &["a!=b"], &["a==b"], &[""], &["a b=c"]] {
            assert!(pairs(bad).is_err(), "{bad:?} accepted");
        }
    }

    fn errors(config: GatewayConfig) -> Vec<String> {
        let mut checks = Checks::new();
        validate(&config, &mut checks);
        checks.finish().err().map(|e| e.0).unwrap_or_default().into_iter().map(|e| e.field).collect()
    }

    #[test]
    fn discovery_options_are_checked_together() {
        let base = GatewayConfig::default();
        assert!(errors(base.clone()).is_empty());
        let orphan = GatewayConfig { selector: vec!["a=b".into()], ..base.clone() };
        assert_eq!(errors(orphan), ["selector"]);
        let on = GatewayConfig { service_discovery: true, ..base.clone() };
        assert_eq!(errors(on.clone()), ["selector"]);
        let ok = GatewayConfig { selector: vec!["a=b".into()], ..on.clone() };
        assert!(errors(ok.clone()).is_empty());
        let pd_without_flag = GatewayConfig { prefill_selector: vec!["a=p".into()], ..ok.clone() };
        assert_eq!(errors(pd_without_flag), ["prefill_selector"]);
        let pd = GatewayConfig { pd_disaggregation: true, ..on.clone() };
        assert_eq!(errors(pd.clone()), ["prefill_selector"]);
        let pd_ok = GatewayConfig { decode_selector: vec!["a=d".into()], ..pd };
        assert!(errors(pd_ok).is_empty());
        let bad = GatewayConfig { service_discovery_port: 0, selector: vec!["nope".into()], ..on };
        assert_eq!(errors(bad), ["selector", "service_discovery_port"]);
    }
}
