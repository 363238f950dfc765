//! The replay report: client-side latency mean and percentiles (over the successes, and the p99s over every request with a failure ranking last), cache hit rate from the servers' usage beside the trace's references, errors; markdown and JSON.

use std::fmt::Write as _;
use std::time::Duration;

use kvgate_trace::{percentile, CacheReference, SessionFigures};
use serde::Serialize;

use crate::request::{Endpoint, Observed, RequestError};

/// Error messages kept as samples in the report.
const ERROR_SAMPLES: usize = 5;

/// What `kvgate replay` measured. Latencies in milliseconds of wall time.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    pub label: String,
    pub trace: String,
    pub url: String,
    pub model: String,
    pub endpoint: Endpoint,
    pub speedup: f64,
    pub requests_in_trace: usize,
    pub sent: usize,
    pub succeeded: u64,
    pub errors: u64,
    /// Requests still running at the deadline (counted in `errors`).
    pub deadline_hits: u64,
    pub error_samples: Vec<String>,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    /// The 99th percentiles over every request sent, a failed one counting as slower than every
    /// success (a gateway that fails its slow requests does not look faster for it): null when
    /// the percentile falls on a failure (more than 1% failed), "failed" in the table.
    pub ttft_p99_all_ms: Option<f64>,
    pub e2e_p99_all_ms: Option<f64>,
    /// Mean lateness of sends behind the trace schedule (client-side queueing).
    pub mean_send_delay_ms: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// `cached_tokens / prompt_tokens` over the successful requests.
    pub cache_hit_rate: f64,
    /// The trace's infinite-cache ceiling, and the hit rate as a fraction of it.
    pub ceiling_hit_rate: f64,
    pub hit_of_ceiling: f64,
    /// `--fleet-kv-tokens`, the size of the one cache of the pooled references (the three
    /// fields below are null without it).
    pub fleet_kv_tokens: Option<u64>,
    /// The trace's pooled-LRU reference and pooled-Belady bound for that cache.
    pub pooled_lru_hit_rate: Option<f64>,
    pub pooled_belady_hit_rate: Option<f64>,
    /// `cache_hit_rate` over `pooled_lru_hit_rate`.
    pub hit_of_pooled_lru: Option<f64>,
    /// Successful requests over the wall time of the run.
    pub completed_per_s: f64,
    pub wall_s: f64,
    /// Per tenant, when the trace's lines name tenants (sent in `--tenant-header`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantReport>,
    /// What the sessions took (first send to last answer, wall time), when the trace's lines
    /// name sessions (replayed closed loop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sessions: Option<SessionFigures>,
}

/// One tenant's figures in a replay. Latencies in milliseconds of wall time.
#[derive(Clone, Debug, Serialize)]
pub struct TenantReport {
    pub tenant: String,
    pub succeeded: u64,
    pub errors: u64,
    /// Its share of the successful requests.
    pub request_share: f64,
    /// Its successful requests per second of the run's wall time.
    pub completed_per_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub cache_hit_rate: f64,
}

/// Each tenant's figures (empty when no request named one).
fn per_tenant(
    results: &[(Option<String>, Result<Observed, RequestError>)],
    wall: Duration,
) -> Vec<TenantReport> {
    if results.iter().all(|(tenant, _)| tenant.is_none()) {
        return Vec::new();
    }
    let mut tenants: std::collections::BTreeMap<&str, Vec<&Result<Observed, RequestError>>> =
        Default::default();
    for (tenant, result) in results {
        tenants.entry(tenant.as_deref().unwrap_or("default")).or_default().push(result);
    }
    let succeeded_total = results.iter().filter(|(_, r)| r.is_ok()).count();
    tenants
        .into_iter()
        .map(|(tenant, results)| {
            let ok: Vec<&Observed> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
            let mut ttft: Vec<f64> = ok.iter().map(|o| ms(o.ttft)).collect();
            ttft.sort_by(f64::total_cmp);
            let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
            let cached: u64 = ok.iter().map(|o| o.cached_tokens).sum();
            TenantReport {
                tenant: tenant.to_string(),
                succeeded: ok.len() as u64,
                errors: (results.len() - ok.len()) as u64,
                request_share: ratio(ok.len() as f64, succeeded_total as f64),
                completed_per_s: ratio(ok.len() as f64, wall.as_secs_f64()),
                ttft_p50_ms: percentile(&ttft, 50.0),
                ttft_p90_ms: percentile(&ttft, 90.0),
                ttft_p99_ms: percentile(&ttft, 99.0),
                cache_hit_rate: ratio(cached as f64, prompt as f64),
            }
        })
        .collect()
}

