//! The gateway's listener: client connections that send no request head in time, idle past the
//! keep-alive timeout, or exceed `max_connections` are closed; HTTPS on the listener; `https://`
//! workers reached with the configured CAs and client certificate (mTLS). Certificates are made
//! by each test (rcgen); every server is on 127.0.0.1.

use crate::common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvgate_gateway::GatewayConfig;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long after `since` the peer closed `stream` (EOF or reset), if it did within `limit`;
/// panics if the gateway answers instead.
async fn closed_within(stream: &mut TcpStream, since: Instant, limit: Duration) -> Option<Duration> {
    let mut buf = [0u8; 1024];
    match tokio::time::timeout(limit, stream.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => Some(since.elapsed()),
        Ok(Ok(n)) => {
            panic!("expected the connection to be closed, got {:?}", String::from_utf8_lossy(&buf[..n]))
        }
        Err(_) => None,
    }
}

/// Read one HTTP/1.1 response with a content-length body; returns its head.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut buf).await.expect("response");
        assert!(n > 0, "connection closed before a response");
        data.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&data[..head_end]).to_string();
    let length: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
        .and_then(|v| v.parse().ok())
        .expect("a content-length");
    while data.len() < head_end + length {
        let n = stream.read(&mut buf).await.expect("response body");
        assert!(n > 0, "connection closed inside a response body");
        data.extend_from_slice(&buf[..n]);
    }
    head
}

/// The gateway's `kvgate_client_connections`, read from what `/metrics` would serve.
fn client_connections(gw: &kvgate_gateway::GatewayHandle) -> Option<f64> {
    exposition::Selector::parse("kvgate_client_connections").unwrap().first(&gw.render_metrics())
}

