//! Worker URLs: the one canonical spelling of a worker's address (what the duplicate check, the
//! metrics' labels and `/workers` use), and credentials kept out of messages.

/// Check and canonicalize a worker URL (parsed by `url`, the WHATWG URL standard):
/// `scheme://host[:port][/prefix]` with the scheme and host lower-cased, the scheme's default
/// port dropped, no trailing slash, so that one worker has one
/// spelling (the duplicate check runs on it). Credentials (`user:pass@`) are refused: they would
/// be shown in `/workers`, logs and metric labels (give the worker's key with `--api-key`).
pub fn normalize_url(url: &str) -> Result<String, String> {
    // Every message names the URL with its credentials, if any, redacted.
    let shown = redact_credentials(url.trim());
    if !url.contains("://") {
        return Err(format!("worker URL {shown:?} must start with http:// or https://"));
    }
    let parsed = match url::Url::parse(url.trim()) {
        Ok(parsed) => parsed,
        Err(url::ParseError::EmptyHost) => return Err(format!("worker URL {shown:?} has no host")),
        Err(url::ParseError::InvalidPort) => {
            return Err(format!("worker URL {shown:?}: the port is not in 1-65535"))
        }
        Err(error) => return Err(format!("worker URL {shown:?} is not a valid URL: {error}")),
    };
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "worker URL {shown:?}: scheme {:?} is not supported, use http:// or https://",
            parsed.scheme()
        ));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(format!("worker URL {shown:?} must not carry a query string or fragment"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(format!(
            "worker URL {shown:?} must not carry credentials (user:password@); give the workers' key with --api-key"
        ));
    }
    // `url` lower-cases the scheme and host and drops the scheme's default port.
    let host = match parsed.host_str() {
        Some(host) if !host.is_empty() => host,
        _ => return Err(format!("worker URL {shown:?} has no host")),
    };
    let path = parsed.path().trim_end_matches('/');
    let canonical = match parsed.port() {
        Some(0) => return Err(format!("worker URL {shown:?}: the port is not in 1-65535")),
        Some(port) => format!("{}://{host}:{port}{path}", parsed.scheme()),
        None => format!("{}://{host}{path}", parsed.scheme()),
    };
    // What the HTTP client is given must parse as its URI too.
    canonical.parse::<http::Uri>().map_err(|e| format!("worker URL {shown:?} is not a valid URL: {e}"))?;
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

/// Where workers may be (`--worker-url-allow`): CIDRs, host names and `*.suffix` patterns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowList {
    networks: Vec<ipnet::IpNet>,
    /// Lower-cased names, matched whole.
    names: Vec<String>,
    /// Lower-cased suffixes of `*.suffix` patterns, with their dot (`.svc.cluster.local`).
    suffixes: Vec<String>,
}

impl AllowList {
    /// Every entry parsed (validated with the configuration).
    pub fn new(entries: &[String]) -> Result<AllowList, String> {
        let mut list = AllowList::default();
        for entry in entries {
            match AllowList::parse_entry(entry)? {
                Entry::Network(network) => list.networks.push(network),
                Entry::Name(name) => list.names.push(name),
                Entry::Suffix(suffix) => list.suffixes.push(suffix),
            }
        }
        Ok(list)
    }

    /// One entry: `10.0.0.0/8`, `127.0.0.1` (a /32), `[::1]` or `::1/128`, `engine-1`,
    /// `*.svc.cluster.local`.
    pub fn parse_entry(entry: &str) -> Result<Entry, String> {
        let entry = entry.trim();
        let bare = entry.trim_start_matches('[').trim_end_matches(']');
        if let Ok(network) = bare.parse::<ipnet::IpNet>() {
            return Ok(Entry::Network(network.trunc()));
        }
        if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
            return Ok(Entry::Network(ipnet::IpNet::from(ip)));
        }
        let name_like = |text: &str| {
            !text.is_empty()
                && text.split('.').all(|label| {
                    !label.is_empty()
                        && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                })
        };
        if let Some(suffix) = entry.strip_prefix("*.") {
            if name_like(suffix) {
                return Ok(Entry::Suffix(format!(".{}", suffix.to_ascii_lowercase())));
            }
        } else if name_like(entry) && !entry.contains('/') {
            return Ok(Entry::Name(entry.to_ascii_lowercase()));
        }
        Err(format!("{entry:?} is not a CIDR (10.0.0.0/8), an address, a host name or a *.domain pattern"))
    }

    /// Whether any address may be registered (no entry given).
    pub fn is_open(&self) -> bool {
        self.networks.is_empty() && self.names.is_empty() && self.suffixes.is_empty()
    }

    /// Whether the host name (not an address literal) is allowed by name.
    pub fn allows_name(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.names.contains(&host) || self.suffixes.iter().any(|suffix| host.ends_with(suffix.as_str()))
    }

    /// Whether `ip` is in an allowed network (IPv4-mapped IPv6 addresses as IPv4).
    pub fn allows_ip(&self, ip: std::net::IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.networks.iter().any(|network| network.contains(&ip))
    }
}

/// One `--worker-url-allow` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    Network(ipnet::IpNet),
    Name(String),
    Suffix(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_list_entries() {
        let list = AllowList::new(&[
            "10.0.0.0/8".into(),
            "127.0.0.1".into(),
            "[::1]".into(),
            "engine-1".into(),
            "*.svc.cluster.local".into(),
        ])
        .unwrap();
        assert!(list.allows_ip("10.1.2.3".parse().unwrap()));
        assert!(list.allows_ip("127.0.0.1".parse().unwrap()));
        assert!(list.allows_ip("::ffff:10.0.0.1".parse().unwrap()), "IPv4-mapped IPv6 is IPv4");
        assert!(list.allows_ip("::1".parse().unwrap()));
        assert!(!list.allows_ip("127.0.0.2".parse().unwrap()));
        assert!(!list.allows_ip("192.168.0.1".parse().unwrap()));
        assert!(list.allows_name("ENGINE-1") && list.allows_name("vllm.ns.svc.cluster.local."));
        assert!(!list.allows_name("engine-10") && !list.allows_name("svc.cluster.local.evil.com"));
        assert!(AllowList::new(&[]).unwrap().is_open());
        for bad in ["10.0.0.0/33", "http://x", "*.", "a..b", ""] {
            assert!(AllowList::parse_entry(bad).is_err(), "{bad}");
        }
    }

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
        let bad_port = normalize_url("http://user:hunter2@10.0.0.1:99999").unwrap_err();
        assert!(bad_port.contains("1-65535") && !bad_port.contains("hunter2"), "{bad_port}");
        // One address, one spelling: `url` reads the other spellings of an IPv4 address.
        assert_eq!(normalize_url("http://0x7f.0.0.1:8000").unwrap(), "http://127.0.0.1:8000");
        assert_eq!(normalize_url("http://[0:0::1]:8000/").unwrap(), "http://[::1]:8000");
    }
}
