//! Real vLLM engines (the CPU build `scripts/real-vllm/install.sh` installs) started through
//! `scripts/real-vllm/serve.sh` on free 127.0.0.1 ports, each in a process group of its own,
//! stopped by that group's id when dropped (a test that panics stops them too).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository's harness and where it installed vLLM and the models.
pub struct Harness {
    pub scripts: PathBuf,
    pub models: PathBuf,
}

impl Harness {
    /// The harness when vLLM is installed; `None` (after saying it was skipped) when it is not,
    /// unless `KVGATE_REQUIRE_VLLM=1` (CI, whose `.ci/run` installs it), which makes it a failure.
    pub fn find() -> Option<Harness> {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let scripts = root.join("scripts/real-vllm");
        let home = std::env::var_os("KVGATE_VLLM_HOME").map(PathBuf::from).unwrap_or_else(|| {
            // As scripts/real-vllm/env.sh.
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into()))
                .join(".cache/kvgate-vllm")
        });
        let ready = home.join("venv/.kvgate-vllm-0.32.0");
        let models = home.join("models");
        let complete = ready.exists()
            && ["tiny-llama-chatml", "tiny-llama-plain"]
                .iter()
                .all(|m| models.join(m).join("tokenizer_config.json").is_file());
        if complete {
            return Some(Harness { scripts, models });
        }
        let why = format!(
            "vLLM's CPU build and the test models are not in {} (run scripts/real-vllm/install.sh)",
            home.display()
        );
        if std::env::var("KVGATE_REQUIRE_VLLM").as_deref() == Ok("1") {
            panic!("KVGATE_REQUIRE_VLLM=1 but {why}");
        }
        eprintln!("SKIPPED: the real-engine tests: {why}; set KVGATE_REQUIRE_VLLM=1 to make this a failure");
        None
    }

    pub fn model(&self, name: &str) -> PathBuf {
        self.models.join(name)
    }
}

/// How one engine is started.
pub struct EngineSpec {
    pub model: PathBuf,
    /// More `vllm serve` flags.
    pub flags: Vec<String>,
}

/// A running engine: its HTTP port, its KV event publisher and replay ports.
pub struct Engine {
    child: Option<Child>,
    pub port: u16,
    pub events_port: u16,
    pub replay_port: u16,
    log: PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Engine {
    /// Starts an engine on new ports (not waiting for it).
    pub fn spawn(harness: &Harness, spec: EngineSpec) -> Engine {
        let (port, events_port, replay_port) = (free_port(), free_port(), free_port());
        Engine::spawn_on(harness, spec, [port, events_port, replay_port])
    }

    /// Starts an engine on the given ports: HTTP, KV events, replay.
    pub fn spawn_on(harness: &Harness, spec: EngineSpec, ports: [u16; 3]) -> Engine {
        use std::os::unix::process::CommandExt;
        let log =
            std::env::temp_dir().join(format!("kvgate-real-vllm-{}-{}.log", std::process::id(), ports[0]));
        let file = std::fs::File::create(&log).expect("engine log");
        let child = Command::new(harness.scripts.join("serve.sh"))
            .arg(&spec.model)
            .args(ports.iter().map(u16::to_string))
            .args(&spec.flags)
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .process_group(0)
            .spawn()
            .expect("serve.sh starts");
        Engine { child: Some(child), port: ports[0], events_port: ports[1], replay_port: ports[2], log }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn events_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.events_port)
    }

    pub fn replay_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }

    /// Waits until `/health` answers 200 (at most `limit`); returns when it did.
    pub async fn wait_healthy(&mut self, limit: Duration) -> Instant {
        let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(2)).build().unwrap();
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(answer) = client.get(format!("{}/health", self.url())).send().await {
                if answer.status().is_success() {
                    return Instant::now();
                }
            }
            let exited = self.child.as_mut().and_then(|child| child.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> =
                    log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
                panic!(
                    "engine on {} not healthy ({exited:?}); its log ends:\n{}",
                    self.port,
                    tail.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the engine's process group (SIGTERM, then SIGKILL after 10 s) and waits for it.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let group = format!("-{}", child.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) && !group_alive(&group) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Whether any process of the group is left.
fn group_alive(group: &str) -> bool {
    Command::new("kill").args(["-0", "--", group]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}
