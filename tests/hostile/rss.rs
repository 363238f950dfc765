//! The gateway's memory under each attack, as a process of its own: idle RSS after a warm-up,
//! then the peak RSS (`VmHWM`, reset with `/proc/PID/clear_refs`) while the attack runs. Ignored
//! by default (the figures want a release build and a quiet machine); docs/RELIABILITY.md
//! records them. Run it with:
//!
//! ```sh
//! cargo build --release --bin kvgate
//! KVGATE_BIN=target/release/kvgate cargo test --test hostile rss -- --ignored --nocapture
//! ```

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use serde_json::json;

use crate::common::kv_wire::{batch, block_stored, Publisher};
use crate::common::redis::{publish, Redis};
use crate::common::{client, dead_url, upstream};
use crate::flood::flood;

/// A `kvgate launch` child on free loopback ports, killed when dropped.
struct Gateway {
    child: Child,
    url: String,
    admin: String,
}

const ADMIN_KEY: &str = "rss-measurement-admin-key";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Gateway {
    async fn start(args: &[String]) -> Gateway {
        let binary = std::env::var("KVGATE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvgate").to_string());
        let (port, admin_port) = (free_port(), free_port());
        let child = Command::new(binary)
            .args(["launch", "--port", &port.to_string(), "--admin-port", &admin_port.to_string()])
            .args([
                "--admin-api-key",
                ADMIN_KEY,
                "--log-level",
                "error",
                "--health-check-interval-secs",
                "0.5",
            ])
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .expect("kvgate starts");
        let gateway = Gateway {
            child,
            url: format!("http://127.0.0.1:{port}"),
            admin: format!("http://127.0.0.1:{admin_port}"),
        };
        let started = Instant::now();
        while client().get(format!("{}/health", gateway.url)).send().await.is_err() {
            assert!(started.elapsed() < Duration::from_secs(20), "kvgate listens within 20 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        gateway
    }

    fn status(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|line| line.starts_with(field)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// Open file descriptors (sockets included).
    fn open_files(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id())).map_or(0, |dir| dir.count())
    }

    /// Resident memory now, in KiB.
    fn rss(&self) -> u64 {
        self.status("VmRSS:")
    }

    /// The peak resident memory since the last reset, in KiB.
    fn peak(&self) -> u64 {
        self.status("VmHWM:")
    }

    fn reset_peak(&self) {
        std::fs::write(format!("/proc/{}/clear_refs", self.child.id()), "5").unwrap();
    }

    async fn add_worker(&self, body: serde_json::Value) -> reqwest::StatusCode {
        let sent =
            client().post(format!("{}/workers", self.admin)).bearer_auth(ADMIN_KEY).json(&body).send().await;
        sent.unwrap().status()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs of `bodies` to `url`, from `clients` clients at a time; returns how many got 2xx.
async fn post_many(url: &str, bodies: Vec<Bytes>, clients: usize) -> usize {
    stream::iter(bodies)
        .map(|body| async move {
            let sent = client().post(url).header("content-type", "application/json").body(body).send().await;
            match sent {
                Ok(res) if res.status().is_success() => res.bytes().await.is_ok() as usize,
                Ok(res) => {
                    let _ = res.bytes().await;
                    0
                }
                Err(_) => 0,
            }
        })
        .buffer_unordered(clients)
        .fold(0, |sum, ok| async move { sum + ok })
        .await
}

fn small_chats(count: usize) -> Vec<Bytes> {
    (0..count)
        .map(|i| {
            Bytes::from(
                json!({"model": "m", "messages": [{"role": "user", "content": format!("hello {i}")}]})
                    .to_string(),
            )
        })
        .collect()
}

/// Idle RSS after a warm-up of small chats, then the peak while `attack` runs; prints a row.
/// Within bounds: the peak under twice the idle RSS, or (where the bound is a configured size,
/// docs/RELIABILITY.md) at most `allowance_mib` over it.
async fn measure(
    name: &str,
    gateway: &Gateway,
    allowance_mib: f64,
    attack: impl AsyncFnOnce(&Gateway) -> String,
) -> (String, f64, bool) {
    let chats = format!("{}/v1/chat/completions", gateway.url);
    post_many(&chats, small_chats(200), 8).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = gateway.rss();
    gateway.reset_peak();
    let started = Instant::now();
    let what = attack(gateway).await;
    let seconds = started.elapsed().as_secs_f64();
    let peak = gateway.peak();
    let after = gateway.rss();
    let ratio = peak as f64 / idle as f64;
    println!(
        "| {name} | {what} | {:.1} | {:.1} | {:.1} | {ratio:.2} | {seconds:.1} |",
        idle as f64 / 1024.0,
        peak as f64 / 1024.0,
        after as f64 / 1024.0
    );
    let growth_mib = peak.saturating_sub(idle) as f64 / 1024.0;
    (name.to_string(), ratio, ratio < 2.0 || growth_mib <= allowance_mib)
}

fn tokenizer_flags(worker: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/kvgate-tokenizer/testdata/tiny-chatml");
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    [
        "--worker-urls",
        worker,
        "--kv-events-endpoints",
        &format!("tcp://{dead}"),
        "--prefix-index",
        "exact",
        "--tokenizer-path",
        root.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run with --ignored (see the module's doc)"]
async fn rss_under_each_attack() {
    println!("| attack | volume | idle MiB | peak MiB | after MiB | peak/idle | s |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let worker = upstream("w", "m").await;
    let mut ratios = Vec::new();

    let gateway = Gateway::start(&["--worker-urls".into(), worker.url.clone()]).await;
    ratios.push(
        measure("`POST /workers` on the main listener, no key", &gateway, 0.0, async |gw| {
            let bodies = (0..10_000)
                .map(|i| {
                    Bytes::from(
                        json!({"url": format!("http://10.0.{}.{}:8000", i / 250, i % 250)}).to_string(),
                    )
                })
                .collect();
            let added = post_many(&format!("{}/workers", gw.url), bodies, 8).await;
            assert_eq!(added, 0);
            "10,000 registrations".into()
        })
        .await,
    );
    drop(gateway);

    let gateway =
        Gateway::start(&["--worker-urls".into(), worker.url.clone(), "--max-workers".into(), "100".into()])
            .await;
    ratios.push(
        measure("registrations past `--max-workers 100`, with the key", &gateway, 0.0, async |gw| {
            let mut added = 0;
            for _ in 0..2000 {
                added += gw.add_worker(json!({"url": dead_url().await, "model_id": "m"})).await.is_success()
                    as usize;
            }
            assert_eq!(added, 99);
            "2,000 registrations".into()
        })
        .await,
    );
    drop(gateway);

    let gateway = Gateway::start(&["--worker-urls".into(), worker.url.clone()]).await;
    ratios.push(
        measure("a worker answering `/v1/models` and `/health` without end", &gateway, 0.0, async |gw| {
            let hostile = flood("m", &["/v1/models", "/health"], false, 1 << 30).await;
            assert!(gw.add_worker(json!({"url": hostile.url})).await.is_success());
            tokio::time::sleep(Duration::from_secs(5)).await;
            format!(
                "{} MiB offered over 5 s of probes",
                hostile.sent.load(std::sync::atomic::Ordering::Relaxed) >> 20
            )
        })
        .await,
    );
    drop(gateway);

    let gateway = Gateway::start(&["--worker-urls".into(), worker.url.clone()]).await;
    ratios.push(
        measure("workers added and removed", &gateway, 0.0, async |gw| {
            let mut halfway = 0;
            for i in 0..1000 {
                if i == 500 {
                    halfway = gw.rss();
                }
                let other = upstream(&format!("churn{i}"), "m").await;
                assert!(gw.add_worker(json!({"url": other.url, "model_id": "m"})).await.is_success());
                let encoded = other.url.replace(':', "%3A").replace('/', "%2F");
                let res = client()
                    .delete(format!("{}/workers/{encoded}", gw.admin))
                    .bearer_auth(ADMIN_KEY)
                    .send()
                    .await;
                assert!(res.unwrap().status().is_success());
            }
            // Each removed worker's idle probe connection stays in the pool until its idle
            // timeout (90 s): the growth is those connections, not the worker's state.
            format!(
                "1,000 cycles (RSS {:.1} MiB after 500; {} files open after)",
                halfway as f64 / 1024.0,
                gw.open_files()
            )
        })
        .await,
    );
    drop(gateway);

    // Long inputs: what they cost is bounded by --max-tokenize-chars per tokenizer thread (the
    // tokenizer's working memory, some hundreds of bytes per character) plus the bodies in flight.
    for chars in [262_144usize, 65_536] {
        // The tokenizer's working memory (some hundreds of bytes a character, per thread), what
        // the approximate tree keeps of the 40 prompts (cut at `chars`; about 16 bytes a
        // character, at most --max-tree-size per worker), and the bodies in flight.
        let mib = |bytes: f64| bytes / (1024.0 * 1024.0);
        let allowance = mib(chars as f64 * 512.0) + mib(40.0 * chars as f64 * 24.0) + 64.0;
        let mut flags = tokenizer_flags(&worker.url);
        flags.extend(["--max-tokenize-chars".to_string(), chars.to_string()]);
        let gateway = Gateway::start(&flags).await;
        let name = format!("10,000-message chats, 2 clients, `--max-tokenize-chars {chars}`");
        ratios.push(
            measure(&name, &gateway, allowance, async |gw| {
                let bodies: Vec<Bytes> = (0..40)
                    .map(|n| {
                        let messages: Vec<_> = (0..10_000)
                            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("chat {n} message {i}: the quick brown fox")}))
                            .collect();
                        Bytes::from(serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap())
                    })
                    .collect();
                let served = post_many(&format!("{}/v1/chat/completions", gw.url), bodies, 2).await;
                format!("{served} chats of 10,000 messages")
            })
            .await,
        );
        drop(gateway);
        let gateway = Gateway::start(&flags).await;
        let name = format!("2 MB prompts, 2 clients, `--max-tokenize-chars {chars}`");
        ratios.push(
            measure(&name, &gateway, allowance, async |gw| {
                let bodies: Vec<Bytes> = (0..40)
                    .map(|n| {
                        let prompt: String = (0..250_000).map(|i| format!("w{n}x{i} ")).collect::<String>();
                        Bytes::from(
                            serde_json::to_vec(&json!({"model": "m", "prompt": &prompt[..2_000_000]}))
                                .unwrap(),
                        )
                    })
                    .collect();
                let served = post_many(&format!("{}/v1/completions", gw.url), bodies, 2).await;
                format!("{served} prompts of 2 MB")
            })
            .await,
        );
        drop(gateway);
    }

    let mut publisher = Publisher::bind().await;
    let args: Vec<String> =
        ["--worker-urls", &worker.url, "--kv-events-endpoints", &publisher.endpoint, "--mock-tokenizer"]
            .map(String::from)
            .to_vec();
    let gateway = Gateway::start(&args).await;
    ratios.push(
        measure("KV events past the engine's capacity", &gateway, 0.0, async |gw| {
            let metrics = format!("{}/metrics", gw.url);
            publisher
                .wait_subscribed(async || {
                    let text = client().get(&metrics).send().await.unwrap().text().await.unwrap();
                    crate::common::metric(&text, "kvgate_kv_events_batches_total") > 0.0
                })
                .await;
            // Over the message bound (dropped undecoded), then under it but over the block bound
            // (decoded, refused alone).
            for (round, blocks) in [1_000_000u64, 280_000].into_iter().flat_map(|b| [b; 5]).enumerate() {
                let hashes: Vec<u64> = (0..blocks).map(|i| ((round as u64) << 40) + i).collect();
                let tokens: Vec<u32> = (0..blocks as u32).collect();
                publisher.publish(batch(&[block_stored(&hashes, None, &tokens, 1)])).await;
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            "5 events of 1 M blocks (14 MB each), 5 of 280,000 (3.9 MB)".into()
        })
        .await,
    );
    drop(gateway);

    if let Some(redis) = Redis::start() {
        let args: Vec<String> = [
            "--worker-urls",
            &worker.url,
            "--replica-sync-redis-url",
            &redis.url(),
            "--replica-sync-secret",
            "rss-measurement-replica-secret",
        ]
        .map(String::from)
        .to_vec();
        let gateway = Gateway::start(&args).await;
        // The Redis client reads a message whole before its size is checked: up to a few times
        // the 18 MB message (Redis's `client-output-buffer-limit pubsub` bounds it).
        ratios.push(
            measure("forged replica-sync messages", &gateway, 4.0 * 18.0, async |_| {
                let forged = |replica: u64| {
                    use rmp::encode::{write_array_len, write_str, write_uint};
                    let mut message = Vec::new();
                    write_array_len(&mut message, 3).unwrap();
                    write_uint(&mut message, replica).unwrap();
                    write_array_len(&mut message, 0).unwrap();
                    write_array_len(&mut message, 1).unwrap();
                    write_array_len(&mut message, 2).unwrap();
                    write_str(&mut message, &worker.url).unwrap();
                    write_uint(&mut message, 1_000_000_000).unwrap();
                    message
                };
                for chunk in 0..11u64 {
                    let payloads: Vec<_> = (0..5000).map(|i| forged(chunk * 5000 + i)).collect();
                    publish(redis.port, "kvgate:replica-sync", &payloads).await;
                }
                publish(redis.port, "kvgate:replica-sync", &[vec![0x90; 18 << 20]]).await;
                tokio::time::sleep(Duration::from_secs(2)).await;
                "55,000 forged messages and one of 18 MB".into()
            })
            .await,
        );
        drop(gateway);
    }
    let over: Vec<_> = ratios.iter().filter(|(_, _, ok)| !ok).collect();
    assert!(
        over.is_empty(),
        "peak RSS within 2x idle (or the documented allowance) under every attack: {over:?}"
    );
}
