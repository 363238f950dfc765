//! Keeps web pages away from the admin API. A page opened in a browser on the gateway's host can
//! send "simple" requests to the loopback admin listener (a form or `text/plain` POST needs no
//! CORS preflight), and a page whose name an attacker rebinds to the gateway's address (DNS
//! rebinding) can even read the answers. So every admin request is refused (403) when a browser
//! marks it cross-site (`Sec-Fetch-Site` other than `same-origin` or `none`) or its `Origin` is
//! not the listener's own (the `Host` it was sent to); a write (POST) must be JSON (415
//! otherwise: a page cannot send JSON cross-site without a preflight this listener never
//! answers); and, where the admin API has no key, the `Host` must be one of the listener's own
//! names (its address; `localhost` on a loopback or wildcard bind; `--admin-allowed-hosts`).
//! With a key a rebound page cannot authenticate, so names are not checked (the main listener
//! behind a key is usually reached by a DNS name).

use std::net::{IpAddr, SocketAddr};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderMap, Method};

use kvgate_gateway_core::error::ApiError;
use kvgate_proxy::state::SharedState;

/// The middleware on every admin route.
pub(crate) async fn guard(State(state): State<SharedState>, request: Request, next: Next) -> Response {
    let own = state.admin_addr.get().copied();
    let names = Names {
        keyed: state.config.admin_api_key.is_some(),
        own,
        allowed: &state.config.admin_allowed_hosts,
    };
    match check(request.method(), request.headers(), &names) {
        Ok(()) => next.run(request).await,
        Err(error) => error.into_response(),
    }
}

/// What the `Host` check needs.
struct Names<'a> {
    /// The admin API has a key: names are not checked.
    keyed: bool,
    /// The listener's own address.
    own: Option<SocketAddr>,
    /// `--admin-allowed-hosts`.
    allowed: &'a [String],
}

fn header_text<'h>(headers: &'h HeaderMap, name: &header::HeaderName) -> Option<&'h str> {
    headers.get(name).map(|value| value.to_str().unwrap_or("\u{fffd}"))
}

fn check(method: &Method, headers: &HeaderMap, names: &Names<'_>) -> Result<(), ApiError> {
    let forbidden = |why: String| Err(ApiError::Forbidden(format!("the admin API refuses {why}")));
    if let Some(site) = headers.get("sec-fetch-site") {
        if !matches!(site.as_bytes(), b"same-origin" | b"none") {
            return forbidden(format!(
                "a cross-site request (Sec-Fetch-Site: {})",
                site.to_str().unwrap_or("?")
            ));
        }
    }
    let host = header_text(headers, &header::HOST);
    if let Some(origin) = header_text(headers, &header::ORIGIN) {
        let authority = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"));
        let same = match (authority, host) {
            (Some(authority), Some(host)) => authority.eq_ignore_ascii_case(host),
            _ => false,
        };
        if !same {
            return forbidden(format!("a request from another origin ({origin})"));
        }
    }
    if !names.keyed {
        if let Some(host) = host {
            if !own_name(host, names) {
                return forbidden(format!(
                    "Host {host:?}: not one of the admin listener's own names (add it to --admin-allowed-hosts)"
                ));
            }
        }
    }
    if *method == Method::POST || *method == Method::PUT || *method == Method::PATCH {
        let json = header_text(headers, &header::CONTENT_TYPE)
            .and_then(|value| value.split(';').next())
            .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(ApiError::UnsupportedMediaType(
                "the admin API takes JSON bodies only (Content-Type: application/json)".into(),
            ));
        }
    }
    Ok(())
}

/// `host` (a `Host` header: a name or an IP literal, maybe with a port) without its port.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Whether `host` names the listener: its address (any loopback literal for a loopback bind, any
/// of this machine's addresses for a wildcard one), `localhost`, or an allowed name.
fn own_name(host: &str, names: &Names<'_>) -> bool {
    let name = host_name(host);
    let allowed = names
        .allowed
        .iter()
        .any(|allowed| allowed.eq_ignore_ascii_case(host) || allowed.eq_ignore_ascii_case(name));
    if allowed {
        return true;
    }
    let Some(own) = names.own else { return false };
    let bound = own.ip().to_canonical();
    let local_bind = bound.is_loopback() || bound.is_unspecified();
    if name.eq_ignore_ascii_case("localhost") {
        return local_bind;
    }
    let Ok(ip) = name.parse::<IpAddr>() else { return false };
    let ip = ip.to_canonical();
    ip == bound
        || (ip.is_loopback() && local_bind)
        || (bound.is_unspecified() && kvgate_gateway_core::own_address::is_local(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| (header::HeaderName::from_static(name), value.parse().unwrap()))
            .collect()
    }

    fn status(method: Method, pairs: &[(&'static str, &'static str)], own: &str, allowed: &[String]) -> u16 {
        let names = Names { keyed: false, own: Some(own.parse().unwrap()), allowed };
        match check(&method, &headers(pairs), &names) {
            Ok(()) => 200,
            Err(error) => error.status().as_u16(),
        }
    }

    #[test]
    fn browsers_cross_site_marks_and_foreign_names_are_refused() {
        let own = "127.0.0.1:30001";
        let json = ("content-type", "application/json; charset=utf-8");
        let host = ("host", "127.0.0.1:30001");
        for (pairs, expected) in [
            (vec![host, json], 200),
            (vec![("host", "localhost:30001"), json], 200),
            (vec![("host", "[::1]:30001"), json], 200),
            (vec![host, json, ("origin", "http://127.0.0.1:30001"), ("sec-fetch-site", "same-origin")], 200),
            (vec![host, json, ("sec-fetch-site", "none")], 200),
            (vec![host, json, ("origin", "http://evil.example")], 403),
            (vec![host, json, ("origin", "null")], 403),
            (vec![host, json, ("sec-fetch-site", "cross-site")], 403),
            (vec![host, json, ("sec-fetch-site", "same-site")], 403),
            (vec![("host", "attacker.example:30001"), json], 403),
            (vec![("host", "10.1.2.3:30001"), json], 403),
            (vec![host, ("content-type", "text/plain")], 415),
            (vec![host], 415),
        ] {
            assert_eq!(status(Method::POST, &pairs, own, &[]), expected, "{pairs:?}");
        }
        // Reads and removals need no content type.
        assert_eq!(status(Method::GET, &[host], own, &[]), 200);
        assert_eq!(status(Method::DELETE, &[host, ("origin", "http://evil.example")], own, &[]), 403);
        // Allowed names, with or without their port.
        let allowed = vec!["gw.internal".to_string(), "other:9".to_string()];
        assert_eq!(status(Method::GET, &[("host", "gw.internal:30001")], own, &allowed), 200);
        assert_eq!(status(Method::GET, &[("host", "other:9")], own, &allowed), 200);
        assert_eq!(status(Method::GET, &[("host", "other:10")], own, &allowed), 403);
        // A wildcard bind answers to this machine's addresses, never to another's.
        assert_eq!(status(Method::GET, &[("host", "127.0.0.1:1")], "0.0.0.0:1", &[]), 200);
        assert_eq!(status(Method::GET, &[("host", "192.0.2.1:1")], "0.0.0.0:1", &[]), 403);
        // With a key, names are not checked (a rebound page cannot authenticate).
        let names = Names { keyed: true, own: None, allowed: &[] };
        assert!(check(&Method::GET, &headers(&[("host", "gw.example.com")]), &names).is_ok());
    }
}
