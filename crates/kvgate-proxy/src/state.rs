//! The assembled state of a running gateway: configuration, registry, metrics, clients and the
//! load snapshot, built once at startup from the configuration. Each subsystem is built from the
//! few of these parts it needs (`server.rs` hands them over); the request path and the admin
//! endpoints read the whole.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::HeaderValue;
use kvgate_tokenizer::{Tokenizer, TokenizerOptions};

use crate::replica_sync::{ReplicaSync, SyncLimits};
use kvgate_admission::{Admission, Limits};
use kvgate_fleet::kv_events::{KvEventLimits, KvEvents};
use kvgate_fleet::load_snapshot::LoadSnapshot;
use kvgate_fleet::registration::{OwnAddress, Registration};
use kvgate_fleet::registry::Registry;
use kvgate_fleet::tokenize::Tokenization;
use kvgate_fleet::worker::CircuitSettings;
use kvgate_gateway_core::auth::Clients;
use kvgate_gateway_core::clock::Clock;
use kvgate_gateway_core::config::GatewayConfig;
use kvgate_gateway_core::decisions::DecisionLog;
use kvgate_gateway_core::metrics::Metrics;
use kvgate_gateway_core::otel::Traces;
use kvgate_gateway_core::upstream::{build_client, HealthCheck, HttpClient, Upstream};
use kvgate_gateway_core::worker_url::AllowList;
use kvgate_observe::kv_map::KvMap;

pub struct AppState {
    pub config: GatewayConfig,
    pub registry: Arc<Registry>,
    /// Registering and removing workers (the registry's operations).
    pub registration: Arc<Registration>,
    pub metrics: Arc<Metrics>,
    /// The background loops' client (health checks, model discovery, load polls).
    pub client: HttpClient,
    /// Health probes and model discovery with the workers' key and the health timeout.
    pub health_check: HealthCheck,
    /// The latest engine loads by worker, published by the load monitor.
    pub loads: Arc<LoadSnapshot>,
    /// The clock handed to policies and stamped on load samples.
    pub clock: Clock,
    /// Per-worker overload protection (`--worker-overload-*`), applied to every decision.
    pub overload: kvgate_policy::OverloadSettings,
    pub admission: Arc<Admission>,
    /// The client keys (reloaded on SIGHUP) and the tenant and priority headers.
    pub clients: Arc<Clients>,
    pub api_key_header: Option<HeaderValue>,
    pub request_timeout: Duration,
    /// How long a worker may take to send its response head before another is tried.
    pub ttfb_timeout: Option<Duration>,
    /// The header carrying a request's session key (validated with the configuration).
    pub routing_key_header: http::HeaderName,
    /// Turns requests into the engines' token ids, for the exact index (when configured), on
    /// threads of its own.
    pub tokenization: Option<Arc<Tokenization>>,
    /// This gateway's random id in the `x-kvgate-via` hop header (loop detection).
    pub instance: HeaderValue,
    /// The address the gateway listens on (set once bound): never registered as a worker.
    pub listen_addr: Arc<OnceLock<SocketAddr>>,
    /// The admin listener's address, when it has one (set once bound).
    pub admin_addr: Arc<OnceLock<SocketAddr>>,
    /// The metrics listener's address (`--prometheus-port`), when it has one (set once bound).
    pub metrics_addr: Arc<OnceLock<SocketAddr>>,
    /// The listener's TLS (`tls_cert_path`): set when the gateway serves HTTPS.
    pub listener_tls: Option<tokio_rustls::TlsAcceptor>,
    /// TLS to `https://` workers: the trusted CAs and the client certificate.
    pub upstream_tls: tokio_rustls::TlsConnector,
    /// Sharing approximate routing with the other replicas (`--replica-sync-redis-url`).
    pub replica_sync: Option<Arc<ReplicaSync>>,
    /// The last live routing decisions (`GET /v1/fleet`).
    pub decisions: Arc<DecisionLog>,
    /// The fleet's KV mapped off the request path (`GET /v1/fleet`, tenants' KV shares).
    pub kv_map: Arc<KvMap>,
    /// OpenTelemetry traces (`--otlp-traces-endpoint`); None: off.
    pub traces: Option<Arc<Traces>>,
}

