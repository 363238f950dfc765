//! One worker's answer under the gateway's bounds in time: [`Watched`] passes the answer's
//! frames, holds the request in flight on the worker, and cuts the answer when it stalls (no
//! byte for `--body-stall-timeout-secs`) or runs past `--stream-deadline-secs`; [`Cut`] says why
//! an answer ended before its end. [`AnswerSource`] is what the response body reads from: one
//! watched answer, or (`proxy/migrate.rs`) a stream that moves to another worker when its own
//! fails.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::InFlight;
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::conn::UpstreamBody;

/// What a response body reads from.
pub trait AnswerSource: Body<Data = Bytes, Error = Cut> + Send + Unpin + 'static {
    /// The worker whose answer passes now (named in the error event).
    fn worker_url(&self) -> &str;
    /// Whether the answer moved to another worker (the closed loop's prediction was for the
    /// first one).
    fn migrated(&self) -> bool {
        false
    }
}

/// The bounds on an answer's body in time.
#[derive(Clone, Copy, Debug, Default)]
pub struct BodyWatch {
    /// Longest wait for the next byte (`--body-stall-timeout-secs`).
    pub stall: Option<Duration>,
    /// When the answer must have ended, and the bound it came from (`--stream-deadline-secs`).
    pub deadline: Option<(tokio::time::Instant, Duration)>,
}

/// Why an answer's body ended before its end.
#[derive(Debug)]
pub enum Cut {
    /// The worker's connection broke.
    Broke(hyper::Error),
    /// No byte for this long.
    Stalled(Duration),
    /// The stream ran past its deadline.
    Deadline(Duration),
    /// The answer's engine failed (`cut`) and no other engine could take the stream over.
    Unmoved { cut: Box<Cut>, why: String },
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cut::Broke(error) => write!(f, "{error}"),
            Cut::Stalled(stall) => {
                write!(f, "stalled: no byte for {:.1} s (--body-stall-timeout-secs)", stall.as_secs_f64())
            }
            Cut::Unmoved { cut, why } => write!(f, "{cut}; no other engine took the stream over: {why}"),
            Cut::Deadline(deadline) => {
                write!(
                    f,
                    "the stream ran past its {:.1} s deadline (--stream-deadline-secs)",
                    deadline.as_secs_f64()
                )
            }
        }
    }
}

impl std::error::Error for Cut {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Cut::Broke(error) => Some(error),
            Cut::Unmoved { cut, .. } => Some(cut.as_ref()),
            _ => None,
        }
    }
}

/// The timers of [`BodyWatch`]: the stall timer is set once and moved only when it fires early
/// (a byte came since), so a frame costs a clock read, not a timer update.
struct Timers {
    stall: Option<Duration>,
    last_byte: tokio::time::Instant,
    stall_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    deadline: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
}

impl Timers {
    fn new(watch: BodyWatch) -> Self {
        Self {
            stall: watch.stall,
            last_byte: tokio::time::Instant::now(),
            stall_timer: None,
            deadline: watch.deadline.map(|(at, bound)| (Box::pin(tokio::time::sleep_until(at)), bound)),
        }
    }

    fn on_frame(&mut self) {
        if self.stall.is_some() {
            self.last_byte = tokio::time::Instant::now();
        }
    }

    /// Whether the deadline passed (checked as frames come, so a body that never waits is
    /// bounded too).
    fn past_deadline(&self) -> Option<Cut> {
        let (timer, bound) = self.deadline.as_ref()?;
        (timer.deadline() <= tokio::time::Instant::now()).then_some(Cut::Deadline(*bound))
    }

    /// Polled while the body waits: the cut, when a timer fired (its waker is registered
    /// otherwise).
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> Option<Cut> {
        if let Some((timer, bound)) = &mut self.deadline {
            if timer.as_mut().poll(cx).is_ready() {
                return Some(Cut::Deadline(*bound));
            }
        }
        let stall = self.stall?;
        let timer = self
            .stall_timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(self.last_byte + stall)));
        while timer.as_mut().poll(cx).is_ready() {
            let due = self.last_byte + stall;
            if due <= tokio::time::Instant::now() {
                return Some(Cut::Stalled(stall));
            }
            timer.as_mut().reset(due);
        }
        None
    }
}

/// One worker's answer, watched: its frames pass as they come; the request is in flight on the
/// worker until this is dropped.
pub struct Watched {
    body: UpstreamBody,
    timers: Timers,
    worker: Arc<Worker>,
    #[allow(dead_code, reason = "held until the answer ends: its Drop ends the request")]
    in_flight: InFlight,
}

impl Watched {
    pub fn new(body: UpstreamBody, in_flight: InFlight, worker: Arc<Worker>, watch: BodyWatch) -> Self {
        Self { body, timers: Timers::new(watch), worker, in_flight }
    }

    /// The worker answering.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }
}

impl Body for Watched {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Pending => match this.timers.poll_expired(cx) {
                Some(cut) => Poll::Ready(Some(Err(cut))),
                None => Poll::Pending,
            },
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(Cut::Broke(error)))),
            Poll::Ready(Some(Ok(frame))) => {
                this.timers.on_frame();
                match this.timers.past_deadline() {
                    Some(cut) => Poll::Ready(Some(Err(cut))),
                    None => Poll::Ready(Some(Ok(frame))),
                }
            }
            Poll::Ready(None) => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl AnswerSource for Watched {
    fn worker_url(&self) -> &str {
        &self.worker.url
    }
}
