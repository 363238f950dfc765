//! Scenario O1 (../shared/bench/SCENARIOS.md): gateway overhead. 64 concurrent clients post a
//! fixed chat body to 4 instant simulated engines, straight to one engine and through kvgate, in
//! one run; prints requests/s, latency p50/p99, the ratio to direct, and kvgate's CPU time per
//! proxied request (process CPU seconds over the run / requests).
//!
//! A third target, the floor, is a bare hyper proxy (this binary re-executed): hyper-util's pooled
//! client, no body parsing, no policy but round robin, no metrics. It shows what the HTTP stack
//! and loopback TCP cost on their own, so kvgate's own share can be read off.
//!
//! Two more targets measure tokenization in the request path (what the exact prefix index needs):
//! kvgate cache_aware whose workers declare KV events (an endpoint nothing publishes on, so only
//! the tokenizer and the exact index's bookkeeping are added), with the mock engines' tokenizer
//! (`tokenize_mock`) or the shipped Hugging Face test tokenizer and chat template (`tokenize_hf`).
//!
//! The reference a gateway is held to is nginx (`nginx`: 2 worker processes, `nginx1`: one;
//! `o1/nginx.rs`), configured as users write a reverse proxy and started and stopped by the bench
//! (skipped, with a note, when `/usr/sbin/nginx` or `$O1_NGINX` is not there). Every row of a
//! round also gives its requests/s and CPU per request relative to nginx's (2 workers).
//!
//! Tracing's cost: `POLICY/traced` runs kvgate with `--otlp-traces-endpoint` pointing at an
//! OTLP/HTTP sink in this process (`o1/otlp_sink.rs`: decodes, counts and discards the spans); its
//! row is followed by the spans the sink received and the gateway's `kvgate_otlp_*` losses.
//!
//! `cargo bench --bench o1` (env: O1_SECS=20, O1_CLIENTS=64, O1_PROMPT_BYTES=8192, O1_ROUNDS=1,
//! O1_GATEWAY_THREADS=0, O1_TARGETS=bare,nginx,round_robin,cache_aware; also nginx1,
//! tokenize_mock, tokenize_hf; `POLICY/shared` runs kvgate with `--io-threads 0`,
//! `POLICY/traced` with traces exported, `POLICY/base` with the kvgate binary `$O1_KVGATE_BASE`:
//! another build, e.g. the commit before a change, in the same rounds).

#[path = "o1/nginx.rs"]
mod nginx;
#[path = "o1/otlp_sink.rs"]
mod otlp_sink;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start `kvgate ARGS` and collect stdout lines until `done` says enough.
fn spawn(args: &[&str], done: impl FnMut(&[String]) -> bool) -> (Proc, Vec<String>) {
    spawn_binary(env!("CARGO_BIN_EXE_kvgate").as_ref(), args, done)
}

/// Start `BINARY ARGS` (a kvgate build) and collect stdout lines until `done` says enough.
fn spawn_binary(
    binary: &std::path::Path,
    args: &[&str],
    done: impl FnMut(&[String]) -> bool,
) -> (Proc, Vec<String>) {
    let mut command = Command::new(binary);
    command.args(args);
    spawn_command(command, done)
}

fn spawn_command(mut command: Command, mut done: impl FnMut(&[String]) -> bool) -> (Proc, Vec<String>) {
    let args = format!("{command:?}");
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("kvgate binary");
    let mut lines = Vec::new();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    while !done(&lines) {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            panic!("{args} exited early: {lines:?}");
        }
        lines.push(line.trim().to_string());
    }
    std::thread::spawn(move || for _ in reader.lines() {});
    (Proc(child), lines)
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0 // USER_HZ is 100 on Linux
}

struct Run {
    requests: usize,
    errors: usize,
    secs: f64,
    latencies_us: Vec<u32>,
}

