//! The soak's verdict: every request's client outcome joined with what the engines saw of its id
//! (duplicates and legitimate re-sends), per-phase counts, latency percentiles and resource
//! ranges, as a markdown table and JSON.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::time::Duration;

use kvgate_mock::SoakIdSeen;
use kvgate_trace::percentile;
use serde::Serialize;

use crate::engines::ChurnEvent;
use crate::resources::{range, Sample};
use crate::traffic::{Cause, Outcome};

/// The load phases, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Phase {
    Steady,
    Burst,
    Recovery,
}

impl Phase {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Phase::Steady => "steady",
            Phase::Burst => "burst",
            Phase::Recovery => "recovery",
        }
    }
}

/// One request as the client saw it (compact: the soak keeps one per request sent).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Record {
    pub n: u64,
    pub phase: Phase,
    /// Milliseconds after the load started.
    pub sent_at_ms: u32,
    pub cause: Cause,
    /// Streams that got a token: send to the first token, in microseconds.
    pub ttft_us: Option<u32>,
    /// Non-streamed requests: send to the whole answer, in microseconds.
    pub latency_us: Option<u32>,
    pub multi_answer: bool,
    /// The engine that answered (index into the engine URLs), when the gateway named it.
    pub worker_idx: Option<u8>,
    pub stream: bool,
    /// A stream that ended whole with a text other than the uncut answer (a chunk repeated or
    /// lost where it moved between engines).
    pub wrong_text: bool,
}

/// Why a request is listed in the report, most serious first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum IncidentKind {
    Duplicated,
    /// A whole stream whose text is not the uncut answer.
    WrongText,
    Lost,
    /// Reached engines more than once, answered at most once (a gateway retry).
    Resent,
    FailedClean,
}

/// A request that did not simply succeed once, with its details.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Incident {
    pub soak_id: String,
    pub kind: IncidentKind,
    pub phase: Phase,
    pub sent_at_secs: f64,
    pub cause: String,
    pub worker: Option<String>,
    pub detail: Option<String>,
    /// Filled in at the end: what the engines saw of this id.
    pub engines_received: u32,
    pub engines_answered: u32,
}

pub(crate) fn micros(duration: Duration) -> u32 {
    u32::try_from(duration.as_micros()).unwrap_or(u32::MAX)
}

/// One row of the table.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct PhaseRow {
    pub phase: String,
    pub secs: f64,
    pub target_rate: f64,
    pub sent: usize,
    pub succeeded: usize,
    pub failed_clean: usize,
    pub lost: usize,
    pub duplicated: usize,
    /// Ids that reached engines more than once, never answered twice: the gateway's retries.
    pub resent: usize,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    pub rss_mb: Option<(f64, f64)>,
    pub fds: Option<(usize, usize)>,
    /// CPU time of the process over the phase's wall time (100 = one core busy).
    pub cpu_percent: Option<f64>,
}

/// Descriptor accounting at the end of the run.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct FdCheck {
    /// Before anything started.
    pub baseline: usize,
    /// Engines and gateway up, no request sent yet.
    pub before: usize,
    /// Everything idle for a while after the last answer, the client dropped.
    pub after_idle: usize,
    /// Idle keep-alive connections the gateway pools to the engines at that point: each holds
    /// two descriptors in this process (the gateway's end and the engine's end).
    pub pooled_upstream_idle: usize,
    /// After the gateway and the engines were shut down.
    pub after_shutdown: usize,
}

