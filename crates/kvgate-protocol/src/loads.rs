//! The engines' load reports, read and written: SGLang's `GET /v1/loads` JSON (several DP ranks
//! averaged for usage, summed for counts) and vLLM's Prometheus text at `GET /metrics`. The
//! gateway reads them into a [`LoadSample`] ([`parse_sglang`], [`parse_vllm`]), the one type of
//! a worker's load from the wire to the policies (`kvgate-policy` re-exports it); the simulated
//! engines write them ([`render_sglang`], [`render_metrics`]).

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::exposition;

/// What an engine's load report says, and when it was fetched: as the gateway reads it, as the
/// load monitor publishes it and as a policy sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadSample {
    /// Fraction of KV capacity held by running and waiting requests, 0..=1.
    pub token_usage: f64,
    pub num_running_reqs: u64,
    pub num_waiting_reqs: u64,
    /// Prompt tokens of the waiting requests not found in the cache (SGLang only).
    pub num_waiting_uncached_tokens: u64,
    /// Generated tokens per second, as the engine reports it (SGLang only; 0 when unknown).
    pub gen_throughput: f64,
    /// KV capacity in tokens (0 when unknown).
    pub max_total_num_tokens: u64,
    /// When the poll that fetched the sample was sent, on the host's millisecond clock: not on
    /// the wire, so 0 as parsed, stamped by the reader (the gateway's load monitor, the
    /// simulator's).
    pub fetched_at_ms: u64,
}

#[derive(Deserialize)]
struct SglangLoads {
    loads: Vec<SglangRank>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct SglangRank {
    dp_rank: Option<u32>,
    num_running_reqs: f64,
    num_waiting_reqs: f64,
    num_waiting_uncached_tokens: f64,
    max_total_num_tokens: f64,
    token_usage: f64,
    gen_throughput: f64,
}

fn count(value: f64) -> u64 {
    if value.is_finite() && value > 0.0 {
        value.round() as u64
    } else {
        0
    }
}

/// Parse SGLang's `/v1/loads`: the engine's load (every rank's), or with `rank` (a worker that
/// is one data-parallel rank, `--dp-aware`) that rank's entry alone.
pub fn parse_sglang(body: &[u8], rank: Option<u32>) -> Result<LoadSample, String> {
    let mut parsed: SglangLoads =
        serde_json::from_slice(body).map_err(|e| format!("invalid /v1/loads JSON: {e}"))?;
    if let Some(rank) = rank {
        parsed.loads.retain(|entry| entry.dp_rank == Some(rank));
        if parsed.loads.is_empty() {
            return Err(format!("/v1/loads has no entry for dp_rank {rank}"));
        }
    }
    if parsed.loads.is_empty() {
        return Err("/v1/loads has no ranks".into());
    }
    let ranks = parsed.loads.len() as f64;
    let sum = |f: fn(&SglangRank) -> f64| parsed.loads.iter().map(f).filter(|v| v.is_finite()).sum::<f64>();
    let usage = sum(|r| r.token_usage) / ranks;
    if !(0.0..=1.5).contains(&usage) {
        return Err(format!("/v1/loads token_usage {usage} is out of range"));
    }
    Ok(LoadSample {
        token_usage: usage.clamp(0.0, 1.0),
        num_running_reqs: count(sum(|r| r.num_running_reqs)),
        num_waiting_reqs: count(sum(|r| r.num_waiting_reqs)),
        num_waiting_uncached_tokens: count(sum(|r| r.num_waiting_uncached_tokens)),
        gen_throughput: sum(|r| r.gen_throughput).max(0.0),
        max_total_num_tokens: count(sum(|r| r.max_total_num_tokens)),
        fetched_at_ms: 0,
    })
}

/// One data-parallel rank's entry of `/v1/loads` as SGLang writes it (`scheduler.py`'s
/// `get_loads`, 0.5.x).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SglangRankLoad {
    pub dp_rank: u32,
    pub num_running_reqs: u64,
    pub num_waiting_reqs: u64,
    pub num_waiting_uncached_tokens: u64,
    pub num_total_reqs: u64,
    pub num_used_tokens: u64,
    pub max_total_num_tokens: u64,
    pub token_usage: f64,
    pub gen_throughput: f64,
    pub cache_hit_rate: f64,
    pub utilization: f64,
    pub max_running_requests: u64,
}

/// SGLang's `/v1/loads` body: the time (RFC 3339) and one entry per rank.
pub fn render_sglang(timestamp: &str, ranks: &[SglangRankLoad]) -> serde_json::Value {
    serde_json::json!({
        "timestamp": timestamp,
        "dp_rank_count": ranks.len(),
        "loads": ranks,
    })
}

