//! The background GETs (health checks, model discovery, load polls) and their small helpers. A
//! registered worker is asked over its own keep-alive connections (`conn.rs`), the ones its
//! proxied requests use, so an idle fleet holds one connection a worker, not one per purpose; a
//! worker not registered yet (registration's probes) through the background client, which keeps
//! no connection. Both reach `https://` workers with the same TLS settings (`tls.rs`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderName, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prometheus::IntCounterVec;
use tokio_rustls::TlsConnector;

use crate::conn::{self, ConnPool, SendError};
use crate::tls::{self, WorkerStream};

pub type HttpClient = Client<WorkerConnector, Full<Bytes>>;

/// The client of workers not registered yet (registration's probes) and of the alignment probes:
/// TCP_NODELAY, TLS for `https://` workers, and no idle connection kept (a registered worker's
/// GETs go over its own connections, `Via::Worker`: a connection kept here would be a second one
/// to the same worker, and at 10,000 workers the descriptors run out).
pub fn build_client(tls: TlsConnector) -> HttpClient {
    Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build(WorkerConnector { tls })
}

/// Where a background GET goes.
#[derive(Clone, Copy)]
pub enum Via<'a> {
    /// A registered worker's own keep-alive connections, shared with the requests proxied to it
    /// (the pool's shard of the calling thread: the main runtime's).
    Worker(&'a Arc<ConnPool>),
    /// The background client, to the worker at this base URL (`http[s]://host:port[/prefix]`).
    Client(&'a str),
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

/// Why a worker's answer was not read.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    #[error("{0}")]
    Failed(String),
    /// The body went past the limit (`--max-probe-answer-bytes`, ...): the rest was not read and
    /// the connection is dropped.
    #[error("the answer is larger than {limit} bytes")]
    Oversized { limit: usize },
}

/// Reads `body` to its end, keeping at most `limit` bytes: past it, stops reading and says so
/// (nothing past the limit is ever buffered). The chunks are kept as they came and joined once
/// at the end (one chunk: no copy), so an answer near the limit costs at most twice it, not
/// the regrowth copies of one growing buffer.
pub async fn read_limited<B>(body: B, limit: usize) -> Result<Bytes, GetError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    /// Smaller chunks are gathered into one of this size first (so tiny chunks cost no more
    /// than their bytes).
    const GATHER: usize = 16 * 1024;
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut small = bytes::BytesMut::new();
    let read = each_chunk(body, limit, |data| {
        if data.len() >= GATHER && small.is_empty() {
            chunks.push(data);
        } else {
            small.extend_from_slice(&data);
            if small.len() >= GATHER {
                chunks.push(small.split().freeze());
            }
        }
    })
    .await?;
    if !small.is_empty() {
        chunks.push(small.freeze());
    }
    Ok(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().expect("one chunk"),
        _ => {
            let mut joined = bytes::BytesMut::with_capacity(read);
            for chunk in chunks {
                joined.extend_from_slice(&chunk);
            }
            joined.freeze()
        }
    })
}

/// Reads `body` to its end without keeping it (so its connection can be reused), up to `limit`
/// bytes: past it, stops and says so.
pub async fn drain_limited<B>(body: B, limit: usize) -> Result<(), GetError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    each_chunk(body, limit, drop).await.map(drop)
}

/// The one reading loop of [`read_limited`] and [`drain_limited`]: each data chunk of `body` to
/// `chunk` until the end (the bytes read, returned) or until they pass `limit` (`Oversized`, and
/// the chunk past it is not handed on).
async fn each_chunk<B>(body: B, limit: usize, mut chunk: impl FnMut(Bytes)) -> Result<usize, GetError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let mut body = std::pin::pin!(body);
    let mut read = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| GetError::Failed(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            read = read.saturating_add(data.len());
            if read > limit {
                return Err(GetError::Oversized { limit });
            }
            chunk(data);
        }
    }
    Ok(read)
}

/// What to do with an answer's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Return it (at most the limit).
    Body,
    /// Only the status matters: read it to its end (at most the limit) and drop it.
    Status,
}

