//! kvgate-soak, `kvgate soak`: a bounded soak, burst and churn run in one process (simulated engines, the
//! gateway and the client) that checks no request is lost or answered twice and that memory and
//! file descriptors stay flat. Phases: steady load with worker churn (removal and re-adding
//! through `/workers`, one engine killed outright and restarted), a burst well above capacity,
//! and a recovery at the steady rate. Every request carries a unique `x-soak-id`; the
//! engines count the ids they receive and answer (`kvgate_mock::MockFleet::soak_ids`), and the
//! report joins those counts with what the client saw (`report.rs` defines a duplicate).

mod engines;
mod error;
mod report;
mod resources;
mod traffic;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvgate_config::{Checks, FieldError, Range, ValidationErrors};
use kvgate_engine::EngineFlags;
use kvgate_gateway::GatewayConfig;
use kvgate_mock::MockArgs;
use kvgate_policy::PolicyConfig;

use engines::{Engines, Streaming};
pub use error::SoakError;
use report::{FdCheck, Incident, IncidentKind, Phase, Record, RunData, SoakReport};
use resources::Sample;
use traffic::{Draws, Outcome};

/// The model the simulated engines serve.
const MODEL: &str = "mock-model";
/// Failed-clean requests whose details are kept for the report (lost ones are always kept).
const MAX_FAILED_LISTED: usize = 200;
/// Bytes the client keeps per request.
const RECORD_BYTES: usize = std::mem::size_of::<Record>();
/// Settling time between the start of the gateway and the first request.
const SETTLE: Duration = Duration::from_secs(1);

/// Options of `kvgate soak`.
#[derive(clap::Args, Clone, Debug)]
pub struct SoakArgs {
    /// Simulated engines started in-process.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Model time of the engines runs this many times faster than wall time. At 2, four
    /// reference engines serve about 110 requests/s of this mix (prefill-bound), well below
    /// what the process's CPU can push through the gateway.
    #[arg(long, default_value_t = 2.0)]
    pub time_scale: f64,
    /// Engine model parameters (each unset flag keeps the reference replica's value).
    #[command(flatten)]
    pub engine_flags: EngineFlags,
    /// The gateway's routing policy and its options (as for `kvgate launch`).
    #[command(flatten)]
    pub routing: PolicyConfig,
    /// Gateway admission: most requests proxied at once (0: no limit). Without a limit a burst
    /// piles up in the engines' queues and its requests wait past any deadline.
    #[arg(long, default_value_t = 256)]
    pub max_concurrent_requests: usize,
    /// Gateway admission: requests that may wait for a slot (0: refuse at once with 429).
    #[arg(long, default_value_t = 256)]
    pub queue_size: usize,
    /// Gateway admission: longest wait in the queue, in seconds (then 408).
    #[arg(long, default_value_t = 5.0)]
    pub queue_timeout_secs: f64,

    /// Seconds of steady load (with worker churn).
    #[arg(long, default_value_t = 600.0)]
    pub steady_secs: f64,
    /// Requests per second during the steady and recovery phases (Poisson arrivals). The
    /// default is about 80% of what the default fleet completes at most (~110/s).
    #[arg(long, default_value_t = 90.0)]
    pub rate: f64,
    /// Seconds of burst.
    #[arg(long, default_value_t = 20.0)]
    pub burst_secs: f64,
    /// Requests per second during the burst (default: 10 x --rate).
    #[arg(long)]
    pub burst_rate: Option<f64>,
    /// Seconds of recovery at --rate after the burst.
    #[arg(long, default_value_t = 30.0)]
    pub recovery_secs: f64,
    /// Share of requests that stream.
    #[arg(long, default_value_t = 0.5)]
    pub stream_fraction: f64,
    /// The gateway's --migrate-streams: a stream whose engine fails mid-answer goes on on
    /// another engine (false: it ends with the error event, for a before/after figure).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub migrate_streams: bool,
    /// Closed-loop clients: this many clients each send their next request as soon as their
    /// last one ended, in every phase (the rates are then unused); 0: Poisson arrivals at the
    /// phases' rates.
    #[arg(long, default_value_t = 0)]
    pub clients: usize,