impl AppState {
    /// Build the state from a validated configuration.
    pub fn new(config: GatewayConfig) -> Result<Self, String> {
        let metrics = Arc::new(Metrics::new());
        let circuit = CircuitSettings {
            enabled: !config.disable_circuit_breaker,
            failure_threshold: config.cb_failure_threshold,
            open_duration: Duration::from_secs_f64(config.cb_timeout_duration_secs),
        };
        let api_key_header = match &config.api_key {
            Some(key) => Some(
                HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| "api_key contains characters not allowed in an HTTP header".to_string())?,
            ),
            None => None,
        };
        let tokenizer = match (&config.tokenizer_path, config.mock_tokenizer) {
            (Some(path), _) => Some(
                Tokenizer::from_path_with_options(
                    path,
                    config.chat_template.as_deref(),
                    &TokenizerOptions {
                        content_format: config.chat_template_content_format,
                        ..TokenizerOptions::default()
                    },
                )
                .map_err(|e| format!("loading the tokenizer: {e}"))?,
            ),
            (None, true) => Some(match &config.chat_template {
                Some(template) => Tokenizer::mock_with_chat_template(template)
                    .map_err(|e| format!("loading the chat template: {e}"))?,
                None => Tokenizer::mock(),
            }),
            (None, false) => None,
        };
        let tokenization = match tokenizer {
            Some(tokenizer) => Some(Arc::new(Tokenization::new(
                tokenizer,
                config.tokenizer_thread_count(),
                (
                    config.tokenizer_queue_size,
                    Duration::try_from_secs_f64(config.tokenizer_queue_timeout_secs).unwrap_or(Duration::MAX),
                ),
                config.max_tokenize_chars,
                metrics.clone(),
            )?)),
            None => None,
        };
        // The exporter's blocking HTTP client is made outside any async runtime.
        let traces = match config.otlp_traces_endpoint.clone() {
            Some(endpoint) => Some(Arc::new({
                let metrics = metrics.otlp.clone();
                std::thread::spawn(move || Traces::new(&endpoint, metrics))
                    .join()
                    .map_err(|_| "building the OTLP traces exporter panicked".to_string())??
            })),
            None => None,
        };
        let upstream_tls = kvgate_gateway_core::tls::upstream_connector(&config)?;
        let client = build_client(upstream_tls.clone());
        let replica_sync = match (&config.replica_sync_redis_url, &config.replica_sync_secret) {
            (Some(_), Some(secret)) => {
                let limits = SyncLimits {
                    max_message_bytes: config.replica_sync_max_message_bytes,
                    max_hashes_per_record: config.replica_sync_max_hashes_per_record,
                    max_peers: config.replica_sync_max_peers,
                    max_peer_in_flight: config.replica_sync_max_peer_in_flight,
                    max_age: Duration::from_millis(config.replica_sync_max_age_ms),
                };
                let oversized = metrics.oversized_answers.with_label_values(&["replica_sync"]);
                let sync =
                    ReplicaSync::new(metrics.replica_sync.clone(), oversized, secret.as_bytes(), limits);
                Some(Arc::new(sync))
            }
            _ => None,
        };
        let registry = Arc::new(Registry::new(
            config.routing.clone(),
            config
                .models
                .keys()
                .map(|model| Ok((model.clone(), config.model_routing(model)?)))
                .collect::<Result<_, String>>()?,
            [config.prefill_policy, config.decode_policy],
            circuit,
            metrics.clone(),
            config.replica_sync_max_blocks,
            config.max_workers,
        ));
        let loads = Arc::new(LoadSnapshot::with_orders(config.load_poll_interval_ms(), registry.orders()));
        let health_check = HealthCheck {
            upstream: Upstream { client: client.clone(), tls: upstream_tls.clone() },
            endpoint: config.health_check_endpoint.clone(),
            bearer: config.api_key.clone(),
            timeout: Duration::from_secs_f64(config.health_check_timeout_secs),
            max_answer_bytes: config.max_probe_answer_bytes,
            oversized: metrics.oversized_answers.clone(),
        };
        let listen_addr = Arc::new(OnceLock::new());
        let admin_addr = Arc::new(OnceLock::new());
        let metrics_addr = Arc::new(OnceLock::new());
        let registration = Arc::new(Registration {
            registry: registry.clone(),
            loads: loads.clone(),
            check: health_check.clone(),
            probes_disabled: config.disable_health_check,
            dp_aware: config.dp_aware,
            kv_events: KvEvents {
                registry: registry.clone(),
                loads: loads.clone(),
                metrics: metrics.kv_events.clone(),
                oversized: metrics.oversized_answers.clone(),
                topic: config.kv_events_topic.clone(),
                limits: KvEventLimits {
                    max_message_bytes: config.kv_events_max_message_bytes,
                    max_blocks_per_worker: config.kv_index_max_blocks_per_worker,
                    capacity_slack: config.kv_index_capacity_slack,
                },
            },
            own_address: OwnAddress {
                listen: listen_addr.clone(),
                admin: admin_addr.clone(),
                metrics: metrics_addr.clone(),
            },
            allow: AllowList::new(&config.worker_url_allow)?,
        });
        let clients = Arc::new(Clients::new(
            &config.client_api_keys,
            config.client_api_keys_file.as_deref(),
            &config.tenant_header,
            &config.priority_header,
        )?);
        let limits = Limits {
            max_concurrent: config.max_concurrent_requests,
            rate_per_sec: config.rate_limit_tokens_per_second,
            queue_size: config.queue_size,
            queue_timeout: Duration::from_secs_f64(config.queue_timeout_secs),
            locality_bound: config.fairness_locality_bound,
        };
        let kv_map = Arc::new(KvMap::default());
        let admission = Arc::new(Admission::new(
            limits,
            config.tenants.clone(),
            metrics.admission.clone(),
            kv_map.clone(),
        ));
        admission.name_tenants(clients.tenants().iter().map(String::as_str));
        Ok(Self {
            tokenization,
            registry,
            registration,
            admission,
            clients,
            metrics,
            client,
            health_check,
            listener_tls: kvgate_gateway_core::tls::listener_acceptor(&config)?,
            upstream_tls,
            loads,
            clock: Clock::start(),
            overload: config.overload_settings(),
            api_key_header,
            request_timeout: Duration::from_secs_f64(config.request_timeout_secs),
            ttfb_timeout: config.ttfb_timeout_secs.map(Duration::from_secs_f64),
            routing_key_header: http::HeaderName::from_bytes(config.routing_key_header.as_bytes())
                .map_err(|_| format!("invalid routing_key_header {:?}", config.routing_key_header))?,
            instance: HeaderValue::from_str(&format!("{:016x}", rand::random::<u64>()))
                .expect("hex digits are a valid header value"),
            listen_addr,
            admin_addr,
            metrics_addr,
            replica_sync,
            decisions: Arc::new(DecisionLog::default()),
            kv_map,
            traces,
            config,
        })
    }
}

pub type SharedState = Arc<AppState>;