impl Run {
    fn rps(&self) -> f64 {
        self.requests as f64 / self.secs
    }
    /// The `p`th percentile (in percent) of the sorted latencies, in milliseconds: the one
    /// percentile every report uses (`kvgate_trace::percentile`, nearest rank).
    fn pct(&self, p: f64) -> f64 {
        f64::from(kvgate_trace::percentile(&self.latencies_us, p)) / 1000.0
    }
}

async fn load(url: &str, body: Bytes, clients: usize, secs: u64) -> Run {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).pool_max_idle_per_host(clients).build(connector);
    let client = Arc::new(client);
    let uri: hyper::Uri = format!("{url}/v1/chat/completions").parse().unwrap();
    // Warm up the connections.
    for _ in 0..clients {
        let req = hyper::Request::post(uri.clone())
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))
            .unwrap();
        let _ = client.request(req).await.map(|r| r.into_body());
    }
    let deadline = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (client, uri, body) = (client.clone(), uri.clone(), body.clone());
            tokio::spawn(async move {
                let (mut ok, mut errors, mut latencies) = (0usize, 0usize, Vec::with_capacity(1 << 16));
                while Instant::now() < deadline {
                    let sent = Instant::now();
                    let req = hyper::Request::post(uri.clone())
                        .header("content-type", "application/json")
                        .body(Full::new(body.clone()))
                        .unwrap();
                    match client.request(req).await {
                        Ok(res) if res.status().is_success() => match res.into_body().collect().await {
                            Ok(_) => {
                                ok += 1;
                                latencies.push(sent.elapsed().as_micros() as u32);
                            }
                            Err(_) => errors += 1,
                        },
                        _ => errors += 1,
                    }
                }
                (ok, errors, latencies)
            })
        })
        .collect();
    let mut run = Run { requests: 0, errors: 0, secs: 0.0, latencies_us: Vec::new() };
    for task in tasks {
        let (ok, errors, latencies) = task.await.unwrap();
        run.requests += ok;
        run.errors += errors;
        run.latencies_us.extend(latencies);
    }
    run.secs = started.elapsed().as_secs_f64();
    run.latencies_us.sort_unstable();
    run
}

fn chat_body(prompt_bytes: usize) -> Bytes {
    let words: String =
        (0..).map(|i| format!("w{} ", i % 997)).take_while(|_| true).take(prompt_bytes / 5 + 1).collect();
    let prompt = &words[..prompt_bytes.min(words.len())];
    Bytes::from(
        serde_json::json!({"model": "mock-model", "max_tokens": 16,
            "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": prompt}]})
        .to_string(),
    )
}

const BARE_PROXY_ENV: &str = "O1_BARE_PROXY_UPSTREAMS";

