//! Soak request ids, the counting: the `POST` route that wraps a generation handler and counts
//! its request's `x-soak-id` into the worker's counts (`soak_ids.rs`) when it arrives, and its
//! answer when a 2xx head goes out. Requests without the header are not looked at beyond the one
//! header lookup.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, HttpBody};
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::response::Response;
use axum::routing::{post, MethodRouter};
use bytes::Bytes;

use crate::soak_ids::{SoakIdSeen, WorkerSoakIds, SOAK_ID_HEADER};
use crate::state::AppState;

/// The header the gateway sends with a stream's continuation on another engine.
const RESUMED_HEADER: &str = "x-kvgate-resumed";

/// The `x-soak-id` header of a request, if it has a valid one, and whether the request is a
/// continuation.
pub(crate) struct SoakId(Option<String>, bool);

impl<S: Send + Sync> FromRequestParts<S> for SoakId {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Infallible> {
        let id = parts.headers.get(SOAK_ID_HEADER).and_then(|value| value.to_str().ok());
        Ok(SoakId(id.map(str::to_string), parts.headers.contains_key(RESUMED_HEADER)))
    }
}

fn update(counts: &WorkerSoakIds, id: &str, change: impl FnOnce(&mut SoakIdSeen)) {
    let mut counts = counts.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match counts.get_mut(id) {
        Some(seen) => change(seen),
        None => change(counts.entry(id.to_string()).or_default()),
    }
}

/// A `POST` route for a generation handler that counts soak ids around it: the request when
/// the handler starts, the answer when its status is 2xx and its body gives the server its first
/// bytes (or ends): the server writes the head with them, in the same poll of the connection. An
/// engine killed before that never sent its answer (the gateway sees the connection close before
/// a head and rightly tries another engine), so it is not counted as answering. Without the
/// header the handler runs as is.
pub(crate) fn counted<H, F>(handler: H) -> MethodRouter<Arc<AppState>>
where
    H: Fn(State<Arc<AppState>>, Bytes) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response> + Send + 'static,
{
    post(move |State(state): State<Arc<AppState>>, SoakId(id, resumed): SoakId, body: Bytes| {
        let handler = handler.clone();
        async move {
            let Some(id) = id else {
                return handler(State(state), body).await;
            };
            update(&state.soak_ids, &id, |seen| seen.received += 1);
            let counts = state.soak_ids.clone();
            let response = handler(State(state), body).await;
            if !response.status().is_success() {
                return response;
            }
            let on_first_frame = Some(move || {
                update(&counts, &id, |seen| {
                    seen.answered += 1;
                    seen.resumed += u32::from(resumed);
                })
            });
            response.map(|inner| Body::new(CountedBody { inner, on_first_frame }))
        }
    })
}

/// A response body that runs `on_first_frame` when it first gives the server a frame or ends.
struct CountedBody<F> {
    inner: Body,
    on_first_frame: Option<F>,
}

impl<F: FnOnce() + Unpin + Send + 'static> HttpBody for CountedBody<F> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(Some(Ok(_)) | None)) {
            if let Some(count) = self.on_first_frame.take() {
                count();
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        // Never reported ended before its first frame, so that it is polled (and counts).
        self.on_first_frame.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