    /// Every this many seconds of the steady phase, remove one worker through the gateway's
    /// `DELETE /workers/{url}` and add it back --churn-down-secs later (0: no churn).
    #[arg(long, default_value_t = 30.0)]
    pub churn_every_secs: f64,
    /// Seconds a churned worker stays out.
    #[arg(long, default_value_t = 5.0)]
    pub churn_down_secs: f64,
    /// When to kill the last engine outright (default: between two churns near the middle of
    /// the steady phase); with --kills above 1, unused.
    #[arg(long)]
    pub kill_at_secs: Option<f64>,
    /// Engines killed outright during the steady phase (each restarted --kill-down-secs later):
    /// one (the last engine, at --kill-at-secs), or several at even intervals over the phase,
    /// rotating over the engines. Streams cut by a kill move to another engine
    /// (`--migrate-streams`); the report's migration line counts them. With streamed traffic a
    /// kill waits (at most 3 s) for a stream open on its engine.
    #[arg(long, default_value_t = 1)]
    pub kills: usize,
    /// Seconds the killed engine stays down before it restarts on its port.
    #[arg(long, default_value_t = 5.0)]
    pub kill_down_secs: f64,
    /// Do not kill an engine.
    #[arg(long)]
    pub no_kill: bool,

    /// A request without a complete answer this many seconds after it was sent is lost.
    #[arg(long, default_value_t = 60.0)]
    pub deadline_secs: f64,
    /// Seconds between resource samples (and progress lines on stderr).
    #[arg(long, default_value_t = 10.0)]
    pub sample_every_secs: f64,
    /// Seconds everything stays idle after the last answer before the "after" sample.
    #[arg(long, default_value_t = 5.0)]
    pub idle_secs: f64,
    /// Seed of the request mix and the arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Log level of the gateway and engines (on stderr).
    #[arg(long, default_value = "warn")]
    pub log_level: String,
}

impl SoakArgs {
    fn validate(&self) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        if !(2..=usize::from(u8::MAX)).contains(&self.workers) {
            let message = "must be between 2 (one is churned while others serve) and 255";
            checks.push(FieldError::new("workers", message).got(self.workers));
        }
        for (field, value) in [
            ("time_scale", self.time_scale),
            ("rate", self.rate),
            ("burst_rate", self.burst_rate()),
            ("deadline_secs", self.deadline_secs),
            ("sample_every_secs", self.sample_every_secs),
        ] {
            checks.in_range(field, value, Range::POSITIVE);
        }
        for (field, value) in [
            ("steady_secs", self.steady_secs),
            ("burst_secs", self.burst_secs),
            ("recovery_secs", self.recovery_secs),
            ("churn_every_secs", self.churn_every_secs),
            ("churn_down_secs", self.churn_down_secs),
            ("kill_down_secs", self.kill_down_secs),
            ("idle_secs", self.idle_secs),
            ("queue_timeout_secs", self.queue_timeout_secs),
        ] {
            checks.in_range(field, value, Range::NON_NEGATIVE);
        }
        checks.in_range("stream_fraction", self.stream_fraction, Range::PROBABILITY);
        checks.nested(self.routing.validate());
        if self.kills == 1 && !self.no_kill {
            let at = self.kills().first().map_or(0.0, |kill| kill.0);
            if !(at.is_finite() && at >= 0.0 && at < self.steady_secs) {
                checks.push(FieldError::new("kill_at_secs", "must be within the steady phase").got(at));
            }
        }
        if self.kills > 1 {
            // An engine is killed again only once it is back.
            let every = self.steady_secs / self.kills as f64;
            if every * (self.workers.min(self.kills)) as f64 <= self.kill_down_secs {
                let message = format!(
                    "{} kills over {} s of steady load leave an engine no time to come back ({} s down)",
                    self.kills, self.steady_secs, self.kill_down_secs
                );
                checks.push(FieldError::new("kills", message).got(self.kills));
            }
        }
        checks.finish()
    }

    fn burst_rate(&self) -> f64 {
        self.burst_rate.unwrap_or(10.0 * self.rate)
    }

    /// The kills: (seconds, duration, engine), in time order.
    fn kills(&self) -> Vec<(f64, f64, usize)> {
        if self.no_kill || self.kills == 0 {
            return Vec::new();
        }
        if self.kills > 1 {
            let every = self.steady_secs / self.kills as f64;
            return (0..self.kills)
                .map(|k| ((k as f64 + 0.5) * every, self.kill_down_secs, k % self.workers))
                .collect();
        }
        let half = self.steady_secs / 2.0;
        let at = self.kill_at_secs.unwrap_or(if self.churn_every_secs > 0.0 {
            ((half / self.churn_every_secs).floor() + 0.5) * self.churn_every_secs
        } else {
            half
        });
        vec![(at, self.kill_down_secs, self.workers - 1)]
    }

    /// The phases: (phase, seconds, target rate; 0 with closed-loop clients).
    fn plan(&self) -> Vec<(Phase, f64, f64)> {
        let rate = |rate: f64| if self.clients > 0 { 0.0 } else { rate };
        vec![
            (Phase::Steady, self.steady_secs, rate(self.rate)),
            (Phase::Burst, self.burst_secs, rate(self.burst_rate())),
            (Phase::Recovery, self.recovery_secs, rate(self.rate)),
        ]
    }

    fn mock_args(&self) -> MockArgs {
        MockArgs {
            time_scale: self.time_scale,
            engine_flags: self.engine_flags.clone(),
            ..MockArgs::default()
        }
    }

    fn gateway_config(&self, worker_urls: Vec<String>) -> GatewayConfig {
        GatewayConfig {
            port: 0,
            worker_urls,
            max_concurrent_requests: (self.max_concurrent_requests > 0)
                .then_some(self.max_concurrent_requests),
            queue_size: self.queue_size,
            queue_timeout_secs: self.queue_timeout_secs,
            health_check_interval_secs: 2.0,
            expose_routing_headers: true,
            migrate_streams: self.migrate_streams,
            log_level: self.log_level.clone(),
            routing: self.routing.clone(),
            ..GatewayConfig::default()
        }
    }
}

