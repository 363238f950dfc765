//! The per-tenant figures of a run (a trace whose lines name their `tenant`): each tenant's
//! completed requests, its shares of the requests and prompt tokens served, its TTFT
//! percentiles (from its arrival at the gateway, admission queue included), queueing and hit
//! rate, and where the TTFT of its slowest tenth went (the gateway's queue, the engine's queue,
//! its own prefill, the other requests' work in its prefill steps). Tenants in name order; a
//! request naming none counts as `default`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kvgate_trace::percentile;
use serde::Serialize;

use crate::sim::{SimOutcome, TtftParts};
use kvgate_trace::Trace;

/// One tenant's figures. Latencies in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TenantMetrics {
    pub tenant: String,
    pub completed: u64,
    /// Its share of the completed requests.
    pub request_share: f64,
    /// Its share of the completed requests' prompt tokens.
    pub prompt_token_share: f64,
    /// Its completed requests per second of the run's makespan.
    pub completed_per_s: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// Mean of admitted - arrival (the gateway's queue and the engine's).
    pub mean_queue_ms: f64,
    pub cache_hit_rate: f64,
    /// The TTFT of its requests at or above its TTFT p90, in parts (means over them; they add
    /// up to their mean TTFT; all 0 for a disaggregated fleet, whose parts are not recorded).
    pub tail_gateway_wait_ms: f64,
    pub tail_engine_wait_ms: f64,
    pub tail_prefill_own_ms: f64,
    pub tail_prefill_shared_ms: f64,
    /// Mean of finished - first token (how long an answer holds its slot after its first token).
    pub decode_mean_ms: f64,
}

#[derive(Default)]
struct Sums {
    ttft_ms: Vec<f64>,
    /// (TTFT, its parts) per request.
    parts: Vec<(u64, TtftParts)>,
    decode_us: u64,
    queue_us: u64,
    prompt: u64,
    cached: u64,
}

/// Each tenant's figures (empty when no line of `trace` names a tenant).
pub fn per_tenant(outcome: &SimOutcome, trace: &Trace, makespan_s: f64) -> Vec<TenantMetrics> {
    if trace.requests.iter().all(|request| request.tenant.is_none()) {
        return Vec::new();
    }
    let mut tenants: BTreeMap<&str, Sums> = BTreeMap::new();
    for (position, (stats, &index)) in outcome.finished.iter().zip(&outcome.finished_requests).enumerate() {
        let tenant = trace.requests.get(index).and_then(|r| r.tenant.as_deref()).unwrap_or("default");
        let sums = tenants.entry(tenant).or_default();
        sums.ttft_ms.push(stats.ttft_us() as f64 / 1000.0);
        if let Some(&parts) = outcome.ttft_parts.get(position) {
            sums.parts.push((stats.ttft_us(), parts));
        }
        sums.decode_us += stats.finished_us.saturating_sub(stats.first_token_us);
        sums.queue_us += stats.admitted_us.saturating_sub(stats.arrival_us);
        sums.prompt += u64::from(stats.prompt_tokens);
        sums.cached += u64::from(stats.cached_tokens);
    }
    let requests: usize = tenants.values().map(|sums| sums.ttft_ms.len()).sum();
    let prompt: u64 = tenants.values().map(|sums| sums.prompt).sum();
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    tenants
        .into_iter()
        .map(|(tenant, mut sums)| {
            sums.ttft_ms.sort_by(f64::total_cmp);
            let n = sums.ttft_ms.len() as f64;
            let p90_us = percentile(&sums.ttft_ms, 90.0) * 1000.0;
            let tail: Vec<TtftParts> = sums
                .parts
                .iter()
                .filter(|(ttft, _)| (*ttft as f64) >= p90_us)
                .map(|&(_, parts)| parts)
                .collect();
            let tail_mean_ms = |part: fn(&TtftParts) -> u64| {
                ratio(tail.iter().map(part).sum::<u64>() as f64 / 1000.0, tail.len() as f64)
            };
            TenantMetrics {
                tenant: tenant.to_string(),
                completed: sums.ttft_ms.len() as u64,
                request_share: ratio(n, requests as f64),
                prompt_token_share: ratio(sums.prompt as f64, prompt as f64),
                completed_per_s: ratio(n, makespan_s),
                ttft_mean_ms: ratio(sums.ttft_ms.iter().sum(), n),
                ttft_p50_ms: percentile(&sums.ttft_ms, 50.0),
                ttft_p90_ms: percentile(&sums.ttft_ms, 90.0),
                ttft_p99_ms: percentile(&sums.ttft_ms, 99.0),
                mean_queue_ms: ratio(sums.queue_us as f64 / 1000.0, n),
                cache_hit_rate: ratio(sums.cached as f64, sums.prompt as f64),
                tail_gateway_wait_ms: tail_mean_ms(|parts| parts.gateway_wait_us),
                tail_engine_wait_ms: tail_mean_ms(|parts| parts.engine_wait_us),
                tail_prefill_own_ms: tail_mean_ms(|parts| parts.prefill_own_us),
                tail_prefill_shared_ms: tail_mean_ms(|parts| parts.prefill_shared_us),
                decode_mean_ms: ratio(sums.decode_us as f64 / 1000.0, n),
            }
        })
        .collect()
}

/// A run's per-tenant tables (`label` names the run).
pub(crate) fn markdown(label: &str, tenants: &[TenantMetrics], out: &mut String) {
    let _ = writeln!(
        out,
        "\nPer tenant, `{}`:\n\n| tenant | completed | share of requests | share of prompt tokens \
         | TTFT p50 / p90 / p99 (ms) | mean queueing (ms) | hit rate |\n| --- | ---: | ---: | ---: \
         | ---: | ---: | ---: |",
        label
    );
    for t in tenants {
        let _ = writeln!(
            out,
            "| {} | {} | {:.1}% | {:.1}% | {:.0} / {:.0} / {:.0} | {:.0} | {:.1}% |",
            t.tenant,
            t.completed,
            100.0 * t.request_share,
            100.0 * t.prompt_token_share,
            t.ttft_p50_ms,
            t.ttft_p90_ms,
            t.ttft_p99_ms,
            t.mean_queue_ms,
            100.0 * t.cache_hit_rate
        );
    }
    let _ = writeln!(
        out,
        "\nTTFT of the slowest tenth by part (means over the requests at or above the tenant's \
         p90), `{}`:\n\n| tenant | gateway queue (ms) | engine queue (ms) | own prefill (ms) \
         | others' work in its prefill steps (ms) | decode, first to last token (mean, ms) |\n\
         | --- | ---: | ---: | ---: | ---: | ---: |",
        label
    );
    for t in tenants {
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            t.tenant,
            t.tail_gateway_wait_ms,
            t.tail_engine_wait_ms,
            t.tail_prefill_own_ms,
            t.tail_prefill_shared_ms,
            t.decode_mean_ms
        );
    }
}
