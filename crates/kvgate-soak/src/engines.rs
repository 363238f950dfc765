//! The soak's simulated engines and the churn done to them: one single-worker mock fleet per
//! engine (so one can be killed outright and restarted on its port), worker removal and re-adding
//! through the gateway's `/workers` API, and the engines' soak id counts, kept across restarts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvgate_mock::{MockArgs, MockError, MockFleet, SoakIdLog, SoakIdSeen};
use serde::Serialize;

use crate::SoakError;

/// Tries to bind a killed engine's port again before giving up.
const RESTART_ATTEMPTS: u32 = 20;
/// How long a kill waits past its time for a stream to be open on its engine (none may be at
/// that instant, on a slow or loaded machine): a kill is there to cut streams mid-answer.
const KILL_WAITS_FOR_A_STREAM: Duration = Duration::from_secs(3);

/// The streams whose answer has begun and not ended, by the engine answering them (the
/// gateway's `x-kvgate-worker`): what a kill waits for.
pub(crate) struct Streaming {
    urls: Vec<String>,
    open: Vec<AtomicUsize>,
}

impl Streaming {
    pub(crate) fn new(urls: &[String]) -> Self {
        Self { urls: urls.to_vec(), open: urls.iter().map(|_| AtomicUsize::new(0)).collect() }
    }

    /// A stream from `worker` began; it counts as open until the guard is dropped.
    pub(crate) fn begin(&self, worker: &str) -> Option<OpenStream<'_>> {
        let counter = &self.open[self.urls.iter().position(|url| url == worker)?];
        counter.fetch_add(1, Ordering::Relaxed);
        Some(OpenStream(counter))
    }

    fn any_open(&self, worker_idx: usize) -> bool {
        self.open.get(worker_idx).is_some_and(|open| open.load(Ordering::Relaxed) > 0)
    }
}

/// One open stream of [`Streaming`].
pub(crate) struct OpenStream<'a>(&'a AtomicUsize);

impl Drop for OpenStream<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(crate) struct Engines {
    template: MockArgs,
    /// One fleet per engine; `None` while it is killed.
    fleets: Vec<Option<MockFleet>>,
    urls: Vec<String>,
    /// The soak id counts of every fleet ever started, restarted ones included.
    logs: Vec<SoakIdLog>,
}

impl Engines {
    pub(crate) async fn start(count: usize, template: MockArgs) -> Result<Self, SoakError> {
        let mut engines = Self { template, fleets: Vec::new(), urls: Vec::new(), logs: Vec::new() };
        for worker_idx in 0..count {
            let fleet = engines
                .spawn(0)
                .await
                .map_err(|error| SoakError::engine(format!("starting engine {worker_idx}"), error))?;
            engines.urls.push(fleet.urls()[0].clone());
            engines.fleets.push(Some(fleet));
        }
        Ok(engines)
    }

    async fn spawn(&mut self, port: u16) -> Result<MockFleet, MockError> {
        let args = MockArgs { count: 1, base_port: port, ..self.template.clone() };
        let fleet = kvgate_mock::spawn_fleet(args).await?;
        self.logs.push(fleet.soak_id_log());
        Ok(fleet)
    }

    pub(crate) fn urls(&self) -> &[String] {
        &self.urls
    }

    /// Stops engine `worker_idx` at once: its port closes, its open streams end with an error,
    /// requests waiting in it are answered 503.
    pub(crate) async fn kill(&mut self, worker_idx: usize) -> Result<(), SoakError> {
        let Some(fleet) = self.fleets[worker_idx].take() else {
            return Err(SoakError::engine(
                format!("killing engine {worker_idx}"),
                "the engine is not running",
            ));
        };
        fleet.shutdown().await;
        Ok(())
    }

