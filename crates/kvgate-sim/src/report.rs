//! The simulator's report: per-run metrics computed from a simulation's outcome, the sweep's best settings, and the JSON rendering (the markdown is in `markdown.rs`).

use kvgate_engine::{EngineConfig, RequestStats};
use kvgate_policy::{IndexKind, PolicyConfig, Reason};
use kvgate_trace::percentile;
use serde::Serialize;

use crate::sim::{KvTick, PdSetup, SimOutcome};

/// The whole report of `kvgate sim`.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub trace: TraceInfo,
    pub setup: SetupInfo,
    pub runs: Vec<RunReport>,
    /// Best grid point per metric, per `--policies` entry (empty without `--sweep`).
    pub sweep_best: Vec<BestSetting>,
}

/// What was replayed.
#[derive(Clone, Debug, Serialize)]
pub struct TraceInfo {
    pub path: String,
    pub requests: usize,
    pub prompt_tokens: u64,
    /// Prompt tokens an infinite cache could serve (leading blocks seen before).
    pub ceiling_cached_tokens: u64,
    /// `ceiling_cached_tokens / prompt_tokens`.
    pub ceiling_hit_rate: f64,
    /// The whole fleet's KV tokens (`--workers` x `--kv-capacity-tokens`; a disaggregated fleet's
    /// prefill engines only, whose caches serve prompts): the size of the one cache of the
    /// pooled references.
    pub pooled_kv_tokens: u64,
    /// Prompt tokens one LRU cache of `pooled_kv_tokens` would serve (the pooled-LRU reference).
    pub pooled_lru_cached_tokens: u64,
    /// `pooled_lru_cached_tokens / prompt_tokens`.
    pub pooled_lru_hit_rate: f64,
    /// Prompt tokens the same cache would serve evicting the block used again furthest ahead
    /// (the pooled-Belady bound).
    pub pooled_belady_cached_tokens: u64,
    /// `pooled_belady_cached_tokens / prompt_tokens`.
    pub pooled_belady_hit_rate: f64,
    /// Virtual time from the first to the last arrival, after `--rate-scale`.
    pub span_s: f64,
}

/// The fleet and the simulation options.
#[derive(Clone, Debug, Serialize)]
pub struct SetupInfo {
    /// Engines of the fleet (a disaggregated fleet's prefill and decode engines together).
    pub workers: usize,
    /// The prefill/decode split of a disaggregated fleet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdSetup>,
    pub rate_scale: f64,
    pub load_monitor_interval_ms: u64,
    pub seed: u64,
    pub engine: EngineConfig,
    /// An unequal fleet's per-engine speed factors (`--worker-speeds`; empty: all equal).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub worker_speeds: Vec<f64>,
    /// An unequal fleet's per-engine KV capacities (`--worker-kv-capacity-tokens`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub worker_kv_capacity_tokens: Vec<u64>,
    /// The gateway's admission in front of the fleet (`--max-concurrent-requests`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admission: Option<crate::AdmissionSetup>,
    /// The per-worker overload bounds (`--worker-overload-*`), when on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_overload: Option<WorkerOverload>,
}

/// The per-worker overload protection of a run (`--worker-overload-*`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct WorkerOverload {
    pub waiting_requests: Option<u64>,
    pub token_usage: Option<f64>,
    pub shed: bool,
}

/// One simulated run (a policy at one setting).
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub label: String,
    /// The `--policies` entry the run came from.
    pub entry: String,
    pub sweep_point: Vec<(String, String)>,
    pub policy: PolicyConfig,
    pub metrics: Metrics,
    /// Decisions by reason (reasons the run never gave are left out).
    pub decisions: Vec<(String, u64)>,
    /// A disaggregated fleet's decode-side decisions by reason (zeros left out).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub decode_decisions: Vec<(String, u64)>,
    /// What the requests each reason placed then cost: their TTFT and hit rate, by reason (the
    /// run's policy; reasons no finished request had are left out).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ttft_by_reason: Vec<ReasonCost>,
    /// Sorted TTFTs in ms (for the CDF plot; not in JSON).
    #[serde(skip)]
    pub ttft_ms_sorted: Vec<f64>,
    /// Per-engine KV usage at every monitor tick (for the plot; not in JSON).
    #[serde(skip)]
    pub kv_series: Vec<(f64, Vec<f64>)>,
}

