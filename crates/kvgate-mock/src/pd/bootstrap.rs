//! A prefill engine's bootstrap server: the KV side channel decode engines pull from (`GET /kv/{room}`, a long-poll answered once the KV is transferred).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::rooms::{KvRooms, PullRefusal};
use crate::shutdown::stopped;

/// The body of a successful pull.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct PulledKv {
    pub(crate) room: String,
    pub(crate) prompt_tokens: u32,
    /// The prompt tokens the prefill engine found in its prefix cache.
    #[serde(default)]
    pub(crate) cached_tokens: u32,
    pub(crate) blocks: u64,
}

/// The bootstrap routes: `GET /kv/{room}` and `GET /health`.
pub(crate) fn router(rooms: Arc<KvRooms>) -> Router {
    Router::new()
        .route("/kv/{room}", get(pull))
        .route("/health", get(|| async { StatusCode::OK }))
        .with_state(rooms)
}

/// `GET /kv/{room}`: waits (at most a hold timeout) until the room's prefill is done, then
/// transfers its KV (sleeps the transfer time), frees it in the engine and answers
/// `{"room", "prompt_tokens", "cached_tokens", "blocks"}`. A room that failed (the prefill answered an error,
/// its KV expired, it was pulled already) answers 410 at once; one that never became ready
/// answers 404 (unknown) or 504 (still prefilling) after the hold timeout.
async fn pull(State(rooms): State<Arc<KvRooms>>, Path(room): Path<String>) -> Response {
    let held = match rooms.take(&room).await {
        Ok(held) => held,
        Err(PullRefusal::Closed(reason)) => return refusal(StatusCode::GONE, reason),
        Err(PullRefusal::Unknown(reason)) => return refusal(StatusCode::NOT_FOUND, reason),
        Err(PullRefusal::StillPrefilling(reason)) => return refusal(StatusCode::GATEWAY_TIMEOUT, reason),
        Err(PullRefusal::ShuttingDown) => {
            return refusal(StatusCode::SERVICE_UNAVAILABLE, "the prefill engine is shutting down".into())
        }
    };
    // The transfer runs in a task of its own: a puller that goes away mid-transfer still
    // leaves the KV released, never held forever.
    let transfer = {
        let rooms = rooms.clone();
        let room = room.clone();
        tokio::spawn(async move {
            let mut stop = rooms.stop.clone();
            tokio::select! {
                () = tokio::time::sleep(rooms.timing.transfer_time(u64::from(held.prompt_tokens))) => {}
                () = stopped(&mut stop) => {}
            }
            rooms.transferred(&room, held);
        })
    };
    if transfer.await.is_err() {
        return refusal(StatusCode::INTERNAL_SERVER_ERROR, "the KV transfer task failed".into());
    }
    Json(PulledKv {
        room,
        prompt_tokens: held.prompt_tokens,
        cached_tokens: held.cached_tokens,
        blocks: held.blocks,
    })
    .into_response()
}

fn refusal(status: StatusCode, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": "kv_transfer_error", "code": status.as_u16()}});
    (status, Json(body)).into_response()
}