/// Runs the soak, prints the table (and writes the JSON); fails when a request was lost or
/// duplicated.
pub async fn run_cli(args: SoakArgs) -> Result<(), SoakError> {
    args.validate()?;
    let report = run(&args).await?;
    if let Some(path) = &args.json {
        let output = |error: &dyn std::fmt::Display| SoakError::Output {
            path: path.display().to_string(),
            message: error.to_string(),
        };
        let json = serde_json::to_string_pretty(&report).map_err(|error| output(&error))?;
        std::fs::write(path, json).map_err(|error| output(&error))?;
    }
    println!("{}", report.markdown());
    if !report.passed() {
        return Err(SoakError::Failed {
            lost: report.total.lost,
            duplicated: report.total.duplicated,
            wrong_text: report.migrations.wrong_text,
        });
    }
    Ok(())
}

/// Counters shared by the request tasks, for the progress lines and the drain.
#[derive(Default)]
struct Progress {
    sent: AtomicU64,
    in_flight: AtomicUsize,
    succeeded: AtomicU64,
    failed: AtomicU64,
    lost: AtomicU64,
    failed_listed: AtomicUsize,
}

/// What the request tasks collect.
#[derive(Default)]
struct Collected {
    records: Mutex<Vec<Record>>,
    incidents: Mutex<Vec<Incident>>,
    samples: Mutex<Vec<Sample>>,
}

/// Everything a request task needs.
struct Shared {
    client: reqwest::Client,
    url: String,
    id_prefix: String,
    worker_urls: Vec<String>,
    /// The streams open on each engine, for the kills.
    streaming: Streaming,
    seed: u64,
    stream_fraction: f64,
    deadline: Duration,
    started: Instant,
    progress: Progress,
    collected: Collected,
}