#[tokio::test]
async fn unfinished_and_silent_clients_are_disconnected_at_the_header_timeout() {
    let up = upstream("a", "m").await;
    let gw = gateway(GatewayConfig { header_read_timeout_secs: 0.5, ..config(vec![up.url.clone()]) }).await;
    let half_head = async {
        let mut stream = TcpStream::connect(gw.addr).await.unwrap();
        let since = Instant::now();
        stream.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty").await.unwrap();
        closed_within(&mut stream, since, Duration::from_secs(3)).await
    };
    let silent = async {
        let mut stream = TcpStream::connect(gw.addr).await.unwrap();
        closed_within(&mut stream, Instant::now(), Duration::from_secs(3)).await
    };
    let dribbling = async {
        // One byte every 100 ms: the head is never complete, the deadline does not move.
        let stream = TcpStream::connect(gw.addr).await.unwrap();
        let since = Instant::now();
        let (mut reader, mut writer) = stream.into_split();
        let writing = tokio::spawn(async move {
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ".iter().cycle().take(50) {
                if writer.write_all(&[*byte]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut buf = [0u8; 64];
        let closed = match tokio::time::timeout(Duration::from_secs(3), reader.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => Some(since.elapsed()),
            _ => None,
        };
        writing.abort();
        closed
    };
    let (half_head, silent, dribbling) = tokio::join!(half_head, silent, dribbling);
    for (what, closed) in [("half a head", half_head), ("nothing", silent), ("a byte at a time", dribbling)] {
        let closed =
            closed.unwrap_or_else(|| panic!("a client sending {what} was not disconnected within 3 s"));
        assert!(
            closed >= Duration::from_millis(400) && closed < Duration::from_secs(2),
            "a client sending {what} was disconnected after {closed:?}, expected about 0.5 s"
        );
    }
    let res =
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 200, "complete requests are still served");
    gw.shutdown().await;
}

#[tokio::test]
async fn idle_keep_alive_connections_close_after_the_keep_alive_timeout() {
    let gw = gateway(GatewayConfig {
        header_read_timeout_secs: 0.3,
        keep_alive_timeout_secs: 2.0,
        ..config(vec![])
    })
    .await;
    let mut stream = TcpStream::connect(gw.addr).await.unwrap();
    stream.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    assert!(read_response(&mut stream).await.starts_with("HTTP/1.1 200"));
    // fixed sleep: the input under test, idle for longer than the header timeout (idle time is
    // not head time) and, with 1.4 s to spare under load, shorter than the keep-alive timeout.
    tokio::time::sleep(Duration::from_millis(600)).await;
    stream.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    assert!(
        read_response(&mut stream).await.starts_with("HTTP/1.1 200"),
        "the kept-alive connection is reused"
    );
    let idle_since = Instant::now();
    let closed = closed_within(&mut stream, idle_since, Duration::from_secs(4))
        .await
        .expect("the idle connection was not closed within 4 s");
    assert!(
        closed >= Duration::from_millis(1900) && closed < Duration::from_secs(3),
        "the idle connection was closed after {closed:?}, expected about 2 s"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_slow_answer_is_not_cut_by_the_client_timeouts() {
    let up = upstream("a", "m").await;
    up.delay_ms.store(1200, Ordering::SeqCst);
    let gw = gateway(GatewayConfig {
        header_read_timeout_secs: 0.3,
        keep_alive_timeout_secs: 0.5,
        ..config(vec![up.url.clone()])
    })
    .await;
    let res =
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let body: serde_json::Value = res.json().await.unwrap();
    assert_eq!(body["worker"], "a");
    gw.shutdown().await;
}

#[tokio::test]
async fn connections_beyond_max_connections_are_closed() {
    let up = upstream("a", "m").await;
    let gw = gateway(GatewayConfig { max_connections: 4, ..config(vec![up.url.clone()]) }).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(gw.addr).await.unwrap());
    }
    assert!(
        eventually(2.0, async || client_connections(&gw) == Some(4.0)).await,
        "the four idle connections are counted"
    );
    let mut fifth = TcpStream::connect(gw.addr).await.unwrap();
    let closed = closed_within(&mut fifth, Instant::now(), Duration::from_secs(2)).await;
    assert!(closed.is_some(), "a fifth connection is closed at once while four are open");
    assert_eq!(client_connections(&gw), Some(4.0));

    drop(idle);
    let client = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    assert!(
        eventually(3.0, async || {
            matches!(client.post(&url).json(&chat("m")).send().await, Ok(res) if res.status() == 200)
        })
        .await,
        "requests are served again once the idle connections closed"
    );
    assert!(eventually(2.0, async || client_connections(&gw) == Some(1.0)).await);
    gw.shutdown().await;
}

/// A throwaway certificate authority and the PEM files of what it issues, in a directory of
/// the test's own.
struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
}

/// A certificate for 127.0.0.1 and localhost issued by the test CA.
struct Issued {
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
    cert_path: PathBuf,
    key_path: PathBuf,
}

impl Pki {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvgate-listener-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.distinguished_name.push(DnType::CommonName, "kvgate test CA");
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Self { ca, dir }
    }

    fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    fn issue(&self, name: &str, purpose: ExtendedKeyUsagePurpose) -> Issued {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![purpose];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &*self.ca).unwrap();
        let (cert_path, key_path) =
            (self.dir.join(format!("{name}.pem")), self.dir.join(format!("{name}.key")));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        Issued {
            cert: cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            cert_path,
            key_path,
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A chat completion posted over HTTPS to `addr` as server name `host`, trusting `pki`'s CA
/// (`None`: trusting no CA at all): its status and JSON body, or the error that stopped it.
async fn https_chat(
    addr: &std::net::SocketAddr,
    host: &str,
    pki: Option<&Pki>,
) -> Result<(u16, serde_json::Value), String> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(pki) = pki {
        roots.add(pki.ca.der().clone()).map_err(|e| e.to_string())?;
    }
    let config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| e.to_string())?;
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let request = hyper::Request::post(format!("https://{host}:{}/v1/chat/completions", addr.port()))
        .header("host", format!("{host}:{}", addr.port()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat("m").to_string())))
        .map_err(|e| e.to_string())?;
    let response = sender.send_request(request).await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((status, serde_json::from_slice(&body).map_err(|e| e.to_string())?))
}

