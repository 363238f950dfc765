//! Parsing engine load reports into a `LoadSample`: SGLang's `GET /v1/loads` JSON (several DP
//! ranks averaged for usage, summed for counts) and vLLM's Prometheus text at `GET /metrics`.

use kvgate_policy::LoadSample;
use serde::Deserialize;

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
/// is one data-parallel rank, `--dp-aware`) that rank's entry alone; `fetched_at_ms` is left 0
/// for the caller to set.
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

/// The value of label `name` in a Prometheus label set `a="x",b="y"` (no escapes in numbers).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = labels;
    while let Some(at) = rest.find(name) {
        let before = rest[..at].chars().next_back();
        let after = &rest[at + name.len()..];
        if matches!(before, None | Some(',') | Some(' ')) {
            if let Some(value) = after.strip_prefix("=\"") {
                return value.split('"').next();
            }
        }
        rest = after;
    }
    None
}

/// Parse vLLM's Prometheus text. Unknown lines, comments, labels and timestamps are tolerated;
/// several series of one metric (e.g. per engine) are averaged for usage and summed for counts.
/// The KV capacity comes from `vllm:cache_config_info` (`num_gpu_blocks` x `block_size`).
pub fn parse_vllm(text: &str) -> Result<LoadSample, String> {
    let (mut usage_sum, mut usage_n) = (0.0, 0u32);
    let (mut running, mut waiting) = (0.0, 0.0);
    let mut capacity = 0u64;
    let mut seen_any = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => continue,
        };
        let (labels, after_labels) = match rest.strip_prefix('{') {
            Some(labels) => match labels.rfind('}') {
                Some(end) => (&labels[..end], &labels[end + 1..]),
                None => continue,
            },
            None => ("", rest),
        };
        if name == "vllm:cache_config_info" {
            let number = |key: &str| label(labels, key).and_then(|v| v.parse::<u64>().ok());
            if let (Some(blocks), Some(block_size)) = (number("num_gpu_blocks"), number("block_size")) {
                capacity += blocks.saturating_mul(block_size);
            }
            continue;
        }
        let Some(value) = after_labels.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        match name {
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                usage_sum += value;
                usage_n += 1;
                seen_any = true;
            }
            "vllm:num_requests_running" => {
                running += value;
                seen_any = true;
            }
            "vllm:num_requests_waiting" => {
                waiting += value;
                seen_any = true;
            }
            _ => {}
        }
    }
    if !seen_any || usage_n == 0 {
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
        assert_eq!(label("a=\"1\",ba=\"2\"", "a"), Some("1"));
        assert_eq!(label("ba=\"2\", a=\"3\"", "a"), Some("3"));
        assert_eq!(label("ba=\"2\"", "a"), None);
    }

    #[test]
    fn vllm_without_usage_is_an_error() {
        assert!(parse_vllm("vllm:num_requests_running 1\n").is_err());
        assert!(parse_vllm("").is_err());
        assert!(parse_vllm("\u{0}\u{1}{{{ }}} 1 2 3").is_err());
    }
}
