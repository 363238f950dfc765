//! A `redis-server` the test starts on a free 127.0.0.1 port (the replica-sync tests), and a
//! raw publisher speaking RESP (a peer that says what the test wants).

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A `redis-server` child on a loopback port, killed when dropped.
pub struct Redis {
    child: Child,
    pub port: u16,
}

impl Redis {
    /// Starts one, or returns `None` (with a notice) when redis-server is not installed, unless
    /// `KVGATE_REQUIRE_REDIS=1` (CI), which makes its absence a failure.
    pub fn start() -> Option<Redis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        Redis::start_on(port)
    }

    pub fn start_on(port: u16) -> Option<Redis> {
        let spawned = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(error) if std::env::var("KVGATE_REQUIRE_REDIS").as_deref() == Ok("1") => {
                panic!("KVGATE_REQUIRE_REDIS=1 but redis-server cannot be started ({error}): install it (apt-get install -y redis-server)")
            }
            Err(error) => {
                eprintln!("SKIPPED: redis-server cannot be started ({error}); set KVGATE_REQUIRE_REDIS=1 to make this a failure");
                return None;
            }
        };
        let redis = Redis { child, port };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "redis-server listens on {port} within 10 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(redis)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `PUBLISH channel payload` for each payload, pipelined on one plain connection; returns how
/// many subscribers each reached (Redis's integer replies).
pub async fn publish(port: u16, channel: &str, payloads: &[Vec<u8>]) -> Vec<i64> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut commands = Vec::new();
    for payload in payloads {
        let head =
            format!("*3\r\n$7\r\nPUBLISH\r\n${}\r\n{channel}\r\n${}\r\n", channel.len(), payload.len());
        commands.extend_from_slice(head.as_bytes());
        commands.extend_from_slice(payload);
        commands.extend_from_slice(b"\r\n");
    }
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut stream = tokio::io::BufReader::new(stream);
    stream.get_mut().write_all(&commands).await.unwrap();
    let mut replies = Vec::with_capacity(payloads.len());
    for _ in payloads {
        let mut reply = String::new();
        stream.read_line(&mut reply).await.unwrap();
        replies.push(reply.trim().trim_start_matches(':').parse().unwrap_or(-1));
    }
    replies
}
