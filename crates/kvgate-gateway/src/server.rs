//! Starting and stopping a gateway: validate the configuration, register the initial workers,
//! build the router, serve, run the background loops, and shut down gracefully.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{delete, get, post};
use axum::Router;
use futures_util::future::join_all;
use kvgate_policy::ValidationErrors;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin;
use crate::listen::{self, Surface};
use kvgate_discovery::{Discovery, DiscoverySettings};
use kvgate_fleet::health::HealthLoop;
use kvgate_fleet::monitor::LoadMonitor;
use kvgate_fleet::registry::{NewWorker, Registry};
use kvgate_gateway_core::clock::Clock;
use kvgate_gateway_core::config::GatewayConfig;
use kvgate_gateway_core::error::ApiError;
use kvgate_observe::alignment::{Alignment, AlignmentSettings};
use kvgate_observe::fleet_view::{self, FleetView};
use kvgate_observe::kv_map::KvMapTask;
use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::role::WorkerRole;
use kvgate_proxy::replica_sync::SyncSettings;
use kvgate_proxy::state::{AppState, SharedState};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ValidationErrors),
    #[error("{0}")]
    State(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
}

/// A running gateway.
pub struct GatewayHandle {
    pub addr: SocketAddr,
    /// The admin listener's address, when it has one (`GatewayConfig::admin_listener`).
    pub admin_addr: Option<SocketAddr>,
    /// The metrics listener's address, with `--prometheus-port`.
    pub metrics_addr: Option<SocketAddr>,
    pub(crate) state: SharedState,
    shutdown: watch::Sender<bool>,
    server: JoinHandle<()>,
    background: Vec<JoinHandle<()>>,
}

impl GatewayHandle {
    /// Reads `--client-api-keys-file` again, as SIGHUP does: its keys are in force for the
    /// next request (requests under way are not disturbed); on an error the keys in use stay.
    /// Returns how many keys are in force.
    pub fn reload_client_keys(&self) -> Result<usize, String> {
        key_reload(&self.state).reload()
    }

    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme(), self.addr)
    }

    fn scheme(&self) -> &'static str {
        if self.state.listener_tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// Where the admin API is: the admin listener, else (with `--admin-api-key`) the main one.
    pub fn admin_url(&self) -> String {
        match self.admin_addr {
            Some(addr) => format!("{}://{addr}", self.scheme()),
            None => self.url(),
        }
    }

    /// Stop accepting, let in-flight requests finish for up to the grace period, stop the loops.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let grace = Duration::from_secs_f64(self.state.config.shutdown_grace_period_secs);
        let server = self.server;
        let abort = server.abort_handle();
        if tokio::time::timeout(grace, server).await.is_err() {
            tracing::warn!(
                grace_secs = grace.as_secs_f64(),
                "grace period over; dropping remaining requests"
            );
            abort.abort();
        }
        for task in self.background {
            task.abort();
        }
        for worker in &self.state.registry.snapshot().workers {
            worker.stop_kv_events();
        }
        if let Some(traces) = self.state.traces.clone() {
            // Sends the spans still buffered (blocking: off the runtime's threads).
            let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
        }
    }
}

/// The read-only endpoints every listener serves.
fn read_only_routes(router: Router<SharedState>) -> Router<SharedState> {
    router
        .route("/health", get(admin::health))
        .route("/readiness", get(admin::readiness))
        .route("/v1/models", get(admin::models))
        .route("/metrics", get(admin::metrics))
        .route("/get_loads", get(admin::get_loads))
}

/// The admin API: worker management, the dry run, and the fleet page with its JSON.
/// Every admin route is behind the browser guard (`browser_guard.rs`).
fn admin_routes(router: Router<SharedState>, state: &SharedState) -> Router<SharedState> {
    let admin = Router::new()
        .route("/workers", get(admin::list_workers).post(admin::add_worker))
        .route("/workers/{*url}", delete(admin::remove_worker))
        .route("/v1/route", post(kvgate_proxy::route_only::route))
        .merge(fleet_routes(state))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), crate::browser_guard::guard));
    router.merge(admin)
}