/// GET `path` of a worker with a deadline; returns the status and the body, read up to `limit`
/// bytes (`Keep::Status`: read and dropped, an empty body is returned). A `Via::Worker`
/// connection goes back to its pool once the answer is read to its end.
pub async fn get(
    upstream: &Upstream,
    via: Via<'_>,
    path: &str,
    bearer: Option<&str>,
    timeout: Duration,
    limit: usize,
    keep: Keep,
) -> Result<(StatusCode, Bytes), GetError> {
    let failed = |error: String| GetError::Failed(error);
    let target = match via {
        Via::Worker(pool) => pool.target(path).map_err(|e| failed(e.to_string()))?,
        Via::Client(base) => {
            format!("{base}{path}").parse().map_err(|e: http::uri::InvalidUri| failed(e.to_string()))?
        }
    };
    let mut builder = Request::get(target);
    if let Some(token) = bearer {
        builder = builder.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = builder.body(Full::new(Bytes::new())).map_err(|e| failed(e.to_string()))?;
    let exchange = async {
        let (status, body) = match via {
            Via::Worker(pool) => {
                let response =
                    conn::send(pool, request, &upstream.tls).await.map_err(|error| match error {
                        SendError::Connect(error) => failed(error),
                        SendError::Exchange(error) => failed(error.to_string()),
                    })?;
                let status = response.status();
                (status, read_answer(response.into_body(), limit, keep).await?)
            }
            Via::Client(_) => {
                let response = upstream.client.request(request).await.map_err(|e| failed(e.to_string()))?;
                let status = response.status();
                (status, read_answer(response.into_body(), limit, keep).await?)
            }
        };
        Ok::<_, GetError>((status, body))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| GetError::Failed(format!("no answer within {:.1} s", timeout.as_secs_f64())))?
}

/// An answer's body as `keep` says (read to its end either way, so its connection can be reused).
async fn read_answer<B>(body: B, limit: usize, keep: Keep) -> Result<Bytes, GetError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    match keep {
        Keep::Body => read_limited(body, limit).await,
        Keep::Status => drain_limited(body, limit).await.map(|()| Bytes::new()),
    }
}

/// How the background loops reach workers: the client of workers not registered yet, and the TLS
/// settings a registered worker's own connections are opened with.
#[derive(Clone)]
pub struct Upstream {
    pub client: HttpClient,
    pub tls: TlsConnector,
}

/// What a worker's `GET /v1/models` says of the model it serves (its first entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedModel {
    pub id: String,
    /// Its context length in tokens (`max_model_len`: vLLM's and SGLang's `ModelCard`), when said.
    pub max_model_len: Option<u32>,
}

/// Ask a worker which model it serves (`GET /v1/models`, first entry).
pub async fn discover_model(
    upstream: &Upstream,
    via: Via<'_>,
    bearer: Option<&str>,
    timeout: Duration,
    limit: usize,
) -> Result<ServedModel, GetError> {
    let (status, body) = get(upstream, via, "/v1/models", bearer, timeout, limit, Keep::Body).await?;
    let failed = |message: String| GetError::Failed(message);
    if !status.is_success() {
        return Err(failed(format!("GET /v1/models answered {status}")));
    }
    let value: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| failed(format!("GET /v1/models: invalid JSON: {e}")))?;
    let first = &value["data"][0];
    let id = first["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| failed("GET /v1/models: no model id in data[0].id".to_string()))?;
    let max_model_len =
        first["max_model_len"].as_u64().and_then(|len| u32::try_from(len).ok()).filter(|&len| len > 0);
    Ok(ServedModel { id, max_model_len })
}

/// Health probes and model discovery, as registration and the health loop run them: the
/// way to the workers, the workers' key (`--api-key`), the health endpoint, the deadline and the
/// largest answer read (`--max-probe-answer-bytes`; past it the probe fails, counted in
/// `oversized`).
#[derive(Clone)]
pub struct HealthCheck {
    pub upstream: Upstream,
    /// The path probed (`--health-check-endpoint`).
    pub endpoint: String,
    pub bearer: Option<String>,
    pub timeout: Duration,
    pub max_answer_bytes: usize,
    /// `kvgate_oversized_answers_total{source}`.
    pub oversized: IntCounterVec,
}

