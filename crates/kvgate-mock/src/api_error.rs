//! The mock's OpenAI-style error answer (`{"error": {"message", "type", "code"}}`) and the JSON body parser that answers with it.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;

/// An OpenAI-style error: `{"error": {"message", "type", "code"}}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", message: message.into() }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, kind: "server_error", message: message.into() }
    }

    /// A prefill/decode KV transfer failed (502, before any response byte).
    pub(crate) fn kv_transfer(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_GATEWAY, kind: "kv_transfer_error", message: message.into() }
    }

    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
        Self { status: StatusCode::SERVICE_UNAVAILABLE, kind: "server_error", message: message.into() }
    }

    pub(crate) fn injected() -> Self {
        Self::internal("injected failure (--fail-rate)")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "code": self.status.as_u16(),
        }});
        (self.status, Json(body)).into_response()
    }
}

/// Parses a JSON request body, answering 400 on malformed input.
pub(crate) fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|error| ApiError::bad_request(format!("invalid JSON body: {error}")))
}