/// `GET /v1/fleet` and `GET /dashboard`, on the fleet view's narrow handle.
fn fleet_routes(state: &SharedState) -> Router<SharedState> {
    let view = Arc::new(FleetView::new(
        state.registry.clone(),
        state.loads.clone(),
        state.metrics.clone(),
        state.decisions.clone(),
        state.kv_map.clone(),
        state.clock,
        state.config.admin_api_key.clone(),
    ));
    Router::new()
        .route("/v1/fleet", get(fleet_view::fleet))
        .route("/dashboard", get(fleet_view::dashboard))
        .with_state(view)
}

fn not_found(router: Router<SharedState>) -> Router<SharedState> {
    router.fallback(|uri: axum::http::Uri| async move {
        ApiError::NotFound(format!("no route for {}", uri.path()))
    })
}

/// The HTTP routes of the main (traffic) listener: the proxied endpoints, the read-only ones,
/// and the admin API only with `--admin-api-key` (which it then requires); without a key the
/// admin paths say where the admin listener is.
pub(crate) fn router(state: SharedState) -> Router {
    let mut router = read_only_routes(Router::new());
    router = match state.config.admin_api_key {
        Some(_) => admin_routes(router, &state),
        None => {
            let elsewhere = || {
                async move |axum::extract::State(state): axum::extract::State<SharedState>| {
                    let at = state
                        .admin_addr
                        .get()
                        .map_or("no admin listener".to_string(), |addr| format!("http://{addr}"));
                    ApiError::NotFound(format!(
                    "the admin API is not served on this listener: it is on the admin listener ({at}, --admin-host/--admin-port), or here with --admin-api-key"
                ))
                }
            };
            router
                .route("/workers", get(elsewhere()).post(elsewhere()))
                .route("/workers/{*url}", delete(elsewhere()))
                .route("/v1/route", post(elsewhere()))
                .route("/v1/fleet", get(elsewhere()))
                .route("/dashboard", get(elsewhere()))
        }
    };
    for endpoint in Endpoint::ALL {
        router = router.route(
            endpoint.path(),
            post(move |state, request| kvgate_proxy::handle(state, endpoint, request))
                .options(kvgate_proxy::cors::preflight),
        );
    }
    not_found(router).with_state(state)
}

/// The HTTP routes of the admin listener: the admin API (behind the key when one is set) and
/// the read-only endpoints; no proxied traffic.
pub fn admin_router(state: SharedState) -> Router {
    not_found(admin_routes(read_only_routes(Router::new()), &state)).with_state(state)
}

/// Binds the admin listener (`GatewayConfig::admin_listener`), refusing a non-loopback address
/// without an admin key unless `--admin-insecure` says so (then loudly).
async fn bind_admin(config: &GatewayConfig) -> Result<Option<tokio::net::TcpListener>, StartError> {
    let Some((host, port)) = config.admin_listener() else { return Ok(None) };
    let addr = format!("{host}:{port}");
    let bind_error = |source| StartError::Bind { addr: format!("{addr} (the admin listener)"), source };
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    if !bound.ip().is_loopback() && config.admin_api_key.is_none() {
        if !config.admin_insecure {
            let error = kvgate_config::FieldError::new(
                "admin_host",
                format!(
                    "binds {bound}, not a loopback address: give admin_api_key (or admin_insecure to serve the admin API to anyone who reaches it)"
                ),
            );
            return Err(StartError::Config(error.into()));
        }
        tracing::warn!(
            addr = %bound,
            "--admin-insecure: the admin API is served WITHOUT A KEY on a non-loopback address; anyone \
             who reaches it can add workers, which then receive clients' prompts"
        );
    }
    Ok(Some(listener))
}

/// Connections the admin listener takes at once (its own, so a full traffic listener leaves it
/// reachable).
const ADMIN_CONNECTIONS: usize = 256;

