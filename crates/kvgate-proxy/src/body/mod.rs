//! The response body wrapper of a proxied request: passes the worker's frames through as they
//! arrive, and on the way records time to first byte, total latency and the end of the request.
//! When an event stream breaks (the worker died mid-answer, its body stalled past
//! `--body-stall-timeout-secs`, the stream ran past `--stream-deadline-secs`), the client gets an
//! OpenAI-style error event and then the connection is cut (the chunked body never ends), so
//! neither an SSE client nor an HTTP one takes the answer as complete.

mod watch;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use kvgate_index::InFlightPrompt;

pub use watch::{AnswerSource, BodyWatch, Cut, Watched};

use kvgate_admission::{AdmissionHold, Used};
use kvgate_fleet::registry::ModelPrefix;
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::metrics::Metrics;
use kvgate_gateway_core::otel::RequestSpan;
use kvgate_observe::accuracy::UsageTap;
use kvgate_protocol::endpoint::Endpoint;

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

/// Everything that must live exactly as long as the response body.
pub struct RequestTail {
    pub endpoint: Endpoint,
    pub started: Instant,
    pub metrics: Arc<Metrics>,
    /// The admission's hold (a concurrency slot, the tenant's request), freed when dropped.
    #[allow(dead_code, reason = "held until the body ends: its Drop frees a concurrency slot")]
    pub permit: Option<Box<dyn AdmissionHold>>,
    /// An event stream: a cut is told to the client in an error event.
    pub event_stream: bool,
    /// Reads the engine's usage as the answer passes (the closed loop, `accuracy.rs`).
    pub usage: Option<UsageTap>,
    /// The request's trace span (`--otlp-traces-endpoint`), ended with the body.
    pub span: Option<RequestSpan>,
    /// The most the answer's usage can be.
    pub usage_bound: UsageBound,
}

pub struct MeteredBody<S> {
    inner: S,
    tail: RequestTail,
    first_byte_seen: bool,
    /// Seconds from the request's arrival to the answer's first byte.
    first_byte_s: Option<f64>,
    /// Why the body was cut, held while the error event goes out first.
    broken: Option<Cut>,
    /// The error event was handed over and one poll has let the connection flush it.
    flushed: bool,
    /// The worker's body ended (what the usage tap still held has been passed on).
    ended: bool,
}

impl<S: AnswerSource> MeteredBody<S> {
    pub fn new(inner: S, tail: RequestTail) -> Self {
        Self {
            inner,
            tail,
            first_byte_seen: false,
            first_byte_s: None,
            broken: None,
            flushed: false,
            ended: false,
        }
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
    usage: Option<kvgate_protocol::usage::EngineUsage>,
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
    let body = kvgate_gateway_core::error::error_body(&message, "upstream_error", "upstream_stream_broken");
    Bytes::from(format!("data: {body}\n\n"))
}

impl<S: AnswerSource> Body for MeteredBody<S> {
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
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let polled = match polled {
            Poll::Ready(Some(Err(cut))) if this.tail.event_stream => {
                this.tail.event_stream = false;
                let worker = this.inner.worker_url();
                let event = error_event(worker, &cut);
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
                    // The whole answer arrived: the closed loop's sample is recorded (unless the
                    // answer moved to another worker than the one predicted for).
                    this.ended = true;
                    if this.inner.migrated() {
                        tap.forget_probe();
                    }
                    let (rest, usage) = tap.finish(&this.tail.metrics, this.first_byte_s);
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
                this.first_byte_s = Some(elapsed);
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

impl<S> Drop for MeteredBody<S> {
    fn drop(&mut self) {
        if let Some(tap) = &mut self.tail.usage {
            let usage = tap.dropped(&self.tail.metrics);
            settle(&mut self.tail.permit, usage, self.tail.usage_bound);
        }
        let elapsed = self.tail.started.elapsed().as_secs_f64();
        self.tail.metrics.duration(self.tail.endpoint).observe(elapsed);
    }
}