/// The numbers compared across runs. Latencies in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Metrics {
    pub completed: u64,
    pub rejected: u64,
    pub unrouted: u64,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    /// Mean of admitted - arrival (on the prefill engine, in a disaggregated fleet).
    pub mean_queue_ms: f64,
    /// Cached over prompt tokens of the completed requests.
    pub cache_hit_rate: f64,
    /// `cache_hit_rate` over the trace's infinite-cache ceiling.
    pub hit_of_ceiling: f64,
    /// `cache_hit_rate` over the trace's pooled-LRU reference (above 1 when the fleet serves more
    /// than one LRU cache of all its KV would).
    pub hit_of_pooled_lru: f64,
    /// Completed requests over the time from the first arrival to the last completion.
    pub completed_per_s: f64,
    /// Mean over monitor ticks of (max - min) KV usage across engines. This and the other KV
    /// figures are over the prefill engines in a disaggregated fleet (`pd` has the decode side's).
    pub kv_spread_mean: f64,
    pub kv_usage_mean: f64,
    pub kv_usage_max: f64,
    /// Mean prefix match rate of the chosen worker and of the best worker (prefix-aware policies).
    pub chosen_match_mean: Option<f64>,
    pub best_match_mean: Option<f64>,
    /// Virtual seconds from the first arrival to the last completion.
    pub makespan_s: f64,
    /// Each engine's share of the prompt tokens computed (prompt minus cache hit), fleet order.
    pub prefill_share_by_engine: Vec<f64>,
    /// Each engine's mean TTFT over the requests it served, fleet order (a regular fleet's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ttft_mean_ms_by_engine: Vec<f64>,
    /// Of the slowest requests (TTFT at or above the run's p99), the share each engine served,
    /// fleet order (a regular fleet's): where the tail lands.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub slowest_share_by_engine: Vec<f64>,
    /// The policy's predicted time to first token term by term, mean over its decisions in ms
    /// (`PredictedTtft::TERMS` order; kv_aware's: empty for a policy that predicts none), as the
    /// gateway's `kvgate_predicted_ttft_seconds` sum over count.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub predicted_mean_ms: Vec<(String, f64)>,
    /// The decode side of a disaggregated fleet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdMetrics>,
    /// Per tenant, when the trace's lines name tenants.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<crate::tenants::TenantMetrics>,
    /// What the sessions took (first turn's arrival to last turn's end), when the trace's lines
    /// name sessions (their later turns then arrive closed loop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sessions: Option<kvgate_trace::SessionFigures>,
}

/// A disaggregated fleet's transfers and decode side. Latencies in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PdMetrics {
    /// Mean time from a prefill's finish to its KV reaching the decode engine.
    pub kv_transfer_mean_ms: f64,
    /// Mean decode-engine queueing: admitted minus KV arrival.
    pub decode_queue_mean_ms: f64,
    /// KV usage of the decode engines, as `kv_usage_mean` / `kv_usage_max` / `kv_spread_mean`.
    pub decode_kv_usage_mean: f64,
    pub decode_kv_usage_max: f64,
    pub decode_kv_spread_mean: f64,
    /// The most uncached prompt tokens a decode engine ever reported waiting (0: decode engines
    /// never prefilled).
    pub decode_uncached_tokens_max: u64,
    /// Share of the finished requests prefilled in place on their decode engine
    /// (`pd_conditional`; 0 when every request went through a pair).
    pub in_place_share: f64,
    /// Share of the prompt tokens computed that the decode engines computed (in place).
    pub decode_prefill_share: f64,
    /// The predicted rule's means over its decisions (kv_aware on both sides; 0 otherwise),
    /// ms: the time to first token in place and through the pair, each path's cost to the
    /// other requests, and the pair's transfer.
    pub predicted_in_place_ms: f64,
    pub predicted_in_place_others_ms: f64,
    pub predicted_pair_ms: f64,
    pub predicted_pair_others_ms: f64,
    pub predicted_transfer_ms: f64,
}

/// Mean (max - min) usage across the engines `engines` of each tick, mean usage, max usage.
fn kv_summary(ticks: &[KvTick], engines: std::ops::Range<usize>) -> (f64, f64, f64) {
    let mut spread_sum = 0.0;
    let mut usage_sum = 0.0;
    let mut usage_max: f64 = 0.0;
    let mut samples = 0usize;
    for tick in ticks {
        let usage = &tick.token_usage[engines.clone()];
        let lo = usage.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = usage.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if hi.is_finite() {
            spread_sum += hi - lo;
            usage_max = usage_max.max(hi);
        }
        usage_sum += usage.iter().sum::<f64>();
        samples += usage.len();
    }
    (ratio(spread_sum, ticks.len() as f64), ratio(usage_sum, samples as f64), usage_max)
}

