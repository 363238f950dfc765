//! Validation of the gateway configuration: every problem at once, each naming its field (YAML
//! path), flag, value and what is allowed.

use kvgate_config::{Checks, FieldError, Range, ValidationErrors};

use super::{parse_bootstrap_port, prefill_groups, GatewayConfig};

/// The client-connection limits and the TLS files: bounded timeouts, paths given in pairs.
fn validate_client_connections(config: &GatewayConfig, checks: &mut Checks) {
    for (field, value) in [
        ("header_read_timeout_secs", config.header_read_timeout_secs),
        ("keep_alive_timeout_secs", config.keep_alive_timeout_secs),
    ] {
        checks.in_range(field, value, Range::new(0.0, false, 86400.0, true));
    }
    if let Some(threads) = config.io_threads.filter(|&n| n > super::MAX_IO_THREADS) {
        checks.push(
            FieldError::new("io_threads", format!("must be at most {}", super::MAX_IO_THREADS)).got(threads),
        );
    }
    if config.max_connections == 0 || config.max_connections > tokio::sync::Semaphore::MAX_PERMITS {
        checks.push(
            FieldError::new(
                "max_connections",
                format!("must be between 1 and {}", tokio::sync::Semaphore::MAX_PERMITS),
            )
            .got(config.max_connections),
        );
    }
    for (cert_field, cert, key_field, key) in [
        ("tls_cert_path", &config.tls_cert_path, "tls_key_path", &config.tls_key_path),
        ("client_cert_path", &config.client_cert_path, "client_key_path", &config.client_key_path),
    ] {
        match (cert, key) {
            (Some(_), None) => checks.push(FieldError::new(
                key_field,
                format!("must be given with {cert_field} (both or neither)"),
            )),
            (None, Some(_)) => checks.push(FieldError::new(
                cert_field,
                format!("must be given with {key_field} (both or neither)"),
            )),
            _ => {}
        }
    }
}

