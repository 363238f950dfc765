//! The response body wrapper of a proxied request: passes the worker's frames through as they
//! arrive, and on the way records time to first byte, total latency and the end of the request.
//! When an event stream breaks (the worker died mid-answer, its body stalled past
//! `--body-stall-timeout-secs`, the stream ran past `--stream-deadline-secs`), the client gets an
//! OpenAI-style error event and then the connection is cut (the chunked body never ends), so
//! neither an SSE client nor an HTTP one takes the answer as complete.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use kvgate_index::InFlightPrompt;

use crate::accuracy::UsageTap;
use crate::conn::UpstreamBody;
use crate::endpoint::Endpoint;
use crate::metrics::Metrics;
use crate::otel::RequestSpan;
use crate::registry::ModelPrefix;
use crate::worker::Worker;

/// Marks a request in flight on a worker; dropping it ends the request.
pub struct InFlight {
    worker: Arc<Worker>,
    /// The prompt's blocks, counted as held by the worker in the model's exact index until the
    /// request ends (its engine reports them only once prefill completes).
    prompt: Option<Box<(Arc<ModelPrefix>, InFlightPrompt)>>,
}

impl InFlight {
    pub fn begin(worker: Arc<Worker>, prompt: Option<(Arc<ModelPrefix>, InFlightPrompt)>) -> Self {
        worker.begin_request();
        worker.series.in_flight.inc();
        Self { worker, prompt: prompt.map(Box::new) }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.end_request();
        self.worker.series.in_flight.dec();
        if let Some(held) = self.prompt.take() {
            let (prefix, prompt) = *held;
            prefix.in_flight.remove(prompt);
        }
    }
}

/// What an answer used, as its engine reported it, bounded by what the request could use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Used {
    pub prompt: u64,
    pub completion: u64,
}

/// What admission holds for a request until its answer ends (a concurrency slot, its tenant's
/// share), dropped with the body; told the tokens the answer really used, when the engine said.
pub trait AdmissionHold: Send + Sync {
    /// Whether the answer's usage is wanted (the hold corrects a charge with it).
    fn wants_usage(&self) -> bool;
    /// The answer's prompt and output tokens.
    fn used(&mut self, used: Used);
}

/// Everything that must live exactly as long as the response body.
pub struct RequestTail {
    pub endpoint: Endpoint,
    pub started: Instant,
    pub metrics: Arc<Metrics>,
    #[allow(dead_code, reason = "held until the body ends: its Drop ends the request")]
    pub in_flight: InFlight,
    /// The admission's hold (a concurrency slot, the tenant's request), freed when dropped.
    #[allow(dead_code, reason = "held until the body ends: its Drop frees a concurrency slot")]
    pub permit: Option<Box<dyn AdmissionHold>>,
    /// Set for event streams: the worker named in the error event if the stream breaks.
    pub worker_url: Option<String>,
    /// Reads the engine's usage as the answer passes (the closed loop, `accuracy.rs`).
    pub usage: Option<UsageTap>,
    /// The request's trace span (`--otlp-traces-endpoint`), ended with the body.
    pub span: Option<RequestSpan>,
    /// How long the body may stall, and by when a stream must end.
    pub watch: BodyWatch,
    /// The most the answer's usage can be.
    pub usage_bound: UsageBound,
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
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cut::Broke(error) => write!(f, "{error}"),
            Cut::Stalled(stall) => {
                write!(f, "stalled: no byte for {:.1} s (--body-stall-timeout-secs)", stall.as_secs_f64())
            }
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

pub struct MeteredBody {
    inner: UpstreamBody,
    tail: RequestTail,
    timers: Timers,
    first_byte_seen: bool,
    /// Why the body was cut, held while the error event goes out first.
    broken: Option<Cut>,
    /// The error event was handed over and one poll has let the connection flush it.
    flushed: bool,
    /// The worker's body ended (what the usage tap still held has been passed on).
    ended: bool,
}

impl MeteredBody {
    pub fn new(inner: UpstreamBody, tail: RequestTail) -> Self {
        let timers = Timers::new(tail.watch);
        Self { inner, tail, timers, first_byte_seen: false, broken: None, flushed: false, ended: false }
    }
}

/// The most an answer can have used: each prompt token comes from at least one byte of the
/// request, and each choice's output is at most the request's maximum (or the model's context).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsageBound {
    pub prompt: u64,
    pub completion: u64,
}