/// A metric that runs are compared on, and which way is better.
#[derive(Clone, Copy, Debug)]
pub struct MetricDef {
    pub name: &'static str,
    pub higher_is_better: bool,
    pub get: fn(&Metrics) -> f64,
}

/// The metrics a sweep picks the best setting for.
pub const SWEEP_METRICS: [MetricDef; 10] = [
    MetricDef { name: "ttft_mean_ms", higher_is_better: false, get: |m| m.ttft_mean_ms },
    MetricDef { name: "ttft_p50_ms", higher_is_better: false, get: |m| m.ttft_p50_ms },
    MetricDef { name: "ttft_p90_ms", higher_is_better: false, get: |m| m.ttft_p90_ms },
    MetricDef { name: "ttft_p99_ms", higher_is_better: false, get: |m| m.ttft_p99_ms },
    MetricDef { name: "e2e_p50_ms", higher_is_better: false, get: |m| m.e2e_p50_ms },
    MetricDef { name: "e2e_p99_ms", higher_is_better: false, get: |m| m.e2e_p99_ms },
    MetricDef { name: "mean_queue_ms", higher_is_better: false, get: |m| m.mean_queue_ms },
    MetricDef { name: "cache_hit_rate", higher_is_better: true, get: |m| m.cache_hit_rate },
    MetricDef { name: "completed_per_s", higher_is_better: true, get: |m| m.completed_per_s },
    MetricDef { name: "kv_spread_mean", higher_is_better: false, get: |m| m.kv_spread_mean },
];

/// The best grid point of one `--policies` entry for one metric.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BestSetting {
    pub entry: String,
    pub metric: &'static str,
    pub value: f64,
    pub sweep_point: Vec<(String, String)>,
    pub label: String,
}

fn sorted_ms(values: impl Iterator<Item = u64>) -> Vec<f64> {
    let mut values: Vec<u64> = values.collect();
    values.sort_unstable();
    values.into_iter().map(|us| us as f64 / 1000.0).collect()
}

fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 {
        numerator / denominator
    } else {
        0.0
    }
}

