//! The markdown rendering of the simulator's report: the header lines (trace, references, fleet), the metrics side by side (one column per run) or one row per run for sweeps, and the sweep's best settings.

use std::fmt::Write as _;

use kvgate_policy::Reason;
use kvgate_trace::SessionFigures;

use crate::report::{Metrics, PdMetrics, SimReport};

/// Renders one metric of a run for the markdown table.
type Cell = fn(&Metrics) -> String;

/// The markdown rows, in order; the first `ROW_PER_RUN_METRICS` are the columns of sweep tables.
const METRIC_ROWS: [(&str, Cell); 20] = [
    ("TTFT mean (ms)", |m| fmt_ms(m.ttft_mean_ms)),
    ("TTFT p50 (ms)", |m| fmt_ms(m.ttft_p50_ms)),
    ("TTFT p90 (ms)", |m| fmt_ms(m.ttft_p90_ms)),
    ("TTFT p99 (ms)", |m| fmt_ms(m.ttft_p99_ms)),
    ("e2e p50 (ms)", |m| fmt_ms(m.e2e_p50_ms)),
    ("e2e p99 (ms)", |m| fmt_ms(m.e2e_p99_ms)),
    ("mean queueing (ms)", |m| fmt_ms(m.mean_queue_ms)),
    ("cache hit rate", |m| pct(m.cache_hit_rate)),
    ("hit rate / ceiling", |m| pct(m.hit_of_ceiling)),
    ("hit rate / pooled LRU", |m| pct(m.hit_of_pooled_lru)),
    ("completed req/s", |m| format!("{:.2}", m.completed_per_s)),
    ("KV spread mean (max-min)", |m| format!("{:.3}", m.kv_spread_mean)),
    ("KV usage mean", |m| format!("{:.3}", m.kv_usage_mean)),
    ("KV usage max", |m| format!("{:.3}", m.kv_usage_max)),
    ("chosen / best match", |m| match (m.chosen_match_mean, m.best_match_mean) {
        (Some(chosen), Some(best)) => format!("{} / {}", pct(chosen), pct(best)),
        _ => "-".to_string(),
    }),
    ("completed", |m| m.completed.to_string()),
    ("rejected by engine", |m| m.rejected.to_string()),
    ("unrouted", |m| m.unrouted.to_string()),
    ("makespan (s)", |m| format!("{:.1}", m.makespan_s)),
    ("predicted TTFT terms, mean (ms)", predicted_terms),
];

/// The predicted time to first token's terms, mean per decision, those that make it up and are
/// not all zero ("-" for a policy that predicts none).
fn predicted_terms(m: &Metrics) -> String {
    const SHOWN: [&str; 7] = ["total", "queue", "prefill", "decode", "kv", "base", "kv_wait"];
    let shown: Vec<String> = m
        .predicted_mean_ms
        .iter()
        .filter(|(term, ms)| SHOWN.contains(&term.as_str()) && (*ms != 0.0 || term == "total"))
        .map(|(term, ms)| format!("{term} {}", fmt_ms(*ms)))
        .collect();
    match shown.is_empty() {
        true => "-".to_string(),
        false => shown.join(", "),
    }
}

const ROW_PER_RUN_METRICS: usize = 14;

/// Renders one decode-side metric of a disaggregated run.
type PdCell = fn(&PdMetrics) -> String;

/// The rows a disaggregated fleet adds, after `METRIC_ROWS`.
const PD_ROWS: [(&str, PdCell); 10] = [
    ("share prefilled in place", |m| format!("{:.1}%", m.in_place_share * 100.0)),
    ("prefill tokens computed on decode engines", |m| format!("{:.1}%", m.decode_prefill_share * 100.0)),
    ("KV transfer mean (ms)", |m| fmt_ms(m.kv_transfer_mean_ms)),
    ("decode queueing (ms)", |m| fmt_ms(m.decode_queue_mean_ms)),
    ("decode KV usage mean", |m| format!("{:.3}", m.decode_kv_usage_mean)),
    ("decode KV usage max", |m| format!("{:.3}", m.decode_kv_usage_max)),
    ("decode KV spread mean", |m| format!("{:.3}", m.decode_kv_spread_mean)),
    ("decode uncached tokens max", |m| m.decode_uncached_tokens_max.to_string()),
    ("predicted in place / pair, mean (ms)", |m| {
        format!("{} / {}", fmt_ms(m.predicted_in_place_ms), fmt_ms(m.predicted_pair_ms))
    }),
    ("predicted cost to others in place / pair, mean (ms)", |m| {
        format!("{} / {}", fmt_ms(m.predicted_in_place_others_ms), fmt_ms(m.predicted_pair_others_ms))
    }),
];

/// Renders one per-session figure of a run.
type SessionCell = fn(&SessionFigures) -> String;

