//! SGLang's native endpoints: `/generate` (text or input_ids, `sampling_params`) and the `/v1/loads` load report.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use kvgate_engine::{tokenize, EngineLoad};
use kvgate_protocol::loads::{render_sglang, SglangRankLoad};
use kvgate_protocol::usage::meta_info_usage;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api_error::{parse_json, ApiError};
use crate::driver::unix_now_secs;
use crate::generation::{respond, GenerationParams, Outcome, ResponseFormat};
use crate::state::AppState;
use kvgate_protocol::sse::{data_event, DONE};

#[derive(Deserialize)]
struct GenerateRequest {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    input_ids: Option<Vec<u32>>,
    #[serde(default)]
    sampling_params: SamplingParams,
    #[serde(default)]
    stream: bool,
    /// SGLang names a request's adapter by `lora_path`.
    #[serde(default)]
    lora_path: Option<String>,
    /// The data-parallel rank to run on (SGLang's `GenerateReqInput.data_parallel_rank`).
    #[serde(default)]
    data_parallel_rank: Option<u32>,
    /// SGLang's `priority` (`GenerateReqInput.priority`): higher first, SGLang's default
    /// (`schedule_low_priority_values_first` off), honoured with `--priority-scheduling`.
    #[serde(default)]
    priority: Option<i32>,
}

#[derive(Deserialize, Default)]
struct SamplingParams {
    #[serde(default)]
    max_new_tokens: Option<u32>,
    #[serde(default)]
    ignore_eos: bool,
}

/// `POST /generate`.
pub(crate) async fn generate(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let (pd, cut) = match state.admit(&body).await {
        Ok(admitted) => admitted,
        Err(response) => return response,
    };
    let request: GenerateRequest = match parse_json(&body) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    let prompt = match (request.input_ids, request.text) {
        (Some(ids), _) => ids,
        (None, Some(text)) => tokenize(&text),
        (None, None) => {
            return ApiError::bad_request("either `text` or `input_ids` is required").into_response()
        }
    };
    let params = GenerationParams {
        prompt,
        max_tokens: request.sampling_params.max_new_tokens,
        ignore_eos: request.sampling_params.ignore_eos,
        stream: request.stream,
        pd,
        lora: state.lora(request.lora_path.as_deref()),
        dp_rank: request.data_parallel_rank,
        // The engine model serves lower values first (vLLM's convention).
        priority: request.priority.unwrap_or(0).saturating_neg(),
        continuation: None,
    };
    let format = GenerateFormat {
        id: state.response_id("gen"),
        prompt_tokens: params.prompt.len(),
        text: String::new(),
    };
    respond(&state, params, format, cut).await
}

/// SGLang `/generate` bodies; streamed chunks carry the cumulative text.
struct GenerateFormat {
    id: String,
    prompt_tokens: usize,
    text: String,
}

fn finish_reason(outcome: &Outcome) -> Value {
    if outcome.finish_reason == "length" {
        json!({"type": "length", "length": outcome.completion_tokens})
    } else {
        json!({"type": "stop", "matched": null})
    }
}

impl GenerateFormat {
    /// The closing object: the text so far, `meta_info`, and vLLM's `kv_transfer_params` on
    /// a prefill engine.
    fn closing(&self, text: &str, outcome: &Outcome) -> Value {
        let mut body = json!({"text": text, "meta_info": self.final_meta(outcome)});
        if let Some(params) = &outcome.kv_transfer_params {
            body["kv_transfer_params"] = params.clone();
        }
        body
    }

    fn final_meta(&self, outcome: &Outcome) -> Value {
        let mut meta = serde_json::Map::new();
        meta.insert("id".into(), json!(self.id));
        meta_info_usage(outcome.written_usage(), &mut meta);
        meta.insert("finish_reason".into(), finish_reason(outcome));
        meta.insert("e2e_latency".into(), json!(outcome.stats.latency_us() as f64 / 1e6));
        Value::Object(meta)
    }
}

