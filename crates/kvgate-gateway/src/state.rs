//! The shared state of a running gateway: configuration, registry, metrics, client and the load
//! snapshot, built once at startup and handed to every handler and background task.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::HeaderValue;
use kvgate_policy::{LoadSample, WorkerId};
use kvgate_tokenizer::Tokenizer;

use crate::config::GatewayConfig;
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::upstream::{build_client, HttpClient};
use crate::worker::CircuitSettings;

pub struct AppState {
    pub config: GatewayConfig,
    pub registry: Registry,
    pub metrics: Arc<Metrics>,
    pub client: HttpClient,
    /// The latest engine loads by worker, published by the load monitor.
    pub loads: ArcSwap<HashMap<WorkerId, LoadSample>>,
    pub load_poll_interval_ms: u64,
    /// Whether the load monitor polled in its last round (some policy consumes loads).
    pub monitor_active: std::sync::atomic::AtomicBool,
    pub admission: crate::admission::Admission,
    pub api_key_header: Option<HeaderValue>,
    pub request_timeout: Duration,
    /// How long a worker may take to send its response head before another is tried.
    pub ttfb_timeout: Option<Duration>,
    /// The header carrying a request's session key (validated with the configuration).
    pub routing_key_header: http::HeaderName,
    /// Turns requests into the engines' token ids, for the exact index (when configured), on
    /// its own threads.
    pub(crate) tokenization: Option<crate::tokenize::Tokenization>,
    /// This gateway's random id in the `x-kvgate-via` hop header (loop detection).
    pub instance: HeaderValue,
    /// The address the gateway listens on (set once bound): never registered as a worker.
    pub listen_addr: std::sync::OnceLock<std::net::SocketAddr>,
    /// The listener's TLS (`tls_cert_path`): set when the gateway serves HTTPS.
    pub listener_tls: Option<tokio_rustls::TlsAcceptor>,
    /// TLS to `https://` workers: the trusted CAs and the client certificate.
    pub upstream_tls: tokio_rustls::TlsConnector,
    /// Sharing approximate routing with the other replicas (`--replica-sync-redis-url`).
    pub replica_sync: Option<Arc<crate::replica_sync::ReplicaSync>>,
    started: Instant,
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
                Tokenizer::from_path(path, config.chat_template.as_deref())
                    .map_err(|e| format!("loading the tokenizer: {e}"))?,
            ),
            (None, true) => Some(Tokenizer::mock()),
            (None, false) => None,
        };
        let tokenization = match tokenizer {
            Some(tokenizer) => Some(crate::tokenize::Tokenization::new(
                tokenizer,
                config.tokenizer_thread_count(),
                config.tokenizer_queue_size,
                config.max_tokenize_chars,
                metrics.clone(),
            )?),
            None => None,
        };
        let upstream_tls = crate::tls::upstream_connector(&config)?;
        let replica_sync = match (&config.replica_sync_redis_url, &config.replica_sync_secret) {
            (Some(_), Some(secret)) => {
                let limits = crate::replica_sync::SyncLimits {
                    max_message_bytes: config.replica_sync_max_message_bytes,
                    max_hashes_per_record: config.replica_sync_max_hashes_per_record,
                    max_peers: config.replica_sync_max_peers,
                    max_peer_in_flight: config.replica_sync_max_peer_in_flight,
                    max_age: Duration::from_millis(config.replica_sync_max_age_ms),
                };
                let sync = crate::replica_sync::ReplicaSync::new(
                    metrics.replica_sync.clone(),
                    secret.as_bytes(),
                    limits,
                );
                Some(Arc::new(sync))
            }
            _ => None,
        };
        Ok(Self {
            tokenization,
            registry: Registry::new(
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
            ),
            admission: crate::admission::Admission::new(
                config.max_concurrent_requests,
                config.rate_limit_tokens_per_second,
                config.queue_size,
                Duration::from_secs_f64(config.queue_timeout_secs),
                metrics.clone(),
            ),
            metrics,
            client: build_client(upstream_tls.clone()),
            listener_tls: crate::tls::listener_acceptor(&config)?,
            upstream_tls,
            loads: ArcSwap::from_pointee(HashMap::new()),
            load_poll_interval_ms: config.load_poll_interval_ms(),
            monitor_active: std::sync::atomic::AtomicBool::new(false),
            api_key_header,
            request_timeout: Duration::from_secs_f64(config.request_timeout_secs),
            ttfb_timeout: config.ttfb_timeout_secs.map(Duration::from_secs_f64),
            routing_key_header: http::HeaderName::from_bytes(config.routing_key_header.as_bytes())
                .map_err(|_| format!("invalid routing_key_header {:?}", config.routing_key_header))?,
            instance: HeaderValue::from_str(&format!("{:016x}", rand::random::<u64>()))
                .expect("hex digits are a valid header value"),
            listen_addr: std::sync::OnceLock::new(),
            replica_sync,
            started: Instant::now(),
            config,
        })
    }

    /// Milliseconds since the gateway started: the clock handed to policies.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    pub fn health_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.config.health_check_timeout_secs)
    }
}

pub type SharedState = Arc<AppState>;
