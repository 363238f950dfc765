//! Keep-alive HTTP/1 connections to one worker, pooled per worker and driven by the request that
//! uses them: no connection task, so one proxied exchange runs in one task (the client
//! connection's) instead of handing the request and the answer across two.
//!
//! A connection is taken from the pool (most recently used first), checked without blocking, used
//! for one request, and returned when its answer has been read to the end. Idle connections are
//! never polled by a task; a closed one is noticed when it is taken, or by `sweep`.
//!
//! Under `--io-threads` each I/O thread has its own runtime, and keeps its own idle connections
//! (one shard of the pool per thread): a connection is only ever used by the thread whose
//! reactor it is registered with, so no readiness event crosses threads.
//!
//! `https://` workers are reached over TLS (`tls.rs`): the connection then runs on a TLS stream,
//! driven the same way.

use std::cell::Cell;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use crate::tls::{self, WorkerStream};

type Driver = http1::Connection<TokioIo<WorkerStream>, Full<Bytes>>;

/// Idle connections older than this are closed instead of reused.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// At most this many idle connections are kept per worker.
const MAX_IDLE: usize = 1024;

/// Idle connections are kept in this many shards, one per I/O thread (shard 0 for every thread
/// of a shared runtime); I/O threads past the last shard share it.
const SHARDS: usize = 16;

thread_local! {
    /// The pool shard of the current thread (see `use_shard`).
    static SHARD: Cell<usize> = const { Cell::new(0) };
}

/// The current thread takes and returns its idle connections in shard `shard` (taken modulo the
/// number of shards): called by each I/O thread once, before it serves.
pub fn use_shard(shard: usize) {
    SHARD.with(|current| current.set(shard % SHARDS));
}

fn current_shard() -> usize {
    SHARD.with(Cell::get)
}

/// Why a request could not be exchanged with a worker.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be opened: the request was not sent (safe to try another worker).
    Connect(String),
    /// The exchange failed after the request may have reached the worker.
    Exchange(hyper::Error),
}

/// One open connection: the request half and the connection state machine that moves bytes.
pub struct UpstreamConn {
    sender: http1::SendRequest<Full<Bytes>>,
    driver: Driver,
    /// The pool shard it goes back to (`ConnPool::checkout`).
    home: usize,
}

impl UpstreamConn {
    /// Poll the connection once, outside any task: true when it is open and takes a request.
    fn is_reusable(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(&mut self.driver).poll(&mut cx) {
            Poll::Ready(_) => false,
            Poll::Pending => self.sender.is_ready(),
        }
    }
}

struct Idle {
    conn: Box<UpstreamConn>,
    since: Instant,
}

/// The connections of one worker.
pub struct ConnPool {
    /// `host:port` to connect to.
    addr: String,
    /// The `Host` header sent with every request.
    host: HeaderValue,
    /// Path prefix of the worker URL (`http://host:port/prefix`), empty for most workers.
    prefix: String,
    /// For an `https://` worker, the name its certificate must carry (or why the host is not one).
    tls_name: Option<Result<ServerName<'static>, String>>,
    /// Idle connections, most recently used last, one list per shard.
    idle: [Mutex<Vec<Idle>>; SHARDS],
}

impl std::fmt::Debug for ConnPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool").field("addr", &self.addr).field("idle", &self.idle_count()).finish()
    }
}

impl ConnPool {
    /// For a normalized worker URL (`http[s]://host[:port][/prefix]`).
    pub fn new(url: &str) -> Self {
        let uri: http::Uri = url.parse().unwrap_or_default();
        let https = uri.scheme_str() == Some("https");
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or("");
        let host_name = uri.host().unwrap_or("");
        let addr = match uri.port_u16() {
            Some(_) => authority.to_string(),
            None => format!("{host_name}:{}", if https { 443 } else { 80 }),
        };
        let host = HeaderValue::from_str(authority).unwrap_or_else(|_| HeaderValue::from_static(""));
        let prefix = uri.path().trim_end_matches('/').to_string();
        let tls_name = https.then(|| tls::server_name(host_name));
        Self { addr, host, prefix, tls_name, idle: std::array::from_fn(|_| Mutex::new(Vec::new())) }
    }

    pub fn idle_count(&self) -> usize {
        self.idle.iter().map(|shard| shard.lock().unwrap_or_else(|p| p.into_inner()).len()).sum()
    }

    /// The request target on this worker for a client's path and query.
    pub fn target(&self, path_and_query: &str) -> Result<http::Uri, http::uri::InvalidUri> {
        if self.prefix.is_empty() {
            path_and_query.parse()
        } else {
            format!("{}{}", self.prefix, path_and_query).parse()
        }
    }

    /// An idle connection: the thread's own shard's first (most recently used first), else one
    /// another thread left. An I/O thread only takes the shared runtime's (shard 0: the health
    /// probes' and load polls'), which then stays with it; the shared runtime borrows any and
    /// gives it back to its shard. So a worker whose only traffic is the gateway's own GETs and
    /// a request now and then keeps one connection, not one per thread (at 10,000 workers the
    /// descriptors run out otherwise), and an I/O thread's connections stay with it. A
    /// connection used on another thread than the one that opened it works the same, its
    /// readiness waking this one.
    fn checkout(&self, now: Instant) -> Option<Box<UpstreamConn>> {
        let own = current_shard();
        let others = if own == 0 { 1..SHARDS } else { 0..1 };
        let (shard, mut conn) = std::iter::once(own)
            .chain(others)
            .find_map(|shard| Some((shard, self.checkout_from(shard, now)?)))?;
        conn.home = if own == 0 { shard } else { own };
        Some(conn)
    }