/// The floor target: forward every request as it comes to the next upstream, nothing else.
async fn bare_proxy(upstreams: Vec<String>) {
    use hyper::body::Incoming;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("bare proxy listening on http://{}", listener.local_addr().unwrap());
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Incoming> =
        Client::builder(TokioExecutor::new()).pool_max_idle_per_host(1024).build(connector);
    let next = Arc::new(AtomicUsize::new(0));
    let upstreams = Arc::new(upstreams);
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let _ = stream.set_nodelay(true);
        let (client, next, upstreams) = (client.clone(), next.clone(), upstreams.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let upstream = &upstreams[next.fetch_add(1, Ordering::Relaxed) % upstreams.len()];
                let (mut parts, body) = request.into_parts();
                parts.uri = format!("{upstream}{}", parts.uri.path()).parse().unwrap();
                client.request(hyper::Request::from_parts(parts, body))
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if let Ok(upstreams) = std::env::var(BARE_PROXY_ENV) {
        return bare_proxy(upstreams.split(',').map(str::to_string).collect()).await;
    }
    let secs = env_or("O1_SECS", 20);
    let clients = env_or("O1_CLIENTS", 64) as usize;
    let prompt_bytes = env_or("O1_PROMPT_BYTES", 8192) as usize;
    let body = chat_body(prompt_bytes);
    let (_engines, lines) =
        spawn(&["mock", "--count", "4", "--engine", "canned", "--gen-ms", "0"], |l| l.len() >= 4);
    let urls: Vec<String> = lines.iter().filter_map(|l| l.split(": ").nth(1).map(str::to_string)).collect();

    let threads = std::env::var("O1_GATEWAY_THREADS").unwrap_or_else(|_| "0".into());
    let targets: Vec<String> = std::env::var("O1_TARGETS")
        .unwrap_or_else(|_| "bare,nginx,round_robin,cache_aware".into())
        .split(',')
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    let tokenizer_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/crates/kvgate-tokenizer/testdata/tiny-chatml");
    // Workers that declare KV events nobody publishes: tokenization runs, the index stays empty.
    let silent_events: Vec<String> = urls.iter().map(|_| "tcp://127.0.0.1:1".to_string()).collect();
    let rounds = env_or("O1_ROUNDS", 1).max(1);
    let nginx_binary = nginx::binary();
    let sink = targets.iter().any(|t| t.ends_with("/traced")).then(otlp_sink::Sink::start);
    println!(
        "O1: {clients} clients, {secs} s per run, body {} bytes, 4 canned engines, gateway threads {threads} (0 = one per core), {rounds} round(s)",
        body.len()
    );
    println!("| round | target | req/s | p50 ms | p99 ms | errors | vs direct | vs nginx | proxy CPU us/req | CPU vs nginx |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut results: Vec<Measured> = Vec::new();
    for round in 1..=rounds {
        // Direct and proxied runs alternate, so each ratio compares neighbours in time.
        let direct = load(&urls[0], body.clone(), clients, secs).await;
        let mut measured: Vec<Measured> = Vec::new();
        for target in targets.iter().map(String::as_str) {
            let otlp = sink.as_ref().map(|sink| sink.url.as_str());
            let server = match start_target(
                target,
                &urls,
                &threads,
                &silent_events,
                tokenizer_dir,
                &nginx_binary,
                otlp,
            ) {
                Ok(server) => server,
                Err(skipped) => {
                    println!("| {round} | {} | {skipped}: skipped | | | | | | | |", label(target));
                    continue;
                }
            };
            let spans_before = sink.as_ref().map_or(0, otlp_sink::Sink::spans);
            let cpu_before = server.cpu_seconds();
            let run = load(server.url(), body.clone(), clients, secs).await;
            let cpu = server.cpu_seconds() - cpu_before;
            let note = match &sink {
                Some(sink) if target.ends_with("/traced") => {
                    Some(exported_spans(sink, spans_before, run.requests + clients, server.url()).await)
                }
                _ => None,
            };
            drop(server);
            measured.push(Measured {
                target: target.to_string(),
                rps: run.rps(),
                vs_direct: run.rps() / direct.rps(),
                cpu_us: cpu * 1e6 / (run.requests + clients) as f64,
                vs_nginx: None,
                cpu_vs_nginx: None,
                run,
                note,
            });
        }
        // nginx (2 workers) is the reference of the round.
        let reference = measured.iter().find(|m| m.target == "nginx").map(|m| (m.rps, m.cpu_us));
        println!(
            "| {round} | direct (one engine) | {:.0} | {:.2} | {:.2} | {} | 1.00 | | — | |",
            direct.rps(),
            direct.pct(50.0),
            direct.pct(99.0),
            direct.errors
        );
        for mut m in measured {
            if let Some((rps, cpu_us)) = reference {
                m.vs_nginx = Some(m.rps / rps);
                m.cpu_vs_nginx = Some(m.cpu_us / cpu_us);
            }
            let ratio = |r: Option<f64>| r.map_or(String::new(), |r| format!("{r:.2}"));
            println!(
                "| {round} | {} | {:.0} | {:.2} | {:.2} | {} | {:.2} | {} | {:.1} | {} |",
                label(&m.target),
                m.rps,
                m.run.pct(50.0),
                m.run.pct(99.0),
                m.run.errors,
                m.vs_direct,
                ratio(m.vs_nginx),
                m.cpu_us,
                ratio(m.cpu_vs_nginx)
            );
            if let Some(note) = &m.note {
                println!("| {round} | ↳ {note} | | | | | | | | |");
            }
            results.push(m);
        }
    }
    if rounds > 1 {
        for target in targets.iter().map(String::as_str) {
            let mine: Vec<&Measured> = results.iter().filter(|m| m.target == target).collect();
            if mine.is_empty() {
                continue;
            }
            let median = |values: Vec<f64>| {
                let mut values = values;
                values.sort_by(f64::total_cmp);
                values[values.len() / 2]
            };
            let mut line = format!(
                "median {target}: {:.2} of direct, {:.1} us CPU/req",
                median(mine.iter().map(|m| m.vs_direct).collect()),
                median(mine.iter().map(|m| m.cpu_us).collect())
            );
            let vs_nginx: Vec<f64> = mine.iter().filter_map(|m| m.vs_nginx).collect();
            let cpu_vs_nginx: Vec<f64> = mine.iter().filter_map(|m| m.cpu_vs_nginx).collect();
            if !vs_nginx.is_empty() {
                line.push_str(&format!(
                    ", {:.2} of nginx's req/s, {:.2}x its CPU/req",
                    median(vs_nginx),
                    median(cpu_vs_nginx)
                ));
            }
            println!("{line}");
        }
    }
}

/// One proxied run of a round.
struct Measured {
    target: String,
    run: Run,
    rps: f64,
    vs_direct: f64,
    cpu_us: f64,
    vs_nginx: Option<f64>,
    cpu_vs_nginx: Option<f64>,
    /// The traced targets: what reached the collector.
    note: Option<String>,
}

/// After a traced run of `requests` requests: the spans the sink received (waiting up to 5 s for
/// the last batches) and what the gateway counted as lost.
async fn exported_spans(sink: &otlp_sink::Sink, before: u64, requests: usize, gateway: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.spans() - before < requests as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let received = sink.spans() - before;
    let metrics = get_text(&format!("{gateway}/metrics")).await;
    let value = |series: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or("?")
            .to_string()
    };
    format!(
        "spans received {received} of {requests} requests; dropped: queue_full {}, export_failed {}",
        value(r#"kvgate_otlp_spans_dropped_total{reason="queue_full"}"#),
        value(r#"kvgate_otlp_spans_dropped_total{reason="export_failed"}"#)
    )
}

async fn get_text(url: &str) -> String {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let Ok(uri) = url.parse::<hyper::Uri>() else { return String::new() };
    match client.get(uri).await {
        Ok(res) => match res.into_body().collect().await {
            Ok(body) => String::from_utf8_lossy(&body.to_bytes()).into_owned(),
            Err(_) => String::new(),
        },
        Err(_) => String::new(),
    }
}

fn label(target: &str) -> String {
    match target {
        "bare" => "bare hyper proxy (floor)".to_string(),
        "nginx" => "nginx, 2 workers".to_string(),
        "nginx1" => "nginx, 1 worker".to_string(),
        "tokenize_mock" => "kvgate cache_aware + mock tokenizer (exact index)".to_string(),
        "tokenize_hf" => "kvgate cache_aware + HF tokenizer, chat template (exact index)".to_string(),
        _ => match target.split_once('/') {
            Some((policy, "shared")) => format!("kvgate {policy}, shared runtime (--io-threads 0)"),
            Some((policy, "traced")) => {
                format!("kvgate {policy}, traced (--otlp-traces-endpoint, local sink)")
            }
            Some((policy, "base")) => format!("kvgate {policy}, base build ($O1_KVGATE_BASE)"),
            _ => format!("kvgate {target}"),
        },
    }
}

/// A proxy under test: a child process (the floor, kvgate) or nginx's processes.
enum Server {
    Child(Proc, String),
    Nginx(nginx::Nginx),
}

impl Server {
    fn cpu_seconds(&self) -> f64 {
        match self {
            Server::Child(proc, _) => cpu_seconds(proc.0.id()),
            Server::Nginx(nginx) => nginx.cpu_seconds(),
        }
    }
}

impl Server {
    fn url(&self) -> &str {
        match self {
            Server::Child(_, url) => url,
            Server::Nginx(nginx) => &nginx.url,
        }
    }
}

/// Start one target in front of the engines, or say why it is skipped.
fn start_target(
    target: &str,
    urls: &[String],
    threads: &str,
    silent_events: &[String],
    tokenizer_dir: &str,
    nginx_binary: &Option<std::path::PathBuf>,
    otlp: Option<&str>,
) -> Result<Server, String> {
    if let Some(workers) = match target {
        "nginx" => Some(2),
        "nginx1" => Some(1),
        _ => None,
    } {
        let Some(binary) = nginx_binary else { return Err("nginx not found".into()) };
        return nginx::Nginx::start(binary, urls, workers).map(Server::Nginx);
    }
    if target == "bare" {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command.env(BARE_PROXY_ENV, urls.join(","));
        let (proxy, lines) =
            spawn_command(command, |l| l.iter().any(|l| l.starts_with("bare proxy listening on")));
        let url = lines.iter().find_map(|l| l.strip_prefix("bare proxy listening on ")).unwrap();
        return Ok(Server::Child(proxy, url.to_string()));
    }
    // `POLICY/shared`: client connections on the shared multi-threaded runtime (`--io-threads 0`)
    // instead of one I/O thread per core; `POLICY/traced`: spans exported to the sink;
    // `POLICY/base`: the kvgate binary named by `$O1_KVGATE_BASE` (another build, e.g. the commit
    // before a change, measured in the same rounds as this one).
    let (target, variant) = match target.split_once('/') {
        Some((target, variant)) => (target, Some(variant)),
        None => (target, None),
    };
    let shared_runtime = variant == Some("shared");
    let routing = if target.starts_with("tokenize") { "cache_aware" } else { target };
    let mut args = vec!["launch", "--port", "0", "--policy", routing, "--log-level", "warn"];
    if shared_runtime {
        args.extend(["--io-threads", "0"]);
    }
    if variant == Some("traced") {
        args.extend(["--otlp-traces-endpoint", otlp.expect("the sink runs for traced targets")]);
    }
    args.extend(["--worker-threads", threads, "--worker-urls"]);
    args.extend(urls.iter().map(String::as_str));
    if target.starts_with("tokenize") {
        args.extend(["--prefix-index", "exact", "--kv-events-endpoints"]);
        args.extend(silent_events.iter().map(String::as_str));
    }
    match target {
        "tokenize_mock" => args.push("--mock-tokenizer"),
        "tokenize_hf" => args.extend(["--tokenizer-path", tokenizer_dir]),
        _ => {}
    }
    let binary = match variant {
        Some("base") => match std::env::var_os("O1_KVGATE_BASE") {
            Some(path) => std::path::PathBuf::from(path),
            None => return Err("O1_KVGATE_BASE not set".into()),
        },
        _ => std::path::PathBuf::from(env!("CARGO_BIN_EXE_kvgate")),
    };
    let (gateway, lines) =
        spawn_binary(&binary, &args, |l| l.iter().any(|l| l.starts_with("kvgate listening on")));
    // `kvgate listening on URL (admin API: ...)`.
    let url = lines.iter().find_map(|l| l.strip_prefix("kvgate listening on ")).unwrap();
    let url = url.split_whitespace().next().unwrap_or(url);
    Ok(Server::Child(gateway, url.to_string()))
}
