//! Gateway configuration: the one declaration of every `kvgate launch` option (flag, YAML key,
//! default, help) and its validation.

use clap::Args;
use kvgate_policy::{ConfigError, PolicyConfig};

use crate::kv_events::KvEventsSource;
use crate::role::{PdProtocol, WorkerRole};
use kvgate_policy::PolicyKind;
use serde::{Deserialize, Serialize};

/// Everything `kvgate launch` can be told. Flags and YAML keys come from these fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free port).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Engine URLs to route to (more can be added at runtime with POST /workers).
    #[arg(long = "worker-urls", num_args = 0.., value_name = "URL")]
    pub worker_urls: Vec<String>,
    /// Routing policy and its options.
    #[command(flatten)]
    pub routing: PolicyConfig,

    /// Route a prefill/decode disaggregated fleet: each request goes to a prefill worker and a
    /// decode worker (--prefill, --decode, or POST /workers with a worker_type).
    #[arg(long)]
    pub pd_disaggregation: bool,
    /// A prefill worker and, optionally, its SGLang bootstrap port (`none` for no port); repeat
    /// the flag for each. YAML: a list of URLs or `{url, bootstrap_port}` maps.
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = clap::ArgAction::Append)]
    #[serde(with = "prefill_entries")]
    pub prefill: Vec<String>,
    /// A decode worker; repeat the flag for each.
    #[arg(long, value_name = "URL", action = clap::ArgAction::Append)]
    pub decode: Vec<String>,
    /// Policy of the prefill side (default: --policy).
    #[arg(long, value_enum)]
    pub prefill_policy: Option<PolicyKind>,
    /// Policy of the decode side (default: --policy).
    #[arg(long, value_enum)]
    pub decode_policy: Option<PolicyKind>,
    /// How prefill workers hand their KV cache to decode workers.
    #[arg(long, value_enum, default_value_t = PdProtocol::Sglang)]
    pub pd_protocol: PdProtocol,

    /// Header carrying a request's session key (consistent_hashing, manual); without it the
    /// body's `user` field is the key.
    #[arg(long, default_value = "x-kvgate-routing-key")]
    pub routing_key_header: String,
    /// Honour `x-kvgate-target-worker: URL`: the request goes to that worker of its model
    /// (400 when it is not a routable worker of the model).
    #[arg(long)]
    pub routing_key_override: bool,
    /// Per-model routing (YAML only): model name → policy options laid over `routing:`, e.g.
    /// `models: {llama: {policy: cache_aware, cache_threshold: 0.5}, qwen: {policy: manual}}`.
    #[arg(skip)]
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub models: std::collections::BTreeMap<String, serde_norway::Value>,

    /// ZMQ endpoints of the workers' KV event publishers (vLLM/SGLang `--kv-events-config`),
    /// one per worker in the order --worker-urls, --prefill, --decode: `tcp://host:port`, several
    /// comma-separated for data-parallel ranks, `-` for a worker without events.
    #[arg(long = "kv-events-endpoints", num_args = 0.., value_name = "ENDPOINT")]
    pub kv_events_endpoints: Vec<String>,
    /// ZMQ endpoints of the workers' KV event replay sockets, shaped like --kv-events-endpoints
    /// (`-` for none). Replay fills gaps and rebuilds the index after a start or restart.
    #[arg(long = "kv-events-replay-endpoints", num_args = 0.., value_name = "ENDPOINT")]
    pub kv_events_replay_endpoints: Vec<String>,
    /// ZMQ topic the engines publish KV events under.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Tokenizer for matching requests to KV blocks: a Hugging Face tokenizer.json, or a directory
    /// holding it and tokenizer_config.json (the chat template). Never downloaded.
    #[arg(long, value_name = "DIR_OR_FILE")]
    pub tokenizer_path: Option<std::path::PathBuf>,
    /// Chat template file (Jinja) overriding the tokenizer's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<std::path::PathBuf>,
    /// Tokenize as kvgate's simulated engines do (one word = one token); set by
    /// `launch --mock-workers`.
    #[arg(long)]
    pub mock_tokenizer: bool,

    /// Seconds between engine load polls (used only while a policy consumes loads).
    #[arg(long, default_value_t = 1.0)]
    pub load_monitor_interval: f64,
    /// Milliseconds between engine load polls; overrides --load-monitor-interval.
    #[arg(long)]
    pub load_monitor_interval_ms: Option<u64>,

    /// Deadline for a worker's response headers, in seconds.
    #[arg(long, default_value_t = 1800.0)]
    pub request_timeout_secs: f64,
    /// Largest accepted request body in bytes; larger bodies get 413.
    #[arg(long, default_value_t = 512 * 1024 * 1024)]
    pub max_payload_size: usize,
    /// Most requests proxied at once; further requests wait in the queue (--queue-size) or get
    /// 429 (unset: no limit).
    #[arg(long)]
    pub max_concurrent_requests: Option<usize>,
    /// Requests that may wait for a concurrency slot or a rate-limit token (0: refuse at once
    /// with 429); a full queue refuses with 429.
    #[arg(long, default_value_t = 0)]
    pub queue_size: usize,
    /// Longest wait in the admission queue, in seconds; then 408.
    #[arg(long, default_value_t = 60.0)]
    pub queue_timeout_secs: f64,
    /// Requests admitted per second (token bucket, bursts of up to one second's worth); over it,
    /// requests queue (--queue-size) or get 429 (unset: no limit).
    #[arg(long)]
    pub rate_limit_tokens_per_second: Option<f64>,
    /// Seconds a client has to send its whole request body; then 408.
    #[arg(long, default_value_t = 60.0)]
    pub body_read_timeout_secs: f64,
    /// Seconds to wait for a worker's response head before giving up on it and trying another
    /// worker (nothing has reached the client yet); unset: wait up to --request-timeout-secs.
    #[arg(long)]
    pub ttfb_timeout_secs: Option<f64>,

    /// Seconds between health checks of each worker.
    #[arg(long, default_value_t = 10.0)]
    pub health_check_interval_secs: f64,
    /// Timeout of one health check, in seconds.
    #[arg(long, default_value_t = 5.0)]
    pub health_check_timeout_secs: f64,
    /// Path probed on each worker.
    #[arg(long, default_value = "/health")]
    pub health_check_endpoint: String,
    /// Consecutive failed checks that mark a healthy worker unhealthy.
    #[arg(long, default_value_t = 3)]
    pub health_failure_threshold: u32,
    /// Consecutive passed checks that mark an unhealthy worker healthy again.
    #[arg(long, default_value_t = 2)]
    pub health_success_threshold: u32,
    /// Do not probe workers: every worker is considered healthy.
    #[arg(long)]
    pub disable_health_check: bool,

    /// Retries of a failed request on other workers (connect errors, 502/503/504 before any byte).
    #[arg(long, default_value_t = 3)]
    pub retry_max_retries: u32,
    /// First retry backoff in milliseconds (doubled per attempt, with jitter).
    #[arg(long, default_value_t = 50)]
    pub retry_initial_backoff_ms: u64,
    /// Largest retry backoff in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub retry_max_backoff_ms: u64,
    /// Never retry.
    #[arg(long)]
    pub disable_retries: bool,

    /// Consecutive failures that open a worker's circuit.
    #[arg(long, default_value_t = 5)]
    pub cb_failure_threshold: u32,
    /// Seconds an open circuit waits before letting a probe request through (half-open).
    #[arg(long, default_value_t = 30.0)]
    pub cb_timeout_duration_secs: f64,
    /// Never open circuits.
    #[arg(long)]
    pub disable_circuit_breaker: bool,

    /// When set, /workers requires `Authorization: Bearer KEY`.
    #[arg(long, env = "KVGATE_ADMIN_API_KEY", hide_env_values = true)]
    pub admin_api_key: Option<String>,
    /// Bearer token sent to workers.
    #[arg(long, env = "KVGATE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// When set, the inference endpoints require `Authorization: Bearer KEY` with one of these
    /// keys (401 otherwise); the client's key is not forwarded to workers.
    #[arg(long, env = "KVGATE_CLIENT_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub client_api_keys: Vec<String>,

    /// Seconds a client has to send a complete request head, counted from the connection's
    /// start (TLS handshake included) or from the first byte of a later request; a client that
    /// has not finished by then (or sent nothing) is disconnected.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout_secs: f64,
    /// Seconds an idle keep-alive client connection (no request in progress) stays open after
    /// its last response before it is closed.
    #[arg(long, default_value_t = 60.0)]
    pub keep_alive_timeout_secs: f64,
    /// Most client connections open at once; connections beyond it are closed as soon as they
    /// are accepted. Keep it below the process's file descriptor limit (`ulimit -n`), leaving
    /// room for worker connections.
    #[arg(long, default_value_t = 10000)]
    pub max_connections: usize,
    /// Serve HTTPS: the listener's certificate chain (PEM), with --tls-key-path.
    #[arg(long, value_name = "FILE")]
    pub tls_cert_path: Option<std::path::PathBuf>,
    /// The listener's private key (PEM: PKCS#8, PKCS#1 or SEC1), with --tls-cert-path.
    #[arg(long, value_name = "FILE")]
    pub tls_key_path: Option<std::path::PathBuf>,
    /// CA certificates (PEM) trusted for `https://` workers, instead of the built-in Mozilla
    /// roots.
    #[arg(long = "ca-cert-paths", num_args = 0.., value_name = "FILE")]
    pub ca_cert_paths: Vec<std::path::PathBuf>,
    /// Client certificate chain (PEM) presented to `https://` workers (mTLS), with
    /// --client-key-path.
    #[arg(long, value_name = "FILE")]
    pub client_cert_path: Option<std::path::PathBuf>,
    /// The private key (PEM) of --client-cert-path.
    #[arg(long, value_name = "FILE")]
    pub client_key_path: Option<std::path::PathBuf>,

    /// Log level (error, warn, info, debug, trace) or a tracing filter directive.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Log as JSON lines.
    #[arg(long)]
    pub log_json: bool,
    /// Add x-kvgate-worker and x-kvgate-route headers to proxied responses.
    #[arg(long)]
    pub expose_routing_headers: bool,
    /// Seconds in-flight requests may take to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace_period_secs: f64,

    /// Find workers as Kubernetes pods (--selector, or --prefill-selector/--decode-selector with
    /// --pd-disaggregation): Ready pods join, pods deleted or no longer Ready leave.
    #[arg(long)]
    pub service_discovery: bool,
    /// Label selector of the worker pods, as `key=value` pairs (all must match).
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub selector: Vec<String>,
    /// Label selector of the prefill pods (with --pd-disaggregation), as `key=value` pairs.
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub prefill_selector: Vec<String>,
    /// Label selector of the decode pods (with --pd-disaggregation), as `key=value` pairs.
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub decode_selector: Vec<String>,
    /// Namespace whose pods are watched (unset: every namespace, which needs cluster-wide
    /// permission to list and watch pods).
    #[arg(long, value_name = "NAMESPACE")]
    pub service_discovery_namespace: Option<String>,
    /// Port of the workers on the discovered pods: a pod is the worker `http://{podIP}:{port}`.
    #[arg(long, default_value_t = 8000)]
    pub service_discovery_port: u16,
    /// Pod annotation holding a prefill pod's SGLang bootstrap port.
    #[arg(long, default_value = "sglang.ai/bootstrap-port")]
    pub bootstrap_port_annotation: String,
    /// Pod annotation that overrides --service-discovery-port for one pod (pods whose worker
    /// listens elsewhere).
    #[arg(long, default_value = "kvgate.io/worker-port")]
    pub worker_port_annotation: String,
    /// Kubeconfig file of the cluster to watch (unset: the in-cluster service account, else
    /// $KUBECONFIG or ~/.kube/config).
    #[arg(long, value_name = "FILE")]
    pub service_discovery_kubeconfig: Option<std::path::PathBuf>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        use clap::Parser;
        #[derive(Parser)]
        struct Defaults {
            #[command(flatten)]
            config: GatewayConfig,
        }
        Defaults::parse_from(["kvgate"]).config
    }
}

