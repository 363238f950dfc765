//! The nginx target of O1: the Debian package's nginx configured as users write a reverse proxy
//! (an upstream block of the engines with `keepalive`, HTTP/1.1 to them, no buffering in either
//! direction, no access log), started in a temporary prefix directory and stopped by the bench.
//! Its CPU is the sum over the master and its workers.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the Debian package installs nginx; `O1_NGINX` overrides it.
const DEFAULT_NGINX: &str = "/usr/sbin/nginx";

/// The nginx binary to run, if one is installed.
pub fn binary() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var("O1_NGINX").unwrap_or_else(|_| DEFAULT_NGINX.into()));
    path.is_file().then_some(path)
}

/// A running nginx; stopped (and its directory removed) when dropped.
pub struct Nginx {
    master: Child,
    dir: PathBuf,
    pub url: String,
}

/// The configuration a user would write to put nginx in front of `upstreams` (`http://host:port`).
pub fn config(upstreams: &[String], workers: usize, port: u16, dir: &std::path::Path) -> String {
    let servers: String = upstreams
        .iter()
        .map(|url| format!("        server {};\n", url.trim_start_matches("http://")))
        .collect();
    let dir = dir.display();
    format!(
        "worker_processes {workers};
daemon off;
master_process on;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    client_max_body_size 16m;
    keepalive_requests 1000000;
    upstream engines {{
{servers}        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} reuseport;
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"
    )
}

impl Nginx {
    /// Start nginx with `workers` worker processes in front of `upstreams`; waits until it
    /// accepts connections (at most 10 s).
    pub fn start(binary: &std::path::Path, upstreams: &[String], workers: usize) -> Result<Nginx, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let dir = std::env::temp_dir().join(format!("kvgate-o1-nginx-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        std::fs::write(dir.join("nginx.conf"), config(upstreams, workers, port, &dir))
            .map_err(|e| format!("nginx.conf: {e}"))?;
        let master = Command::new(binary)
            .arg("-p")
            .arg(&dir)
            .arg("-e")
            .arg(dir.join("error.log"))
            .args(["-c", "nginx.conf"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{}: {e}", binary.display()))?;
        let mut nginx = Nginx { master, dir, url: format!("http://127.0.0.1:{port}") };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = nginx.master.try_wait() {
                let log = std::fs::read_to_string(nginx.dir.join("error.log")).unwrap_or_default();
                return Err(format!("nginx exited ({status}): {log}"));
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                && nginx.processes().len() > workers
            {
                return Ok(nginx);
            }
            if Instant::now() >= deadline {
                return Err("nginx did not accept connections within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The master and its worker processes.
    fn processes(&self) -> Vec<u32> {
        let master = self.master.id();
        let mut pids = vec![master];
        let Ok(entries) = std::fs::read_dir("/proc") else { return pids };
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else {
                continue;
            };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // The parent pid is the second field after the command name's closing parenthesis.
            let parent = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(1));
            if parent.and_then(|p| p.parse::<u32>().ok()) == Some(master) {
                pids.push(pid);
            }
        }
        pids
    }

    /// utime + stime of the master and its workers, in seconds.
    pub fn cpu_seconds(&self) -> f64 {
        self.processes().into_iter().map(super::cpu_seconds).sum()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGKILL on the master leaves the workers running: ask for a fast stop (SIGTERM) first.
        let _ = Command::new("kill").args(["-TERM", &self.master.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.master.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.master.kill();
        let _ = self.master.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