pub(crate) struct Inputs {
    pub label: String,
    pub trace: String,
    pub url: String,
    pub model: String,
    pub endpoint: Endpoint,
    pub speedup: f64,
    pub requests_in_trace: usize,
    pub sent: usize,
    /// Each request's tenant (the trace line's) and outcome.
    pub results: Vec<(Option<String>, Result<Observed, RequestError>)>,
    pub deadline_hits: u64,
    pub mean_send_delay: Duration,
    pub wall: Duration,
    pub ceiling_hit_rate: f64,
    pub pooled: Option<Pooled>,
    pub sessions: Option<SessionFigures>,
}

/// The trace's pooled references for the fleet's KV size (`--fleet-kv-tokens`).
pub(crate) struct Pooled {
    pub lru: CacheReference,
    pub belady: CacheReference,
}

/// A percentile over every request: its value, or "failed" when it falls on a failure.
fn all_requests(value: Option<f64>) -> String {
    value.map_or_else(|| "failed".to_string(), |ms| format!("{ms:.1}"))
}

fn pct(rate: f64) -> String {
    format!("{:.1}%", rate * 100.0)
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// The `p`th percentile (nearest rank) over `total` requests of which `sorted_ok` are the
/// successes' values, in order, the failures ranking above them all: `None` on a failure.
fn percentile_counting_failures(sorted_ok: &[f64], total: usize, p: f64) -> Option<f64> {
    let ranked: Vec<Option<f64>> = sorted_ok
        .iter()
        .map(|&v| Some(v))
        .chain(std::iter::repeat(None))
        .take(total.max(sorted_ok.len()))
        .collect();
    percentile(&ranked, p)
}

fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 {
        numerator / denominator
    } else {
        0.0
    }
}

impl ReplayReport {
    pub(crate) fn new(inputs: Inputs) -> ReplayReport {
        let ok: Vec<&Observed> = inputs.results.iter().filter_map(|(_, r)| r.as_ref().ok()).collect();
        let mut error_samples: Vec<String> = Vec::new();
        for error in inputs.results.iter().filter_map(|(_, r)| r.as_ref().err()) {
            let message = error.to_string();
            if error_samples.len() < ERROR_SAMPLES && !error_samples.contains(&message) {
                error_samples.push(message);
            }
        }
        if inputs.deadline_hits > 0 && error_samples.len() < ERROR_SAMPLES {
            error_samples.push(format!("{} requests still running at the deadline", inputs.deadline_hits));
        }
        let sorted = |f: fn(&Observed) -> Duration| {
            let mut values: Vec<f64> = ok.iter().map(|o| ms(f(o))).collect();
            values.sort_by(f64::total_cmp);
            values
        };
        let ttft = sorted(|o| o.ttft);
        let e2e = sorted(|o| o.e2e);
        let prompt_tokens: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
        let cached_tokens: u64 = ok.iter().map(|o| o.cached_tokens).sum();
        let cache_hit_rate = ratio(cached_tokens as f64, prompt_tokens as f64);
        let errors = inputs.results.len() as u64 - ok.len() as u64 + inputs.deadline_hits;
        ReplayReport {
            label: inputs.label,
            trace: inputs.trace,
            url: inputs.url,
            model: inputs.model,
            endpoint: inputs.endpoint,
            speedup: inputs.speedup,
            requests_in_trace: inputs.requests_in_trace,
            sent: inputs.sent,
            succeeded: ok.len() as u64,
            errors,
            deadline_hits: inputs.deadline_hits,
            error_samples,
            ttft_mean_ms: ratio(ttft.iter().sum(), ttft.len() as f64),
            ttft_p50_ms: percentile(&ttft, 50.0),
            ttft_p90_ms: percentile(&ttft, 90.0),
            ttft_p99_ms: percentile(&ttft, 99.0),
            e2e_p50_ms: percentile(&e2e, 50.0),
            e2e_p99_ms: percentile(&e2e, 99.0),
            ttft_p99_all_ms: percentile_counting_failures(&ttft, ok.len() + errors as usize, 99.0),
            e2e_p99_all_ms: percentile_counting_failures(&e2e, ok.len() + errors as usize, 99.0),
            mean_send_delay_ms: ms(inputs.mean_send_delay),
            prompt_tokens,
            cached_tokens,
            completion_tokens: ok.iter().map(|o| o.completion_tokens).sum(),
            cache_hit_rate,
            ceiling_hit_rate: inputs.ceiling_hit_rate,
            hit_of_ceiling: ratio(cache_hit_rate, inputs.ceiling_hit_rate),
            fleet_kv_tokens: inputs.pooled.as_ref().map(|pooled| pooled.lru.capacity_tokens),
            pooled_lru_hit_rate: inputs.pooled.as_ref().map(|pooled| pooled.lru.rate()),
            pooled_belady_hit_rate: inputs.pooled.as_ref().map(|pooled| pooled.belady.rate()),
            hit_of_pooled_lru: inputs.pooled.as_ref().map(|pooled| ratio(cache_hit_rate, pooled.lru.rate())),
            completed_per_s: ratio(ok.len() as f64, inputs.wall.as_secs_f64()),
            wall_s: inputs.wall.as_secs_f64(),
            tenants: per_tenant(&inputs.results, inputs.wall),
            sessions: inputs.sessions,
        }
    }