/// The client-connection limits and the TLS files: bounded timeouts, paths given in pairs.
fn validate_client_connections(config: &GatewayConfig, errors: &mut Vec<ConfigError>) {
    for (field, value) in [
        ("header_read_timeout_secs", config.header_read_timeout_secs),
        ("keep_alive_timeout_secs", config.keep_alive_timeout_secs),
    ] {
        if !value.is_finite() || value <= 0.0 || value > 86400.0 {
            errors.push(ConfigError {
                field,
                message: format!("must be a number of seconds > 0 and <= 86400, got {value}"),
            });
        }
    }
    if config.max_connections == 0 || config.max_connections > tokio::sync::Semaphore::MAX_PERMITS {
        errors.push(ConfigError {
            field: "max_connections",
            message: format!("must be between 1 and {}", tokio::sync::Semaphore::MAX_PERMITS),
        });
    }
    for (cert_field, cert, key_field, key) in [
        ("tls_cert_path", &config.tls_cert_path, "tls_key_path", &config.tls_key_path),
        ("client_cert_path", &config.client_cert_path, "client_key_path", &config.client_key_path),
    ] {
        match (cert, key) {
            (Some(_), None) => errors.push(ConfigError {
                field: key_field,
                message: format!("must be given with {cert_field} (both or neither)"),
            }),
            (None, Some(_)) => errors.push(ConfigError {
                field: cert_field,
                message: format!("must be given with {key_field} (both or neither)"),
            }),
            _ => {}
        }
    }
}