    fn checkout_from(&self, shard: usize, now: Instant) -> Option<Box<UpstreamConn>> {
        loop {
            let Idle { mut conn, since } =
                self.idle[shard].lock().unwrap_or_else(|p| p.into_inner()).pop()?;
            if now.saturating_duration_since(since) < IDLE_TIMEOUT && conn.is_reusable() {
                return Some(conn);
            }
        }
    }

    fn checkin(&self, mut conn: Box<UpstreamConn>) {
        if !conn.is_reusable() {
            return;
        }
        let mut idle = self.idle[conn.home].lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(Idle { conn, since: Instant::now() });
        }
    }

    /// Close idle connections that expired or that the worker closed.
    pub fn sweep(&self, now: Instant) {
        for shard in &self.idle {
            shard.lock().unwrap_or_else(|p| p.into_inner()).retain_mut(|entry| {
                now.saturating_duration_since(entry.since) < IDLE_TIMEOUT && entry.conn.is_reusable()
            });
        }
    }

    /// Close every idle connection.
    pub fn clear(&self) {
        for shard in &self.idle {
            shard.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    /// Open a connection (TCP, and the TLS handshake for an `https://` worker).
    async fn connect(&self, connector: &TlsConnector) -> Result<Box<UpstreamConn>, SendError> {
        let tls = match &self.tls_name {
            None => None,
            Some(Ok(name)) => Some((connector, name.clone())),
            Some(Err(message)) => return Err(SendError::Connect(format!("{}: {message}", self.addr))),
        };
        let stream = tls::connect_worker(&self.addr, tls).await.map_err(SendError::Connect)?;
        let (sender, driver) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|error| SendError::Connect(format!("handshake with {}: {error}", self.addr)))?;
        // Boxed once per connection: requests then move a pointer, not the connection state.
        Ok(Box::new(UpstreamConn { sender, driver, home: current_shard() }))
    }
}

/// Send `request` (origin-form URI) to the pool's worker on a pooled or new connection; the
/// response body carries the connection and gives it back to `pool` once read to the end.
///
/// A pooled connection that turns out closed before the request was written is replaced by a new
/// one: the request was not sent, so this is not a retry. `tls` opens connections to an
/// `https://` worker.
pub async fn send(
    pool: &Arc<ConnPool>,
    mut request: Request<Full<Bytes>>,
    tls: &TlsConnector,
) -> Result<Response<UpstreamBody>, SendError> {
    request.headers_mut().insert(header::HOST, pool.host.clone());
    let mut pooled = pool.checkout(Instant::now());
    loop {
        let reused = pooled.is_some();
        let mut conn = match pooled.take() {
            Some(conn) => conn,
            None => pool.connect(tls).await?,
        };
        let answer = conn.sender.try_send_request(request);
        let mut answer = std::pin::pin!(answer);
        let mut driver_done = false;
        let result = poll_fn(|cx| {
            if !driver_done && Pin::new(&mut conn.driver).poll(cx).is_ready() {
                driver_done = true;
            }
            answer.as_mut().poll(cx)
        })
        .await;
        match result {
            Ok(response) => {
                let conn = (!driver_done).then_some(conn);
                return Ok(response.map(|incoming| UpstreamBody {
                    incoming,
                    conn,
                    pool: pool.clone(),
                    ended: false,
                }));
            }
            Err(mut error) => match error.take_message() {
                Some(unsent) if reused => request = unsent,
                _ => return Err(SendError::Exchange(error.into_error())),
            },
        }
    }
}

/// A worker's answer body; polling it also drives the connection it arrives on.
pub struct UpstreamBody {
    incoming: Incoming,
    /// `None` once the connection has ended.
    conn: Option<Box<UpstreamConn>>,
    /// Where the connection goes back to.
    pool: Arc<ConnPool>,
    /// The body was read to its end (a chunked body does not say so in `is_end_stream`).
    ended: bool,
}

impl UpstreamBody {
    /// Drive the connection; drop it when it ends.
    fn drive(&mut self, cx: &mut Context<'_>) {
        if let Some(conn) = &mut self.conn {
            if Pin::new(&mut conn.driver).poll(cx).is_ready() {
                self.conn = None;
            }
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let mut polled = Pin::new(&mut this.incoming).poll_frame(cx);
        if polled.is_pending() {
            this.drive(cx);
            polled = Pin::new(&mut this.incoming).poll_frame(cx);
        }
        if let Poll::Ready(None) = polled {
            this.ended = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.incoming.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // Only a connection whose answer was read to the end can carry another request.
        if self.ended || self.incoming.is_end_stream() {
            if let Some(conn) = self.conn.take() {
                self.pool.checkin(conn);
            }
        }
    }
}