impl FdCheck {
    /// Descriptors open after the idle wait beyond the start's, not explained by pooled idle
    /// connections.
    pub(crate) fn unexplained_after_idle(&self) -> i64 {
        self.after_idle as i64 - self.before as i64 - 2 * self.pooled_upstream_idle as i64
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct SoakReport {
    pub command: String,
    pub phases: Vec<PhaseRow>,
    pub total: PhaseRow,
    /// Failed-clean and lost requests by cause.
    pub causes: BTreeMap<String, usize>,
    pub fd_check: FdCheck,
    pub samples: Vec<Sample>,
    pub churn: Vec<ChurnEvent>,
    /// Ids the engines saw that the client never sent (should be none).
    pub unknown_engine_ids: usize,
    /// Steady phase: the highest RSS of its first and of its last third, in MB (a leak shows as a
    /// gap that grows with the phase's length).
    pub steady_rss_drift_mb: Option<(f64, f64)>,
    /// Steady phase: the least-squares slope of RSS over its second half, in MB per minute, as
    /// measured and without the soak's own bookkeeping (`Sample::bookkeeping_kb`).
    pub steady_rss_slope_mb_per_min: Option<f64>,
    pub steady_rss_slope_net_mb_per_min: Option<f64>,
    /// Requests the client saw succeed that no engine answered (should be none).
    pub succeeded_without_engine_answer: usize,
    /// The streams cut mid-answer and what became of them.
    pub migrations: Migrations,
    /// Lost and duplicated requests, then a few re-sent and failed ones, with their details.
    pub incidents: Vec<Incident>,
}

/// Whether an id counts as duplicated, given what the engines saw of it and what the client got.
///
/// The gateway re-sends a request only when nothing of the first attempt reached the client: a
/// connect error (the engine never saw it) or a 502/503/504 head (the engine saw it and refused
/// it). So an id may legitimately reach engines more than once, but at most one engine may
/// answer it with a 2xx, and the client must get exactly one answer. A stream cut mid-answer is
/// continued on another engine (`--migrate-streams`): those continuations (`resumed`) are parts
/// of the one answer. It is duplicated when two engines began 2xx answers for it besides its
/// continuations, or when the client's one response carried more than one answer (two `[DONE]`s
/// or two completion ids).
pub(crate) fn is_duplicated(seen: SoakIdSeen, multi_answer: bool) -> bool {
    multi_answer || seen.answered.saturating_sub(seen.resumed) > 1
}

/// What became of the streams an engine failed mid-answer.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Migrations {
    /// Streams cut mid-answer: continued on another engine, or ended with the error event.
    pub cut: usize,
    /// Continued on another engine and ended whole, with the uncut answer's text.
    pub completed_whole: usize,
    /// Ended with the error event (not continued, or cut again past the limit).
    pub error_event: usize,
    /// Ended whole with another text than the uncut answer (a chunk repeated or lost).
    pub wrong_text: usize,
    /// Streams continued on another engine, counting each continuation.
    pub continuations: usize,
}

impl Migrations {
    /// The share of the cut streams that completed whole on another engine, in percent.
    pub(crate) fn completed_percent(&self) -> Option<f64> {
        (self.cut > 0).then(|| 100.0 * self.completed_whole as f64 / self.cut as f64)
    }
}

/// The `p`th percentile (in percent) of sorted microseconds, in milliseconds; `None` when empty.
fn percentile_ms(sorted_us: &[u32], p: f64) -> Option<f64> {
    (!sorted_us.is_empty()).then(|| f64::from(percentile(sorted_us, p)) / 1000.0)
}

/// Re-sent requests listed at most (they are expected around a killed engine).
const MAX_RESENT_LISTED: usize = 50;

/// What the report is built from.
pub(crate) struct RunData {
    pub command: String,
    /// (phase, seconds, target rate).
    pub plan: Vec<(Phase, f64, f64)>,
    pub records: Vec<Record>,
    pub incidents: Vec<Incident>,
    pub engine_ids: HashMap<String, SoakIdSeen>,
    pub id_prefix: String,
    pub worker_urls: Vec<String>,
    pub samples: Vec<Sample>,
    pub fd_check: FdCheck,
    pub churn: Vec<ChurnEvent>,
}

fn mb_range(samples: &[&Sample]) -> Option<(f64, f64)> {
    range(samples, |s| s.rss_kb).map(|(lo, hi)| (lo as f64 / 1024.0, hi as f64 / 1024.0))
}

/// Joins the client's records with the engines' counts and tallies them.
pub(crate) fn build(data: RunData) -> SoakReport {
    let RunData {
        command,
        plan,
        records,
        mut incidents,
        engine_ids,
        id_prefix,
        worker_urls,
        samples,
        fd_check,
        churn,
    } = data;
    let mut rows: Vec<PhaseRow> = plan
        .iter()
        .map(|&(phase, secs, rate)| PhaseRow {
            phase: phase.label().into(),
            secs,
            target_rate: rate,
            ..PhaseRow::default()
        })
        .collect();
    let mut ttfts: Vec<Vec<u32>> = vec![Vec::new(); rows.len()];
    let mut latencies: Vec<Vec<u32>> = vec![Vec::new(); rows.len()];
    let mut causes: BTreeMap<String, usize> = BTreeMap::new();
    let mut flagged: HashMap<String, (IncidentKind, Record)> = HashMap::new();
    let mut succeeded_without_engine_answer = 0;
    let mut known_ids = 0;
    let mut migrations = Migrations::default();
    for record in &records {
        let index = plan.iter().position(|&(phase, ..)| phase == record.phase).expect("a planned phase");
        let row = &mut rows[index];
        let id = format!("{id_prefix}{}", record.n);
        let seen = engine_ids.get(&id).copied();
        known_ids += usize::from(seen.is_some());
        let seen = seen.unwrap_or_default();
        row.sent += 1;
        match record.cause.outcome() {
            Outcome::Succeeded => row.succeeded += 1,
            Outcome::FailedClean => row.failed_clean += 1,
            Outcome::Lost => row.lost += 1,
        }
        if record.cause.outcome() != Outcome::Succeeded {
            *causes.entry(record.cause.label()).or_default() += 1;
        } else if seen.answered == 0 {
            succeeded_without_engine_answer += 1;
        }
        if record.stream && (seen.resumed > 0 || record.cause == Cause::ErrorEvent) {
            migrations.cut += 1;
            migrations.continuations += seen.resumed as usize;
            match record.cause {
                Cause::Answered if !record.wrong_text => migrations.completed_whole += 1,
                Cause::ErrorEvent => migrations.error_event += 1,
                _ => {}
            }
        }
        migrations.wrong_text += usize::from(record.wrong_text);
        if is_duplicated(seen, record.multi_answer) {
            row.duplicated += 1;
            flagged.insert(id, (IncidentKind::Duplicated, *record));
        } else if seen.received.saturating_sub(seen.resumed) > 1 {
            row.resent += 1;
            flagged.insert(id, (IncidentKind::Resent, *record));
        }
        ttfts[index].extend(record.ttft_us);
        latencies[index].extend(record.latency_us);
    }
    for (row, (ttft, latency)) in rows.iter_mut().zip(ttfts.iter_mut().zip(latencies.iter_mut())) {
        ttft.sort_unstable();
        latency.sort_unstable();
        row.ttft_p50_ms = percentile_ms(ttft, 50.0);
        row.ttft_p99_ms = percentile_ms(ttft, 99.0);
        row.latency_p50_ms = percentile_ms(latency, 50.0);
        row.latency_p99_ms = percentile_ms(latency, 99.0);
        let in_phase: Vec<&Sample> = samples.iter().filter(|s| s.label == row.phase).collect();
        row.rss_mb = mb_range(&in_phase);
        row.fds = range(&in_phase, |s| s.fds);
    }
    // CPU: from the last sample before a phase (the previous phase's end) to its last one.
    let mut previous = samples.iter().find(|s| s.label == "before");
    for row in &mut rows {
        let last = samples.iter().rfind(|s| s.label == row.phase);
        if let (Some(start), Some(end)) = (previous, last) {
            let wall = end.at_secs - start.at_secs;
            row.cpu_percent = (wall > 0.0).then(|| 100.0 * (end.cpu_secs - start.cpu_secs) / wall);
        }
        previous = last.or(previous);
    }
    let steady: Vec<&Sample> = samples.iter().filter(|s| s.label == Phase::Steady.label()).collect();
    let third = steady.len() / 3;
    let steady_rss_drift_mb = (third > 0).then(|| {
        let max_mb = |part: &[&Sample]| part.iter().map(|s| s.rss_kb).max().unwrap_or(0) as f64 / 1024.0;
        (max_mb(&steady[..third]), max_mb(&steady[steady.len() - third..]))
    });
    let per_min = |kb_per_sec: f64| kb_per_sec * 60.0 / 1024.0;
    let second_half = &steady[steady.len() / 2..];
    let steady_rss_slope_mb_per_min = slope(second_half, |s| s.rss_kb as f64).map(per_min);
    let steady_rss_slope_net_mb_per_min =
        slope(second_half, |s| s.rss_kb as f64 - s.bookkeeping_kb as f64).map(per_min);
    let mut total = PhaseRow { phase: "total".into(), ..PhaseRow::default() };
    for row in &rows {
        total.secs += row.secs;
        total.sent += row.sent;
        total.succeeded += row.succeeded;
        total.failed_clean += row.failed_clean;
        total.lost += row.lost;
        total.duplicated += row.duplicated;
        total.resent += row.resent;
    }
    let mut all_ttfts: Vec<u32> = ttfts.concat();
    all_ttfts.sort_unstable();
    total.ttft_p50_ms = percentile_ms(&all_ttfts, 50.0);
    total.ttft_p99_ms = percentile_ms(&all_ttfts, 99.0);
    let mut all_latencies: Vec<u32> = latencies.concat();
    all_latencies.sort_unstable();
    total.latency_p50_ms = percentile_ms(&all_latencies, 50.0);
    total.latency_p99_ms = percentile_ms(&all_latencies, 99.0);
    let all_samples: Vec<&Sample> =
        samples.iter().filter(|s| !matches!(s.label.as_str(), "baseline" | "after shutdown")).collect();
    total.rss_mb = mb_range(&all_samples);
    total.fds = range(&all_samples, |s| s.fds);
    let before = samples.iter().find(|s| s.label == "before");
    let end = samples.iter().rfind(|s| s.label == plan.last().map_or("", |p| p.0.label()));
    if let (Some(start), Some(end)) = (before, end) {
        let wall = end.at_secs - start.at_secs;
        total.cpu_percent = (wall > 0.0).then(|| 100.0 * (end.cpu_secs - start.cpu_secs) / wall);
    }

    // The incidents the requests reported, marked duplicated where they are, then the
    // duplicated and re-sent requests that reported none (they succeeded).
    for incident in &mut incidents {
        if let Some((kind, _)) = flagged.remove(&incident.soak_id) {
            incident.kind = incident.kind.min(kind);
        }
    }
    let mut flagged: Vec<(String, (IncidentKind, Record))> = flagged.into_iter().collect();
    flagged.sort_by_key(|(_, (kind, record))| (*kind, record.n));
    let mut resent_listed = 0;
    for (soak_id, (kind, record)) in flagged {
        if kind == IncidentKind::Resent {
            if resent_listed == MAX_RESENT_LISTED {
                continue;
            }
            resent_listed += 1;
        }
        incidents.push(Incident {
            soak_id,
            kind,
            phase: record.phase,
            sent_at_secs: f64::from(record.sent_at_ms) / 1000.0,
            cause: record.cause.label(),
            worker: record.worker_idx.and_then(|i| worker_urls.get(usize::from(i)).cloned()),
            detail: None,
            engines_received: 0,
            engines_answered: 0,
        });
    }
    for incident in &mut incidents {
        let seen = engine_ids.get(&incident.soak_id).copied().unwrap_or_default();
        incident.engines_received = seen.received;
        incident.engines_answered = seen.answered;
    }
    incidents.sort_by(|a, b| a.kind.cmp(&b.kind).then(a.sent_at_secs.total_cmp(&b.sent_at_secs)));
    SoakReport {
        command,
        phases: rows,
        total,
        causes,
        fd_check,
        samples,
        churn,
        steady_rss_drift_mb,
        steady_rss_slope_mb_per_min,
        steady_rss_slope_net_mb_per_min,
        unknown_engine_ids: engine_ids.len() - known_ids,
        succeeded_without_engine_answer,
        migrations,
        incidents,
    }
}

/// The least-squares slope of `value` (kB) over time (s), from at least three samples.
fn slope(samples: &[&Sample], value: impl Fn(&Sample) -> f64) -> Option<f64> {
    if samples.len() < 3 {
        return None;
    }
    let n = samples.len() as f64;
    let mean_t = samples.iter().map(|s| s.at_secs).sum::<f64>() / n;
    let mean_value = samples.iter().map(|s| value(s)).sum::<f64>() / n;
    let covariance: f64 = samples.iter().map(|s| (s.at_secs - mean_t) * (value(s) - mean_value)).sum();
    let variance: f64 = samples.iter().map(|s| (s.at_secs - mean_t).powi(2)).sum();
    (variance > 0.0).then(|| covariance / variance)
}

fn ms(value: Option<f64>) -> String {
    value.map_or("—".into(), |v| format!("{v:.1}"))
}

fn span<T: std::fmt::Display + PartialEq>(value: Option<(T, T)>) -> String {
    match value {
        Some((lo, hi)) if lo == hi => format!("{lo}"),
        Some((lo, hi)) => format!("{lo}–{hi}"),
        None => "—".into(),
    }
}

impl SoakReport {
    pub(crate) fn passed(&self) -> bool {
        self.total.lost == 0 && self.total.duplicated == 0 && self.migrations.wrong_text == 0
    }