fn positive_seconds(errors: &mut Vec<ConfigError>, field: &'static str, value: f64) {
    if !value.is_finite() || value <= 0.0 {
        errors.push(ConfigError {
            field,
            message: format!("must be a finite number of seconds > 0, got {value}"),
        });
    }
}

impl GatewayConfig {
    /// Read a YAML configuration file (keys are the field names, routing options under
    /// `routing:`) and lay the command line's explicitly given flags (`explicit`: their clap ids,
    /// which are the field names) over it. Unknown keys and wrong types are errors.
    pub fn with_file(yaml: &str, cli: &GatewayConfig, explicit: &[String]) -> Result<GatewayConfig, String> {
        let file: GatewayConfig = if yaml.trim().is_empty() {
            GatewayConfig::default()
        } else {
            serde_norway::from_str(yaml).map_err(|e| format!("invalid configuration file: {e}"))?
        };
        // YAML values (not JSON) so that NaN and infinities survive the merge and reach validation.
        let as_value = |config: &GatewayConfig| serde_norway::to_value(config).map_err(|e| e.to_string());
        let mut merged = as_value(&file)?;
        let given = as_value(cli)?;
        for id in explicit {
            if let Some(value) = given.get(id) {
                merged[id] = value.clone();
            } else if let Some(value) = given["routing"].get(id) {
                merged["routing"][id] = value.clone();
            }
        }
        serde_norway::from_value(merged).map_err(|e| format!("invalid configuration: {e}"))
    }