async fn run(args: &SoakArgs) -> Result<SoakReport, SoakError> {
    let baseline = resources::sample("baseline", 0.0, 0, 0);
    let engines = Engines::start(args.workers, args.mock_args()).await?;
    let worker_urls = engines.urls().to_vec();
    let gateway = kvgate_gateway::start(args.gateway_config(worker_urls.clone()))
        .await
        .map_err(|error| SoakError::Gateway(error.to_string()))?;
    tokio::time::sleep(SETTLE).await;
    let before = resources::sample("before", 0.0, 0, 0);
    let expected: f64 =
        args.plan().iter().map(|(_, secs, rate)| secs * rate.max(args.clients as f64 * 20.0)).sum();
    let shared = Arc::new(Shared {
        // Short-lived idle connections, so descriptor samples follow the load.
        client: reqwest::Client::builder()
            .pool_idle_timeout(Duration::from_secs(2))
            .build()
            .map_err(|error| SoakError::run("building the HTTP client", error))?,
        url: format!("{}/v1/chat/completions", gateway.url()),
        id_prefix: format!("soak{}-", args.seed),
        worker_urls: worker_urls.clone(),
        streaming: Streaming::new(&worker_urls),
        seed: args.seed,
        stream_fraction: args.stream_fraction,
        deadline: Duration::from_secs_f64(args.deadline_secs),
        started: Instant::now(),
        progress: Progress::default(),
        collected: Collected {
            records: Mutex::new(Vec::with_capacity((expected * 1.1) as usize)),
            ..Collected::default()
        },
    });
    shared.collected.samples.lock().unwrap_or_else(|p| p.into_inner()).extend([baseline, before.clone()]);

    let events = engines::schedule(
        args.steady_secs,
        args.workers,
        args.churn_every_secs,
        args.churn_down_secs,
        &args.kills(),
    );
    let admin_url = gateway.admin_url();
    let started = shared.started;
    let churn_shared = shared.clone();
    let churn = tokio::spawn(async move {
        let mut engines = engines;
        let streams = (churn_shared.stream_fraction > 0.0).then_some(&churn_shared.streaming);
        let done = engines::churn(&mut engines, &admin_url, MODEL, events, started, streams).await;
        drop(churn_shared);
        (engines, done)
    });
    let (stop_sampler, stopped) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_loop(shared.clone(), args.plan(), args.sample_every_secs, stopped));

    match args.clients {
        0 => dispatch(&shared, &args.plan()).await,
        clients => closed_loop(&shared, &args.plan(), clients).await,
    }
    drain(&shared).await;
    let (engines, churn_events) = churn.await.map_err(|error| SoakError::run("the churn task", error))?;
    let _ = stop_sampler.send(true);
    let _ = sampler.await;

    let Shared { collected, worker_urls, id_prefix, .. } = release(shared).await?;
    // The client (and its connections) is gone; let the gateway and engines go idle.
    tokio::time::sleep(Duration::from_secs_f64(args.idle_secs)).await;
    let requests = collected.records.lock().unwrap_or_else(|p| p.into_inner()).len() as u64;
    let after = resources::sample("after", started.elapsed().as_secs_f64(), requests, RECORD_BYTES);
    let pooled_upstream_idle = gateway.idle_upstream_connections();
    let engine_ids = engines.soak_ids();
    gateway.shutdown().await;
    engines.shutdown().await;
    tokio::time::sleep(SETTLE).await;
    let after_shutdown =
        resources::sample("after shutdown", started.elapsed().as_secs_f64(), requests, RECORD_BYTES);

    let fd_check = FdCheck {
        baseline: collected.samples.lock().unwrap_or_else(|p| p.into_inner())[0].fds,
        before: before.fds,
        after_idle: after.fds,
        pooled_upstream_idle,
        after_shutdown: after_shutdown.fds,
    };
    let mut samples = collected.samples.into_inner().unwrap_or_else(|p| p.into_inner());
    samples.extend([after, after_shutdown]);
    Ok(report::build(RunData {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        plan: args.plan(),
        records: collected.records.into_inner().unwrap_or_else(|p| p.into_inner()),
        incidents: collected.incidents.into_inner().unwrap_or_else(|p| p.into_inner()),
        engine_ids,
        id_prefix,
        worker_urls,
        samples,
        fd_check,
        churn: churn_events,
    }))
}

