//! Worker URLs: the one canonical spelling of a worker's address (what the duplicate check, the
//! metrics' labels and `/workers` use), and credentials kept out of messages.

/// Check and canonicalize a worker URL: `scheme://host[:port][/prefix]` with the scheme and host
/// lower-cased, the scheme's default port dropped, no trailing slash, so that one worker has one
/// spelling (the duplicate check runs on it). Credentials (`user:pass@`) are refused: they would
/// be shown in `/workers`, logs and metric labels (give the worker's key with `--api-key`).
pub fn normalize_url(url: &str) -> Result<String, String> {
    let (scheme, rest) = match url.trim().split_once("://") {
        Some((scheme, rest)) => (scheme.to_ascii_lowercase(), rest.trim_end_matches('/')),
        None => return Err(format!("worker URL {url:?} must start with http:// or https://")),
    };
    let default_port = match scheme.as_str() {
        "http" => 80,
        "https" => 443,
        other => {
            return Err(format!(
                "worker URL {url:?}: scheme {other:?} is not supported, use http:// or https://"
            ))
        }
    };
    let (authority, path) = match rest.find(['/', '?', '#']) {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    if path.contains(['?', '#']) {
        return Err(format!("worker URL {url:?} must not carry a query string or fragment"));
    }
    if authority.contains('@') {
        return Err(format!(
            "worker URL {:?} must not carry credentials (user:password@); give the workers' key with --api-key",
            redact_credentials(url)
        ));
    }
    if authority.is_empty() {
        return Err(format!("worker URL {url:?} has no host"));
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, Some(port)),
        _ => (authority, None),
    };
    if host.is_empty() || host == "[]" {
        return Err(format!("worker URL {url:?} has no host"));
    }
    let port = match port {
        None => None,
        Some(text) => match text.parse::<u16>() {
            Ok(0) | Err(_) => return Err(format!("worker URL {url:?}: port {text:?} is not in 1-65535")),
            Ok(port) if port == default_port => None,
            Ok(port) => Some(port),
        },
    };
    let host = host.to_ascii_lowercase();
    let canonical = match port {
        Some(port) => format!("{scheme}://{host}:{port}{path}"),
        None => format!("{scheme}://{host}{path}"),
    };
    // Anything else malformed (spaces, bad characters) fails here.
    canonical.parse::<http::Uri>().map_err(|e| format!("worker URL {url:?} is not a valid URL: {e}"))?;
    Ok(canonical)
}

/// `url` with any `user:password@` replaced by `***@`, for messages.
pub fn redact_credentials(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_normalization() {
        assert_eq!(normalize_url("http://127.0.0.1:8000/").unwrap(), "http://127.0.0.1:8000");
        assert_eq!(normalize_url("HTTP://LocalHost:8000").unwrap(), "http://localhost:8000");
        assert_eq!(normalize_url("http://host:80/v1/").unwrap(), "http://host/v1", "default port dropped");
        assert_eq!(normalize_url("https://host:443").unwrap(), "https://host");
        assert_eq!(normalize_url("http://[::1]:8000").unwrap(), "http://[::1]:8000");
        assert_eq!(normalize_url("http://[::1]").unwrap(), "http://[::1]");
        for (bad, says) in [
            ("127.0.0.1:8000", "must start with"),
            ("ftp://x:1", "not supported"),
            ("http://", "no host"),
            ("http://x:1/?a=b", "query"),
            ("http://x:99999", "1-65535"),
            ("http://x:0", "1-65535"),
            ("http://x:port", "1-65535"),
            ("not a url", "must start with"),
            ("http://bad host:1", "not a valid URL"),
        ] {
            let error = normalize_url(bad).unwrap_err();
            assert!(error.contains(says), "{bad}: {error}");
        }
        let secret = normalize_url("http://user:hunter2@10.0.0.1:8000").unwrap_err();
        assert!(secret.contains("credentials") && !secret.contains("hunter2"), "{secret}");
    }
}