    /// The policy configuration of `model`: `routing` with the model's `models:` entry laid over it.
    pub fn model_routing(&self, model: &str) -> Result<PolicyConfig, String> {
        let Some(overrides) = self.models.get(model) else { return Ok(self.routing.clone()) };
        let mut merged = serde_norway::to_value(&self.routing).map_err(|e| e.to_string())?;
        let serde_norway::Value::Mapping(entries) = overrides else {
            return Err(format!("models.{model} must be a map of policy options"));
        };
        for (key, value) in entries {
            let Some(key) = key.as_str() else {
                return Err(format!("models.{model}: keys must be option names"));
            };
            merged[key] = value.clone();
        }
        serde_norway::from_value(merged).map_err(|e| format!("models.{model}: {e}"))
    }

    /// The configuration as YAML, readable back with `--config` (secrets shown as `<set>`).
    pub fn to_yaml(&self) -> Result<String, String> {
        let mut shown = self.clone();
        for secret in [&mut shown.admin_api_key, &mut shown.api_key] {
            if secret.is_some() {
                *secret = Some("<set>".into());
            }
        }
        if !shown.client_api_keys.is_empty() {
            shown.client_api_keys = vec!["<set>".into()];
        }
        serde_norway::to_string(&shown).map_err(|e| e.to_string())
    }

    /// The effective load poll interval in milliseconds.
    pub fn load_poll_interval_ms(&self) -> u64 {
        self.load_monitor_interval_ms.unwrap_or((self.load_monitor_interval * 1000.0).round().max(1.0) as u64)
    }