/// The rows a trace with sessions adds, after `METRIC_ROWS`.
const SESSION_ROWS: [(&str, SessionCell); 4] = [
    ("sessions (turns)", |s| format!("{} ({})", s.sessions, s.turns)),
    ("session makespan mean (ms)", |s| fmt_ms(s.makespan_mean_ms)),
    ("session makespan p50 (ms)", |s| fmt_ms(s.makespan_p50_ms)),
    ("session makespan p99 (ms)", |s| fmt_ms(s.makespan_p99_ms)),
];

fn fmt_ms(ms: f64) -> String {
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else {
        format!("{ms:.1}")
    }
}

fn pct(rate: f64) -> String {
    format!("{:.1}%", rate * 100.0)
}

impl SimReport {
    /// Markdown: metrics side by side, one column per run; with a sweep, one row per run and
    /// the best setting per metric.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let t = &self.trace;
        let s = &self.setup;
        let _ = writeln!(
            out,
            "Trace `{}`: {} requests over {:.0} s (after rate scale {}), {} prompt tokens; \
             infinite-cache ceiling {} of prompt tokens; pooled LRU {}, pooled Belady {} (one cache \
             of the {} {} KV tokens).",
            t.path,
            t.requests,
            t.span_s,
            s.rate_scale,
            t.prompt_tokens,
            pct(t.ceiling_hit_rate),
            pct(t.pooled_lru_hit_rate),
            pct(t.pooled_belady_hit_rate),
            if s.pd.is_some() { "prefill engines'" } else { "fleet's" },
            t.pooled_kv_tokens
        );
        let e = &s.engine;
        let _ = writeln!(
            out,
            "Fleet: {} ({} prefill tok/s, chunk {}, decode {} ms + {} ms/req, max {} running, \
             KV {} tokens in blocks of {}, prefix cache {}); load monitor every {} ms; seed {}.\n",
            match &s.pd {
                Some(pd) => format!(
                    "prefill/decode disaggregated, {} prefill + {} decode engines (each run's policy \
                     routes the prefill side, `{}` the decode side; KV transfer {} GB/s at {} bytes per \
                     prompt token; TTFT is the decode engine's first token; queueing, hit rate and KV \
                     rows are the prefill side's, `decode` rows the decode side's), every engine",
                    pd.prefill_workers,
                    pd.decode_workers,
                    pd.decode_policy_entry,
                    pd.kv_transfer_gbps,
                    pd.kv_bytes_per_token
                ),
                None => format!("{} engines", s.workers),
            },
            e.prefill_tokens_per_sec,
            e.prefill_chunk_tokens,
            e.decode_base_ms,
            e.decode_per_request_ms,
            e.max_running_requests,
            e.kv_capacity_tokens,
            e.block_size,
            if e.prefix_cache { "on" } else { "off" },
            s.load_monitor_interval_ms,
            s.seed
        );
        if !s.worker_speeds.is_empty() || !s.worker_kv_capacity_tokens.is_empty() {
            let speeds: Vec<String> = (0..s.workers)
                .map(|i| format!("{}", s.worker_speeds.get(i).copied().unwrap_or(1.0)))
                .collect();
            let kv: Vec<String> = (0..s.workers)
                .map(|i| {
                    s.worker_kv_capacity_tokens.get(i).copied().unwrap_or(e.kv_capacity_tokens).to_string()
                })
                .collect();
            let _ = writeln!(
                out,
                "Unequal fleet: engine speeds {} (prefill rate x, decode step times /); KV tokens {}.\n",
                speeds.join(", "),
                kv.join(", ")
            );
        }
        if let Some(admission) = &s.admission {
            let _ = writeln!(
                out,
                "Admission: at most {} requests in flight, the rest queued {}.\n",
                admission.max_concurrent.unwrap_or(0),
                match (admission.ignore_tenants, admission.fairness_locality_bound) {
                    (true, _) => "in arrival order (tenants ignored)".to_string(),
                    (false, 0) => "by class, then fair queuing on tokens per tenant (strict)".to_string(),
                    (false, bound) => format!(
                        "by class, then fair queuing on tokens per tenant, locality preferred within \
                         {bound} tokens"
                    ),
                }
            );
        }
        if let Some(overload) = &s.worker_overload {
            let bound = |name: &str, value: Option<String>| value.map(|v| format!("{v} {name}"));
            let bounds: Vec<String> = [
                bound("waiting requests", overload.waiting_requests.map(|n| n.to_string())),
                bound("KV usage", overload.token_usage.map(|u| u.to_string())),
            ]
            .into_iter()
            .flatten()
            .collect();
            let _ = writeln!(
                out,
                "Overload protection: an engine at {} or more is left out while another is under; {}.\n",
                bounds.join(" or "),
                if overload.shed {
                    "when all are, the request is refused"
                } else {
                    "when all are, the least loaded"
                }
            );
        }
        if self.sweep_best.is_empty() {
            self.side_by_side(&mut out);
        } else {
            self.one_row_per_run(&mut out);
            let _ = writeln!(
                out,
                "\nBest setting per metric:\n\n| policy | metric | best | setting |\n| --- | --- | ---: | --- |"
            );
            for best in &self.sweep_best {
                let setting: Vec<String> = best.sweep_point.iter().map(|(k, v)| format!("{k}={v}")).collect();
                let value = if best.metric.ends_with("_ms") {
                    fmt_ms(best.value)
                } else if best.metric.ends_with("rate") {
                    pct(best.value)
                } else {
                    format!("{:.3}", best.value)
                };
                let _ =
                    writeln!(out, "| {} | {} | {value} | {} |", best.entry, best.metric, setting.join(" "));
            }
        }
        for run in self.runs.iter().filter(|run| !run.metrics.tenants.is_empty()) {
            crate::tenants::markdown(&run.label, &run.metrics.tenants, &mut out);
        }
        out
    }

    /// Metrics as rows, one column per run.
    fn side_by_side(&self, out: &mut String) {
        let mut header = String::from("| metric |");
        let mut rule = String::from("| --- |");
        for run in &self.runs {
            let _ = write!(header, " {} |", run.label);
            rule.push_str(" ---: |");
        }
        let _ = writeln!(out, "{header}\n{rule}");
        for (name, cell) in METRIC_ROWS {
            let mut line = format!("| {name} |");
            for run in &self.runs {
                let _ = write!(line, " {} |", cell(&run.metrics));
            }
            let _ = writeln!(out, "{line}");
        }
        if self.runs.iter().any(|run| run.metrics.sessions.is_some()) {
            for (name, cell) in SESSION_ROWS {
                let mut line = format!("| {name} |");
                for run in &self.runs {
                    let _ =
                        write!(line, " {} |", run.metrics.sessions.as_ref().map_or("-".to_string(), cell));
                }
                let _ = writeln!(out, "{line}");
            }
        }
        if self.runs.iter().any(|run| run.metrics.pd.is_some()) {
            for (name, cell) in PD_ROWS {
                let mut line = format!("| {name} |");
                for run in &self.runs {
                    let _ = write!(line, " {} |", run.metrics.pd.as_ref().map_or("-".to_string(), cell));
                }
                let _ = writeln!(out, "{line}");
            }
        }
        let unequal =
            !self.setup.worker_speeds.is_empty() || !self.setup.worker_kv_capacity_tokens.is_empty();
        if unequal {
            let mut line = String::from("| prefill share by engine (%) |");
            for run in &self.runs {
                let shares: Vec<String> =
                    run.metrics.prefill_share_by_engine.iter().map(|s| format!("{:.0}", s * 100.0)).collect();
                let _ = write!(line, " {} |", shares.join("/"));
            }
            let _ = writeln!(out, "{line}");
        }
        // Every decision name some run gave, in `decision_counts` order (reasons, then indexes).
        let mut reasons: Vec<&str> = Vec::new();
        for run in &self.runs {
            for (name, _) in &run.decisions {
                if !reasons.contains(&name.as_str()) {
                    reasons.push(name);
                }
            }
        }
        let order =
            |name: &str| Reason::ALL.iter().position(|r| r.as_str() == name).unwrap_or(Reason::ALL.len());
        reasons.sort_by_key(|name| (order(name), name.to_string()));
        for reason in reasons {
            let mut line = format!("| decisions: {reason} |");
            for run in &self.runs {
                let count = run.decisions.iter().find(|(name, _)| name == reason).map_or(0, |(_, c)| *c);
                let _ = write!(line, " {count} |");
            }
            let _ = writeln!(out, "{line}");
        }
        // The decode side's, in `Reason::ALL` order (one policy for every run).
        for reason in Reason::ALL {
            let count = |run: &crate::RunReport| {
                run.decode_decisions.iter().find(|(name, _)| name == reason.as_str()).map_or(0, |(_, c)| *c)
            };
            if self.runs.iter().all(|run| count(run) == 0) {
                continue;
            }
            let mut line = format!("| decode decisions: {} |", reason.as_str());
            for run in &self.runs {
                let _ = write!(line, " {} |", count(run));
            }
            let _ = writeln!(out, "{line}");
        }
    }

    /// One row per run (sweeps have many runs with long labels), the main metrics as columns.
    fn one_row_per_run(&self, out: &mut String) {
        let shown = &METRIC_ROWS[..ROW_PER_RUN_METRICS];
        let mut header = String::from("| run |");
        let mut rule = String::from("| --- |");
        for (name, _) in shown {
            let _ = write!(header, " {name} |");
            rule.push_str(" ---: |");
        }
        let _ = writeln!(out, "{header} decisions |\n{rule} --- |");
        for run in &self.runs {
            let mut line = format!("| {} |", run.label);
            for (_, cell) in shown {
                let _ = write!(line, " {} |", cell(&run.metrics));
            }
            let decisions: Vec<String> =
                run.decisions.iter().map(|(name, count)| format!("{name} {count}")).collect();
            let _ = writeln!(out, "{line} {} |", decisions.join(", "));
        }
    }
}
