//! The accept loop: HTTP/1 connections served by hyper, proxied endpoints dispatched straight to
//! the proxy (no router, no boxed body), everything else through the axum router, and a graceful
//! stop that lets open requests finish.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::response::Response;
use axum::Router;
use http::{Method, Request};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;

use crate::proxy::{self, Endpoint};
use crate::state::SharedState;

/// One connection's service: the state for the proxy, the router for the rest.
#[derive(Clone)]
struct GatewayService {
    state: SharedState,
    router: Router,
}

impl hyper::service::Service<Request<Incoming>> for GatewayService {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        if request.method() == Method::POST {
            if let Some(endpoint) = Endpoint::from_path(request.uri().path()) {
                let state = self.state.clone();
                return Box::pin(async move { Ok(proxy::serve(state, endpoint, request).await) });
            }
        }
        Box::pin(self.router.clone().oneshot(request))
    }
}

/// Serve `listener` until `stop` turns true, then stop accepting and wait for open connections
/// to finish their requests (the caller bounds that wait with the grace period).
pub async fn serve(
    listener: TcpListener,
    state: SharedState,
    router: Router,
    mut stop: watch::Receiver<bool>,
) {
    let service = GatewayService { state, router };
    let http = hyper::server::conn::http1::Builder::new();
    let graceful = GracefulShutdown::new();
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
        let _ = stream.set_nodelay(true);
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service.clone()));
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::trace!(%error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
