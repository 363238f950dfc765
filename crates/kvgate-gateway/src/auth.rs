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

/// As [`check_admin_key`], and also accepting the key as the password of `Authorization: Basic`
/// (any user name): what a browser sends after asking, so the fleet page opens where a key is set.
pub fn check_admin_browser(expected: Option<&str>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(expected) = expected else { return Ok(()) };
    if check_admin_key(Some(expected), headers).is_ok() {
        return Ok(());
    }
    let password = basic_password(headers).unwrap_or_default();
    if constant_time_eq(password.as_bytes(), expected.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

/// The password of `Authorization: Basic base64(user:password)`.
fn basic_password(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let encoded = headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    text.split_once(':').map(|(_, password)| password.to_string())
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