/// Validate, bind, register the initial workers and serve in the background.
pub async fn start(config: GatewayConfig) -> Result<GatewayHandle, StartError> {
    config.validate().map_err(StartError::Config)?;
    let addr = format!("{}:{}", config.host, config.port);
    let io_threads = config.io_thread_count();
    let listeners = listen::bind(&addr, io_threads)
        .await
        .map_err(|source| StartError::Bind { addr: addr.clone(), source })?;
    let local_addr =
        listeners[0].local_addr().map_err(|source| StartError::Bind { addr: addr.clone(), source })?;
    let admin_listener = bind_admin(&config).await?;
    let metrics_listener = crate::metrics_listener::bind(&config)
        .await
        .map_err(|(addr, source)| StartError::Bind { addr, source })?;
    let state: SharedState = Arc::new(AppState::new(config).map_err(StartError::State)?);
    let _ = state.listen_addr.set(local_addr);
    // Every listener is the gateway's own address, before any worker is registered.
    if let Some(addr) = metrics_listener.as_ref().and_then(|listener| listener.local_addr().ok()) {
        let _ = state.metrics_addr.set(addr);
    }
    let admin_addr = match &admin_listener {
        Some(listener) => {
            Some(listener.local_addr().map_err(|source| StartError::Bind { addr: addr.clone(), source })?)
        }
        None => None,
    };
    if let Some(admin_addr) = admin_addr {
        let _ = state.admin_addr.set(admin_addr);
    }

    let initial: Vec<_> = state
        .config
        .initial_workers()
        .into_iter()
        .enumerate()
        .map(|(index, worker)| {
            let source = state.config.kv_events_source(index).expect("validated with the configuration");
            let new = NewWorker {
                url: worker.url,
                model: None,
                role: worker.role,
                bootstrap_port: worker.bootstrap_port,
                kv_events: source,
                policy: None,
                dp_rank: None,
            };
            let registration = state.registration.clone();
            async move { registration.register(new).await }
        })
        .collect();
    for result in join_all(initial).await {
        if let Err(error) = result {
            tracing::warn!(%error, "initial worker not registered");
        }
    }

    if state.tokenization.is_none()
        && state.config.kv_events_endpoints.iter().any(|e| e != kvgate_gateway_core::config::NO_ENDPOINT)
    {
        tracing::warn!(
            "KV events are configured but no tokenizer (--tokenizer-path): only requests that carry \
             token ids (/generate input_ids) can be matched against the exact index"
        );
    }
    if let Some(tokenization) = &state.tokenization {
        match tokenization.tokenizer().segment_cache_status() {
            kvgate_tokenizer::SegmentCacheStatus::Unsupported { reason } => tracing::warn!(
                %reason,
                "the tokenizer's segment cache is off: every request is tokenized whole"
            ),
            status => tracing::info!(?status, "tokenizer loaded"),
        }
        if let Some(format) = tokenization.tokenizer().chat_content_format() {
            tracing::info!(
                format = format.as_str(),
                "chat template content format (as vLLM's --chat-template-content-format {})",
                state.config.chat_template_content_format.as_str()
            );
        }
    }
    let discovery = match DiscoverySettings::from_config(&state.config) {
        Some(settings) => {
            let client = settings.client().await.map_err(|e| StartError::State(e.to_string()))?;
            Some((settings, client))
        }
        None => None,
    };
    let (shutdown, shutdown_rx) = watch::channel(false);
    let mut background = spawn_background(&state, discovery, &shutdown_rx);
    if let Some(listener) = admin_listener {
        let slots = Arc::new(tokio::sync::Semaphore::new(ADMIN_CONNECTIONS));
        let admin = listen::serve(
            listener,
            state.clone(),
            admin_router(state.clone()),
            shutdown_rx.clone(),
            slots,
            Surface::Admin,
        );
        background.push(tokio::spawn(admin));
    }
    let metrics_addr = match metrics_listener {
        Some(listener) => {
            let (metrics_addr, serving) =
                crate::metrics_listener::serve(listener, &state, shutdown_rx.clone())
                    .map_err(|source| StartError::Bind { addr: "the metrics listener".into(), source })?;
            background.push(tokio::spawn(serving));
            tracing::info!(%metrics_addr, "metrics listening (/metrics)");
            Some(metrics_addr)
        }
        None => None,
    };
    let server = if io_threads == 0 {
        let slots = listen::connection_slots(&state);
        let listener = listeners.into_iter().next().expect("one listener was bound");
        tokio::spawn(listen::serve(
            listener,
            state.clone(),
            router(state.clone()),
            shutdown_rx,
            slots,
            Surface::Traffic,
        ))
    } else {
        listen::spawn_io_threads(listeners, state.clone(), router(state.clone()), shutdown_rx)
            .map_err(|source| StartError::Bind { addr, source })?
    };
    if state.config.pd_disaggregation {
        let config = &state.config;
        tracing::info!(
            addr = %local_addr,
            protocol = config.pd_protocol.as_str(),
            prefill_policy = state.registry.policy_config("", WorkerRole::Prefill).policy.as_str(),
            decode_policy = state.registry.policy_config("", WorkerRole::Decode).policy.as_str(),
            "kvgate listening (prefill/decode disaggregation)"
        );
    } else {
        tracing::info!(addr = %local_addr, policy = state.config.routing.policy.as_str(), "kvgate listening");
    }
    match admin_addr {
        Some(admin) => tracing::info!(%admin, "admin API listening"),
        None => tracing::info!(addr = %local_addr, "admin API on the main listener, behind --admin-api-key"),
    }
    Ok(GatewayHandle { addr: local_addr, admin_addr, metrics_addr, state, shutdown, server, background })
}