impl Metrics {
    /// Summarises a simulation; `ceiling` and `pooled_lru` are the trace's infinite-cache and
    /// pooled-LRU hit rates.
    pub fn from_outcome(outcome: &SimOutcome, ceiling: f64, pooled_lru: f64) -> (Metrics, Vec<f64>) {
        let finished = &outcome.finished;
        let ttft = sorted_ms(finished.iter().map(|s| s.ttft_us()));
        let e2e = sorted_ms(finished.iter().map(|s| s.latency_us()));
        let queue_sum: u64 = finished.iter().map(|s| s.admitted_us.saturating_sub(s.arrival_us)).sum();
        let prompt: u64 = finished.iter().map(|s| u64::from(s.prompt_tokens)).sum();
        let cached: u64 = finished.iter().map(|s| u64::from(s.cached_tokens)).sum();
        let last_finish = finished.iter().map(|s| s.finished_us).max().unwrap_or(outcome.first_arrival_us);
        let makespan_s = last_finish.saturating_sub(outcome.first_arrival_us) as f64 / 1e6;
        let ticks = &outcome.kv_ticks;
        let n_engines = ticks.first().map_or(0, |tick| tick.token_usage.len());
        let prompt_engines = outcome.pd.as_ref().map_or(n_engines, |pd| pd.prefill_engines.min(n_engines));
        let (kv_spread_mean, kv_usage_mean, kv_usage_max) = kv_summary(ticks, 0..prompt_engines);
        let pd = outcome.pd.as_ref().map(|pd| {
            let mean_ms = |sum_s: f64| ratio(sum_s * 1000.0, pd.predicted.decisions as f64);
            let (decode_kv_spread_mean, decode_kv_usage_mean, decode_kv_usage_max) =
                kv_summary(ticks, prompt_engines..n_engines);
            PdMetrics {
                kv_transfer_mean_ms: ratio(pd.transfer_us_sum as f64 / 1000.0, pd.transfers as f64),
                decode_queue_mean_ms: ratio(pd.decode_queue_us_sum as f64 / 1000.0, pd.decoded as f64),
                decode_kv_usage_mean,
                decode_kv_usage_max,
                decode_kv_spread_mean,
                decode_uncached_tokens_max: pd.decode_uncached_tokens_max,
                in_place_share: ratio(pd.in_place as f64, (pd.in_place + pd.pairs) as f64),
                predicted_in_place_ms: mean_ms(pd.predicted.in_place_s),
                predicted_in_place_others_ms: mean_ms(pd.predicted.in_place_others_s),
                predicted_pair_ms: mean_ms(pd.predicted.pair_s),
                predicted_pair_others_ms: mean_ms(pd.predicted.pair_others_s),
                predicted_transfer_ms: mean_ms(pd.predicted.transfer_s),
                decode_prefill_share: {
                    let computed = &outcome.prefill_tokens_by_engine;
                    let on_decode: u64 = computed.iter().skip(pd.prefill_engines).sum();
                    ratio(on_decode as f64, computed.iter().sum::<u64>() as f64)
                },
            }
        });
        let cache_hit_rate = ratio(cached as f64, prompt as f64);
        let ttft_p99_ms = percentile(&ttft, 99.0);
        let (ttft_mean_ms_by_engine, slowest_share_by_engine) = by_engine(
            finished,
            &outcome.finished_engines,
            outcome.prefill_tokens_by_engine.len(),
            ttft_p99_ms,
        );
        let n_match = outcome.match_decisions as f64;
        let metrics = Metrics {
            completed: finished.len() as u64,
            rejected: outcome.rejected,
            unrouted: outcome.unrouted,
            ttft_mean_ms: ratio(ttft.iter().sum::<f64>(), ttft.len() as f64),
            ttft_p50_ms: percentile(&ttft, 50.0),
            ttft_p90_ms: percentile(&ttft, 90.0),
            ttft_p99_ms,
            e2e_p50_ms: percentile(&e2e, 50.0),
            e2e_p99_ms: percentile(&e2e, 99.0),
            mean_queue_ms: ratio(queue_sum as f64 / 1000.0, finished.len() as f64),
            cache_hit_rate,
            hit_of_ceiling: ratio(cache_hit_rate, ceiling),
            hit_of_pooled_lru: ratio(cache_hit_rate, pooled_lru),
            completed_per_s: ratio(finished.len() as f64, makespan_s),
            kv_spread_mean,
            kv_usage_mean,
            kv_usage_max,
            chosen_match_mean: (n_match > 0.0).then(|| outcome.chosen_match_sum / n_match),
            best_match_mean: (n_match > 0.0).then(|| outcome.best_match_sum / n_match),
            makespan_s,
            prefill_share_by_engine: {
                let total: u64 = outcome.prefill_tokens_by_engine.iter().sum();
                outcome.prefill_tokens_by_engine.iter().map(|&t| ratio(t as f64, total as f64)).collect()
            },
            ttft_mean_ms_by_engine,
            slowest_share_by_engine,
            predicted_mean_ms: predicted_means(outcome),
            pd,
            tenants: Vec::new(),
            sessions: outcome.sessions.clone(),
        };
        (metrics, ttft)
    }
}

/// The predicted terms' means over the decisions that predicted them, ms (none without any).
fn predicted_means(outcome: &SimOutcome) -> Vec<(String, f64)> {
    let decisions = outcome.predicted_decisions as f64;
    if decisions == 0.0 {
        return Vec::new();
    }
    let terms = kvgate_policy::PredictedTtft::TERMS.iter().zip(outcome.predicted_sums);
    terms.map(|(term, sum_s)| (term.to_string(), sum_s * 1000.0 / decisions)).collect()
}

/// The finished requests one decision reason placed, and what they cost. Latencies in ms.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReasonCost {
    pub reason: String,
    pub requests: u64,
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
    /// Cached over prompt tokens of these requests.
    pub cache_hit_rate: f64,
}

