//! kvgate-replay: `kvgate replay`, which sends a trace as real streaming HTTP requests to any OpenAI-compatible endpoint at its recorded (scaled) times and measures what the client sees.
//!
//! Each trace line becomes the same prompt the simulator routes on, as text
//! ([`kvgate_trace::prompt_text`]), sent with `"stream": true`, `"max_tokens"` =
//! `output_length`, `"ignore_eos": true` and `"stream_options": {"include_usage": true}`. TTFT is
//! the time from sending to the first SSE `data:` event, end-to-end the time to `data: [DONE]`;
//! the cache hit rate comes from `usage.prompt_tokens_details.cached_tokens` of the final usage
//! chunk. Runs are bounded by `--max-requests` and an overall `--deadline-secs`. The hit rate is
//! set beside the trace's references: the infinite-cache ceiling and, given the fleet's KV size
//! (`--fleet-kv-tokens`), the pooled-LRU reference and pooled-Belady bound
//! ([`kvgate_trace::CacheReference`]).
//!
//! Several `--url`s are replayed one after another (never concurrently: they usually share the
//! fleet) with the same trace and options, and reported side by side. `--flush-cache-urls` names
//! the engines behind them; each gets `POST /flush_cache` (SGLang's endpoint) before every target's
//! run, so each target starts from cold caches. With `--spread-urls` the `--url`s are instead the
//! replicas of one gateway: one run, its requests spread over them round-robin.
//!
//! A trace whose lines name sessions (`session_id`, `think_ms`) is replayed closed loop: a
//! session's later turn is sent once the previous turn's answer has ended plus its think time
//! (`schedule.rs`), and the report adds each session's makespan (first send to last answer). A
//! turn's `session_id` also goes in `--session-header` (the gateway's routing key).

mod error;
mod report;
mod request;
mod schedule;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvgate_config::{Checks, FieldError, Range, ValidationErrors};
use kvgate_trace::SessionSchedule;
use kvgate_trace::{Trace, TraceFormat};

pub use error::ReplayError;
pub use report::{json_all, markdown_all, ReplayReport};
pub use request::{
    request_body, send, send_payload, send_with_headers, Endpoint, Observed, RequestError, SseReader,
};

/// Options of `kvgate replay`.
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct ReplayArgs {
    /// Trace file.
    #[arg(long)]
    pub trace: PathBuf,
    /// Trace file format.
    #[arg(long, value_enum, default_value_t = TraceFormat::Mooncake)]
    pub trace_format: TraceFormat,
    /// Base URL(s) of the OpenAI-compatible endpoint(s), e.g. http://127.0.0.1:30000; several are
    /// replayed one after another with the same trace and options, and reported side by side.
    #[arg(long, num_args = 1.., required = true)]
    pub url: Vec<String>,
    /// Model name to send [default: the first model of GET /v1/models].
    #[arg(long)]
    pub model: Option<String>,
    /// Trace timestamps are divided by this (10 = ten times faster); `kvgate sim`'s flag of the
    /// same name (`--speedup` is an alias).
    #[arg(long, visible_alias = "speedup", default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Send only the first K requests (in arrival order).
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Most requests in flight at once; a request due while the limit is reached waits.
    #[arg(long)]
    pub concurrency_limit: Option<usize>,
    /// Endpoint to send to.
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    /// Give up on requests still running this many seconds after the first was sent
    /// [default: the scaled trace span + 600].
    #[arg(long)]
    pub deadline_secs: Option<f64>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Name of each run in the report (e.g. the gateway under test), one per --url in order
    /// [default: the URL].
    #[arg(long, num_args = 1..)]
    pub label: Vec<String>,
    /// Engine base URLs to send `POST /flush_cache` (SGLang's endpoint) before each target's run,
    /// so every target starts from cold caches.
    #[arg(long, num_args = 1..)]
    pub flush_cache_urls: Vec<String>,
    /// Seconds to wait between one target's run and the next.
    #[arg(long, default_value_t = 0.0)]
    pub pause_secs: f64,
    /// Total KV cache tokens of the fleet behind the target(s) (engines x KV capacity of each):
    /// the report then gives the trace's pooled-LRU reference and pooled-Belady bound for one
    /// cache that large, and the hit rate as a fraction of the LRU reference [default: left out].
    #[arg(long, value_name = "TOKENS")]
    pub fleet_kv_tokens: Option<u64>,
    /// Treat the `--url`s as the replicas of one gateway: one run whose requests are spread over
    /// them round-robin in arrival order (as an L4 load balancer would), instead of one run per URL.
    #[arg(long)]
    pub spread_urls: bool,
    /// Header carrying a trace line's `tenant` (the gateway's `--tenant-header`); the report
    /// then gives each tenant's latencies.
    #[arg(long, default_value = "x-kvgate-tenant")]
    pub tenant_header: String,
    /// Header carrying a trace line's `priority` (the gateway's `--priority-header`).
    #[arg(long, default_value = "x-kvgate-priority")]
    pub priority_header: String,
    /// Header carrying a trace line's `session_id` (the gateway's `--routing-key-header`, what
    /// `consistent_hashing` and `manual` route by, as `kvgate sim` does).
    #[arg(long, default_value = "x-kvgate-routing-key")]
    pub session_header: String,
}

