//! TLS on both sides of the gateway: the listener's server configuration (`tls_cert_path`,
//! `tls_key_path`), the client configuration for `https://` workers (the CAs of `ca_cert_paths`,
//! the client certificate of `client_cert_path`), and the stream a worker connection runs on,
//! plain TCP or TLS. Certificates and keys are PEM files read once at start; the crypto provider
//! is ring.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::{client, TlsAcceptor, TlsConnector};

use crate::config::GatewayConfig;

/// Deadline for opening a worker connection: the TCP connect and, for `https://`, the handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate of a PEM file (at least one).
fn read_certificates(path: &Path, field: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates = CertificateDer::pem_file_iter(path)
        .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
        .map_err(|error| format!("{field} {}: {error}", path.display()))?;
    if certificates.is_empty() {
        return Err(format!("{field} {}: no PEM certificate in the file", path.display()));
    }
    Ok(certificates)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn read_private_key(path: &Path, field: &str) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|error| format!("{field} {}: {error}", path.display()))
}

/// The listener's TLS acceptor when `tls_cert_path` and `tls_key_path` are set (HTTP/1.1 only).
pub fn listener_acceptor(config: &GatewayConfig) -> Result<Option<TlsAcceptor>, String> {
    let (Some(cert_path), Some(key_path)) = (&config.tls_cert_path, &config.tls_key_path) else {
        return Ok(None);
    };
    let chain = read_certificates(cert_path, "tls_cert_path")?;
    let key = read_private_key(key_path, "tls_key_path")?;
    let mut server = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|error| format!("TLS listener: {error}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|error| format!("tls_cert_path/tls_key_path: {error}"))?;
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(TlsAcceptor::from(Arc::new(server))))
}

/// The TLS client of `https://` workers: it trusts the CAs of `ca_cert_paths` (the Mozilla roots
/// when none is given) and presents the certificate of `client_cert_path`, if any.
pub fn upstream_connector(config: &GatewayConfig) -> Result<TlsConnector, String> {
    let mut roots = RootCertStore::empty();
    if config.ca_cert_paths.is_empty() {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    for path in &config.ca_cert_paths {
        for certificate in read_certificates(path, "ca_cert_paths")? {
            roots.add(certificate).map_err(|error| format!("ca_cert_paths {}: {error}", path.display()))?;
        }
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|error| format!("TLS to workers: {error}"))?
        .with_root_certificates(roots);
    let mut client = match (&config.client_cert_path, &config.client_key_path) {
        (Some(cert_path), Some(key_path)) => builder
            .with_client_auth_cert(
                read_certificates(cert_path, "client_cert_path")?,
                read_private_key(key_path, "client_key_path")?,
            )
            .map_err(|error| format!("client_cert_path/client_key_path: {error}"))?,
        _ => builder.with_no_client_auth(),
    };
    client.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(client)))
}

/// The name a worker's certificate must carry: its URL's host, a DNS name or an IP address.
pub fn server_name(host: &str) -> Result<ServerName<'static>, String> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(bare.to_string()).map_err(|_| format!("{host:?} is not a valid TLS server name"))
}

/// A connection to a worker: plain TCP for `http://`, TLS over TCP for `https://`.
pub enum WorkerStream {
    Plain(TcpStream),
    Tls(Box<client::TlsStream<TcpStream>>),
}

/// Open a connection to `addr` (`host:port`) within `CONNECT_TIMEOUT`, with a TLS handshake when
/// `tls` gives a connector and the name to verify. The error says which step failed.
pub async fn connect_worker(
    addr: &str,
    tls: Option<(&TlsConnector, ServerName<'static>)>,
) -> Result<WorkerStream, String> {
    let opening = async {
        let stream = TcpStream::connect(addr).await.map_err(|error| format!("connect to {addr}: {error}"))?;
        let _ = stream.set_nodelay(true);
        match tls {
            None => Ok(WorkerStream::Plain(stream)),
            Some((connector, name)) => match connector.connect(name, stream).await {
                Ok(stream) => Ok(WorkerStream::Tls(Box::new(stream))),
                Err(error) => Err(format!("TLS handshake with {addr}: {error}")),
            },
        }
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, opening).await {
        Ok(result) => result,
        Err(_) => Err(format!("connect to {addr}: no answer within {} s", CONNECT_TIMEOUT.as_secs())),
    }
}

impl AsyncRead for WorkerStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WorkerStream::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            WorkerStream::Tls(stream) => Pin::new(&mut **stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WorkerStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WorkerStream::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            WorkerStream::Tls(stream) => Pin::new(&mut **stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WorkerStream::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            WorkerStream::Tls(stream) => Pin::new(&mut **stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            WorkerStream::Plain(stream) => stream.is_write_vectored(),
            WorkerStream::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WorkerStream::Plain(stream) => Pin::new(stream).poll_flush(cx),
            WorkerStream::Tls(stream) => Pin::new(&mut **stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WorkerStream::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            WorkerStream::Tls(stream) => Pin::new(&mut **stream).poll_shutdown(cx),
        }
    }
}