    /// Starts engine `worker_idx` again on its port (a fresh engine: empty cache and queue).
    pub(crate) async fn restart(&mut self, worker_idx: usize) -> Result<(), SoakError> {
        let what = "restarting the engine on its port";
        let Some(port) = self.urls[worker_idx].rsplit(':').next().and_then(|p| p.parse::<u16>().ok()) else {
            return Err(SoakError::engine(what, format!("no port in {}", self.urls[worker_idx])));
        };
        let mut last_error = None;
        for _ in 0..RESTART_ATTEMPTS {
            match self.spawn(port).await {
                Ok(fleet) => {
                    self.fleets[worker_idx] = Some(fleet);
                    return Ok(());
                }
                Err(error) => last_error = Some(error),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(SoakError::engine(what, last_error.expect("at least one attempt")))
    }

    /// Every soak id the engines received, summed over engines and restarts.
    pub(crate) fn soak_ids(&self) -> HashMap<String, SoakIdSeen> {
        let mut total: HashMap<String, SoakIdSeen> = HashMap::new();
        for log in &self.logs {
            for (id, seen) in log.snapshot() {
                let entry = total.entry(id).or_default();
                entry.received += seen.received;
                entry.answered += seen.answered;
                entry.resumed += seen.resumed;
            }
        }
        total
    }

    pub(crate) async fn shutdown(self) {
        for fleet in self.fleets.into_iter().flatten() {
            fleet.shutdown().await;
        }
    }
}

/// One churn action.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Action {
    /// `DELETE /workers/{url}`.
    Remove,
    /// `POST /workers` again.
    Add,
    /// Shut the engine down outright (the gateway still lists it).
    Kill,
    /// Start it again on the same port.
    Restart,
}

/// The churn schedule: `(seconds after the start, action, worker)`, in time order.
pub(crate) fn schedule(
    steady_secs: f64,
    n_workers: usize,
    churn_every_secs: f64,
    churn_down_secs: f64,
    kills: &[(f64, f64, usize)],
) -> Vec<(f64, Action, usize)> {
    let mut events = Vec::new();
    // One kill takes the last engine, and churn rotates over the others; several rotate over
    // every engine.
    let churned = if kills.len() == 1 { n_workers - 1 } else { n_workers };
    if churn_every_secs > 0.0 && churned > 0 {
        let mut k = 1;
        while k as f64 * churn_every_secs + churn_down_secs < steady_secs {
            let at = k as f64 * churn_every_secs;
            let worker_idx = (k - 1) % churned;
            events.push((at, Action::Remove, worker_idx));
            events.push((at + churn_down_secs, Action::Add, worker_idx));
            k += 1;
        }
    }
    for &(at, down, worker_idx) in kills {
        events.push((at, Action::Kill, worker_idx));
        events.push((at + down, Action::Restart, worker_idx));
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    events
}

/// What one churn action did.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct ChurnEvent {
    pub at_secs: f64,
    pub action: String,
    pub worker: String,
    pub result: String,
}

/// Runs the schedule against the gateway's admin API at `gateway_url` from `started`. A kill
/// waits (at most [`KILL_WAITS_FOR_A_STREAM`]) for a stream to be open on its engine when
/// `streams` are sent, and its restart keeps the down time after it.
pub(crate) async fn churn(
    engines: &mut Engines,
    gateway_url: &str,
    model: &str,
    events: Vec<(f64, Action, usize)>,
    started: Instant,
    streams: Option<&Streaming>,
) -> Vec<ChurnEvent> {
    let client = reqwest::Client::new();
    let mut done = Vec::new();
    // How late each engine's kill came, so its restart comes as late.
    let mut kill_delay: HashMap<usize, Duration> = HashMap::new();
    for (at, action, worker_idx) in events {
        let delay = match action {
            Action::Restart => kill_delay.remove(&worker_idx).unwrap_or_default(),
            _ => Duration::ZERO,
        };
        let due = started + Duration::from_secs_f64(at) + delay;
        tokio::time::sleep_until(due.into()).await;
        if let (Action::Kill, Some(streams)) = (action, streams) {
            let limit = Instant::now() + KILL_WAITS_FOR_A_STREAM;
            while !streams.any_open(worker_idx) && Instant::now() < limit {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            kill_delay.insert(worker_idx, due.elapsed());
        }
        let url = engines.urls()[worker_idx].clone();
        let result = match action {
            Action::Remove => {
                let encoded: String = url.bytes().map(|c| format!("%{c:02X}")).collect();
                let sent = client.delete(format!("{gateway_url}/workers/{encoded}")).send().await;
                sent.map(|r| r.status().as_u16().to_string()).unwrap_or_else(|e| e.to_string())
            }
            Action::Add => {
                let body = serde_json::json!({"url": url, "model_id": model});
                let sent = client.post(format!("{gateway_url}/workers")).json(&body).send().await;
                sent.map(|r| r.status().as_u16().to_string()).unwrap_or_else(|e| e.to_string())
            }
            Action::Kill => engines.kill(worker_idx).await.map_or_else(|e| e.to_string(), |()| "ok".into()),
            Action::Restart => {
                engines.restart(worker_idx).await.map_or_else(|e| e.to_string(), |()| "ok".into())
            }
        };
        let action = format!("{action:?}").to_lowercase();
        tracing::info!(%action, worker = %url, %result, "soak churn");
        done.push(ChurnEvent { at_secs: started.elapsed().as_secs_f64(), action, worker: url, result });
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn churn_rotates_over_the_workers_not_killed_and_ends_within_the_steady_phase() {
        let events = schedule(100.0, 3, 30.0, 5.0, &[(45.0, 5.0, 2)]);
        let shown: Vec<String> =
            events.iter().map(|(at, action, w)| format!("{at} {action:?} {w}")).collect();
        assert_eq!(
            shown,
            [
                "30 Remove 0",
                "35 Add 0",
                "45 Kill 2",
                "50 Restart 2",
                "60 Remove 1",
                "65 Add 1",
                "90 Remove 0",
                "95 Add 0"
            ]
        );
        assert_eq!(schedule(3.0, 2, 1.0, 0.5, &[]).len(), 4, "both workers churn when none is killed");
        assert!(schedule(3.0, 2, 0.0, 0.5, &[]).is_empty());
    }
}