impl ReplayArgs {
    /// Defaults for everything but the trace and the URL.
    pub fn new(trace: impl Into<PathBuf>, url: impl Into<String>) -> ReplayArgs {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: ReplayArgs,
        }
        let mut args =
            <Command as clap::Parser>::parse_from(["kvgate-replay", "--trace", "-", "--url", "-"]).args;
        args.trace = trace.into();
        args.url = vec![url.into()];
        args
    }

    /// The report label of target `index`: its `--label`, else its URL; repeated labels get ` #N`.
    fn label(&self, index: usize) -> String {
        let label_of = |i: usize| self.label.get(i).cloned().unwrap_or_else(|| self.url[i].clone());
        let label = label_of(index);
        if (0..index).any(|i| label_of(i) == label) {
            format!("{label} #{}", index + 1)
        } else {
            label
        }
    }

    fn validate(&self) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        checks.in_range("rate_scale", self.rate_scale, Range::POSITIVE);
        for (field, value) in [
            ("max_requests", self.max_requests),
            ("fleet_kv_tokens", self.fleet_kv_tokens.map(|n| n as usize)),
            ("concurrency_limit", self.concurrency_limit),
        ] {
            if let Some(value) = value {
                checks.at_least(field, value as u64, 1);
            }
        }
        if let Some(deadline) = self.deadline_secs {
            checks.in_range("deadline_secs", deadline, Range::POSITIVE);
        }
        checks.ensure(!self.url.is_empty(), "url", "is required");
        for (field, urls) in [("url", &self.url), ("flush_cache_urls", &self.flush_cache_urls)] {
            for url in urls {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    checks.push(
                        FieldError::new(field, "must start with http:// or https://").got(format!("{url:?}")),
                    );
                }
            }
        }
        if self.label.len() > self.url.len() {
            checks.push(FieldError::new(
                "label",
                format!(
                    "given {} times but --url only {} (one label per URL)",
                    self.label.len(),
                    self.url.len()
                ),
            ));
        }
        checks.in_range("pause_secs", self.pause_secs, Range::NON_NEGATIVE);
        checks.finish()
    }
}

/// Loads `--trace` and replays it against the one `--url`.
pub async fn run(args: &ReplayArgs) -> Result<ReplayReport, ReplayError> {
    args.validate()?;
    let trace = Trace::load(&args.trace, args.trace_format)?;
    run_on_trace(args, &trace).await
}

/// Loads `--trace` and replays it against every `--url` in turn: one report per URL, in order.
pub async fn run_all(args: &ReplayArgs) -> Result<Vec<ReplayReport>, ReplayError> {
    args.validate()?;
    let trace = Trace::load(&args.trace, args.trace_format)?;
    run_all_on_trace(args, &trace).await
}