    /// The same latency table as `kvgate sim`, one column for this run.
    pub fn markdown(&self) -> String {
        let mut out = self.header();
        out.push('\n');
        out.push_str(&table(std::slice::from_ref(self)));
        self.push_tenants(&mut out);
        self.push_error_samples(&mut out, "Errors (samples):");
        out
    }

    /// The per-tenant table, when requests named tenants.
    fn push_tenants(&self, out: &mut String) {
        if self.tenants.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "\nPer tenant, {}:\n\n| tenant | succeeded | errors | share of requests | req/s | TTFT p50 / p90 / p99 \
             (ms) | hit rate |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            self.label
        );
        for t in &self.tenants {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.1}% | {:.2} | {:.1} / {:.1} / {:.1} | {} |",
                t.tenant,
                t.succeeded,
                t.errors,
                100.0 * t.request_share,
                t.completed_per_s,
                t.ttft_p50_ms,
                t.ttft_p90_ms,
                t.ttft_p99_ms,
                pct(t.cache_hit_rate)
            );
        }
    }

    /// One line naming the trace, the target, the run and the trace's references.
    fn header(&self) -> String {
        let pooled = match (self.fleet_kv_tokens, self.pooled_lru_hit_rate, self.pooled_belady_hit_rate) {
            (Some(tokens), Some(lru), Some(belady)) => format!(
                "; pooled LRU {}, pooled Belady {} (one cache of the fleet's {tokens} KV tokens)",
                pct(lru),
                pct(belady)
            ),
            _ => String::new(),
        };
        format!(
            "Replay of `{}` ({} of {} requests, speedup {}) to {} (model `{}`), {:.1} s wall; \
             infinite-cache ceiling {} of prompt tokens{pooled}.\n",
            self.trace,
            self.sent,
            self.requests_in_trace,
            self.speedup,
            self.url,
            self.model,
            self.wall_s,
            pct(self.ceiling_hit_rate)
        )
    }

    fn push_error_samples(&self, out: &mut String, title: &str) {
        if !self.error_samples.is_empty() {
            let _ = writeln!(out, "\n{title}");
            for sample in &self.error_samples {
                let _ = writeln!(out, "- {sample}");
            }
        }
    }

    /// The metric rows of the table, as (name, formatted value); "hit rate / pooled LRU" only
    /// with `--fleet-kv-tokens`.
    fn rows(&self) -> Vec<(&'static str, String)> {
        let mut rows = vec![
            ("TTFT mean (ms)", format!("{:.1}", self.ttft_mean_ms)),
            ("TTFT p50 (ms)", format!("{:.1}", self.ttft_p50_ms)),
            ("TTFT p90 (ms)", format!("{:.1}", self.ttft_p90_ms)),
            ("TTFT p99 (ms)", format!("{:.1}", self.ttft_p99_ms)),
            ("e2e p50 (ms)", format!("{:.1}", self.e2e_p50_ms)),
            ("e2e p99 (ms)", format!("{:.1}", self.e2e_p99_ms)),
            ("TTFT p99, all requests (ms)", all_requests(self.ttft_p99_all_ms)),
            ("e2e p99, all requests (ms)", all_requests(self.e2e_p99_all_ms)),
            ("cache hit rate", pct(self.cache_hit_rate)),
            ("hit rate / ceiling", pct(self.hit_of_ceiling)),
        ];
        if let Some(of_lru) = self.hit_of_pooled_lru {
            rows.push(("hit rate / pooled LRU", pct(of_lru)));
        }
        if let Some(sessions) = &self.sessions {
            rows.extend([
                ("sessions (turns)", format!("{} ({})", sessions.sessions, sessions.turns)),
                ("session makespan mean (ms)", format!("{:.1}", sessions.makespan_mean_ms)),
                ("session makespan p50 (ms)", format!("{:.1}", sessions.makespan_p50_ms)),
                ("session makespan p99 (ms)", format!("{:.1}", sessions.makespan_p99_ms)),
            ]);
            if sessions.unfinished > 0 {
                rows.push(("sessions unfinished", sessions.unfinished.to_string()));
            }
        }
        rows.extend([
            ("completed req/s", format!("{:.2}", self.completed_per_s)),
            ("mean send delay (ms)", format!("{:.1}", self.mean_send_delay_ms)),
            ("succeeded", self.succeeded.to_string()),
            ("errors", self.errors.to_string()),
        ]);
        rows
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the report always serializes")
    }
}

