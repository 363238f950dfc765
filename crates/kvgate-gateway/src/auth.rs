//! The gateway's own keys: the admin key (`--admin-api-key`) in front of its management
//! endpoints, and the client keys (`--client-api-keys`) in front of the proxied ones. Both are
//! `Authorization: Bearer` tokens compared in constant time.

use http::{header, HeaderMap};

use crate::error::ApiError;

/// Refuses the request unless it carries the admin key (when one is configured).
pub fn check_admin_key(expected: Option<&str>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(expected) = expected else { return Ok(()) };
    if constant_time_eq(bearer_token(headers).as_bytes(), expected.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

/// With client keys configured, the request must present one of them (every key is compared,
/// so the time taken does not say which one nearly matched).
pub fn check_client_key(keys: &[String], headers: &HeaderMap) -> Result<(), ApiError> {
    if keys.is_empty() {
        return Ok(());
    }
    let presented = bearer_token(headers);
    let mut valid = false;
    for key in keys {
        valid |= constant_time_eq(presented.as_bytes(), key.as_bytes());
    }
    if valid {
        Ok(())
    } else {
        Err(ApiError::InvalidApiKey)
    }
}

/// The `Authorization: Bearer TOKEN` token of a request ("" when there is none).
fn bearer_token(headers: &HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