/// Sends the phases' requests at their Poisson arrival times, each in its own task.
async fn dispatch(shared: &Arc<Shared>, plan: &[(Phase, f64, f64)]) {
    let mut draws = Draws::new(shared.seed, u64::MAX / 2);
    let mut n = 0u64;
    let mut phase_start = 0.0;
    for &(phase, secs, rate) in plan {
        let phase_end = phase_start + secs;
        let mut at = phase_start + draws.exponential(rate);
        while at < phase_end {
            tokio::time::sleep_until((shared.started + Duration::from_secs_f64(at)).into()).await;
            shared.progress.sent.fetch_add(1, Ordering::Relaxed);
            shared.progress.in_flight.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(request(shared.clone(), n, phase));
            n += 1;
            at += draws.exponential(rate);
        }
        tokio::time::sleep_until((shared.started + Duration::from_secs_f64(phase_end)).into()).await;
        let sent = shared.progress.sent.load(Ordering::Relaxed);
        let sample = resources::sample(phase.label(), phase_end, sent, RECORD_BYTES);
        shared.collected.samples.lock().unwrap_or_else(|p| p.into_inner()).push(sample);
        phase_start = phase_end;
    }
}

/// Runs `clients` closed-loop clients through the phases: each sends its next request as soon
/// as its last one ended.
async fn closed_loop(shared: &Arc<Shared>, plan: &[(Phase, f64, f64)], clients: usize) {
    let next = Arc::new(AtomicU64::new(0));
    let mut phase_start = 0.0;
    for &(phase, secs, _) in plan {
        let phase_end = phase_start + secs;
        let end = shared.started + Duration::from_secs_f64(phase_end);
        let loops: Vec<_> = (0..clients)
            .map(|_| {
                let (shared, next) = (shared.clone(), next.clone());
                tokio::spawn(async move {
                    while Instant::now() < end {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        shared.progress.sent.fetch_add(1, Ordering::Relaxed);
                        shared.progress.in_flight.fetch_add(1, Ordering::Relaxed);
                        request(shared.clone(), n, phase).await;
                    }
                })
            })
            .collect();
        for client in loops {
            let _ = client.await;
        }
        let sent = shared.progress.sent.load(Ordering::Relaxed);
        let sample = resources::sample(phase.label(), phase_end, sent, RECORD_BYTES);
        shared.collected.samples.lock().unwrap_or_else(|p| p.into_inner()).push(sample);
        phase_start = phase_end;
    }
}

