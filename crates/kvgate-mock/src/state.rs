//! One worker's shared state, as its handlers see it: the answering options, the engine ranks, the PD context, the canned bodies, the soak id counts, and the fault flags applied to each generation request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use kvgate_engine::{splitmix64, LoraAdapter};
use tokio::time::Instant;

use crate::api_error::ApiError;
use crate::args::MockArgs;
use crate::canned_bodies::CannedBodies;
use crate::driver::EngineHandle;
use crate::pd::{PdContext, PdPlan};
use crate::soak_ids::WorkerSoakIds;

/// Per-worker answering options taken from `MockArgs`.
#[derive(Clone, Debug)]
pub(crate) struct ServeOptions {
    pub(crate) force_max_tokens: bool,
    pub(crate) default_max_tokens: u32,
    pub(crate) gen_ms: u64,
    pub(crate) fail_rate: f64,
    pub(crate) cut_stream_rate: f64,
    pub(crate) cut_after_tokens: Option<u32>,
    pub(crate) extra_latency_ms: u64,
    pub(crate) unhealthy_after: Option<Duration>,
    pub(crate) seed: u64,
    /// LoRA adapters served besides the base model, as vLLM serves `--lora-modules`.
    pub(crate) lora_adapters: Vec<LoraAdapter>,
}

impl ServeOptions {
    pub(crate) fn from_args(args: &MockArgs, worker_idx: usize) -> Self {
        Self {
            force_max_tokens: args.force_max_tokens,
            default_max_tokens: args.default_max_tokens,
            gen_ms: args.gen_ms,
            fail_rate: args.fail_rate,
            cut_stream_rate: args.cut_stream_rate,
            cut_after_tokens: args.cut_after_tokens,
            extra_latency_ms: args.extra_latency_ms,
            unhealthy_after: args.unhealthy_after_secs.map(Duration::from_secs_f64),
            // Ids from 1, in the order given (vLLM numbers its `--lora-modules` the same way).
            lora_adapters: args
                .lora_adapters
                .iter()
                .enumerate()
                .map(|(i, name)| LoraAdapter { id: i as u32 + 1, name: name.clone() })
                .collect(),
            seed: splitmix64(args.seed ^ splitmix64(worker_idx as u64)),
        }
    }
}

/// Everything a worker's handlers share.
pub(crate) struct AppState {
    pub(crate) model: String,
    pub(crate) worker_idx: usize,
    pub(crate) started: Instant,
    /// The engine model (data-parallel rank 0); `None` for the canned engine.
    pub(crate) engine: Option<EngineHandle>,
    /// Every data-parallel rank's engine model, rank 0 first (`--dp-size`; empty when canned).
    pub(crate) ranks: Vec<EngineHandle>,
    /// Generation requests each rank took.
    pub(crate) rank_requests: Vec<AtomicU64>,
    /// The next rank of a request that names none (round robin).
    next_rank: AtomicU64,
    pub(crate) options: ServeOptions,
    pub(crate) pd: PdContext,
    pub(crate) canned: CannedBodies,
    /// Counts of `x-soak-id` values seen on generation requests (`soak_ids.rs`).
    pub(crate) soak_ids: WorkerSoakIds,
    fault_draws: AtomicU64,
    response_ids: AtomicU64,
}

impl AppState {
    /// The adapter a request's `model` names (`None`: the base model, or a name not served).
    pub(crate) fn lora(&self, model: Option<&str>) -> Option<LoraAdapter> {
        let model = model?;
        self.options.lora_adapters.iter().find(|lora| lora.name == model).cloned()
    }

    pub(crate) fn new(
        model: String,
        worker_idx: usize,
        ranks: Vec<EngineHandle>,
        options: ServeOptions,
        pd: PdContext,
    ) -> Self {
        Self {
            canned: CannedBodies::new(&model),
            model,
            worker_idx,
            started: Instant::now(),
            engine: ranks.first().cloned(),
            rank_requests: ranks.iter().map(|_| AtomicU64::new(0)).collect(),
            ranks,
            next_rank: AtomicU64::new(0),
            options,
            pd,
            soak_ids: WorkerSoakIds::default(),
            fault_draws: AtomicU64::new(0),
            response_ids: AtomicU64::new(0),
        }
    }

    /// The engine of the data-parallel rank a request names (`data_parallel_rank`, as SGLang's
    /// `GenerateReqInput` carries it), or the next one in turn when it names none.
    pub(crate) fn rank_engine(&self, rank: Option<u32>) -> Result<&EngineHandle, ApiError> {
        if self.ranks.is_empty() {
            return Err(ApiError::internal("this worker has no engine model"));
        }
        let index = match rank {
            Some(rank) if rank as usize >= self.ranks.len() => {
                return Err(ApiError::bad_request(format!(
                    "data_parallel_rank {rank} is out of range: this engine runs {} data-parallel ranks",
                    self.ranks.len()
                )))
            }
            Some(rank) => rank as usize,
            None => (self.next_rank.fetch_add(1, Ordering::Relaxed) % self.ranks.len() as u64) as usize,
        };
        self.rank_requests[index].fetch_add(1, Ordering::Relaxed);
        Ok(&self.ranks[index])
    }

    /// A fresh response id such as `chatcmpl-0-17`.
    pub(crate) fn response_id(&self, prefix: &str) -> String {
        let n = self.response_ids.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{}-{n}", self.worker_idx)
    }

    /// The start of a generation request on the model engine: its PD plan (a prefill engine
    /// opens the request's room now), then the fault flags. An injected 500 fails the room at
    /// once, so the decode engine waiting on it answers 502 without waiting a hold timeout.
    pub(crate) async fn admit(&self, body: &[u8]) -> Result<(PdPlan, bool), Response> {
        let plan = self.pd.plan(body);
        let cut = match self.inject_faults().await {
            Ok(cut) => cut,
            Err(response) => {
                if let Ok(PdPlan::Prefill { ticket, .. }) = plan {
                    ticket.fail("the prefill engine answered HTTP 500 (injected, --fail-rate)".into());
                }
                return Err(response);
            }
        };
        let plan = plan.map_err(IntoResponse::into_response)?;
        Ok((plan, cut))
    }

    /// Applies the fault flags to one generation request: the extra latency, then an injected
    /// 500 (`Err`), or whether to cut the response's connection mid-body (`Ok(true)`).
    pub(crate) async fn inject_faults(&self) -> Result<bool, Response> {
        let options = &self.options;
        if options.extra_latency_ms > 0 {
            tokio::time::sleep(Duration::from_millis(options.extra_latency_ms)).await;
        }
        if options.fail_rate <= 0.0 && options.cut_stream_rate <= 0.0 {
            return Ok(false);
        }
        let draw = self.fault_draws.fetch_add(1, Ordering::Relaxed);
        if unit_draw(options.seed, draw, 0) < options.fail_rate {
            return Err(ApiError::injected().into_response());
        }
        Ok(unit_draw(options.seed, draw, 1) < options.cut_stream_rate)
    }
}

/// A uniform draw in [0, 1) from (seed, draw number, salt).
fn unit_draw(seed: u64, draw: u64, salt: u64) -> f64 {
    let bits = splitmix64(seed ^ splitmix64(draw.wrapping_mul(2).wrapping_add(salt)));
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_draws_are_uniform_enough() {
        let n = 10_000;
        let below = (0..n).filter(|&d| unit_draw(7, d, 0) < 0.25).count();
        assert!((2_200..2_800).contains(&below), "{below}");
        assert!((0..n).all(|d| (0.0..1.0).contains(&unit_draw(7, d, 1))));
    }
}