#[tokio::test]
async fn https_listener_serves_chat_completions() {
    let pki = Pki::new("https-listener");
    let server = pki.issue("gateway", ExtendedKeyUsagePurpose::ServerAuth);
    let up = upstream("a", "m").await;
    let gw = gateway(GatewayConfig {
        tls_cert_path: Some(server.cert_path.clone()),
        tls_key_path: Some(server.key_path.clone()),
        ..config(vec![up.url.clone()])
    })
    .await;
    for host in ["127.0.0.1", "localhost"] {
        let (status, body) = https_chat(&gw.addr, host, Some(&pki)).await.expect("an answer over TLS");
        assert_eq!(status, 200, "https://{host}");
        assert_eq!(body["worker"], "a");
    }
    assert!(
        https_chat(&gw.addr, "localhost", None).await.is_err(),
        "a client that does not trust the test CA refuses the gateway's certificate"
    );
    assert!(
        client().get(format!("http://{}/health", gw.addr)).send().await.is_err(),
        "plain HTTP is not served on a TLS listener"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn the_tls_handshake_is_due_with_the_first_request_head() {
    let pki = Pki::new("tls-handshake-deadline");
    let server = pki.issue("gateway", ExtendedKeyUsagePurpose::ServerAuth);
    let gw = gateway(GatewayConfig {
        tls_cert_path: Some(server.cert_path.clone()),
        tls_key_path: Some(server.key_path.clone()),
        header_read_timeout_secs: 0.5,
        ..config(vec![])
    })
    .await;
    let mut silent = TcpStream::connect(gw.addr).await.unwrap();
    let closed = closed_within(&mut silent, Instant::now(), Duration::from_secs(3))
        .await
        .expect("a client that never starts the TLS handshake was not disconnected within 3 s");
    assert!(
        closed >= Duration::from_millis(400) && closed < Duration::from_secs(2),
        "closed after {closed:?}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn listener_options_are_validated_together() {
    let bad = GatewayConfig {
        header_read_timeout_secs: 0.0,
        keep_alive_timeout_secs: f64::NAN,
        max_connections: 0,
        tls_cert_path: Some("cert.pem".into()),
        client_key_path: Some("client.key".into()),
        ..config(vec![])
    };
    let Err(kvgate_gateway::StartError::Config(errors)) = kvgate_gateway::start(bad).await else {
        panic!("an invalid configuration must not start");
    };
    let fields: Vec<_> = errors.iter().map(|error| error.field.clone()).collect();
    assert_eq!(
        fields,
        [
            "header_read_timeout_secs",
            "keep_alive_timeout_secs",
            "max_connections",
            "tls_key_path",
            "client_cert_path"
        ]
    );
    let missing = GatewayConfig {
        tls_cert_path: Some("/nonexistent/cert.pem".into()),
        tls_key_path: Some("/nonexistent/key.pem".into()),
        ..config(vec![])
    };
    match kvgate_gateway::start(missing).await {
        Err(kvgate_gateway::StartError::State(message)) => {
            assert!(
                message.contains("tls_cert_path") && message.contains("/nonexistent/cert.pem"),
                "{message}"
            )
        }
        Err(other) => panic!("unexpected error: {other}"),
        Ok(_) => panic!("a gateway without its certificate file must not start"),
    }
}

/// An `https://` worker that requires a client certificate issued by the test CA.
struct TlsWorker {
    url: String,
    /// Proxied requests answered.
    requests: AtomicUsize,
    /// Handshakes that failed (no client certificate, or one it does not trust).
    refused: AtomicUsize,
}

async fn answer(worker: Arc<TlsWorker>, request: hyper::Request<Incoming>) -> hyper::Response<Full<Bytes>> {
    let json = |value: serde_json::Value| {
        hyper::Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(value.to_string())))
            .unwrap()
    };
    match request.uri().path() {
        "/health" => json(serde_json::json!({"status": "ok"})),
        "/v1/models" => json(serde_json::json!({"object": "list", "data": [{"id": "m", "object": "model"}]})),
        "/v1/chat/completions" => {
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
            worker.requests.fetch_add(1, Ordering::SeqCst);
            json(serde_json::json!({"worker": "tls", "model": request["model"], "object": "chat.completion"}))
        }
        _ => hyper::Response::builder().status(404).body(Full::new(Bytes::new())).unwrap(),
    }
}

async fn tls_worker(pki: &Pki) -> Arc<TlsWorker> {
    let issued = pki.issue("worker", ExtendedKeyUsagePurpose::ServerAuth);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.ca.der().clone()).unwrap();
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![issued.cert], issued.key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker = Arc::new(TlsWorker {
        url: format!("https://{}", listener.local_addr().unwrap()),
        requests: AtomicUsize::new(0),
        refused: AtomicUsize::new(0),
    });
    let serving = worker.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, worker) = (acceptor.clone(), serving.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    worker.refused.fetch_add(1, Ordering::SeqCst);
                    return;
                };
                let service = hyper::service::service_fn(move |request| {
                    let worker = worker.clone();
                    async move { Ok::<_, std::convert::Infallible>(answer(worker, request).await) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
            });
        }
    });
    worker
}

