//! Prefill/decode disaggregation on the simulated engines: a worker's PD role, the plan a PD request gets (open a room on a prefill engine, pull the KV on a decode engine), and the engine stage it runs as.
//!
//! The pull protocol between mock engines (the gateway never calls it): a prefill engine keeps
//! one room per PD request (SGLang's `bootstrap_room` as decimal digits, or the
//! `remote_request_id` it returned in vLLM's `kv_transfer_params`), opened when the request
//! arrives. Its bootstrap server answers `GET /kv/{room}` once the room's KV is ready (a
//! long-poll, at most a hold timeout, so a pull may come before the prefill request), after
//! sleeping the transfer time, with `{"room", "prompt_tokens", "blocks"}`; that also releases
//! the hold. A room whose prefill failed (an injected 500, a rejection, a cancellation), whose
//! KV expired, or that was pulled already answers 410 at once; a room never seen answers 404
//! after the hold timeout. The decode engine answers 502 on any of these.

mod args;
mod bootstrap;
mod pull;
mod rooms;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvgate_engine::{EngineOutput, PdStage};
use serde_json::Value;
use tokio::sync::{oneshot, watch};

pub(crate) use args::PdTiming;
pub use args::WorkerRole;
pub(crate) use bootstrap::router as bootstrap_router;
pub(crate) use rooms::KvRooms;

use crate::api_error::ApiError;
use crate::driver::EngineHandle;
use crate::shutdown::stopped;
use kvgate_protocol::transfer::{self, KvSource, PdRequest, RemotePrefill};
use rooms::{HeldKv, RoomTicket};

/// One worker's PD role and what it needs to serve it.
pub(crate) struct PdContext {
    role: WorkerRole,
    timing: PdTiming,
    /// Prefill role: this worker's rooms and the bootstrap address they are pulled from.
    prefill: Option<PrefillSide>,
    /// Decode role: the client that pulls KV from prefill engines.
    client: Option<reqwest::Client>,
    stop: watch::Receiver<bool>,
}

/// A prefill worker's rooms and bootstrap address.
pub(crate) struct PrefillSide {
    pub(crate) rooms: Arc<KvRooms>,
    pub(crate) host: String,
    pub(crate) port: u16,
    /// This engine's id in vLLM's `remote_engine_id`.
    pub(crate) engine_id: String,
    next_transfer: AtomicU64,
    next_block_id: AtomicU64,
}

impl PrefillSide {
    pub(crate) fn new(rooms: Arc<KvRooms>, host: String, port: u16, engine_id: String) -> Self {
        Self {
            rooms,
            host,
            port,
            engine_id,
            next_transfer: AtomicU64::new(0),
            next_block_id: AtomicU64::new(0),
        }
    }
}

/// What a generation request is, PD-wise, on this worker.
pub(crate) enum PdPlan {
    Regular,
    /// Prefill it (one output token), hold its KV in its room until pulled.
    Prefill {
        ticket: RoomTicket,
        vllm: bool,
    },
    /// Pull its KV from a prefill engine, then decode it.
    Decode(KvSource),
}

/// How the engine runs a request, once its plan is under way.
pub(crate) struct PdStart {
    pub(crate) stage: PdStage,
    /// The output-length cap the plan imposes (1 on a prefill engine).
    pub(crate) max_tokens: Option<u32>,
    pub(crate) on_end: Option<oneshot::Sender<EngineOutput>>,
    /// vLLM prefill: the `kv_transfer_params` of the answer.
    pub(crate) kv_transfer_params: Option<Value>,
    /// Decode of a transferred prompt: the tokens the prefill engine found cached, which the
    /// answer reports instead of this engine's own match (it computes no prompt, so its cache
    /// saved nothing; counting its match would credit KV that arrived by transfer).
    pub(crate) transferred_cached_tokens: Option<u32>,
}

impl PdContext {
    pub(crate) fn new(
        role: WorkerRole,
        timing: PdTiming,
        prefill: Option<PrefillSide>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        let client = (role == WorkerRole::Decode).then(|| {
            reqwest::Client::builder().no_proxy().build().unwrap_or_else(|_| reqwest::Client::new())
        });
        Self { role, timing, prefill, client, stop }
    }