/// Builds each background loop from the parts of `state` it needs (never the whole state) and
/// spawns it: the health loop, the policies' maintenance, the load monitor, and replica sync and
/// discovery when they are on.
fn spawn_background(
    state: &AppState,
    discovery: Option<(DiscoverySettings, kvgate_discovery::Client)>,
    shutdown: &watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let config = &state.config;
    let health = HealthLoop {
        registry: state.registry.clone(),
        loads: state.loads.clone(),
        check: state.health_check.clone(),
        metrics: state.metrics.clone(),
        interval: Duration::from_secs_f64(config.health_check_interval_secs),
        failure_threshold: config.health_failure_threshold,
        success_threshold: config.health_success_threshold,
        probes_disabled: config.disable_health_check,
    };
    let monitor = LoadMonitor {
        registry: state.registry.clone(),
        loads: state.loads.clone(),
        upstream: state.health_check.upstream.clone(),
        bearer: config.api_key.clone(),
        health_timeout: state.health_check.timeout,
        clock: state.clock,
        metrics: state.metrics.loads.clone(),
        max_answer_bytes: config.max_probe_answer_bytes,
        oversized: state.metrics.oversized_answers.clone(),
        always_poll: state.overload.enabled(),
    };
    let alignment = Alignment {
        registry: state.registry.clone(),
        tokenization: state.tokenization.clone(),
        client: state.client.clone(),
        bearer: config.api_key.clone(),
        metrics: state.metrics.clone(),
        kv_map: state.kv_map.clone(),
        clock: state.clock,
        settings: AlignmentSettings {
            probe: config.alignment_probe,
            interval: Duration::from_secs_f64(config.alignment_probe_interval_secs),
            repair: config.index_repair,
            max_tokenize_chars: config.max_tokenize_chars,
        },
    };
    let kv_map = KvMapTask {
        map: state.kv_map.clone(),
        registry: state.registry.clone(),
        metrics: state.metrics.clone(),
        tenants: config.tenants.clone(),
        clock: state.clock,
    };
    let mut background = vec![
        tokio::spawn(health.run(shutdown.clone())),
        tokio::spawn(alignment.run(shutdown.clone())),
        tokio::spawn(kv_map.run(shutdown.clone())),
        tokio::spawn(maintain_policies(state.registry.clone(), state.clock, shutdown.clone())),
        tokio::spawn(monitor.run(shutdown.clone())),
    ];
    #[cfg(unix)]
    if config.client_api_keys_file.is_some() {
        // Listening before start returns, so a SIGHUP right after start never finds the default
        // action (ending the process) in place.
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(hangup) => {
                background.push(tokio::spawn(key_reload(state).on_sighup(hangup, shutdown.clone())))
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGHUP: the client keys file is read at start only")
            }
        }
    }
    if let (Some(sync), Some(redis_url)) = (&state.replica_sync, &config.replica_sync_redis_url) {
        let settings = SyncSettings {
            redis_url: redis_url.clone(),
            channel: config.replica_sync_channel.clone(),
            interval_ms: config.replica_sync_interval_ms,
        };
        background.push(tokio::spawn(kvgate_proxy::replica_sync::run(
            sync.clone(),
            state.registry.clone(),
            settings,
            shutdown.clone(),
        )));
    }
    if let Some((settings, client)) = discovery {
        let discovery = Discovery {
            registration: state.registration.clone(),
            events: state.metrics.discovery_events.clone(),
            pd_disaggregation: config.pd_disaggregation,
        };
        background.push(kvgate_discovery::spawn(discovery, client, settings, shutdown.clone()));
    }
    background
}

