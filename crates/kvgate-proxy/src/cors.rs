//! CORS for browsers calling the proxied endpoints (`--cors-allowed-origins`, SMG's name): a
//! request whose `Origin` is allowed gets `Access-Control-Allow-Origin` on its response, and the
//! preflight `OPTIONS` of a proxied path is answered here. No allowed origins: no CORS headers,
//! and a preflight is refused (the browser then refuses the call).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderMap, HeaderValue, StatusCode};

use crate::state::SharedState;
use kvgate_gateway_core::error::ApiError;

/// The `Access-Control-Allow-Origin` value for a request with these headers: its origin when it
/// is one of `allowed` (or `allowed` has `*`: then `*`); `None` without an allowed origin.
pub fn allow_origin(allowed: &[String], headers: &HeaderMap) -> Option<HeaderValue> {
    if allowed.is_empty() {
        return None;
    }
    let origin = headers.get(header::ORIGIN)?;
    if allowed.iter().any(|entry| entry == "*") {
        return Some(HeaderValue::from_static("*"));
    }
    let text = origin.to_str().ok()?;
    allowed.iter().any(|entry| entry.trim_end_matches('/') == text).then(|| origin.clone())
}

/// Adds the CORS headers of an allowed origin to a response.
pub fn decorate(response: &mut Response, origin: HeaderValue) {
    let headers = response.headers_mut();
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    headers.append(header::VARY, HeaderValue::from_static("origin"));
}

/// `OPTIONS` on a proxied path: the preflight answer for an allowed origin (204), else 403.
pub async fn preflight(State(state): State<SharedState>, headers: HeaderMap) -> Response {
    let Some(origin) = allow_origin(&state.config.cors_allowed_origins, &headers) else {
        return ApiError::Forbidden("CORS: the request's origin is not in --cors-allowed-origins".into())
            .into_response();
    };
    let mut response = StatusCode::NO_CONTENT.into_response();
    decorate(&mut response, origin);
    let answer = response.headers_mut();
    answer.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("POST, OPTIONS"));
    let asked = headers.get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
    answer.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.unwrap_or(HeaderValue::from_static("*")));
    answer.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_origin(origin: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::ORIGIN, HeaderValue::from_str(origin).unwrap());
        headers
    }

    #[test]
    fn only_listed_origins_are_allowed() {
        let listed = vec!["https://app.example".to_string(), "http://localhost:3000/".to_string()];
        assert_eq!(
            allow_origin(&listed, &with_origin("https://app.example")).unwrap(),
            "https://app.example"
        );
        assert_eq!(
            allow_origin(&listed, &with_origin("http://localhost:3000")).unwrap(),
            "http://localhost:3000"
        );
        assert_eq!(allow_origin(&listed, &with_origin("https://evil.example")), None);
        assert_eq!(allow_origin(&listed, &HeaderMap::new()), None);
        assert_eq!(allow_origin(&[], &with_origin("https://app.example")), None);
        assert_eq!(allow_origin(&["*".to_string()], &with_origin("https://any.example")).unwrap(), "*");
    }
}