/// Replays `trace` against the one `--url` (after flushing `--flush-cache-urls`, if any).
pub async fn run_on_trace(args: &ReplayArgs, trace: &Trace) -> Result<ReplayReport, ReplayError> {
    args.validate()?;
    if args.url.len() != 1 {
        let message = format!("replays one URL, got {} (use run_all_on_trace)", args.url.len());
        return Err(ValidationErrors::from(FieldError::new("url", message)).into());
    }
    run_target(args, trace, 0).await
}

/// Replays `trace` against every `--url` in turn, sequentially, flushing `--flush-cache-urls`
/// before each and pausing `--pause-secs` between them.
pub async fn run_all_on_trace(args: &ReplayArgs, trace: &Trace) -> Result<Vec<ReplayReport>, ReplayError> {
    args.validate()?;
    if args.spread_urls {
        let client = reqwest::Client::builder()
            .build()
            .map_err(|e| ReplayError::http("building the HTTP client", e))?;
        flush_caches(&client, &args.flush_cache_urls).await?;
        let label = args.label.first().cloned().unwrap_or_else(|| args.url.join(","));
        let report = replay_one(args, trace, &client, &args.url, label).await?;
        return Ok(vec![report]);
    }
    let mut reports = Vec::with_capacity(args.url.len());
    for index in 0..args.url.len() {
        if index > 0 && args.pause_secs > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(args.pause_secs)).await;
        }
        if args.url.len() > 1 {
            eprintln!("replay: target {}/{}: {}", index + 1, args.url.len(), args.url[index]);
        }
        reports.push(run_target(args, trace, index).await?);
    }
    Ok(reports)
}

async fn run_target(args: &ReplayArgs, trace: &Trace, index: usize) -> Result<ReplayReport, ReplayError> {
    let client =
        reqwest::Client::builder().build().map_err(|e| ReplayError::http("building the HTTP client", e))?;
    flush_caches(&client, &args.flush_cache_urls).await?;
    replay_one(args, trace, &client, std::slice::from_ref(&args.url[index]), args.label(index)).await
}

/// How often a flush refused because requests are still running (HTTP 400) is retried.
const FLUSH_ATTEMPTS: u32 = 20;
const FLUSH_RETRY_DELAY: Duration = Duration::from_millis(250);

/// `POST {url}/flush_cache` to each engine; any failure is an error. A refusal while requests are
/// still running (HTTP 400, e.g. ones aborted at the previous target's deadline) is retried a few
/// times.
pub async fn flush_caches(client: &reqwest::Client, base_urls: &[String]) -> Result<(), ReplayError> {
    for base_url in base_urls {
        let url = format!("{}/flush_cache", base_url.trim_end_matches('/'));
        let mut attempt = 1;
        loop {
            let response = client
                .post(&url)
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .map_err(|e| ReplayError::http(format!("flushing the cache: POST {url}"), e))?;
            let status = response.status();
            if status.is_success() {
                break;
            }
            let body = response.text().await.unwrap_or_default();
            if status == reqwest::StatusCode::BAD_REQUEST && attempt < FLUSH_ATTEMPTS {
                attempt += 1;
                tokio::time::sleep(FLUSH_RETRY_DELAY).await;
                continue;
            }
            let message = format!("HTTP {status} {}", body.trim());
            return Err(ReplayError::http(format!("flushing the cache: POST {url}"), message));
        }
    }
    Ok(())
}

