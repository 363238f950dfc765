//! The pooled HTTP client of the background loops (health checks, model discovery, load polls)
//! and their small GET helpers. Proxied requests use `conn.rs` instead. Both reach `https://`
//! workers with the same TLS settings (`tls.rs`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderName, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio_rustls::TlsConnector;

use crate::tls::{self, WorkerStream};

pub type HttpClient = Client<WorkerConnector, Full<Bytes>>;

/// One client for the background loops: keep-alive pooled connections, TCP_NODELAY, TLS for
/// `https://` workers.
pub fn build_client(tls: TlsConnector) -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .build(WorkerConnector { tls })
}

/// Opens the client's connections: plain TCP for `http://` URLs, TLS for `https://`.
#[derive(Clone)]
pub struct WorkerConnector {
    tls: TlsConnector,
}

impl tower::Service<Uri> for WorkerConnector {
    type Response = TokioIo<WorkerStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, io::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connector = self.tls.clone();
        Box::pin(async move {
            let https = match uri.scheme_str() {
                Some("https") => true,
                Some("http") => false,
                _ => return Err(io::Error::other(format!("{uri}: only http:// and https:// are supported"))),
            };
            let host = uri.host().ok_or_else(|| io::Error::other(format!("{uri} has no host")))?;
            let addr = format!("{host}:{}", uri.port_u16().unwrap_or(if https { 443 } else { 80 }));
            let name = match https {
                true => Some(tls::server_name(host).map_err(io::Error::other)?),
                false => None,
            };
            let stream = tls::connect_worker(&addr, name.map(|name| (&connector, name))).await;
            stream.map(TokioIo::new).map_err(io::Error::other)
        })
    }
}

impl Connection for WorkerStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// Headers that describe one connection and must not be forwarded by a proxy (RFC 9110 7.6.1).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "trailers"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// GET `url` with a deadline; returns the status and the whole (small) body.
pub async fn get(
    client: &HttpClient,
    url: &str,
    bearer: Option<&str>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), String> {
    let mut builder = Request::get(url);
    if let Some(token) = bearer {
        builder = builder.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = builder.body(Full::new(Bytes::new())).map_err(|e| e.to_string())?;
    let exchange = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let body = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok::<_, String>((status, body))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("no answer within {:.1} s", timeout.as_secs_f64()))?
}

/// Ask a worker which model it serves (`GET /v1/models`, first entry).
pub async fn discover_model(
    client: &HttpClient,
    worker_url: &str,
    bearer: Option<&str>,
    timeout: Duration,
) -> Result<String, String> {
    let (status, body) = get(client, &format!("{worker_url}/v1/models"), bearer, timeout).await?;
    if !status.is_success() {
        return Err(format!("GET /v1/models answered {status}"));
    }
    let value: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| format!("GET /v1/models: invalid JSON: {e}"))?;
    value["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| "GET /v1/models: no model id in data[0].id".to_string())
}

/// Health probes and model discovery, as registration and the health loop run them: the
/// background client, the workers' key (`--api-key`), the health endpoint and the deadline.
#[derive(Clone)]
pub struct HealthCheck {
    pub client: HttpClient,
    /// The path probed (`--health-check-endpoint`).
    pub endpoint: String,
    pub bearer: Option<String>,
    pub timeout: Duration,
}

impl HealthCheck {
    /// One health check: 2xx from the health endpoint within the timeout.
    pub async fn probe(&self, url: &str) -> bool {
        let target = format!("{url}{}", self.endpoint);
        matches!(
            get(&self.client, &target, self.bearer.as_deref(), self.timeout).await,
            Ok((status, _)) if status.is_success()
        )
    }

    /// The model the worker serves (`GET /v1/models`).
    pub async fn discover_model(&self, url: &str) -> Result<String, String> {
        discover_model(&self.client, url, self.bearer.as_deref(), self.timeout).await
    }
}
