//! Deadlines of one client connection: a request head must be complete within `header_read` of
//! the connection's start or of its first byte, and a connection with no request in progress is
//! closed `keep_alive` after its last response. A request in progress has no deadline here (the
//! proxy bounds the worker's answer).
//!
//! hyper's own `header_read_timeout` starts counting when a kept-alive connection turns idle, so
//! it cannot tell a slow head from an idle connection; these deadlines do. Nothing runs beside
//! the connection: the reader notes the first byte of a head, the service and the response body
//! note a request's start and end, and `with_deadlines` re-arms one timer, in the connection's
//! own task, after each poll that changed them.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use kvgate_gateway_core::config::GatewayConfig;

/// The two client deadlines, from the configuration.
#[derive(Clone, Copy, Debug)]
pub struct ClientLimits {
    pub header_read: Duration,
    pub keep_alive: Duration,
}

impl ClientLimits {
    /// From a validated configuration (both timeouts within (0, 1 day]).
    pub fn new(config: &GatewayConfig) -> Self {
        Self {
            header_read: Duration::from_secs_f64(config.header_read_timeout_secs),
            keep_alive: Duration::from_secs_f64(config.keep_alive_timeout_secs),
        }
    }
}

/// What one client connection is doing, shared by its reader, its service and its deadline.
/// Every update happens while the connection's task polls the connection.
#[derive(Debug)]
pub struct Activity {
    /// Requests whose head was read (the service was called).
    begun: AtomicU64,
    /// Requests whose response was handed to the socket to its end, or dropped.
    ended: AtomicU64,
    /// Bytes of a request head arrived while no request was in progress; a new connection
    /// starts out waiting for its first head.
    head_started: AtomicBool,
}

/// A snapshot of `Activity`: any change re-arms the deadline.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Snapshot {
    begun: u64,
    ended: u64,
    head_started: bool,
}

impl Snapshot {
    /// How long the client may take from now, or `None` while a request is in progress.
    fn allowance(self, limits: ClientLimits) -> Option<Duration> {
        if self.begun != self.ended {
            None
        } else if self.head_started {
            Some(limits.header_read)
        } else {
            Some(limits.keep_alive)
        }
    }
}

impl Activity {
    /// A new connection: waiting for its first request head.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            begun: AtomicU64::new(0),
            ended: AtomicU64::new(0),
            head_started: AtomicBool::new(true),
        })
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            begun: self.begun.load(Ordering::Relaxed),
            ended: self.ended.load(Ordering::Relaxed),
            head_started: self.head_started.load(Ordering::Relaxed),
        }
    }

    /// Bytes were read from the client.
    fn bytes_arrived(&self) {
        if !self.head_started.load(Ordering::Relaxed)
            && self.begun.load(Ordering::Relaxed) == self.ended.load(Ordering::Relaxed)
        {
            self.head_started.store(true, Ordering::Relaxed);
        }
    }

    /// A request's head was read: it is in progress until the returned guard is dropped.
    pub fn begin(self: &Arc<Self>) -> RequestGuard {
        self.head_started.store(false, Ordering::Relaxed);
        self.begun.fetch_add(1, Ordering::Relaxed);
        RequestGuard(self.clone())
    }
}

/// One request in progress; dropped with its response body (or with the service future, when
/// the connection goes away first).
#[derive(Debug)]
pub struct RequestGuard(Arc<Activity>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::Relaxed);
    }
}

/// A response body that ends its request when hyper drops it (written to its end, or given up).
pub struct GuardedBody<B> {
    inner: B,
    _request: RequestGuard,
}

impl<B> GuardedBody<B> {
    pub fn new(inner: B, request: RequestGuard) -> Self {
        Self { inner, _request: request }
    }
}

impl<B: Body + Unpin> Body for GuardedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The client's stream, noting when the first bytes of a request head arrive.
pub struct ActivityIo<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S> ActivityIo<S> {
    pub fn new(inner: S, activity: Arc<Activity>) -> Self {
        Self { inner, activity }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ActivityIo<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.bytes_arrived();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ActivityIo<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Drive `connection` to its end (`Some(output)`), or until the client misses a deadline
/// (`None`: the connection is dropped, which closes it). The first head is due by
/// `first_head_by`; after that the deadline follows `activity`.
pub async fn with_deadlines<F: Future>(
    connection: F,
    activity: &Activity,
    limits: ClientLimits,
    first_head_by: Instant,
) -> Option<F::Output> {
    let mut connection = std::pin::pin!(connection);
    let mut deadline = std::pin::pin!(tokio::time::sleep_until(first_head_by));
    let mut seen = activity.snapshot();
    let mut armed = true;
    poll_fn(move |cx| {
        if let Poll::Ready(output) = connection.as_mut().poll(cx) {
            return Poll::Ready(Some(output));
        }
        let now = activity.snapshot();
        if now != seen {
            seen = now;
            let allowance = now.allowance(limits);
            armed = allowance.is_some();
            if let Some(allowance) = allowance {
                deadline.as_mut().reset(Instant::now() + allowance);
            }
        }
        if armed && deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ClientLimits =
        ClientLimits { header_read: Duration::from_secs(1), keep_alive: Duration::from_secs(7) };

    #[test]
    fn the_allowance_follows_the_request_cycle() {
        let activity = Activity::new();
        let allowance = |activity: &Activity| activity.snapshot().allowance(LIMITS);
        assert_eq!(allowance(&activity), Some(LIMITS.header_read), "a new connection owes its head");
        let request = activity.begin();
        activity.bytes_arrived();
        assert_eq!(allowance(&activity), None, "a request in progress (its body arriving) has no deadline");
        drop(request);
        assert_eq!(allowance(&activity), Some(LIMITS.keep_alive), "idle after the response");
        activity.bytes_arrived();
        assert_eq!(allowance(&activity), Some(LIMITS.header_read), "the next head has started");
        let before = activity.snapshot();
        activity.bytes_arrived();
        assert!(activity.snapshot() == before, "more bytes of the same head do not extend its deadline");
    }
}
