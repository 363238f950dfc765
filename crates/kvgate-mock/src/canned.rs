//! The canned engine's handlers: fixed small answers (prebuilt bytes) after `--gen-ms`, no model, for measuring gateway overhead.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;

use crate::api_error::parse_json;
use crate::canned_bodies::{CannedBodies, CannedEndpoint};
use crate::generation::{cut_body, sse_response, whole_response};
use crate::state::AppState;

/// Only `stream` matters; the rest of the body is checked to be JSON and ignored.
#[derive(Deserialize)]
struct CannedRequest {
    #[serde(default)]
    stream: bool,
}

async fn answer(state: &AppState, body: &[u8], pick: fn(&CannedBodies) -> &CannedEndpoint) -> Response {
    let cut = match state.inject_faults().await {
        Ok(cut) => cut,
        Err(response) => return response,
    };
    let request: CannedRequest = match parse_json(body) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    if state.options.gen_ms > 0 {
        tokio::time::sleep(Duration::from_millis(state.options.gen_ms)).await;
    }
    let endpoint = pick(&state.canned);
    if !request.stream {
        return whole_response(endpoint.whole.clone(), cut);
    }
    if cut {
        return sse_response(cut_body(endpoint.stream_head.clone()));
    }
    let chunks = [Ok::<_, Infallible>(endpoint.stream_head.clone()), Ok(endpoint.stream_tail.clone())];
    sse_response(Body::from_stream(futures_util::stream::iter(chunks)))
}

pub(crate) async fn chat(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    answer(&state, &body, |bodies| &bodies.chat).await
}

pub(crate) async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    answer(&state, &body, |bodies| &bodies.completion).await
}

pub(crate) async fn generate(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    answer(&state, &body, |bodies| &bodies.generate).await
}
