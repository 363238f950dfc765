//! The gateway's errors and their one mapping to HTTP: OpenAI-style JSON bodies
//! `{"error": {"message", "type", "code"}}` with the matching status.

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};

/// Every way a request can fail in the gateway itself (upstream answers are passed through).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("missing or invalid admin API key")]
    Unauthorized,
    #[error("missing or invalid API key (Authorization: Bearer KEY)")]
    InvalidApiKey,
    #[error("{0}")]
    NotFound(String),
    #[error("the model `{0}` does not exist or is not served by any worker")]
    ModelNotFound(String),
    #[error("request body exceeds the limit of {0} bytes")]
    PayloadTooLarge(usize),
    #[error("too many concurrent requests (limit {0})")]
    TooManyRequests(usize),
    #[error("no healthy worker is available{0}")]
    NoHealthyWorker(String),
    #[error("the worker did not answer within {0:.1} s")]
    UpstreamTimeout(f64),
    #[error("could not reach a worker: {0}")]
    UpstreamUnreachable(String),
    #[error("{0}")]
    Conflict(String),
    /// Refused by the gateway's policy (a worker address outside `--worker-url-allow`).
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    LoopDetected(String),
    /// A body of a type the endpoint does not take (the admin API's writes take JSON only).
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("over the rate limit (--rate-limit-tokens-per-second)")]
    RateLimited,
    /// Over one of the tenant's quotas (`tenants:`).
    #[error("{}", over_quota_message(tenant, over))]
    OverQuota { tenant: String, over: crate::tenant::OverQuota },
    #[error("waited {0:.1} s in the admission queue without a free slot")]
    QueueTimeout(f64),
    #[error("{0}")]
    RequestTimeout(String),
    /// Every worker the request could use is over the overload bounds (`--worker-overload-shed`);
    /// the client may retry after `retry_after_secs`.
    #[error("every worker{where_} is overloaded (--worker-overload-waiting-requests, --worker-overload-token-usage); retry later")]
    Overloaded { where_: String, retry_after_secs: u64 },
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized | ApiError::InvalidApiKey => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) | ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NoHealthyWorker(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::LoopDetected(_) => StatusCode::LOOP_DETECTED,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::RateLimited | ApiError::OverQuota { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::QueueTimeout(_) | ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn kind_and_code(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::BadRequest(_) => ("invalid_request_error", "invalid_request"),
            ApiError::Unauthorized | ApiError::InvalidApiKey => ("authentication_error", "invalid_api_key"),
            ApiError::NotFound(_) => ("invalid_request_error", "not_found"),
            ApiError::ModelNotFound(_) => ("invalid_request_error", "model_not_found"),
            ApiError::PayloadTooLarge(_) => ("invalid_request_error", "payload_too_large"),
            ApiError::TooManyRequests(_) => ("rate_limit_error", "too_many_requests"),
            ApiError::NoHealthyWorker(_) => ("service_unavailable", "no_healthy_worker"),
            ApiError::UpstreamTimeout(_) => ("timeout_error", "upstream_timeout"),
            ApiError::UpstreamUnreachable(_) => ("upstream_error", "upstream_unreachable"),
            ApiError::Conflict(_) => ("invalid_request_error", "conflict"),
            ApiError::Forbidden(_) => ("permission_error", "forbidden"),
            ApiError::LoopDetected(_) => ("invalid_request_error", "loop_detected"),
            ApiError::UnsupportedMediaType(_) => ("invalid_request_error", "unsupported_media_type"),
            ApiError::RateLimited => ("rate_limit_error", "rate_limited"),
            ApiError::OverQuota { over, .. } => ("rate_limit_error", over_quota_code(over.quota)),
            ApiError::QueueTimeout(_) => ("rate_limit_error", "queue_timeout"),
            ApiError::RequestTimeout(_) => ("invalid_request_error", "request_timeout"),
            // SMG's code for the same refusal.
            ApiError::Overloaded { .. } => ("service_unavailable", "worker_overload_protection_shed"),
        }
    }
}

fn over_quota_code(quota: crate::tenant::Quota) -> &'static str {
    use crate::tenant::Quota;
    match quota {
        Quota::RequestsPerMinute => "requests_per_minute_exceeded",
        Quota::TokensPerMinute => "tokens_per_minute_exceeded",
        Quota::MaxConcurrent => "max_concurrent_exceeded",
    }
}

fn over_quota_message(tenant: &str, over: &crate::tenant::OverQuota) -> String {
    use crate::tenant::Quota;
    let limit = over.limit;
    let what = match over.quota {
        Quota::RequestsPerMinute => format!("its requests_per_minute quota ({limit} requests per minute)"),
        Quota::TokensPerMinute => format!("its tokens_per_minute quota ({limit} tokens per minute)"),
        Quota::MaxConcurrent => format!("its max_concurrent quota ({limit} requests at once)"),
    };
    match over.retry_after {
        Some(wait) => format!("tenant `{tenant}` is over {what}; retry after {} s", retry_after_secs(wait)),
        None => format!(
            "tenant `{tenant}`: this request alone (prompt plus max_tokens) exceeds {what}; lower max_tokens or shorten the prompt"
        ),
    }
}

/// `Retry-After` in whole seconds, at least 1.
fn retry_after_secs(wait: std::time::Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}

/// Render an OpenAI-style error body.
pub fn error_body(message: &str, kind: &str, code: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "code": code}}).to_string()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (kind, code) = self.kind_and_code();
        let mut response = (self.status(), error_body(&self.to_string(), kind, code)).into_response();
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let ApiError::Overloaded { retry_after_secs, .. } = &self {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_secs));
        }
        if let ApiError::OverQuota { over, .. } = &self {
            // A request that can never pass is told to come back in a minute, the quota's window.
            let wait = over.retry_after.unwrap_or(std::time::Duration::from_secs(60));
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs(wait)));
        }
        response
    }
}