/// The first model the server lists on `GET /v1/models`.
pub async fn discover_model(client: &reqwest::Client, base_url: &str) -> Result<String, ReplayError> {
    let url = format!("{base_url}/v1/models");
    let what = format!("GET {url}");
    let response = client.get(&url).send().await.map_err(|e| ReplayError::http(&what, e))?;
    let status = response.status();
    if !status.is_success() {
        return Err(ReplayError::http(&what, format!("HTTP {status}")));
    }
    let body: serde_json::Value =
        response.json().await.map_err(|e| ReplayError::http(&what, format!("reading JSON: {e}")))?;
    body["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| ReplayError::http(&what, format!("no model in {body}")))
}

/// Replays `trace` to `base_urls`, request `i` to `base_urls[i % n]` (`args.trace` only names it
/// in the report).
async fn replay_one(
    args: &ReplayArgs,
    trace: &Trace,
    client: &reqwest::Client,
    base_urls: &[String],
    label: String,
) -> Result<ReplayReport, ReplayError> {
    let trace = trace.truncated(args.max_requests);
    let base_urls: Vec<String> = base_urls.iter().map(|u| u.trim_end_matches('/').to_string()).collect();
    let model = match &args.model {
        Some(model) => model.clone(),
        None => discover_model(client, &base_urls[0]).await?,
    };
    let report_model = model.clone();
    let urls: Vec<String> = base_urls.iter().map(|base| format!("{base}{}", args.endpoint.path())).collect();
    let url = urls.join(",");
    let schedule = SessionSchedule::new(&trace.requests, args.rate_scale);
    let span_s = schedule
        .timestamp_us(schedule.len().saturating_sub(1))
        .saturating_sub(schedule.timestamp_us(0)) as f64
        / 1e6;
    let deadline = Duration::from_secs_f64(args.deadline_secs.unwrap_or(span_s + 600.0));
    let settings =
        schedule::ScheduleSettings { limit: args.concurrency_limit, deadline, show_progress: true };
    let total = trace.requests.len();
    let requests = Arc::new(trace.requests.clone());
    let (client, endpoint) = (client.clone(), args.endpoint);
    let header_names =
        [args.tenant_header.clone(), args.priority_header.clone(), args.session_header.clone()];
    let urls = Arc::new(urls);
    // Run ahead of the request's due time (on the sending thread): its body, serialized.
    let prepare = move |position: usize| {
        let request = &requests[position];
        let url = urls[position % urls.len()].clone();
        let headers: Vec<(String, String)> = header_names
            .iter()
            .zip([&request.tenant, &request.priority, &request.session_id])
            .filter_map(|(name, value)| value.as_ref().map(|value| (name.clone(), value.clone())))
            .collect();
        let payload = serde_json::to_vec(&request::request_body(request, &model, endpoint))
            .expect("a JSON value always serializes");
        let (client, tenant) = (client.clone(), request.tenant.clone());
        async move { (tenant, request::send_payload(&client, &url, payload, &headers).await) }
    };
    let run = schedule::run_on_sending_thread(schedule, settings, prepare, |message| {
        (None, Err(RequestError::Send(message)))
    })
    .await
    .map_err(|e| ReplayError::http("starting the sending thread", e))?;
    let sent = run.sent;
    let results: Vec<_> = run.results.into_iter().map(|(_, result)| result).collect();
    let wall = run.wall;
    let ceiling = trace.cache_ceiling();
    let pooled = args
        .fleet_kv_tokens
        .map(|tokens| report::Pooled { lru: trace.pooled_lru(tokens), belady: trace.pooled_belady(tokens) });
    Ok(ReplayReport::new(report::Inputs {
        label,
        trace: args.trace.display().to_string(),
        url,
        model: report_model,
        endpoint: args.endpoint,
        speedup: args.rate_scale,
        requests_in_trace: total,
        sent,
        results,
        deadline_hits: run.deadline_hits,
        mean_send_delay: if sent == 0 { Duration::ZERO } else { run.send_delay_total / sent as u32 },
        wall,
        ceiling_hit_rate: ceiling.rate(),
        pooled,
        sessions: run.sessions,
    }))
}

/// `kvgate replay`: replays every `--url`, prints the markdown report (side by side for several)
/// on stdout, writes `--json` (an object for one URL, an array for several).
pub async fn run_cli(args: ReplayArgs) -> Result<(), ReplayError> {
    let reports = run_all(&args).await?;
    print!("{}", markdown_all(&reports));
    if let Some(path) = &args.json {
        std::fs::write(path, json_all(&reports) + "\n")
            .map_err(|e| ReplayError::Output { path: path.display().to_string(), message: e.to_string() })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