    pub(crate) fn markdown(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "| phase | secs | rate/s | sent | succeeded | failed clean | lost | duplicated | re-sent | TTFT p50 ms | TTFT p99 ms | RSS MB | fds | CPU % |\n\
             | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for row in self.phases.iter().chain([&self.total]) {
            let rate = match row.target_rate {
                _ if row.phase == "total" => "".into(),
                0.0 => "closed loop".into(),
                rate => format!("{rate}"),
            };
            let rss = span(row.rss_mb.map(|(lo, hi)| (format!("{lo:.0}"), format!("{hi:.0}"))));
            let _ = writeln!(
                out,
                "| {} | {} | {rate} | {} | {} | {} | {} | {} | {} | {} | {} | {rss} | {} | {} |",
                row.phase,
                row.secs,
                row.sent,
                row.succeeded,
                row.failed_clean,
                row.lost,
                row.duplicated,
                row.resent,
                ms(row.ttft_p50_ms),
                ms(row.ttft_p99_ms),
                span(row.fds),
                row.cpu_percent.map_or("—".into(), |cpu| format!("{cpu:.0}")),
            );
        }
        let fd = &self.fd_check;
        let sample = |label: &str| self.samples.iter().find(|s| s.label == label);
        let rss_of =
            |label: &str| sample(label).map_or("—".into(), |s| format!("{:.0}", s.rss_kb as f64 / 1024.0));
        let _ = writeln!(
            out,
            "\nResources (one process: gateway, engines and client): before the load RSS {} MB, {} fds; \
             idle after the load: RSS {} MB, {} fds, of which {} are the gateway's {} pooled idle \
             engine connections (2 fds each), {} unexplained; after shutdown RSS {} MB, {} fds \
             (baseline before start {}).",
            rss_of("before"),
            fd.before,
            rss_of("after"),
            fd.after_idle,
            2 * fd.pooled_upstream_idle,
            fd.pooled_upstream_idle,
            fd.unexplained_after_idle(),
            rss_of("after shutdown"),
            fd.after_shutdown,
            fd.baseline,
        );
        if let Some((first, last)) = self.steady_rss_drift_mb {
            let slope = |s: Option<f64>| s.map_or("—".into(), |s| format!("{s:+.2}"));
            let _ = writeln!(
                out,
                "Steady RSS: highest {first:.0} MB in the first third of the phase, {last:.0} MB in the \
                 last third; slope over its second half {} MB/min ({} MB/min without the soak's own \
                 per-request bookkeeping).",
                slope(self.steady_rss_slope_mb_per_min),
                slope(self.steady_rss_slope_net_mb_per_min),
            );
        }
        if !self.causes.is_empty() {
            let causes: Vec<String> = self.causes.iter().map(|(cause, n)| format!("{cause}: {n}")).collect();
            let _ = writeln!(out, "Failed and lost requests by cause: {}.", causes.join(", "));
        }
        let _ = writeln!(
            out,
            "Churn: {} actions ({}). Engine ids never sent by the client: {}; successes no engine answered: {}.",
            self.churn.len(),
            self.churn_summary(),
            self.unknown_engine_ids,
            self.succeeded_without_engine_answer,
        );
        let m = &self.migrations;
        let _ = writeln!(
            out,
            "Streams cut mid-answer: {}; completed whole on another engine: {} ({}); ended with the \
             error event: {}; continuations sent: {}; whole streams whose text is not the uncut \
             answer: {}.",
            m.cut,
            m.completed_whole,
            m.completed_percent().map_or("—".into(), |p| format!("{p:.1}%")),
            m.error_event,
            m.continuations,
            m.wrong_text,
        );
        let verdict = if self.passed() { "PASS" } else { "FAIL" };
        let _ = writeln!(
            out,
            "Verdict: {verdict} ({} lost, {} duplicated, {} wrong texts).",
            self.total.lost, self.total.duplicated, m.wrong_text
        );
        out
    }