/// Reloading `--client-api-keys-file`: the keys, the tenants' series, the reload counter.
struct KeyReload {
    clients: Arc<kvgate_gateway_core::auth::Clients>,
    admission: Arc<kvgate_admission::Admission>,
    reloads: prometheus::IntCounterVec,
}

fn key_reload(state: &AppState) -> KeyReload {
    KeyReload {
        clients: state.clients.clone(),
        admission: state.admission.clone(),
        reloads: state.metrics.admission.client_keys_reloads.clone(),
    }
}

impl KeyReload {
    /// Reads the key file again; on an error the keys in use stay (logged, counted).
    fn reload(&self) -> Result<usize, String> {
        match self.clients.reload() {
            Ok(count) => {
                let tenants = self.clients.tenants();
                self.admission.name_tenants(tenants.iter().map(String::as_str));
                self.reloads.with_label_values(&["ok"]).inc();
                tracing::info!(keys = count, "client keys reloaded");
                Ok(count)
            }
            Err(message) => {
                self.reloads.with_label_values(&["error"]).inc();
                tracing::error!(%message, "client keys not reloaded: the keys in use stay");
                Err(message)
            }
        }
    }

    /// Reloads on every SIGHUP until shutdown.
    #[cfg(unix)]
    async fn on_sighup(self, mut hangup: tokio::signal::unix::Signal, mut shutdown: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = hangup.recv() => {
                    let _ = self.reload();
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// Each worker's idle connections are swept every this many seconds, a share of the fleet each
/// second (a connection is never reused past its idle timeout anyway; sweeping every worker's 16
/// shards each second was a tenth of an idle 10,000-worker gateway's CPU).
const SWEEP_EVERY_SECS: usize = 10;

/// Once a second: the policies' maintenance (prefix-tree eviction) on the gateway's clock, and
/// closing idle upstream connections that expired or were closed by their worker (each worker's
/// every `SWEEP_EVERY_SECS`).
async fn maintain_policies(registry: Arc<Registry>, clock: Clock, mut shutdown: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for second in 0usize.. {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shutdown.changed() => return,
        }
        let now_ms = clock.now_ms();
        let snapshot = registry.snapshot();
        for pool in snapshot.pools() {
            pool.policy.maintain(now_ms);
            pool.prefix.tree.maintain(now_ms);
        }
        let now = std::time::Instant::now();
        for worker in snapshot.workers.iter().skip(second % SWEEP_EVERY_SECS).step_by(SWEEP_EVERY_SECS) {
            worker.conns.sweep(now);
        }
    }
}

/// Run until SIGINT/SIGTERM, then shut down gracefully.
pub async fn run(config: GatewayConfig) -> Result<(), StartError> {
    let handle = start(config).await?;
    shutdown_signal().await;
    tracing::info!("shutting down: no new connections, waiting for in-flight requests");
    handle.shutdown().await;
    Ok(())
}

/// Resolves on the first SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
}
