//! A stream that survives its engine (`--migrate-streams`). A streamed chat or completion is
//! relayed event by event ([`Relay`]): only whole events go out, and each is read into the
//! answer's [`Transcript`]. When the engine fails after the answer began (its connection breaks,
//! or its body stalls past `--body-stall-timeout-secs`), the request is continued on another
//! engine (`continuation.rs`: the text so far as the prompt's end, `max_tokens` lowered),
//! planned like a retry (the engines that failed it left out) under the request's own admission,
//! and its events are rewritten into the same answer (`transcript.rs`). At most
//! `--max-stream-migrations` times; a request that cannot be continued (several choices, tool
//! calls, reasoning, structured output, token-id prompts, `/generate`) ends with the error event
//! as before. `kvgate_stream_migrations_total{endpoint, result}` counts what became of each cut.

mod continuation;
mod transcript;

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use serde_json::{Map, Value};

use super::outcome::{Failure, Outcome, Served};
use super::plan::RoutePlan;
use crate::body::{AnswerSource, BodyWatch, Cut, InFlight, Watched};
use crate::state::AppState;
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::conn::UpstreamBody;
use kvgate_protocol::edit::FieldEdit;
use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::request::RequestFields;
use kvgate_protocol::role::PdProtocol;
use kvgate_protocol::sse::{event_data, last_boundary, split_events};
use transcript::{Transcript, Verdict};

/// What continuing a request on another engine needs, kept from the request.
pub(super) struct Resume {
    state: Arc<AppState>,
    endpoint: Endpoint,
    path_and_query: String,
    /// The client's headers as forwarded to engines.
    headers: HeaderMap,
    /// The client's session key header (`--routing-key-header`), which the engines do not get.
    session: Option<http::HeaderValue>,
    /// The client's request as forwarded (its KV-transfer fields taken out); read again only
    /// when the stream is cut.
    body: Bytes,
    /// The client asked for the usage chunk.
    client_usage: bool,
    /// The request's class as the engine's `priority` (`--forward-priority`).
    priority: Option<i64>,
    /// The request's tenant, as its series name it.
    tenant: String,
}

impl Resume {
    /// The continuation context of a streamed chat or completion, when `--migrate-streams` is on:
    /// `headers` as forwarded and as the client sent them, the body as forwarded, and what the
    /// admission made of it: the `priority` the gateway gives it and its tenant's label.
    pub(super) fn of(
        state: &Arc<AppState>,
        endpoint: Endpoint,
        path_and_query: &str,
        (headers, client_headers): (&HeaderMap, &HeaderMap),
        fields: &RequestFields<'_>,
        forwarded: &Bytes,
        (priority, tenant): (Option<i64>, &str),
    ) -> Option<Arc<Resume>> {
        let streamed = fields.stream == Some(true);
        if !state.config.migrate_streams
            || !streamed
            || !matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Completions)
        {
            return None;
        }
        Some(Arc::new(Resume {
            state: state.clone(),
            endpoint,
            path_and_query: path_and_query.to_string(),
            headers: headers.clone(),
            session: client_headers.get(&state.routing_key_header).cloned(),
            body: forwarded.clone(),
            client_usage: fields.asks_usage(),
            priority,
            tenant: tenant.to_string(),
        }))
    }

    fn count(&self, result: &str) {
        self.state.metrics.stream_migrations.with_label_values(&[self.endpoint.label(), result]).inc();
    }
}

/// A continuation that reached another engine.
struct Resumed {
    body: UpstreamBody,
    in_flight: InFlight,
    worker: Arc<Worker>,
}

type Resuming = Pin<Box<dyn Future<Output = Result<Resumed, String>> + Send>>;

/// A streamed answer that moves to another engine when its own fails.
pub(super) struct Relay {
    current: Watched,
    resume: Arc<Resume>,
    watch: BodyWatch,
    transcript: Transcript,
    /// Every engine that answered (and failed) this stream.
    tried: Vec<u32>,
    migrations: u32,
    /// A continuation on its way to another engine, and the cut it answers.
    pending: Option<(Resuming, Cut)>,
    /// The current answer's bytes past its last whole event.
    partial: BytesMut,
    /// Whole events ready to go out.
    ready: VecDeque<Bytes>,
    ended: bool,
}