impl ResponseFormat for GenerateFormat {
    fn token_chunk(&mut self, index: u32, piece: &str, out: &mut Vec<u8>) {
        self.text.push_str(piece);
        let chunk = json!({
            "text": self.text,
            "meta_info": {
                "id": self.id,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": index + 1,
                "finish_reason": null,
            },
        });
        data_event(&chunk, out);
    }

    fn final_chunks(&mut self, outcome: &Outcome, out: &mut Vec<u8>) {
        data_event(&self.closing(&self.text, outcome), out);
        out.extend_from_slice(DONE);
    }

    fn full_body(&mut self, text: &str, outcome: &Outcome) -> Vec<u8> {
        let body = self.closing(text, outcome);
        serde_json::to_vec(&body).expect("a JSON value always serializes")
    }
}

/// `GET /v1/loads`: SGLang's load report, one entry per data-parallel rank.
pub(crate) async fn loads(State(state): State<Arc<AppState>>) -> Json<Value> {
    let loads: Vec<EngineLoad> = state.ranks.iter().map(|engine| engine.load()).collect();
    Json(loads_body(&loads, unix_now_secs()))
}

/// `GET /server_info` (and the older `/get_server_info`): the part of SGLang's server arguments
/// a gateway reads (`dp_size` for SMG's and kvgate's `--dp-aware`), plus each rank's requests
/// so far (`kvgate_mock_rank_requests`, the mock's own).
pub(crate) async fn server_info(State(state): State<Arc<AppState>>) -> Json<Value> {
    let taken: Vec<u64> =
        state.rank_requests.iter().map(|count| count.load(std::sync::atomic::Ordering::Relaxed)).collect();
    Json(json!({
        "model_path": state.model,
        "served_model_name": state.model,
        "tp_size": 1,
        "dp_size": state.ranks.len().max(1),
        "load_balance_method": "round_robin",
        "kvgate_mock_rank_requests": taken,
    }))
}

pub(crate) fn loads_body(loads: &[EngineLoad], unix_secs: f64) -> Value {
    let mut ranks: Vec<SglangRankLoad> =
        loads.iter().enumerate().map(|(rank, load)| rank_load(rank, load)).collect();
    if ranks.is_empty() {
        ranks.push(SglangRankLoad::default());
    }
    render_sglang(&rfc3339(unix_secs), &ranks)
}

/// One rank's entry of `/v1/loads`.
fn rank_load(rank: usize, load: &EngineLoad) -> SglangRankLoad {
    let utilization = if load.max_running_requests == 0 {
        0.0
    } else {
        load.num_running_reqs as f64 / load.max_running_requests as f64
    };
    SglangRankLoad {
        dp_rank: rank as u32,
        num_running_reqs: load.num_running_reqs,
        num_waiting_reqs: load.num_waiting_reqs,
        num_waiting_uncached_tokens: load.num_waiting_uncached_tokens,
        num_total_reqs: load.num_running_reqs + load.num_waiting_reqs,
        num_used_tokens: load.num_used_tokens,
        max_total_num_tokens: load.max_total_num_tokens,
        token_usage: load.token_usage,
        gen_throughput: load.gen_throughput,
        cache_hit_rate: load.cache_hit_rate,
        utilization,
        max_running_requests: load.max_running_requests,
    }
}

/// Formats Unix seconds as RFC 3339 UTC with microseconds, e.g. `2025-01-02T03:04:05.000006Z`.
pub(crate) fn rfc3339(unix_secs: f64) -> String {
    let micros_total = (unix_secs.max(0.0) * 1e6) as u64;
    let secs = micros_total / 1_000_000;
    let micros = micros_total % 1_000_000;
    let (days, secs_of_day) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        secs_of_day / 3600,
        secs_of_day / 60 % 60,
        secs_of_day % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(0.0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(rfc3339(951_782_400.5), "2000-02-29T00:00:00.500000Z");
        assert_eq!(rfc3339(1_735_787_045.0), "2025-01-02T03:04:05.000000Z");
    }
}