/// The metric table with one column per report: every row some report has, in order ("-" where
/// a report lacks it).
fn table(reports: &[ReplayReport]) -> String {
    let mut out = String::from("| metric |");
    for report in reports {
        let _ = write!(out, " {} |", report.label.replace('|', "\\|"));
    }
    out.push_str("\n| --- |");
    out.push_str(&" ---: |".repeat(reports.len()));
    out.push('\n');
    let rows: Vec<_> = reports.iter().map(ReplayReport::rows).collect();
    let mut names: Vec<&str> = Vec::new();
    for (name, _) in rows.iter().flatten() {
        if !names.contains(name) {
            names.push(name);
        }
    }
    for name in names {
        let _ = write!(out, "| {name} |");
        for values in &rows {
            let value = values.iter().find(|(row, _)| *row == name).map_or("-", |(_, value)| value.as_str());
            let _ = write!(out, " {value} |");
        }
        out.push('\n');
    }
    out
}

/// The markdown of a run: [`ReplayReport::markdown`] for one report; for several, one table with a
/// column per target, then each target's header line and error samples.
pub fn markdown_all(reports: &[ReplayReport]) -> String {
    match reports {
        [] => String::new(),
        [report] => report.markdown(),
        _ => {
            let mut out = format!(
                "Replay of `{}` to {} targets, one after another.\n\n",
                reports[0].trace,
                reports.len()
            );
            out.push_str(&table(reports));
            for report in reports {
                let _ = write!(out, "\n**{}**: {}", report.label, report.header());
                report.push_tenants(&mut out);
                report.push_error_samples(&mut out, &format!("Errors of {} (samples):", report.label));
            }
            out
        }
    }
}

/// The JSON of a run: one object for one report, an array for several.
pub fn json_all(reports: &[ReplayReport]) -> String {
    match reports {
        [report] => report.to_json(),
        _ => serde_json::to_string_pretty(reports).expect("reports always serialize"),
    }
}

#[cfg(test)]
mod tests {
    use super::percentile_counting_failures;

    #[test]
    fn a_failure_ranks_above_every_success() {
        let ok: Vec<f64> = (1..=99).map(f64::from).collect();
        // 99 successes of 100: the 99th percentile is the slowest success; of 101 sent (two
        // failed) it is a failure.
        assert_eq!(percentile_counting_failures(&ok, 100, 99.0), Some(99.0));
        assert_eq!(percentile_counting_failures(&ok, 101, 99.0), None);
        assert_eq!(percentile_counting_failures(&ok, 99, 50.0), Some(50.0));
        assert_eq!(percentile_counting_failures(&ok, 198, 50.0), Some(99.0));
        assert_eq!(percentile_counting_failures(&ok, 199, 50.0), None);
        assert_eq!(percentile_counting_failures(&[], 0, 99.0), None);
        assert_eq!(percentile_counting_failures(&[], 5, 99.0), None);
    }
}
