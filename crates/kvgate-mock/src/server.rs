//! One simulated engine's HTTP router: its routes, each generation route wrapped in the soak id count, and the small handlers (health, models, flush_cache).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::args::EngineKind;
use crate::soak_counting::counted;
use crate::state::AppState;
use crate::{canned, metrics, openai, sglang};

/// The worker's routes; generation routes answer from the model or canned bodies.
pub(crate) fn router(state: Arc<AppState>, kind: EngineKind) -> Router {
    let router = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/loads", get(sglang::loads))
        .route("/server_info", get(sglang::server_info))
        .route("/get_server_info", get(sglang::server_info))
        .route("/flush_cache", post(flush_cache))
        .route("/metrics", get(metrics::metrics));
    let router = match kind {
        EngineKind::Realistic => router
            .route("/v1/chat/completions", counted(openai::chat))
            .route("/v1/completions", counted(openai::completions))
            .route("/generate", counted(sglang::generate)),
        EngineKind::Canned => router
            .route("/v1/chat/completions", counted(canned::chat))
            .route("/v1/completions", counted(canned::completions))
            .route("/generate", counted(canned::generate)),
    };
    router.with_state(state)
}

async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    let unhealthy = state.options.unhealthy_after.is_some_and(|after| state.started.elapsed() >= after);
    if unhealthy {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

/// `GET /v1/models`: the base model, then each adapter with `parent` naming the base model (as
/// vLLM's `ModelCard` does for a LoRA module).
async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let mut data = vec![serde_json::json!({"id": state.model, "object": "model", "owned_by": "kvgate-mock",
        "created": 0, "root": state.model, "parent": null})];
    data.extend(state.options.lora_adapters.iter().map(|lora| {
        serde_json::json!({"id": lora.name, "object": "model", "owned_by": "kvgate-mock", "created": 0,
            "root": format!("/adapters/{}", lora.name), "parent": state.model})
    }));
    Json(serde_json::json!({"object": "list", "data": data}))
}

/// SGLang's `/flush_cache`: clears the prefix cache when no request uses it.
async fn flush_cache(State(state): State<Arc<AppState>>) -> Response {
    match &state.engine {
        Some(engine) if !engine.flush_cache() => {
            (StatusCode::BAD_REQUEST, "Cache not flushed: requests are running.").into_response()
        }
        _ => (StatusCode::OK, "Cache flushed.").into_response(),
    }
}
