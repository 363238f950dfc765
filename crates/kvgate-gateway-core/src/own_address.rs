//! Whether a worker URL leads back to this gateway. The URL's host is resolved the way the
//! connector resolves it (`host:port` through the system resolver, so every IPv4 spelling
//! `inet_aton` takes, such as `127.1`, `2130706433` or `0x7f000001`, IPv6 forms including
//! IPv4-mapped ones, and names such as `localhost`), and each address is compared with the
//! gateway's own listeners. Loops this cannot see (a forwarder, another gateway) are caught at
//! request time by the `x-kvgate-via` hop header.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// How long a name may take to resolve; past it the URL is taken as not this gateway's (the
/// hop header still refuses a loop).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether `url` (a normalized worker URL) reaches one of `listeners`.
pub async fn leads_to_gateway(url: &str, listeners: &[SocketAddr]) -> bool {
    if listeners.is_empty() {
        return false;
    }
    let Ok(uri) = url.parse::<http::Uri>() else { return false };
    let Some(host) = uri.host() else { return false };
    let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
    if !listeners.iter().any(|listener| listener.port() == port) {
        return false;
    }
    let resolved = resolve(host, port).await;
    resolved.iter().any(|address| listeners.iter().any(|listener| reaches(*address, *listener)))
}

/// The addresses `host:port` resolves to, as the connector resolves them: it dials
/// `format!("{host}:{port}")` (`tls::connect_worker`), through the system resolver. Empty when
/// the name does not resolve within a bound time.
pub async fn resolve(host: &str, port: u16) -> Vec<SocketAddr> {
    let target = format!("{host}:{port}");
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(target)).await {
        Ok(Ok(addresses)) => addresses.collect(),
        _ => Vec::new(),
    }
}

/// Whether a connection to `address` would reach a socket bound to `listener`.
fn reaches(address: SocketAddr, listener: SocketAddr) -> bool {
    if address.port() != listener.port() {
        return false;
    }
    let ip = address.ip().to_canonical();
    let bound = listener.ip().to_canonical();
    // Any loopback address or the unspecified one (which connects to this host) on the
    // listener's port is taken as the gateway itself, whatever loopback address it bound.
    ip == bound
        || ip.is_loopback() && (bound.is_loopback() || bound.is_unspecified())
        || ip.is_unspecified()
        || bound.is_unspecified() && is_local(ip)
}

/// Whether `ip` is one of this machine's addresses: only those can be bound (nothing is sent).
pub fn is_local(ip: IpAddr) -> bool {
    std::net::UdpSocket::bind((ip, 0)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_spelling_of_a_loopback_listener_is_the_gateway() {
        let listener: SocketAddr = "127.0.0.1:30123".parse().unwrap();
        for url in [
            "http://127.0.0.1:30123",
            "http://127.1:30123",
            "http://2130706433:30123",
            "http://0x7f000001:30123",
            "http://0177.0.0.1:30123",
            "http://127.0.0.7:30123",
            "http://0.0.0.0:30123",
            "http://0:30123",
            "http://localhost:30123",
            "http://[::1]:30123",
            "http://[::ffff:127.0.0.1]:30123",
            "http://[::ffff:7f00:1]:30123",
            "http://[::]:30123",
        ] {
            assert!(leads_to_gateway(url, &[listener]).await, "{url}");
        }
        for url in ["http://127.0.0.1:30124", "http://10.255.255.1:30123", "http://[::2]:30123"] {
            assert!(!leads_to_gateway(url, &[listener]).await, "{url}");
        }
        let https_default: SocketAddr = "127.0.0.1:443".parse().unwrap();
        assert!(leads_to_gateway("https://127.1", &[https_default]).await);
        assert!(!leads_to_gateway("http://127.1", &[https_default]).await);
    }

    #[tokio::test]
    async fn a_wildcard_listener_is_reached_on_any_local_address() {
        let listener: SocketAddr = "0.0.0.0:30125".parse().unwrap();
        assert!(leads_to_gateway("http://127.0.0.1:30125", &[listener]).await);
        assert!(leads_to_gateway("http://2130706433:30125", &[listener]).await);
        assert!(!leads_to_gateway("http://192.0.2.1:30125", &[listener]).await, "TEST-NET-1 is not local");
    }
}
