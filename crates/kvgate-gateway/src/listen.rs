//! The accept loop: HTTP/1 connections (plain, or TLS when the listener has a certificate) served
//! by hyper, proxied endpoints dispatched straight to the proxy (no router, no boxed body),
//! everything else through the axum router, and a graceful stop that lets open requests finish.
//!
//! Client connections are bounded: at most `max_connections` at once (one more is closed as soon
//! as it is accepted), and each must send its request heads in time and not idle past the
//! keep-alive timeout (`limits.rs`).

mod limits;
mod threads;

pub use threads::{bind, spawn_io_threads};

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use self::limits::{with_deadlines, Activity, ActivityIo, ClientLimits, GuardedBody};
use kvgate_protocol::endpoint::Endpoint;
use kvgate_proxy::state::SharedState;

/// At most one warning per this interval while connections are refused at the limit.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// One connection's service: the state for the proxy, the router for the rest, and the
/// connection's activity (each request is in progress until its response body is dropped).
struct GatewayService {
    state: SharedState,
    router: Router,
    activity: Arc<Activity>,
    /// Proxied endpoints are served (the traffic listener), or left to the router (the admin
    /// listener, whose router has none).
    proxied: bool,
}

/// What a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// Clients' traffic: the proxied endpoints and the router's.
    Traffic,
    /// The admin listener: its router only.
    Admin,
}

impl hyper::service::Service<Request<Incoming>> for GatewayService {
    type Response = Response<GuardedBody<Body>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let guard = self.activity.begin();
        if self.proxied && request.method() == Method::POST {
            if let Some(endpoint) = Endpoint::from_path(request.uri().path()) {
                let state = self.state.clone();
                return Box::pin(async move {
                    let response = kvgate_proxy::serve(state, endpoint, request).await;
                    Ok(response.map(|body| GuardedBody::new(body, guard)))
                });
            }
        }
        let routed = self.router.clone().oneshot(request);
        Box::pin(async move {
            let response = match routed.await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            Ok(response.map(|body| GuardedBody::new(body, guard)))
        })
    }
}

/// What every connection task shares.
struct Shared {
    state: SharedState,
    router: Router,
    http: hyper::server::conn::http1::Builder,
    limits: ClientLimits,
    surface: Surface,
}

/// A connection's place under `max_connections`, counted in `kvgate_client_connections`.
struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: IntGauge,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, gauge: &IntGauge) -> Self {
        gauge.inc();
        Self { _permit: permit, gauge: gauge.clone() }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// The `max_connections` slots, shared by every listener of the gateway.
pub fn connection_slots(state: &SharedState) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(state.config.max_connections))
}

/// Serve `listener` until `stop` turns true, then stop accepting and wait for open connections
/// to finish their requests (the caller bounds that wait with the grace period).
pub async fn serve(
    listener: TcpListener,
    state: SharedState,
    router: Router,
    mut stop: watch::Receiver<bool>,
    slots: Arc<Semaphore>,
    surface: Surface,
) {
    let max_connections = state.config.max_connections;
    let tls = state.listener_tls.clone();
    let shared = Arc::new(Shared {
        limits: ClientLimits::new(&state.config),
        http: hyper::server::conn::http1::Builder::new(),
        state,
        router,
        surface,
    });
    let graceful = GracefulShutdown::new();
    let mut last_refusal_log: Option<std::time::Instant> = None;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stopping| *stopping) => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors and the like: back off instead of spinning.
                if !matches!(
                    error.kind(),
                    std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                ) {
                    tracing::error!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(stream);
            if last_refusal_log.is_none_or(|at| at.elapsed() >= REFUSAL_LOG_INTERVAL) {
                tracing::warn!(max_connections, "client connections refused: max_connections are open");
                last_refusal_log = Some(std::time::Instant::now());
            }
            continue;
        };
        let slot = Slot::new(permit, &shared.state.metrics.client_connections);
        let first_head_by = tokio::time::Instant::now() + shared.limits.header_read;
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_client(
            stream,
            tls.clone(),
            shared.clone(),
            graceful.watcher(),
            first_head_by,
            slot,
        ));
    }
    drop(listener);
    graceful.shutdown().await;
}

/// One client connection: the TLS handshake if any (due with the first request head), then
/// HTTP/1 until the client leaves, misses a deadline, or the gateway stops.
async fn serve_client(
    stream: TcpStream,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
    watcher: Watcher,
    first_head_by: tokio::time::Instant,
    _slot: Slot,
) {
    let Some(acceptor) = tls else {
        return serve_http(stream, &shared, watcher, first_head_by).await;
    };
    match tokio::time::timeout_at(first_head_by, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => serve_http(stream, &shared, watcher, first_head_by).await,
        Ok(Err(error)) => tracing::debug!(%error, "TLS handshake with a client failed"),
        Err(_) => tracing::debug!("client closed: TLS handshake not finished in time"),
    }
}

async fn serve_http<S>(io: S, shared: &Shared, watcher: Watcher, first_head_by: tokio::time::Instant)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Activity::new();
    let service = GatewayService {
        state: shared.state.clone(),
        router: shared.router.clone(),
        activity: activity.clone(),
        proxied: shared.surface == Surface::Traffic,
    };
    let io = TokioIo::new(ActivityIo::new(io, activity.clone()));
    let connection = watcher.watch(shared.http.serve_connection(io, service));
    match with_deadlines(connection, &activity, shared.limits, first_head_by).await {
        Some(Ok(())) => {}
        Some(Err(error)) => tracing::trace!(%error, "connection ended with an error"),
        None => {
            tracing::debug!("client closed: no request head in time, or idle past the keep-alive timeout")
        }
    }
}
