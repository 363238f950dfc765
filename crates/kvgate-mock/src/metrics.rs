//! `GET /metrics`: the engine's load in Prometheus text format under vLLM's metric names (and SGLang's gauges), written by `kvgate_protocol::loads`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use kvgate_engine::EngineLoad;
use kvgate_protocol::loads::{render_metrics, CacheConfig, EngineMetrics};

use crate::state::AppState;

pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let load = state.engine.as_ref().map(|engine| (engine.load(), engine.block_size()));
    let body = render(&state.model, load.as_ref().map(|(load, block_size)| (load, *block_size)));
    ([(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"))], body)
        .into_response()
}

/// The Prometheus exposition of `load` and the engine's KV block size (all zeros for a canned
/// engine), with vLLM's `cache_config_info` (KV capacity as blocks x block size).
pub(crate) fn render(model: &str, engine: Option<(&EngineLoad, u32)>) -> String {
    let metrics = match engine {
        None => EngineMetrics::default(),
        Some((load, block_size)) => EngineMetrics {
            num_running_reqs: load.num_running_reqs,
            num_waiting_reqs: load.num_waiting_reqs,
            token_usage: load.token_usage,
            gen_throughput: load.gen_throughput,
            total_prompt_tokens: load.total_prompt_tokens,
            total_cached_tokens: load.total_cached_tokens,
            total_generated_tokens: load.total_generated_tokens,
            cache: Some(CacheConfig {
                block_size: u64::from(block_size),
                num_gpu_blocks: load.max_total_num_tokens / u64::from(block_size.max(1)),
            }),
        },
    };
    render_metrics(model, &metrics)
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