#[tokio::test]
async fn https_workers_are_reached_with_the_configured_ca_and_client_certificate() {
    let pki = Pki::new("mtls-worker");
    let worker = tls_worker(&pki).await;
    let gateway_cert = pki.issue("gateway-client", ExtendedKeyUsagePurpose::ClientAuth);

    // Trusting the test CA and presenting its client certificate: model discovery, health
    // checks and proxied requests all go over mTLS.
    let gw = gateway(GatewayConfig {
        ca_cert_paths: vec![pki.ca_path()],
        client_cert_path: Some(gateway_cert.cert_path.clone()),
        client_key_path: Some(gateway_cert.key_path.clone()),
        ..config(vec![worker.url.clone()])
    })
    .await;
    let client = client();
    for _ in 0..3 {
        let res =
            client.post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
        assert_eq!(res.status(), 200);
        let body: serde_json::Value = res.json().await.unwrap();
        assert_eq!(body["worker"], "tls");
    }
    assert_eq!(worker.requests.load(Ordering::SeqCst), 3);
    assert_eq!(worker.refused.load(Ordering::SeqCst), 0);
    gw.shutdown().await;

    // Without a client certificate the worker refuses the gateway; without the test CA the
    // gateway refuses the worker. Registered with their model and no health checks, so that the
    // proxied request itself meets the refusal.
    let without_client_cert = GatewayConfig { ca_cert_paths: vec![pki.ca_path()], ..config(vec![]) };
    let without_ca = GatewayConfig {
        client_cert_path: Some(gateway_cert.cert_path.clone()),
        client_key_path: Some(gateway_cert.key_path.clone()),
        ..config(vec![])
    };
    for (what, settings) in [("no client certificate", without_client_cert), ("no trusted CA", without_ca)] {
        let gw = gateway(GatewayConfig { disable_health_check: true, ..settings }).await;
        let added = client
            .post(format!("{}/workers", gw.admin_url()))
            .json(&serde_json::json!({"url": worker.url, "model_id": "m"}))
            .send()
            .await
            .unwrap();
        assert_eq!(added.status(), 201, "{what}: {}", added.text().await.unwrap_or_default());
        let res =
            client.post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
        assert_ne!(res.status(), 200, "{what}: the exchange must fail");
        gw.shutdown().await;
    }
    assert_eq!(worker.requests.load(Ordering::SeqCst), 3, "no refused gateway got a request through");
    assert!(worker.refused.load(Ordering::SeqCst) >= 2, "the worker saw the refused handshakes");
}