impl Relay {
    /// The relay of `first` (the answer of worker `worker`); `gateway_usage`: the gateway asked
    /// for the usage chunk on the client's behalf (and leaves it out again).
    pub(super) fn new(
        first: Watched,
        worker: u32,
        resume: Arc<Resume>,
        watch: BodyWatch,
        gateway_usage: bool,
    ) -> Self {
        let transcript = Transcript::new(resume.client_usage || gateway_usage);
        Self {
            current: first,
            resume,
            watch,
            transcript,
            tried: vec![worker],
            migrations: 0,
            pending: None,
            partial: BytesMut::new(),
            ready: VecDeque::new(),
            ended: false,
        }
    }

    /// One frame of the current answer: its whole events go out (a frame of whole events as it
    /// is, unless rewritten), read into the transcript; a partial event waits for its end.
    fn on_data(&mut self, data: Bytes) {
        if self.partial.is_empty() && data.ends_with(b"\n\n") && !self.transcript.migrated {
            for event in split_events(&data) {
                if let Some(payload) = event_data(event) {
                    self.transcript.on_event(payload);
                }
            }
            self.ready.push_back(data);
            return;
        }
        self.partial.extend_from_slice(&data);
        let Some(end) = last_boundary(&self.partial) else { return };
        let whole = self.partial.split_to(end).freeze();
        let mut kept: Option<BytesMut> = None;
        for event in split_events(&whole) {
            let verdict =
                event_data(event).map_or(Verdict::Pass, |payload| self.transcript.on_event(payload));
            match verdict {
                Verdict::Pass if kept.is_none() && !self.transcript.migrated => continue,
                Verdict::Pass => kept.get_or_insert_with(BytesMut::new).extend_from_slice(event),
                Verdict::Rewritten(bytes) => kept.get_or_insert_with(BytesMut::new).extend_from_slice(&bytes),
                Verdict::Drop => {
                    kept.get_or_insert_with(BytesMut::new);
                }
            }
        }
        match kept {
            Some(kept) if !kept.is_empty() => self.ready.push_back(kept.freeze()),
            Some(_) => {}
            None => self.ready.push_back(whole),
        }
    }

    /// The current answer was cut: continued on another engine when it can be (`None`), else
    /// the cut the client is told of.
    fn on_cut(&mut self, cut: Cut) -> Option<Cut> {
        if matches!(cut, Cut::Deadline(_)) {
            return Some(cut);
        }
        if self.transcript.done {
            self.ended = true;
            return None;
        }
        if self.transcript.finished {
            // The answer is whole but for its end.
            self.ready.push_back(Bytes::from_static(kvgate_protocol::sse::DONE));
            self.ended = true;
            return None;
        }
        let resume = self.resume.clone();
        let request = match serde_json::from_slice::<Map<String, Value>>(&resume.body) {
            Ok(request) => request,
            Err(_) => Map::new(),
        };
        let unresumable =
            continuation::unresumable(resume.endpoint, &request).or(self.transcript.unresumable);
        if let Some(why) = unresumable {
            resume.count("not_resumable");
            tracing::debug!(why, "a stream that cannot be continued was cut");
            return Some(cut);
        }
        if self.migrations >= resume.state.config.max_stream_migrations {
            resume.count("exhausted");
            return Some(cut);
        }
        let tokens = self.transcript.generated();
        let body = match continuation::continuation(resume.endpoint, request, &self.transcript.text, tokens) {
            Ok(body) => body,
            Err(why) => {
                resume.count("not_resumable");
                tracing::debug!(why, "a cut stream was not continued");
                return Some(cut);
            }
        };
        super::attempt::record_failure(&resume.state, self.current.worker(), "stream");
        tracing::debug!(worker = self.current.worker_url(), %cut, tokens, "a stream moves to another engine");
        self.migrations += 1;
        self.partial.clear();
        let resuming = resume_elsewhere(resume, body, self.tried.clone(), self.migrations);
        let resuming: Resuming = match self.watch.deadline {
            Some((at, _)) => Box::pin(async move {
                tokio::time::timeout_at(at, resuming)
                    .await
                    .unwrap_or_else(|_| Err("the stream's deadline passed".into()))
            }),
            None => Box::pin(resuming),
        };
        self.pending = Some((resuming, cut));
        None
    }
}