impl GatewayConfig {
    /// Check every option; returns all problems at once, each naming its field (its YAML path),
    /// its flag, the value given and what is allowed.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        if let Err(errors) = self.routing.validate() {
            checks.extend(errors.0.into_iter().map(|e| e.under("routing")));
        }
        for (field, value) in [
            ("request_timeout_secs", Some(self.request_timeout_secs)),
            ("queue_timeout_secs", Some(self.queue_timeout_secs)),
            ("body_read_timeout_secs", Some(self.body_read_timeout_secs)),
            ("ttfb_timeout_secs", self.ttfb_timeout_secs),
            ("stream_deadline_secs", self.stream_deadline_secs),
            ("rate_limit_tokens_per_second", self.rate_limit_tokens_per_second),
            ("load_monitor_interval", self.load_monitor_interval),
            ("health_check_interval_secs", Some(self.health_check_interval_secs)),
            ("health_check_timeout_secs", Some(self.health_check_timeout_secs)),
            ("cb_timeout_duration_secs", Some(self.cb_timeout_duration_secs)),
            ("alignment_probe_interval_secs", Some(self.alignment_probe_interval_secs)),
            ("tokenizer_queue_timeout_secs", Some(self.tokenizer_queue_timeout_secs)),
        ] {
            if let Some(value) = value {
                checks.in_range(field, value, Range::POSITIVE);
            }
        }
        checks.in_range("shutdown_grace_period_secs", self.shutdown_grace_period_secs, Range::NON_NEGATIVE);
        checks.in_range("body_stall_timeout_secs", self.body_stall_timeout_secs, Range::NON_NEGATIVE);
        checks.at_least("load_monitor_interval_ms", self.load_monitor_interval_ms, 1);
        for (field, value) in [
            ("health_failure_threshold", self.health_failure_threshold),
            ("health_success_threshold", self.health_success_threshold),
            ("cb_failure_threshold", self.cb_failure_threshold),
        ] {
            checks.at_least(field, value.into(), 1);
        }
        for (field, value) in [
            ("max_probe_answer_bytes", self.max_probe_answer_bytes),
            ("max_prefill_answer_bytes", self.max_prefill_answer_bytes),
            ("kv_events_max_message_bytes", self.kv_events_max_message_bytes),
        ] {
            checks.at_least(field, value as u64, 1024);
        }
        if self.tokenizer_threads.is_some_and(|n| n == 0 || n > 1024) {
            checks.push(
                FieldError::new("tokenizer_threads", "must be between 1 and 1024")
                    .got(self.tokenizer_threads.unwrap_or(0)),
            );
        }
        checks.at_least("max_tokenize_chars", self.max_tokenize_chars as u64, 64);
        checks.at_least("kv_index_max_blocks_per_worker", self.kv_index_max_blocks_per_worker as u64, 1);
        checks.in_range(
            "kv_index_capacity_slack",
            self.kv_index_capacity_slack,
            Range::new(1.0, true, 1000.0, true),
        );
        checks.nested(self.overload_settings().check());
        if self.max_concurrent_requests == Some(0) {
            checks.push(
                FieldError::new("max_concurrent_requests", "must be at least 1 (leave unset for no limit)")
                    .got(0),
            );
        }
        if self.retry_initial_backoff_ms > self.retry_max_backoff_ms {
            checks.push(
                FieldError::new(
                    "retry_initial_backoff_ms",
                    format!("must not exceed retry_max_backoff_ms ({})", self.retry_max_backoff_ms),
                )
                .got(self.retry_initial_backoff_ms),
            );
        }
        if !self.health_check_endpoint.starts_with('/') {
            checks.push(
                FieldError::new("health_check_endpoint", "must be a path starting with '/'")
                    .got(format!("{:?}", self.health_check_endpoint)),
            );
        }
        for url in &self.worker_urls {
            if let Err(message) = crate::worker_url::normalize_url(url) {
                checks.push(FieldError::new("worker_urls", message));
            }
        }
        self.validate_pd(&mut checks);
        for model in self.models.keys() {
            let parent = format!("models.{model}");
            match self.model_routing(model) {
                Ok(routing) => {
                    if let Err(errors) = routing.validate() {
                        checks.extend(errors.0.into_iter().map(|e| e.under(&parent)));
                    }
                }
                Err(message) => {
                    let message =
                        message.strip_prefix(&format!("{parent}: ")).unwrap_or(&message).to_string();
                    checks.push(FieldError::new(parent, message).with_flag(None));
                }
            }
        }
        for (field, name) in [
            ("routing_key_header", &self.routing_key_header),
            ("tenant_header", &self.tenant_header),
            ("priority_header", &self.priority_header),
        ] {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                checks.push(FieldError::new(field, "must be a valid header name").got(format!("{name:?}")));
            }
        }
        for entry in &self.client_api_keys {
            if let Err(message) = crate::auth::ClientKey::parse_flag(entry) {
                checks.push(FieldError::new("client_api_keys", message));
            }
        }
        self.tenants.validate(self.max_concurrent_requests, &mut checks);
        for name in &self.request_id_headers {
            if http::HeaderName::from_bytes(name.trim().as_bytes()).is_err() {
                checks.push(
                    FieldError::new("request_id_headers", "must be valid header names")
                        .got(format!("{name:?}")),
                );
            }
        }
        if let Some(url) = &self.otlp_traces_endpoint {
            let parsed = url.parse::<http::Uri>().ok();
            let http_url = parsed.as_ref().is_some_and(|uri| {
                matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some()
            });
            if !http_url {
                checks.push(
                    FieldError::new(
                        "otlp_traces_endpoint",
                        "must be the collector's OTLP/HTTP URL, e.g. http://127.0.0.1:4318/v1/traces (OTLP over gRPC, host:port, is not supported)",
                    )
                    .got(format!("{url:?}")),
                );
            }
        }
        self.validate_kv_events(&mut checks);
        validate_client_connections(self, &mut checks);
        self.validate_replica_sync(&mut checks);
        self.validate_admin(&mut checks);
        checks.ensure(
            !(self.tokenizer_path.is_some() && self.mock_tokenizer),
            "mock_tokenizer",
            "conflicts with tokenizer_path: give one tokenizer",
        );
        checks.ensure(
            !(self.chat_template.is_some() && self.tokenizer_path.is_none() && !self.mock_tokenizer),
            "chat_template",
            "needs tokenizer_path or mock_tokenizer (the template is rendered for that tokenizer)",
        );
        super::discovery::validate(self, &mut checks);
        checks.finish()
    }

    fn validate_admin(&self, checks: &mut Checks) {
        if self.admin_api_key.as_deref() == Some("") {
            checks.push(FieldError::new("admin_api_key", "must not be empty"));
        }
        if self.admin_port.is_none() && self.admin_api_key.is_none() && self.port == u16::MAX {
            checks.push(FieldError::new(
                "admin_port",
                "must be given when port is 65535 and there is no admin_api_key (the admin listener's default is the port after port)",
            ));
        }
        if let Some((host, port)) = self.admin_listener() {
            if port != 0 && port == self.port && host == self.host {
                checks.push(
                    FieldError::new(
                        "admin_port",
                        "must differ from port (the admin API has a listener of its own)",
                    )
                    .got(port),
                );
            }
            let loopback =
                host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
            let named = host.parse::<std::net::IpAddr>().is_err() && host != "localhost";
            if !loopback && !named && self.admin_api_key.is_none() && !self.admin_insecure {
                checks.push(
                    FieldError::new(
                        "admin_host",
                        "is not a loopback address: give admin_api_key (or admin_insecure to serve the admin API to anyone who reaches it)",
                    )
                    .got(&host),
                );
            }
        }
        checks.at_least("max_workers", self.max_workers as u64, 1);
        for entry in &self.worker_url_allow {
            if let Err(message) = crate::worker_url::AllowList::parse_entry(entry) {
                checks.push(FieldError::new("worker_url_allow", message));
            }
        }
    }

    fn validate_replica_sync(&self, checks: &mut Checks) {
        if let Some(url) = &self.replica_sync_redis_url {
            if let Err(error) = redis::Client::open(url.as_str()) {
                checks.push(FieldError::new(
                    "replica_sync_redis_url",
                    format!("is not a usable Redis URL: {error}"),
                ));
            }
        }
        checks.ensure(!self.replica_sync_channel.is_empty(), "replica_sync_channel", "must not be empty");
        checks.at_least("replica_sync_interval_ms", self.replica_sync_interval_ms, 1);
        checks.at_least("replica_sync_max_blocks", self.replica_sync_max_blocks as u64, 1);
        match (&self.replica_sync_redis_url, &self.replica_sync_secret) {
            (Some(_), None) => checks.push(FieldError::new(
                "replica_sync_secret",
                "is required with replica_sync_redis_url: every message is signed with it (the same on every replica)",
            )),
            (_, Some(secret)) if secret.len() < 16 => checks.push(FieldError::new(
                "replica_sync_secret",
                format!("must be at least 16 bytes, got {}", secret.len()),
            )),
            _ => {}
        }
        checks.at_least("replica_sync_max_age_ms", self.replica_sync_max_age_ms, 1);
        checks.at_least("replica_sync_max_message_bytes", self.replica_sync_max_message_bytes as u64, 4096);
        checks.at_least(
            "replica_sync_max_hashes_per_record",
            self.replica_sync_max_hashes_per_record as u64,
            1,
        );
        checks.at_least("replica_sync_max_peers", self.replica_sync_max_peers as u64, 1);
        checks.at_least("replica_sync_max_peer_in_flight", self.replica_sync_max_peer_in_flight, 1);
    }

    fn validate_pd(&self, errors: &mut Checks) {
        if !self.pd_disaggregation {
            for (field, given) in [
                ("prefill", !self.prefill.is_empty()),
                ("decode", !self.decode.is_empty()),
                ("prefill_policy", self.prefill_policy.is_some()),
                ("decode_policy", self.decode_policy.is_some()),
                ("routing.pd_conditional", self.routing.pd_conditional),
            ] {
                if given {
                    errors.push(FieldError::new(field, "needs pd_disaggregation"));
                }
            }
        }
        let groups = prefill_groups(&self.prefill);
        for entry in &groups {
            match entry.as_slice() {
                [url] | [url, _] => {
                    if let Err(message) = crate::worker_url::normalize_url(url) {
                        errors.push(FieldError::new("prefill", message));
                    }
                    if let Some(Err(message)) = entry.get(1).map(|port| parse_bootstrap_port(port)) {
                        errors.push(FieldError::new("prefill", message));
                    }
                }
                _ => errors.push(FieldError::new(
                    "prefill",
                    format!("expected URL [BOOTSTRAP_PORT], got {entry:?}"),
                )),
            }
        }
        for url in &self.decode {
            if let Err(message) = crate::worker_url::normalize_url(url) {
                errors.push(FieldError::new("decode", message));
            }
        }
    }

    fn validate_kv_events(&self, errors: &mut Checks) {
        let (urls, events, replay) = (
            self.worker_urls.len() + prefill_groups(&self.prefill).len() + self.decode.len(),
            self.kv_events_endpoints.len(),
            self.kv_events_replay_endpoints.len(),
        );
        if events > 0 && events != urls {
            errors.push(FieldError::new(
                "kv_events_endpoints",
                format!("{events} entries for {urls} worker URLs: give one per worker (`-` for none)"),
            ));
        }
        if replay > 0 && replay != events {
            errors.push(FieldError::new(
                "kv_events_replay_endpoints",
                format!(
                    "{replay} entries for {events} KV events endpoints: give one per worker (`-` for none)"
                ),
            ));
        }
        for index in 0..events {
            if let Err(message) = self.kv_events_source(index) {
                errors.push(FieldError::new("kv_events_endpoints", message));
            }
        }
    }
}