/// Tells the admission hold what the answer used, when the engine said both counts, each at
/// most what the request could have used (an engine's absurd report charges no more).
fn settle(
    permit: &mut Option<Box<dyn AdmissionHold>>,
    usage: Option<crate::usage::EngineUsage>,
    bound: UsageBound,
) {
    let (Some(permit), Some(usage)) = (permit, usage) else { return };
    if let (Some(prompt), Some(completion)) = (usage.prompt_tokens, usage.completion_tokens) {
        let used = Used {
            prompt: u64::from(prompt).min(bound.prompt),
            completion: u64::from(completion).min(bound.completion),
        };
        if used.prompt < u64::from(prompt) || used.completion < u64::from(completion) {
            tracing::debug!(
                prompt,
                completion,
                ?bound,
                "an engine reported more usage than the request could have"
            );
        }
        permit.used(used);
    }
}

/// The server-sent event telling a client its stream broke.
fn error_event(worker: &str, cut: &Cut) -> Bytes {
    let message = match cut {
        Cut::Deadline(_) => format!("the stream from the worker {worker} was cut: {cut}"),
        _ => format!("the worker {worker} failed mid-stream: {cut}"),
    };
    let body = crate::error::error_body(&message, "upstream_error", "upstream_stream_broken");
    Bytes::from(format!("data: {body}\n\n"))
}

impl Body for MeteredBody {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if this.broken.is_some() {
            if !this.flushed {
                // Let the connection write the error event out before the error aborts it.
                this.flushed = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if let Some(error) = this.broken.take() {
                return Poll::Ready(Some(Err(error)));
            }
        }
        if this.ended {
            return Poll::Ready(None);
        }
        let polled = match Pin::new(&mut this.inner).poll_frame(cx) {
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
        };
        let polled = match polled {
            Poll::Ready(Some(Err(cut))) if this.tail.worker_url.is_some() => {
                let worker = this.tail.worker_url.take().unwrap_or_default();
                let event = error_event(&worker, &cut);
                tracing::debug!(%worker, %cut, "stream cut");
                this.broken = Some(cut);
                Poll::Ready(Some(Ok(Frame::data(event))))
            }
            Poll::Ready(Some(Ok(frame))) => match &mut this.tail.usage {
                Some(tap) => Poll::Ready(Some(Ok(frame.map_data(|data| tap.on_frame(data))))),
                None => Poll::Ready(Some(Ok(frame))),
            },
            Poll::Ready(None) => match &mut this.tail.usage {
                Some(tap) => {
                    // The whole answer arrived: the closed loop's sample is recorded.
                    this.ended = true;
                    let (rest, usage) = tap.finish(&this.tail.metrics);
                    this.tail.usage = None;
                    settle(&mut this.tail.permit, usage, this.tail.usage_bound);
                    if rest.is_empty() {
                        Poll::Ready(None)
                    } else {
                        Poll::Ready(Some(Ok(Frame::data(rest))))
                    }
                }
                None => Poll::Ready(None),
            },
            other => other,
        };
        if !this.first_byte_seen {
            if let Poll::Ready(Some(Ok(_)) | None) = &polled {
                this.first_byte_seen = true;
                let elapsed = this.tail.started.elapsed().as_secs_f64();
                this.tail.metrics.ttfb(this.tail.endpoint).observe(elapsed);
                if let Some(span) = &mut this.tail.span {
                    span.first_byte(elapsed);
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ended || (self.tail.usage.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match self.tail.usage.as_ref().is_some_and(UsageTap::rewrites) {
            true => SizeHint::default(),
            false => self.inner.size_hint(),
        }
    }
}

impl Drop for MeteredBody {
    fn drop(&mut self) {
        if let Some(tap) = &mut self.tail.usage {
            let usage = tap.dropped(&self.tail.metrics);
            settle(&mut self.tail.permit, usage, self.tail.usage_bound);
        }
        let elapsed = self.tail.started.elapsed().as_secs_f64();
        self.tail.metrics.duration(self.tail.endpoint).observe(elapsed);
    }
}