    fn churn_summary(&self) -> String {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for event in &self.churn {
            *counts.entry(event.action.as_str()).or_default() += 1;
        }
        let failed = self.churn.iter().filter(|e| !matches!(e.result.as_str(), "200" | "201" | "ok")).count();
        let mut parts: Vec<String> = counts.iter().map(|(action, n)| format!("{n} {action}")).collect();
        if failed > 0 {
            parts.push(format!("{failed} failed"));
        }
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(received: u32, answered: u32) -> SoakIdSeen {
        SoakIdSeen { received, answered, resumed: 0 }
    }

    #[test]
    fn the_rss_slope_is_a_least_squares_fit() {
        let sample = |at_secs: f64, rss_kb: u64| Sample {
            label: "steady".into(),
            at_secs,
            rss_kb,
            fds: 0,
            cpu_secs: 0.0,
            bookkeeping_kb: rss_kb / 2,
        };
        let rss = |s: &Sample| s.rss_kb as f64;
        let rising = [sample(0.0, 1000), sample(10.0, 1100), sample(20.0, 1200)];
        assert_eq!(slope(&rising.iter().collect::<Vec<_>>(), rss), Some(10.0));
        let net = |s: &Sample| (s.rss_kb - s.bookkeeping_kb) as f64;
        assert_eq!(slope(&rising.iter().collect::<Vec<_>>(), net), Some(5.0));
        let flat = [sample(0.0, 1000), sample(10.0, 1200), sample(20.0, 1000)];
        assert_eq!(slope(&flat.iter().collect::<Vec<_>>(), rss), Some(0.0));
        assert_eq!(slope(&rising[..2].iter().collect::<Vec<_>>(), rss), None);
    }

    #[test]
    fn duplicates_are_second_answers_not_second_sends() {
        // Sent once, answered once.
        assert!(!is_duplicated(seen(1, 1), false));
        // Refused with a 503 by one engine, answered by the next: a legitimate re-send.
        assert!(!is_duplicated(seen(2, 1), false));
        // Refused everywhere: the client got the last error.
        assert!(!is_duplicated(seen(3, 0), false));
        // Two engines began answers: the gateway sent it again after one answered.
        assert!(is_duplicated(seen(2, 2), false));
        // One response with two answers spliced into it.
        assert!(is_duplicated(seen(1, 1), true));
        // A stream cut mid-answer and continued on another engine: one answer.
        assert!(!is_duplicated(SoakIdSeen { received: 2, answered: 2, resumed: 1 }, false));
        assert!(is_duplicated(SoakIdSeen { received: 3, answered: 3, resumed: 1 }, false));
    }

    #[test]
    fn cut_streams_are_counted_by_what_became_of_them() {
        let record = |n, cause, wrong_text| Record {
            n,
            phase: Phase::Steady,
            sent_at_ms: 0,
            cause,
            ttft_us: None,
            latency_us: None,
            multi_answer: false,
            worker_idx: None,
            stream: true,
            wrong_text,
        };
        let records = vec![
            record(0, Cause::Answered, false),
            record(1, Cause::Answered, false),
            record(2, Cause::ErrorEvent, false),
            record(3, Cause::Answered, true),
        ];
        let resumed = SoakIdSeen { received: 2, answered: 2, resumed: 1 };
        let engine_ids: HashMap<String, SoakIdSeen> =
            [("s-0", seen(1, 1)), ("s-1", resumed), ("s-2", seen(1, 1)), ("s-3", resumed)]
                .into_iter()
                .map(|(id, s)| (id.to_string(), s))
                .collect();
        let fd_check =
            FdCheck { baseline: 0, before: 0, after_idle: 0, pooled_upstream_idle: 0, after_shutdown: 0 };
        let report = build(RunData {
            command: "kvgate soak".into(),
            plan: vec![(Phase::Steady, 1.0, 1.0)],
            records,
            incidents: Vec::new(),
            engine_ids,
            id_prefix: "s-".into(),
            worker_urls: Vec::new(),
            samples: Vec::new(),
            fd_check,
            churn: Vec::new(),
        });
        let m = &report.migrations;
        assert_eq!((m.cut, m.completed_whole, m.error_event, m.wrong_text, m.continuations), (3, 1, 1, 1, 2));
        assert!(!report.passed(), "a wrong text fails the run");
        assert!(
            report.markdown().contains("completed whole on another engine: 1 (33.3%)"),
            "{}",
            report.markdown()
        );
    }

    #[test]
    fn the_report_joins_client_records_with_engine_counts() {
        let record = |n, cause, multi_answer| Record {
            n,
            phase: Phase::Steady,
            sent_at_ms: n as u32,
            cause,
            ttft_us: Some(1000 * (n as u32 + 1)),
            latency_us: None,
            multi_answer,
            worker_idx: Some(0),
            stream: true,
            wrong_text: false,
        };
        let records = vec![
            record(0, Cause::Answered, false),
            record(1, Cause::Answered, false),
            record(2, Cause::ErrorStatus(429), false),
            record(3, Cause::Truncated, false),
            record(4, Cause::Answered, false),
        ];
        let engine_ids: HashMap<String, SoakIdSeen> = [
            ("s-0", seen(1, 1)),
            ("s-1", seen(2, 1)),
            ("s-3", seen(1, 1)),
            ("s-4", seen(2, 2)),
            ("x", seen(1, 1)),
        ]
        .into_iter()
        .map(|(id, s)| (id.to_string(), s))
        .collect();
        let fd_check =
            FdCheck { baseline: 10, before: 20, after_idle: 30, pooled_upstream_idle: 4, after_shutdown: 11 };
        let report = build(RunData {
            command: "kvgate soak".into(),
            plan: vec![(Phase::Steady, 3.0, 5.0)],
            records,
            incidents: Vec::new(),
            engine_ids,
            id_prefix: "s-".into(),
            worker_urls: vec!["http://w0".into()],
            samples: Vec::new(),
            fd_check,
            churn: Vec::new(),
        });
        let row = &report.phases[0];
        assert_eq!((row.sent, row.succeeded, row.failed_clean, row.lost), (5, 3, 1, 1));
        assert_eq!((row.duplicated, row.resent), (1, 1));
        assert_eq!(row.ttft_p50_ms, Some(3.0));
        assert_eq!((report.unknown_engine_ids, report.succeeded_without_engine_answer), (1, 0));
        assert_eq!(report.fd_check.unexplained_after_idle(), 2);
        assert!(!report.passed());
        let kinds: Vec<(&str, IncidentKind)> =
            report.incidents.iter().map(|i| (i.soak_id.as_str(), i.kind)).collect();
        assert_eq!(kinds, [("s-4", IncidentKind::Duplicated), ("s-1", IncidentKind::Resent)]);
        assert_eq!(report.incidents[0].worker.as_deref(), Some("http://w0"));
        let table = report.markdown();
        assert!(table.contains("| steady | 3 | 5 | 5 | 3 | 1 | 1 | 1 | 1 |"), "{table}");
    }
}