    /// Reads a generation body's PD fields; on a prefill engine a PD request's room opens now,
    /// so that an error answered from here on fails it (and the decode side learns at once).
    /// PD fields are ignored on a regular engine; a request asking for the other side is a 400.
    pub(crate) fn plan(&self, body: &[u8]) -> Result<PdPlan, ApiError> {
        if self.role == WorkerRole::Regular {
            return Ok(PdPlan::Regular);
        }
        let request = PdRequest::read(body).map_err(ApiError::bad_request)?;
        match (self.role, request) {
            (WorkerRole::Regular, _) | (_, PdRequest::None) => Ok(PdPlan::Regular),
            (WorkerRole::Prefill, PdRequest::Sglang { room, .. }) => Ok(PdPlan::Prefill {
                ticket: self.prefill_side()?.rooms.open(room.to_string())?,
                vllm: false,
            }),
            (WorkerRole::Prefill, PdRequest::VllmPrefill) => {
                let prefill = self.prefill_side()?;
                let n = prefill.next_transfer.fetch_add(1, Ordering::Relaxed);
                let key = format!("{}-{n}", prefill.engine_id);
                Ok(PdPlan::Prefill { ticket: prefill.rooms.open(key)?, vllm: true })
            }
            (WorkerRole::Prefill, PdRequest::VllmDecode(_)) => Err(ApiError::bad_request(
                "this is a prefill engine: kv_transfer_params with do_remote_prefill go to a decode engine",
            )),
            (WorkerRole::Decode, PdRequest::Sglang { room, bootstrap }) => {
                let (host, port) = bootstrap.ok_or_else(|| {
                    ApiError::bad_request(
                        "a decode engine needs bootstrap_host and bootstrap_port with bootstrap_room",
                    )
                })?;
                Ok(PdPlan::Decode(KvSource { host, port, room: room.to_string() }))
            }
            (WorkerRole::Decode, PdRequest::VllmDecode(source)) => Ok(PdPlan::Decode(source)),
            (WorkerRole::Decode, PdRequest::VllmPrefill) => Err(ApiError::bad_request(
                "this is a decode engine: kv_transfer_params with do_remote_decode go to a prefill engine",
            )),
        }
    }

    fn prefill_side(&self) -> Result<&PrefillSide, ApiError> {
        self.prefill.as_ref().ok_or_else(|| ApiError::internal("this prefill engine has no KV rooms"))
    }

    /// Starts `plan` for a prompt of `prompt_tokens` tokens: a decode engine pulls the KV
    /// first (a 502 on failure, before any response byte); a prefill engine arranges for the
    /// room to turn ready (or failed) when the engine finishes the request, and to expire.
    pub(crate) async fn start(
        &self,
        plan: PdPlan,
        engine: &EngineHandle,
        prompt_tokens: usize,
    ) -> Result<PdStart, ApiError> {
        let regular = PdStart {
            stage: PdStage::Regular,
            max_tokens: None,
            on_end: None,
            kv_transfer_params: None,
            transferred_cached_tokens: None,
        };
        match plan {
            PdPlan::Regular => Ok(regular),
            PdPlan::Decode(source) => {
                let client = self.client.as_ref().ok_or_else(|| ApiError::internal("no KV pull client"))?;
                let cached = pull::pull(client, &self.timing, &self.stop, &source, prompt_tokens).await?;
                Ok(PdStart { stage: PdStage::Decode, transferred_cached_tokens: Some(cached), ..regular })
            }
            PdPlan::Prefill { ticket, vllm } => {
                let prefill = self.prefill_side()?;
                // One output token: the held KV is the prompt's and that token's.
                let blocks = (prompt_tokens as u64 + 1).div_ceil(u64::from(engine.block_size().max(1)));
                let kv_transfer_params = vllm.then(|| {
                    let first = prefill.next_block_id.fetch_add(blocks, Ordering::Relaxed);
                    transfer::vllm_prefill_answer(&RemotePrefill {
                        engine_id: &prefill.engine_id,
                        block_ids: first..first + blocks,
                        host: &prefill.host,
                        port: prefill.port,
                        request_id: ticket.key(),
                    })
                });
                let (on_end, ended) = oneshot::channel();
                tokio::spawn(hold_room(ticket, ended, blocks, self.timing, self.stop.clone()));
                Ok(PdStart {
                    stage: PdStage::Prefill,
                    max_tokens: Some(1),
                    on_end: Some(on_end),
                    kv_transfer_params,
                    transferred_cached_tokens: None,
                })
            }
        }
    }
}

/// A prefill request's room from the engine's verdict on: ready when it finished (then
/// expired, releasing the KV, if nobody pulled it within the hold timeout), else failed.
async fn hold_room(
    ticket: RoomTicket,
    ended: oneshot::Receiver<EngineOutput>,
    blocks: u64,
    timing: PdTiming,
    mut stop: watch::Receiver<bool>,
) {
    let (engine_request_id, prompt_tokens, cached_tokens) = match ended.await {
        Ok(EngineOutput::Finished { id, stats }) => (id, stats.prompt_tokens, stats.cached_tokens),
        Ok(EngineOutput::Rejected { reason, .. }) => {
            return ticket.fail(format!("the prefill engine rejected the request: {reason}"));
        }
        _ => return ticket.fail("the prefill request was cancelled before its KV was ready".into()),
    };
    let (rooms, key) = ticket.ready(HeldKv { engine_request_id, prompt_tokens, cached_tokens, blocks });
    tokio::select! {
        () = tokio::time::sleep(timing.hold_timeout) => rooms.expire(&key, engine_request_id),
        () = stopped(&mut stop) => {}
    }
}