/// TTFT and hit rate of the finished requests by the reason of their decision, in `Reason::ALL`
/// order (empty when the outcome has no reasons: an outside policy's run).
pub fn ttft_by_reason(outcome: &SimOutcome) -> Vec<ReasonCost> {
    let mut ttfts: Vec<Vec<f64>> = vec![Vec::new(); Reason::ALL.len()];
    let mut tokens = vec![(0u64, 0u64); Reason::ALL.len()];
    for (stats, &request) in outcome.finished.iter().zip(&outcome.finished_requests) {
        let Some(&reason) = outcome.reason_by_request.get(request) else { continue };
        let reason = usize::from(reason).min(Reason::ALL.len() - 1);
        ttfts[reason].push(stats.ttft_us() as f64 / 1e3);
        tokens[reason].0 += u64::from(stats.cached_tokens);
        tokens[reason].1 += u64::from(stats.prompt_tokens);
    }
    Reason::ALL
        .iter()
        .zip(ttfts)
        .zip(tokens)
        .filter(|((_, ttfts), _)| !ttfts.is_empty())
        .map(|((reason, mut ttfts), (cached, prompt))| {
            ttfts.sort_by(f64::total_cmp);
            ReasonCost {
                reason: reason.as_str().to_string(),
                requests: ttfts.len() as u64,
                ttft_mean_ms: ttfts.iter().sum::<f64>() / ttfts.len() as f64,
                ttft_p99_ms: percentile(&ttfts, 99.0),
                cache_hit_rate: ratio(cached as f64, prompt as f64),
            }
        })
        .collect()
}

/// Per engine: the mean TTFT of the requests it served, and its share of the requests whose
/// TTFT is at least `p99_ms`. Both empty unless every finished request names its engine.
fn by_engine(finished: &[RequestStats], engines: &[usize], n: usize, p99_ms: f64) -> (Vec<f64>, Vec<f64>) {
    if engines.len() != finished.len() || finished.is_empty() || n == 0 {
        return (Vec::new(), Vec::new());
    }
    let (mut sum_ms, mut count, mut slow) = (vec![0.0; n], vec![0u64; n], vec![0u64; n]);
    for (stats, &engine) in finished.iter().zip(engines).filter(|(_, &engine)| engine < n) {
        let ttft_ms = stats.ttft_us() as f64 / 1000.0;
        sum_ms[engine] += ttft_ms;
        count[engine] += 1;
        slow[engine] += u64::from(ttft_ms >= p99_ms);
    }
    let n_slow: u64 = slow.iter().sum();
    let means = sum_ms.iter().zip(&count).map(|(&sum, &count)| ratio(sum, count as f64)).collect();
    (means, slow.iter().map(|&s| ratio(s as f64, n_slow as f64)).collect())
}

/// Decision counts by reason name, in `Reason::ALL` order, then by the prefix index consulted
/// (`prefix_index=exact`), leaving out zeros.
pub fn decision_counts(outcome: &SimOutcome) -> Vec<(String, u64)> {
    let reasons = reason_counts(&outcome.decisions);
    let indexes = IndexKind::ALL
        .iter()
        .zip(outcome.index_decisions)
        .map(|(kind, count)| (format!("prefix_index={}", kind.as_str()), count));
    reasons.chain(indexes).filter(|(_, count)| *count > 0).collect()
}

/// The decode side's decision counts by reason name, leaving out zeros (empty for a regular fleet).
pub fn decode_decision_counts(outcome: &SimOutcome) -> Vec<(String, u64)> {
    let Some(pd) = &outcome.pd else { return Vec::new() };
    reason_counts(&pd.decode_decisions).filter(|(_, count)| *count > 0).collect()
}

fn reason_counts(counts: &[u64]) -> impl Iterator<Item = (String, u64)> + '_ {
    Reason::ALL.iter().zip(counts).map(|(reason, &count)| (reason.as_str().to_string(), count))
}

/// For each `--policies` entry and metric, the first run (in grid order) with the best value.
pub fn best_settings(runs: &[RunReport]) -> Vec<BestSetting> {
    let mut entries: Vec<&str> = Vec::new();
    for run in runs {
        if !entries.contains(&run.entry.as_str()) {
            entries.push(&run.entry);
        }
    }
    let mut best = Vec::new();
    for entry in entries {
        for metric in SWEEP_METRICS {
            let mut chosen: Option<(&RunReport, f64)> = None;
            for run in runs.iter().filter(|run| run.entry == entry) {
                let value = (metric.get)(&run.metrics);
                let better = match chosen {
                    None => true,
                    Some((_, current)) if metric.higher_is_better => value > current,
                    Some((_, current)) => value < current,
                };
                if better {
                    chosen = Some((run, value));
                }
            }
            if let Some((run, value)) = chosen {
                best.push(BestSetting {
                    entry: entry.to_string(),
                    metric: metric.name,
                    value,
                    sweep_point: run.sweep_point.clone(),
                    label: run.label.clone(),
                });
            }
        }
    }
    best
}

impl SimReport {
    /// The report as pretty JSON (same inputs, same bytes).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the report always serializes")
    }
}