impl HealthCheck {
    /// One health check: 2xx from the health endpoint within the timeout, with an answer no
    /// larger than the bound.
    pub async fn probe(&self, via: Via<'_>) -> bool {
        let (bearer, limit) = (self.bearer.as_deref(), self.max_answer_bytes);
        match get(&self.upstream, via, &self.endpoint, bearer, self.timeout, limit, Keep::Status).await {
            Ok((status, _)) => status.is_success(),
            Err(GetError::Oversized { .. }) => {
                self.oversized.with_label_values(&["health"]).inc();
                false
            }
            Err(GetError::Failed(_)) => false,
        }
    }

    /// The model the worker serves (`GET /v1/models`).
    pub async fn discover_model(&self, via: Via<'_>) -> Result<ServedModel, GetError> {
        let bearer = self.bearer.as_deref();
        let learned = discover_model(&self.upstream, via, bearer, self.timeout, self.max_answer_bytes).await;
        if let Err(GetError::Oversized { .. }) = learned {
            self.oversized.with_label_values(&["models"]).inc();
        }
        learned
    }

    /// How many data-parallel ranks the engine at `url` runs: `dp_size` of SGLang's `GET
    /// /server_info` (`/get_server_info` when that path is unknown, as older SGLang names it;
    /// SMG 1.13 asks the same, `workflow/steps/local/discover_dp.rs`).
    pub async fn dp_size(&self, url: &str) -> Result<u32, String> {
        let bearer = self.bearer.as_deref();
        let limit = self.max_answer_bytes.max(1 << 20);
        let mut answer = None;
        for path in ["/server_info", "/get_server_info"] {
            let via = Via::Client(url);
            let (status, body) = get(&self.upstream, via, path, bearer, self.timeout, limit, Keep::Body)
                .await
                .map_err(|error| format!("GET {path}: {error}"))?;
            if status == http::StatusCode::NOT_FOUND {
                continue;
            }
            if !status.is_success() {
                return Err(format!("GET {path} answered {status}"));
            }
            answer = Some((path, body));
            break;
        }
        let Some((path, body)) = answer else {
            return Err(
                "neither GET /server_info nor GET /get_server_info is served (not an SGLang engine?)".into(),
            );
        };
        let value: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| format!("GET {path}: invalid JSON: {e}"))?;
        match value.get("dp_size").and_then(serde_json::Value::as_u64) {
            Some(size) if (1..=MAX_DP_SIZE).contains(&size) => Ok(size as u32),
            Some(size) => Err(format!("GET {path}: dp_size {size} is not in 1..={MAX_DP_SIZE}")),
            None => Err(format!("GET {path}: no dp_size (a positive integer) in the answer")),
        }
    }
}

/// The most data-parallel ranks one engine may announce.
pub const MAX_DP_SIZE: u64 = 1024;

#[cfg(test)]
mod tests {
    use super::*;

    fn body(chunks: Vec<Bytes>) -> impl http_body::Body<Data = Bytes, Error = std::convert::Infallible> {
        let frames = chunks.into_iter().map(|chunk| Ok(http_body::Frame::data(chunk)));
        http_body_util::StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn a_limited_read_keeps_every_byte_in_order_and_stops_past_the_limit() {
        let big = Bytes::from(vec![b'b'; 40_000]);
        let mut chunks: Vec<Bytes> = (0..3000).map(|i| Bytes::from(vec![b'a' + (i % 3) as u8])).collect();
        chunks.push(big.clone());
        chunks.push(Bytes::from_static(b"end"));
        let expected: Vec<u8> = chunks.iter().flat_map(|chunk| chunk.to_vec()).collect();
        let read = read_limited(body(chunks.clone()), expected.len()).await.unwrap();
        assert_eq!(read.as_ref(), expected.as_slice());
        let one = read_limited(body(vec![big.clone()]), 40_000).await.unwrap();
        assert_eq!(one, big);
        assert!(read_limited(body(Vec::new()), 0).await.unwrap().is_empty());
        let over = read_limited(body(chunks), expected.len() - 1).await;
        assert!(matches!(over, Err(GetError::Oversized { .. })));
    }
}