/// Waits for the requests in flight (each ends by its deadline).
async fn drain(shared: &Shared) {
    let limit = Instant::now() + shared.deadline + Duration::from_secs(10);
    while shared.progress.in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Takes the shared state back once the last request task has let go of it (right after the
/// in-flight count reached zero).
async fn release(mut shared: Arc<Shared>) -> Result<Shared, SoakError> {
    for _ in 0..100 {
        match Arc::try_unwrap(shared) {
            Ok(shared) => return Ok(shared),
            Err(still_shared) => shared = still_shared,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let in_flight = shared.progress.in_flight.load(Ordering::Relaxed);
    Err(SoakError::run("draining", format!("{in_flight} requests are still running after their deadline")))
}

/// One request: plan, send, classify, record.
async fn request(shared: Arc<Shared>, n: u64, phase: Phase) {
    let sent_at = shared.started.elapsed();
    let planned = traffic::plan_request(shared.seed, n, MODEL, shared.stream_fraction);
    let stream = planned.stream;
    let soak_id = format!("{}{n}", shared.id_prefix);
    let observed =
        traffic::send(&shared.client, &shared.url, &soak_id, &planned, shared.deadline, &shared.streaming)
            .await;
    let outcome = observed.cause.outcome();
    // A whole stream must be the uncut answer: a chunk repeated or lost across engines shows.
    let wrong_text = stream && outcome == Outcome::Succeeded && observed.text != planned.expected_answer();
    let worker_idx = observed
        .worker
        .as_deref()
        .and_then(|worker| shared.worker_urls.iter().position(|url| url == worker))
        .and_then(|idx| u8::try_from(idx).ok());
    let record = Record {
        n,
        phase,
        sent_at_ms: u32::try_from(sent_at.as_millis()).unwrap_or(u32::MAX),
        cause: observed.cause,
        ttft_us: observed.ttft.filter(|_| stream && outcome == Outcome::Succeeded).map(report::micros),
        latency_us: (!stream && outcome == Outcome::Succeeded).then(|| report::micros(observed.latency)),
        multi_answer: observed.multi_answer,
        worker_idx,
        stream,
        wrong_text,
    };
    let progress = &shared.progress;
    let counter = match outcome {
        Outcome::Succeeded => &progress.succeeded,
        Outcome::FailedClean => &progress.failed,
        Outcome::Lost => &progress.lost,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    let listed = match outcome {
        Outcome::Succeeded => wrong_text,
        Outcome::Lost => true,
        Outcome::FailedClean => progress.failed_listed.fetch_add(1, Ordering::Relaxed) < MAX_FAILED_LISTED,
    };
    if listed {
        let incident = Incident {
            soak_id,
            kind: match outcome {
                _ if wrong_text => IncidentKind::WrongText,
                Outcome::Lost => IncidentKind::Lost,
                _ => IncidentKind::FailedClean,
            },
            phase,
            sent_at_secs: sent_at.as_secs_f64(),
            cause: observed.cause.label(),
            worker: observed.worker,
            detail: match wrong_text {
                true => Some(format!("got {:?}", observed.text.chars().take(200).collect::<String>())),
                false => observed.detail,
            },
            engines_received: 0,
            engines_answered: 0,
        };
        shared.collected.incidents.lock().unwrap_or_else(|p| p.into_inner()).push(incident);
    }
    shared.collected.records.lock().unwrap_or_else(|p| p.into_inner()).push(record);
    progress.in_flight.fetch_sub(1, Ordering::Relaxed);
}

/// Samples resources every `every_secs` under the current phase's label, with a progress line.
async fn sample_loop(
    shared: Arc<Shared>,
    plan: Vec<(Phase, f64, f64)>,
    every_secs: f64,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(every_secs));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
        let at = shared.started.elapsed().as_secs_f64();
        let mut end = 0.0;
        let label = plan
            .iter()
            .find(|(_, secs, _)| {
                end += secs;
                at < end
            })
            .map_or("drain", |(phase, ..)| phase.label());
        let p = &shared.progress;
        let sample = resources::sample(label, at, p.sent.load(Ordering::Relaxed), RECORD_BYTES);
        eprintln!(
            "soak {at:>6.0}s {label:<8} sent {} ok {} failed {} lost {} in flight {} | RSS {:.0} MB, {} fds",
            p.sent.load(Ordering::Relaxed),
            p.succeeded.load(Ordering::Relaxed),
            p.failed.load(Ordering::Relaxed),
            p.lost.load(Ordering::Relaxed),
            p.in_flight.load(Ordering::Relaxed),
            sample.rss_kb as f64 / 1024.0,
            sample.fds,
        );
        shared.collected.samples.lock().unwrap_or_else(|p| p.into_inner()).push(sample);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        args: SoakArgs,
    }

    fn parse(flags: &[&str]) -> SoakArgs {
        <Command as clap::Parser>::parse_from(std::iter::once("soak").chain(flags.iter().copied())).args
    }

    #[test]
    fn defaults_are_ten_minutes_a_tenfold_burst_and_a_kill_between_churns() {
        let args = parse(&[]);
        assert!(args.validate().is_ok());
        assert_eq!(args.plan().iter().map(|p| p.1).sum::<f64>(), 650.0);
        assert_eq!(args.burst_rate(), 10.0 * args.rate);
        assert_eq!(args.kills(), [(315.0, 5.0, 3)]);
        assert!(parse(&["--no-kill"]).kills().is_empty());
        // Several kills: even intervals over the steady phase, rotating over the engines.
        let many = parse(&["--steady-secs", "120", "--kills", "10", "--churn-every-secs", "0"]);
        assert!(many.validate().is_ok());
        let kills = many.kills();
        assert_eq!(kills.len(), 10);
        assert_eq!((kills[0], kills[9]), ((6.0, 5.0, 0), (114.0, 5.0, 1)));
        let crowded = parse(&["--steady-secs", "10", "--kills", "10", "--workers", "2"]);
        assert!(crowded.validate().unwrap_err().names("kills"));
        let problems =
            parse(&["--workers", "1", "--rate", "0", "--kill-at-secs", "900"]).validate().unwrap_err();
        assert_eq!(problems.errors().len(), 4, "{problems}");
        assert!(problems.names("workers") && problems.names("rate") && problems.names("kill_at_secs"));
    }
}