impl Body for Relay {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        let this = &mut *self;
        loop {
            if let Some(bytes) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            if let Some((resuming, _)) = &mut this.pending {
                let resumed = match resuming.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(resumed) => resumed,
                };
                let (_, cut) = this.pending.take().expect("pending");
                match resumed {
                    Ok(Resumed { body, in_flight, worker }) => {
                        this.resume.count("resumed");
                        this.tried.push(worker.id);
                        this.current = Watched::new(body, in_flight, worker, this.watch);
                        this.transcript.continue_on_another();
                        continue;
                    }
                    Err(why) => {
                        this.resume.count("failed");
                        return Poll::Ready(Some(Err(Cut::Unmoved { cut: Box::new(cut), why })));
                    }
                }
            }
            match Pin::new(&mut this.current).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    if !this.partial.is_empty() {
                        let rest = this.partial.split().freeze();
                        this.ready.push_back(rest);
                    }
                    this.ended = true;
                }
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        this.on_data(data);
                    }
                }
                Poll::Ready(Some(Err(cut))) => {
                    if let Some(cut) = this.on_cut(cut) {
                        return Poll::Ready(Some(Err(cut)));
                    }
                }
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl AnswerSource for Relay {
    fn worker_url(&self) -> &str {
        self.current.worker_url()
    }

    fn migrated(&self) -> bool {
        self.transcript.migrated
    }
}

/// Plans and sends the continuation `body` as the request's retries go, leaving out `tried`:
/// the first engine that starts a streamed answer takes it.
async fn resume_elsewhere(
    resume: Arc<Resume>,
    body: Bytes,
    mut tried: Vec<u32>,
    migration: u32,
) -> Result<Resumed, String> {
    let state = &resume.state;
    let body = match resume.priority {
        Some(priority) => {
            super::attempt::edited(&body, &[FieldEdit::Set("priority", priority.into())], "a continuation")
                .map_err(|error| error.to_string())?
        }
        None => body,
    };
    let fields = RequestFields::parse(&body)?;
    let mut headers = resume.headers.clone();
    headers.insert(kvgate_protocol::headers::RESUMED.clone(), http::HeaderValue::from(migration));
    // Planned as the request was: its session key counts (it is not forwarded).
    let mut planning = HeaderMap::new();
    if let Some(session) = &resume.session {
        planning.insert(state.routing_key_header.clone(), session.clone());
    }
    let prepared = super::prepare::prepare(state, resume.endpoint, &fields, &planning, &body)
        .await
        .map_err(|error| error.to_string())?;
    let request = prepared.route_request();
    let exchange = super::pd::Exchange {
        state,
        path_and_query: &resume.path_and_query,
        headers: &headers,
        body: &body,
        request: &request,
        namespace: prepared.namespace,
        tenant: &resume.tenant,
        // A continuation's answer teaches no policy (`streamed` keeps its response alone).
        started: std::time::Instant::now(),
    };
    let attempts = if state.config.disable_retries { 1 } else { 1 + state.config.retry_max_retries };
    let mut last = String::from("no other engine serves the model");
    for _ in 0..attempts {
        let plan = prepared
            .shape
            .plan(state, &request, prepared.namespace, &tried, None)
            .map_err(|error| format!("{last}; {error}"))?;
        let outcome = match plan {
            RoutePlan::Single(pick) | RoutePlan::InPlace { decode: pick, .. } => {
                super::single(&exchange, pick).await
            }
            RoutePlan::Pair { prefill, decode, .. } => match state.config.pd_protocol {
                PdProtocol::Sglang => super::pd::sglang(&exchange, prefill, decode, false).await,
                PdProtocol::Vllm => super::pd::vllm(&exchange, prefill, decode).await,
            },
        };
        match outcome {
            Outcome::Done(served) => return streamed(*served),
            Outcome::Retry { failure, failed } => {
                tried.push(failed);
                last = match failure {
                    Failure::Response(served) => {
                        format!("{} answered {}", served.worker.url, served.response.status())
                    }
                    Failure::Unreachable(message) => message,
                    Failure::TimedOut(secs) => format!("no answer within {secs:.1} s"),
                };
            }
            Outcome::Fatal(error) => return Err(error.to_string()),
        }
    }
    Err(last)
}

/// A continuation's answer, when it is a stream.
fn streamed(served: Served) -> Result<Resumed, String> {
    let Served { response, in_flight, worker, .. } = served;
    let status = response.status();
    let event_stream = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"));
    if !status.is_success() || !event_stream {
        return Err(format!("{} answered the continuation with {status}", worker.url));
    }
    Ok(Resumed { body: response.into_body(), in_flight, worker })
}