    /// Check every option; returns all problems at once.
    pub fn validate(&self) -> Result<(), Vec<ConfigError>> {
        let mut errors = self.routing.validate().err().unwrap_or_default();
        positive_seconds(&mut errors, "request_timeout_secs", self.request_timeout_secs);
        positive_seconds(&mut errors, "queue_timeout_secs", self.queue_timeout_secs);
        positive_seconds(&mut errors, "body_read_timeout_secs", self.body_read_timeout_secs);
        if let Some(ttfb) = self.ttfb_timeout_secs {
            positive_seconds(&mut errors, "ttfb_timeout_secs", ttfb);
        }
        if let Some(rate) = self.rate_limit_tokens_per_second {
            if !rate.is_finite() || rate <= 0.0 {
                errors.push(ConfigError {
                    field: "rate_limit_tokens_per_second",
                    message: format!("must be a finite number > 0, got {rate}"),
                });
            }
        }
        positive_seconds(&mut errors, "load_monitor_interval", self.load_monitor_interval);
        if self.load_monitor_interval_ms == Some(0) {
            errors.push(ConfigError {
                field: "load_monitor_interval_ms",
                message: "must be at least 1".into(),
            });
        }
        positive_seconds(&mut errors, "health_check_interval_secs", self.health_check_interval_secs);
        positive_seconds(&mut errors, "health_check_timeout_secs", self.health_check_timeout_secs);
        positive_seconds(&mut errors, "cb_timeout_duration_secs", self.cb_timeout_duration_secs);
        if !self.shutdown_grace_period_secs.is_finite() || self.shutdown_grace_period_secs < 0.0 {
            errors.push(ConfigError {
                field: "shutdown_grace_period_secs",
                message: format!("must be a finite number >= 0, got {}", self.shutdown_grace_period_secs),
            });
        }
        for (field, value) in [
            ("health_failure_threshold", self.health_failure_threshold),
            ("health_success_threshold", self.health_success_threshold),
            ("cb_failure_threshold", self.cb_failure_threshold),
        ] {
            if value == 0 {
                errors.push(ConfigError { field, message: "must be at least 1".into() });
            }
        }
        if self.max_concurrent_requests == Some(0) {
            errors.push(ConfigError {
                field: "max_concurrent_requests",
                message: "must be at least 1 (leave unset for no limit)".into(),
            });
        }
        if self.retry_initial_backoff_ms > self.retry_max_backoff_ms {
            errors.push(ConfigError {
                field: "retry_initial_backoff_ms",
                message: "must not exceed retry_max_backoff_ms".into(),
            });
        }
        if !self.health_check_endpoint.starts_with('/') {
            errors.push(ConfigError {
                field: "health_check_endpoint",
                message: format!("must be a path starting with '/', got {:?}", self.health_check_endpoint),
            });
        }
        for url in &self.worker_urls {
            if let Err(message) = crate::worker::normalize_url(url) {
                errors.push(ConfigError { field: "worker_urls", message });
            }
        }
        self.validate_pd(&mut errors);
        for model in self.models.keys() {
            match self.model_routing(model) {
                Ok(routing) => {
                    for error in routing.validate().err().unwrap_or_default() {
                        errors.push(ConfigError { field: "models", message: format!("{model}: {error}") });
                    }
                }
                Err(message) => errors.push(ConfigError { field: "models", message }),
            }
        }
        if http::HeaderName::from_bytes(self.routing_key_header.as_bytes()).is_err() {
            errors.push(ConfigError {
                field: "routing_key_header",
                message: format!("{:?} is not a valid header name", self.routing_key_header),
            });
        }
        self.validate_kv_events(&mut errors);
        validate_client_connections(self, &mut errors);
        if self.tokenizer_path.is_some() && self.mock_tokenizer {
            errors.push(ConfigError {
                field: "mock_tokenizer",
                message: "conflicts with tokenizer_path: give one tokenizer".into(),
            });
        }
        if self.chat_template.is_some() && self.tokenizer_path.is_none() {
            errors.push(ConfigError {
                field: "chat_template",
                message: "needs tokenizer_path (the template is rendered for that tokenizer)".into(),
            });
        }
        crate::discovery::validate(self, &mut errors);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// One worker given at start: URL, role, bootstrap port.
#[derive(Clone, Debug, PartialEq)]
pub struct InitialWorker {
    pub url: String,
    pub role: WorkerRole,
    pub bootstrap_port: Option<u16>,
}

/// Whether a `--prefill` value is a bootstrap port (else it starts the next worker's URL).
fn is_port_value(text: &str) -> bool {
    text.eq_ignore_ascii_case("none") || text.bytes().all(|b| b.is_ascii_digit())
}

/// The `--prefill` values grouped into (URL, bootstrap port) entries.
fn prefill_groups(values: &[String]) -> Vec<Vec<String>> {
    let mut groups: Vec<Vec<String>> = Vec::new();
    for value in values {
        match groups.last_mut() {
            Some(group) if group.len() == 1 && is_port_value(value) => group.push(value.clone()),
            _ => groups.push(vec![value.clone()]),
        }
    }
    groups
}

/// A `--prefill` entry's bootstrap port: a port number or `none`.
fn parse_bootstrap_port(text: &str) -> Result<Option<u16>, String> {
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    match text.parse::<u16>() {
        Ok(port) if port > 0 => Ok(Some(port)),
        _ => Err(format!("bootstrap port {text:?} is not a port number (1-65535) or `none`")),
    }
}

impl GatewayConfig {
    /// Every worker given at start, in the order --worker-urls, --prefill, --decode (the order of
    /// --kv-events-endpoints). Entries that fail validation are skipped.
    pub fn initial_workers(&self) -> Vec<InitialWorker> {
        let regular = self.worker_urls.iter().map(|url| InitialWorker {
            url: url.clone(),
            role: WorkerRole::Regular,
            bootstrap_port: None,
        });
        let prefill = prefill_groups(&self.prefill).into_iter().filter_map(|entry| {
            let port = match entry.get(1) {
                Some(text) => parse_bootstrap_port(text).ok()?,
                None => None,
            };
            Some(InitialWorker {
                url: entry.first()?.clone(),
                role: WorkerRole::Prefill,
                bootstrap_port: port,
            })
        });
        let decode = self.decode.iter().map(|url| InitialWorker {
            url: url.clone(),
            role: WorkerRole::Decode,
            bootstrap_port: None,
        });
        regular.chain(prefill).chain(decode).collect()
    }

    fn validate_pd(&self, errors: &mut Vec<ConfigError>) {
        if !self.pd_disaggregation {
            for (field, given) in [
                ("prefill", !self.prefill.is_empty()),
                ("decode", !self.decode.is_empty()),
                ("prefill_policy", self.prefill_policy.is_some()),
                ("decode_policy", self.decode_policy.is_some()),
            ] {
                if given {
                    errors.push(ConfigError { field, message: "needs pd_disaggregation".into() });
                }
            }
        }
        let groups = prefill_groups(&self.prefill);
        for entry in &groups {
            match entry.as_slice() {
                [url] | [url, _] => {
                    if let Err(message) = crate::worker::normalize_url(url) {
                        errors.push(ConfigError { field: "prefill", message });
                    }
                    if let Some(Err(message)) = entry.get(1).map(|port| parse_bootstrap_port(port)) {
                        errors.push(ConfigError { field: "prefill", message });
                    }
                }
                _ => errors.push(ConfigError {
                    field: "prefill",
                    message: format!("expected URL [BOOTSTRAP_PORT], got {entry:?}"),
                }),
            }
        }
        for url in &self.decode {
            if let Err(message) = crate::worker::normalize_url(url) {
                errors.push(ConfigError { field: "decode", message });
            }
        }
    }

    /// The KV events source of the `index`-th initial worker (validated by `validate`).
    pub fn kv_events_source(&self, index: usize) -> Result<Option<KvEventsSource>, String> {
        let Some(events) = self.kv_events_endpoints.get(index) else { return Ok(None) };
        KvEventsSource::parse(events, self.kv_events_replay_endpoints.get(index).map(String::as_str))
    }

    fn validate_kv_events(&self, errors: &mut Vec<ConfigError>) {
        let (urls, events, replay) = (
            self.worker_urls.len() + prefill_groups(&self.prefill).len() + self.decode.len(),
            self.kv_events_endpoints.len(),
            self.kv_events_replay_endpoints.len(),
        );
        if events > 0 && events != urls {
            errors.push(ConfigError {
                field: "kv_events_endpoints",
                message: format!(
                    "{events} entries for {urls} worker URLs: give one per worker (`-` for none)"
                ),
            });
        }
        if replay > 0 && replay != events {
            errors.push(ConfigError {
                field: "kv_events_replay_endpoints",
                message: format!(
                    "{replay} entries for {events} KV events endpoints: give one per worker (`-` for none)"
                ),
            });
        }
        for index in 0..events {
            if let Err(message) = self.kv_events_source(index) {
                errors.push(ConfigError { field: "kv_events_endpoints", message });
            }
        }
    }
}

/// `prefill` in YAML: a list of `URL`, `[URL, PORT]` or `{url, bootstrap_port}` entries.
mod prefill_entries {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Port {
        Number(u16),
        Text(String),
    }

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Entry {
        url: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bootstrap_port: Option<Port>,
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        Url(String),
        List(Vec<String>),
        Map(Entry),
    }

    fn port_text(port: Port) -> String {
        match port {
            Port::Number(n) => n.to_string(),
            Port::Text(text) => text,
        }
    }

    pub fn serialize<S: Serializer>(values: &[String], serializer: S) -> Result<S::Ok, S::Error> {
        let maps: Vec<Entry> = super::prefill_groups(values)
            .iter()
            .map(|entry| Entry {
                url: entry.first().cloned().unwrap_or_default(),
                bootstrap_port: entry.get(1).map(|port| Port::Text(port.clone())),
            })
            .collect();
        maps.serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
        let given = Vec::<Given>::deserialize(deserializer)?;
        Ok(given
            .into_iter()
            .flat_map(|entry| match entry {
                Given::Url(url) => vec![url],
                Given::List(list) => list,
                Given::Map(Entry { url, bootstrap_port }) => {
                    std::iter::once(url).chain(bootstrap_port.map(port_text)).collect()
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_loopback() {
        let config = GatewayConfig::default();
        assert_eq!(config.host, "127.0.0.1");
        assert_eq!(config.port, 30000);
        assert_eq!(config.health_check_endpoint, "/health");
        config.validate().unwrap();
    }

    #[test]
    fn yaml_file_with_command_line_overrides() {
        let yaml = "port: 31000\nworker_urls: [\"http://127.0.0.1:8000\"]\nrouting:\n  policy: round_robin\n  cache_threshold: 0.5\n";
        let cli = GatewayConfig { port: 32000, ..GatewayConfig::default() };
        let merged = GatewayConfig::with_file(yaml, &cli, &["port".to_string()]).unwrap();
        assert_eq!(merged.port, 32000, "an explicit flag wins over the file");
        assert_eq!(merged.worker_urls, ["http://127.0.0.1:8000"]);
        assert_eq!(merged.routing.policy, kvgate_policy::PolicyKind::RoundRobin);
        assert_eq!(merged.routing.cache_threshold, 0.5);
        assert_eq!(merged.health_check_endpoint, "/health", "unset keys keep their defaults");
        let flag =
            GatewayConfig::with_file(yaml, &GatewayConfig::default(), &["cache_threshold".to_string()]);
        assert_eq!(flag.unwrap().routing.cache_threshold, 0.3, "routing flags override too");
        assert_eq!(GatewayConfig::with_file("", &cli, &[]).unwrap(), GatewayConfig::default());
    }

    #[test]
    fn yaml_unknown_keys_and_wrong_types_are_errors() {
        let unknown = GatewayConfig::with_file("prot: 1\n", &GatewayConfig::default(), &[]).unwrap_err();
        assert!(unknown.contains("prot"), "{unknown}");
        let nested =
            GatewayConfig::with_file("routing:\n  cache_treshold: 1\n", &GatewayConfig::default(), &[]);
        assert!(nested.unwrap_err().contains("cache_treshold"));
        let wrong = GatewayConfig::with_file("port: many\n", &GatewayConfig::default(), &[]).unwrap_err();
        assert!(wrong.contains("port"), "{wrong}");
    }

    #[test]
    fn all_errors_reported_at_once() {
        let config = GatewayConfig {
            request_timeout_secs: f64::NAN,
            cb_timeout_duration_secs: f64::INFINITY,
            health_failure_threshold: 0,
            worker_urls: vec!["ftp://x".into()],
            ..GatewayConfig::default()
        };
        let fields: Vec<_> = config.validate().unwrap_err().iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            ["request_timeout_secs", "cb_timeout_duration_secs", "health_failure_threshold", "worker_urls"]
        );
    }

    #[test]
    fn pd_workers_from_flags_and_yaml() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            config: GatewayConfig,
        }
        let cli = Cli::try_parse_from([
            "kvgate",
            "--pd-disaggregation",
            "--prefill",
            "http://127.0.0.1:1",
            "8998",
            "--prefill",
            "http://127.0.0.1:2",
            "--decode",
            "http://127.0.0.1:3",
            "--prefill-policy",
            "cache_aware",
            "--decode-policy",
            "round_robin",
            "--pd-protocol",
            "vllm",
        ])
        .unwrap()
        .config;
        cli.validate().unwrap();
        let workers = cli.initial_workers();
        assert_eq!(workers.len(), 3);
        assert_eq!((workers[0].role, workers[0].bootstrap_port), (WorkerRole::Prefill, Some(8998)));
        assert_eq!((workers[1].role, workers[1].bootstrap_port), (WorkerRole::Prefill, None));
        assert_eq!(workers[2].role, WorkerRole::Decode);
        assert_eq!(cli.pd_protocol, PdProtocol::Vllm);
        let yaml = concat!(
            "pd_disaggregation: true\nprefill:\n  - http://127.0.0.1:1\n",
            "  - [http://127.0.0.1:2, \"8999\"]\n  - {url: \"http://127.0.0.1:4\", bootstrap_port: 9000}\n",
            "decode: [http://127.0.0.1:3]\n"
        );
        let file = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap();
        file.validate().unwrap();
        let ports: Vec<_> = file.initial_workers().iter().map(|w| w.bootstrap_port).collect();
        assert_eq!(ports, [None, Some(8999), Some(9000), None]);
        let bad = GatewayConfig {
            prefill: vec!["http://127.0.0.1:1".into(), "99999".into()],
            decode: vec!["ftp://x".into()],
            ..GatewayConfig::default()
        };
        let fields: Vec<_> = bad.validate().unwrap_err().iter().map(|e| e.field).collect();
        assert_eq!(fields, ["prefill", "decode", "prefill", "decode"]);
    }

    #[test]
    fn the_printed_configuration_reads_back() {
        let config =
            GatewayConfig { port: 31234, api_key: Some("secret".into()), ..GatewayConfig::default() };
        let yaml = config.to_yaml().unwrap();
        assert!(yaml.contains("port: 31234") && !yaml.contains("secret"), "{yaml}");
        let back = GatewayConfig::with_file(&yaml, &GatewayConfig::default(), &[]).unwrap();
        assert_eq!(back.port, 31234);
        assert_eq!(back.routing, config.routing);
    }

    #[test]
    fn models_get_their_own_policy_options() {
        let yaml = "routing:\n  cache_threshold: 0.4\nmodels:\n  llama:\n    policy: CacheAware\n    cache_threshold: 0.7\n  qwen:\n    policy: manual\n";
        let config = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap();
        config.validate().unwrap();
        let llama = config.model_routing("llama").unwrap();
        assert_eq!((llama.policy, llama.cache_threshold), (kvgate_policy::PolicyKind::CacheAware, 0.7));
        let qwen = config.model_routing("qwen").unwrap();
        assert_eq!((qwen.policy, qwen.cache_threshold), (kvgate_policy::PolicyKind::Manual, 0.4));
        assert_eq!(config.model_routing("other").unwrap(), config.routing, "unlisted models take routing:");
        let bad = "models:\n  llama:\n    cache_treshold: 0.7\n  qwen:\n    cache_threshold: 7\n";
        let config = GatewayConfig::with_file(bad, &GatewayConfig::default(), &[]).unwrap();
        let errors: Vec<String> = config.validate().unwrap_err().iter().map(|e| e.to_string()).collect();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].contains("llama") && errors[0].contains("cache_treshold"), "{errors:?}");
        assert!(errors[1].contains("qwen") && errors[1].contains("cache_threshold"), "{errors:?}");
    }

    #[test]
    fn kv_events_endpoints_are_one_per_worker() {
        let urls = vec!["http://127.0.0.1:1".to_string(), "http://127.0.0.1:2".to_string()];
        let good = GatewayConfig {
            worker_urls: urls.clone(),
            kv_events_endpoints: vec!["tcp://127.0.0.1:5557".into(), "-".into()],
            kv_events_replay_endpoints: vec!["tcp://127.0.0.1:5558".into(), "-".into()],
            ..GatewayConfig::default()
        };
        good.validate().unwrap();
        assert_eq!(
            good.kv_events_source(0).unwrap().unwrap().ranks[0].replay.as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        assert_eq!(good.kv_events_source(1).unwrap(), None);
        let bad = GatewayConfig {
            worker_urls: urls,
            kv_events_endpoints: vec!["tcp://*:5557".into()],
            kv_events_replay_endpoints: vec!["-".into(), "-".into()],
            mock_tokenizer: true,
            tokenizer_path: Some("t.json".into()),
            ..GatewayConfig::default()
        };
        let fields: Vec<_> = bad.validate().unwrap_err().iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            ["kv_events_endpoints", "kv_events_replay_endpoints", "kv_events_endpoints", "mock_tokenizer"]
        );
        let yaml = "worker_urls: [http://127.0.0.1:1]\nkv_events_endpoints: [tcp://127.0.0.1:5557]\n\
                    tokenizer_path: /models/m\nrouting:\n  prefix_index: exact\n";
        let file = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap();
        file.validate().unwrap();
        assert_eq!(file.kv_events_source(0).unwrap().unwrap().ranks[0].events, "tcp://127.0.0.1:5557");
        assert_eq!(file.routing.prefix_index, kvgate_policy::PrefixIndexMode::Exact);
        assert_eq!(file.tokenizer_path.as_deref(), Some(std::path::Path::new("/models/m")));
    }
}
