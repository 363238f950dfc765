//! `GET /metrics`: the engine's load in Prometheus text format under vLLM's metric names (and SGLang's gauges).

use std::fmt::Write;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use kvgate_engine::EngineLoad;

use crate::server::AppState;

pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let load = state.engine.as_ref().map(|engine| (engine.load(), engine.block_size()));
    let body = render(&state.model, load.as_ref().map(|(load, block_size)| (load, *block_size)));
    ([(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"))], body)
        .into_response()
}

/// The Prometheus exposition of `load` and the engine's KV block size (all zeros for a canned
/// engine), with vLLM's `cache_config_info` (KV capacity as blocks x block size).
pub(crate) fn render(model: &str, engine: Option<(&EngineLoad, u32)>) -> String {
    let load = engine.map(|(load, _)| load);
    let value = |pick: fn(&EngineLoad) -> f64| load.map_or(0.0, pick);
    let label = format!("{{model_name=\"{}\"}}", escape_label(model));
    let families: [(&str, &str, &str, f64); 11] = [
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            value(|l| l.num_running_reqs as f64),
        ),
        (
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            value(|l| l.num_waiting_reqs as f64),
        ),
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            value(|l| l.token_usage),
        ),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            value(|l| l.total_prompt_tokens as f64),
        ),
        (
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            value(|l| l.total_cached_tokens as f64),
        ),
        (
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            value(|l| l.total_prompt_tokens as f64),
        ),
        (
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            value(|l| l.total_generated_tokens as f64),
        ),
        (
            "sglang:num_running_reqs",
            "gauge",
            "The number of running requests.",
            value(|l| l.num_running_reqs as f64),
        ),
        (
            "sglang:num_queue_reqs",
            "gauge",
            "The number of requests in the waiting queue.",
            value(|l| l.num_waiting_reqs as f64),
        ),
        ("sglang:token_usage", "gauge", "The token usage.", value(|l| l.token_usage)),
        (
            "sglang:gen_throughput",
            "gauge",
            "The generation throughput (token/s).",
            value(|l| l.gen_throughput),
        ),
    ];
    let mut out = String::with_capacity(2048);
    for (name, kind, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name}{label} {value}");
    }
    if let Some((load, block_size)) = engine {
        let blocks = load.max_total_num_tokens / u64::from(block_size.max(1));
        let _ = writeln!(out, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig");
        let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{block_size}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_cpu_blocks=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0"
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
    fn canned_metrics_are_zero_with_help_and_type() {
        let text = render("m\"x", None);
        assert!(text.contains("# HELP vllm:kv_cache_usage_perc "));
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter"));
        assert!(text.contains("vllm:num_requests_running{model_name=\"m\\\"x\"} 0\n"));
    }
}
