//! The metrics listener (`--prometheus-host`, `--prometheus-port`, SMG's names): `GET /metrics`
//! and `GET /health` on a port of their own, so a Prometheus scrape config written for SMG works
//! unchanged. `/metrics` stays on the main listener too.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::admin;
use crate::listen::{self, Surface};
use kvgate_gateway_core::config::GatewayConfig;
use kvgate_proxy::state::SharedState;

/// Connections the metrics listener takes at once (scrapers are few).
const METRICS_CONNECTIONS: usize = 64;

/// Binds the metrics listener when `--prometheus-port` is given; an error names the address.
pub(crate) async fn bind(config: &GatewayConfig) -> Result<Option<TcpListener>, (String, std::io::Error)> {
    let Some(port) = config.prometheus_port else { return Ok(None) };
    let addr = format!("{}:{port}", config.prometheus_host);
    match TcpListener::bind(&addr).await {
        Ok(listener) => Ok(Some(listener)),
        Err(error) => Err((format!("{addr} (the metrics listener)"), error)),
    }
}

/// The metrics listener's routes.
fn router(state: SharedState) -> Router {
    Router::new()
        .route("/metrics", get(admin::metrics))
        .route("/health", get(admin::health))
        .with_state(state)
}

/// Serves the metrics listener until `shutdown`; returns its address.
pub(crate) fn serve(
    listener: TcpListener,
    state: &SharedState,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<(SocketAddr, impl std::future::Future<Output = ()> + Send + 'static)> {
    let addr = listener.local_addr()?;
    let slots = Arc::new(tokio::sync::Semaphore::new(METRICS_CONNECTIONS));
    let serving =
        listen::serve(listener, state.clone(), router(state.clone()), shutdown, slots, Surface::Admin);
    Ok((addr, serving))
}