/// Parse vLLM's Prometheus text ([`crate::exposition`]). Unknown series, comments and lines that
/// do not parse are passed over; several series of one metric (e.g. per engine) are averaged for
/// usage and summed for counts. The KV capacity comes from `vllm:cache_config_info`
/// (`num_gpu_blocks` x `block_size`).
pub fn parse_vllm(text: &str) -> Result<LoadSample, String> {
    let (mut usage_sum, mut usage_n) = (0.0, 0u32);
    let (mut running, mut waiting) = (0.0, 0.0);
    let mut capacity = 0u64;
    for sample in exposition::samples(text) {
        if sample.name == "vllm:cache_config_info" {
            let number = |key: &str| sample.label(key).and_then(|v| v.parse::<u64>().ok());
            if let (Some(blocks), Some(block_size)) = (number("num_gpu_blocks"), number("block_size")) {
                capacity += blocks.saturating_mul(block_size);
            }
            continue;
        }
        let value = sample.value;
        if !value.is_finite() {
            continue;
        }
        match sample.name {
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                usage_sum += value;
                usage_n += 1;
            }
            "vllm:num_requests_running" => running += value,
            "vllm:num_requests_waiting" => waiting += value,
            _ => {}
        }
    }
    if usage_n == 0 {
        return Err("no vllm:kv_cache_usage_perc in /metrics".into());
    }
    Ok(LoadSample {
        token_usage: (usage_sum / usage_n as f64).clamp(0.0, 1.0),
        num_running_reqs: count(running),
        num_waiting_reqs: count(waiting),
        max_total_num_tokens: capacity,
        ..LoadSample::default()
    })
}

/// What an engine's `/metrics` shows: its load under vLLM's names (and SGLang's gauges).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineMetrics {
    pub num_running_reqs: u64,
    pub num_waiting_reqs: u64,
    pub token_usage: f64,
    pub gen_throughput: f64,
    pub total_prompt_tokens: u64,
    pub total_cached_tokens: u64,
    pub total_generated_tokens: u64,
    /// vLLM's `cache_config_info`: the KV block size and the GPU blocks (the capacity is their
    /// product), when the engine has a cache.
    pub cache: Option<CacheConfig>,
}

/// vLLM's `cache_config_info` labels the gateway reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheConfig {
    pub block_size: u64,
    pub num_gpu_blocks: u64,
}

/// The Prometheus exposition of `metrics` for `model`, as vLLM's `/metrics` names it (with
/// HELP and TYPE lines); what [`parse_vllm`] reads back.
pub fn render_metrics(model: &str, metrics: &EngineMetrics) -> String {
    let label = format!("{{model_name=\"{}\"}}", escape_label(model));
    let families: [(&str, &str, &str, f64); 11] = [
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            metrics.num_running_reqs as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            metrics.num_waiting_reqs as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            metrics.token_usage,
        ),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            metrics.total_prompt_tokens as f64,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            metrics.total_cached_tokens as f64,
        ),
        (
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            metrics.total_prompt_tokens as f64,
        ),
        (
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            metrics.total_generated_tokens as f64,
        ),
        (
            "sglang:num_running_reqs",
            "gauge",
            "The number of running requests.",
            metrics.num_running_reqs as f64,
        ),
        (
            "sglang:num_queue_reqs",
            "gauge",
            "The number of requests in the waiting queue.",
            metrics.num_waiting_reqs as f64,
        ),
        ("sglang:token_usage", "gauge", "The token usage.", metrics.token_usage),
        ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", metrics.gen_throughput),
    ];
    let mut out = String::with_capacity(2048);
    for (name, kind, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name}{label} {value}");
    }
    if let Some(CacheConfig { block_size, num_gpu_blocks }) = metrics.cache {
        let _ = writeln!(out, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig");
        let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{block_size}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_cpu_blocks=\"0\",num_gpu_blocks=\"{num_gpu_blocks}\"}} 1.0"
        );
    }
    out
}

fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_ranks_are_averaged_and_summed() {
        let body = br#"{"timestamp":"x","dp_rank_count":2,"loads":[
            {"dp_rank":0,"num_running_reqs":3,"num_waiting_reqs":1,"num_waiting_uncached_tokens":100,
             "num_used_tokens":10,"max_total_num_tokens":1000,"token_usage":0.2,"gen_throughput":50.0,
             "cache_hit_rate":0.5,"utilization":0.1,"max_running_requests":256,"num_total_reqs":4},
            {"dp_rank":1,"num_running_reqs":5,"num_waiting_reqs":0,"num_waiting_uncached_tokens":20,
             "max_total_num_tokens":1000,"token_usage":0.6,"gen_throughput":70.0}]}"#;
        let load = parse_sglang(body, None).unwrap();
        assert!((load.token_usage - 0.4).abs() < 1e-9);
        assert_eq!((load.num_running_reqs, load.num_waiting_reqs), (8, 1));
        assert_eq!((load.num_waiting_uncached_tokens, load.max_total_num_tokens), (120, 2000));
        assert_eq!(load.gen_throughput, 120.0);
        // One rank as a worker of its own (--dp-aware): its entry alone.
        let rank = parse_sglang(body, Some(1)).unwrap();
        assert!((rank.token_usage - 0.6).abs() < 1e-9);
        assert_eq!((rank.num_running_reqs, rank.max_total_num_tokens), (5, 1000));
        assert!(parse_sglang(body, Some(2)).unwrap_err().contains("dp_rank 2"));
    }

    #[test]
    fn malformed_sglang_is_an_error_not_a_panic() {
        for body in [
            &b"{"[..],
            b"[]",
            br#"{"loads":[]}"#,
            br#"{"loads":[{"token_usage":"x"}]}"#,
            br#"{"loads":[{"token_usage":7}]}"#,
        ] {
            assert!(parse_sglang(body, None).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn vllm_text_with_labels_comments_and_timestamps() {
        let text = "# HELP vllm:kv_cache_usage_perc KV usage\n# TYPE vllm:kv_cache_usage_perc gauge\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m{1}\"} 0.25 1700000000000\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.75\n\
            vllm:num_requests_running{engine=\"0\"} 4\nvllm:num_requests_running{engine=\"1\"} 2\n\
            vllm:num_requests_waiting 3\nsomething_else{a=\"b\"} 9\ngarbage line here\nvllm:num_requests_waiting{x=\"y\"} NaN\n";
        let load = parse_vllm(text).unwrap();
        assert_eq!(load.token_usage, 0.5);
        assert_eq!((load.num_running_reqs, load.num_waiting_reqs), (6, 3));
    }

    #[test]
    fn vllm_kv_capacity_comes_from_cache_config_info() {
        let text = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_cpu_blocks=\"99\",num_gpu_blocks=\"2048\",xnum_gpu_blocks=\"1\"} 1.0\n";
        assert_eq!(parse_vllm(text).unwrap().max_total_num_tokens, 32_768);
        let no_blocks = "vllm:kv_cache_usage_perc 0.5\nvllm:cache_config_info{block_size=\"16\"} 1.0\n";
        assert_eq!(parse_vllm(no_blocks).unwrap().max_total_num_tokens, 0, "unknown capacity stays 0");
    }

    #[test]
    fn what_the_engines_write_reads_back() {
        let rank = |dp_rank, running, usage| SglangRankLoad {
            dp_rank,
            num_running_reqs: running,
            num_waiting_reqs: 1,
            max_total_num_tokens: 1000,
            token_usage: usage,
            ..SglangRankLoad::default()
        };
        let body = render_sglang("2025-01-02T03:04:05.000006Z", &[rank(0, 2, 0.25), rank(1, 4, 0.75)]);
        let read = parse_sglang(body.to_string().as_bytes(), None).unwrap();
        assert_eq!((read.num_running_reqs, read.num_waiting_reqs, read.max_total_num_tokens), (6, 2, 2000));
        assert_eq!(read.token_usage, 0.5);
        let metrics = EngineMetrics {
            num_running_reqs: 3,
            num_waiting_reqs: 2,
            token_usage: 0.5,
            cache: Some(CacheConfig { block_size: 16, num_gpu_blocks: 64 }),
            ..EngineMetrics::default()
        };
        let text = render_metrics("m\"x", &metrics);
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter"));
        assert!(text.contains("vllm:num_requests_running{model_name=\"m\\\"x\"} 3\n"));
        let read = parse_vllm(&text).unwrap();
        assert_eq!((read.num_running_reqs, read.num_waiting_reqs, read.max_total_num_tokens), (3, 2, 1024));
        assert_eq!(read.token_usage, 0.5);
    }

    #[test]
    fn vllm_without_usage_is_an_error() {
        assert!(parse_vllm("vllm:num_requests_running 1\n").is_err());
        assert!(parse_vllm("").is_err());
        assert!(parse_vllm("\u{0}\u{1}{{{ }}} 1 2 3").is_err());
    }
}
