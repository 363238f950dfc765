//! Prefill/decode disaggregation in the simulation: each request is planned at arrival by the gateway's plan (`kvgate_route`, `routing.rs`): a prefill engine (the run's policy) and a decode engine (the decode side's policy), as the gateway's SGLang protocol picks both at once; prefilled with one output token and its KV held, transferred, then decoded. With the run's `pd_conditional`, the plan chooses the decode engine first and the gateway's rule (`kvgate_policy::PdRule`) decides: in place, the decode engine runs the request as a regular one (prefill and decode), as an engine given no bootstrap fields or transfer params does. With kv_aware on both sides the rule compares both paths' predictions (dry decisions on both pools); a pair's decode engine is then the one the decode side chooses for a request bringing its KV.
//!
//! Timeline of one request: arrival → `PdStage::Prefill` on the prefill engine (queueing and
//! prefill there) → prefill finished, its KV held → after the transfer time (prompt tokens x
//! `kv_bytes_per_token` / `kv_transfer_gbps`) `release_held` on the prefill engine and
//! `PdStage::Decode` on the decode engine, which computes no prompt → first token at the decode
//! engine's next decode step (TTFT), finish after `output_tokens` decode steps (e2e). The
//! request counts in flight on its prefill worker until its prefill finishes and on its decode
//! worker until its decode finishes.

use std::collections::HashMap;

use kvgate_engine::{EngineRequest, PdStage, RequestStats};
use kvgate_policy::{PathTtfts, PdRule, PolicyConfig, Reason};
use serde::Serialize;

use super::{Event, Simulation};

/// A prefill/decode disaggregated fleet.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PdSetup {
    pub prefill_workers: usize,
    pub decode_workers: usize,
    /// The `--decode-policy` entry, as given.
    pub decode_policy_entry: String,
    /// The decode side's policy (the same for every run).
    pub decode_policy: PolicyConfig,
    /// Bandwidth of the KV link from a prefill to a decode engine, GB/s.
    pub kv_transfer_gbps: f64,
    /// KV bytes per prompt token a transfer moves.
    pub kv_bytes_per_token: u64,
}

impl PdSetup {
    /// Virtual µs to move the KV of a prompt of `prompt_tokens` tokens to the decode engine.
    pub fn transfer_us(&self, prompt_tokens: u32) -> u64 {
        let bytes = f64::from(prompt_tokens) * self.kv_bytes_per_token as f64;
        (bytes / (self.kv_transfer_gbps * 1e9) * 1e6).round() as u64
    }
}

/// What the decode side of a disaggregated fleet did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PdOutcome {
    /// Engines of the prefill side (the first ones of every `KvTick`).
    pub prefill_engines: usize,
    /// KV transfers completed, and the sum of their durations (prefill finish to decode submit).
    pub transfers: u64,
    pub transfer_us_sum: u64,
    /// Requests the decode side finished, and the sum of their decode-engine queueing
    /// (admitted minus KV arrival).
    pub decoded: u64,
    pub decode_queue_us_sum: u64,
    /// Decisions of the decode side's policy by reason, indexed like `Reason::ALL`.
    pub decode_decisions: Vec<u64>,
    /// The most uncached prompt tokens any decode engine reported waiting at a monitor tick
    /// (0: decode engines never had a prompt to prefill).
    pub decode_uncached_tokens_max: u64,
    /// Requests sent through a pair, and prefilled in place on their decode engine
    /// (`pd_conditional`).
    pub pairs: u64,
    pub in_place: u64,
    /// The predicted rule's inputs summed over its decisions (kv_aware on both sides).
    pub predicted: PredictedSums,
}

/// Sums of the predicted rule's terms over its decisions, seconds (means in the report).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PredictedSums {
    pub decisions: u64,
    pub in_place_s: f64,
    pub in_place_others_s: f64,
    pub pair_s: f64,
    pub pair_others_s: f64,
    pub transfer_s: f64,
}

impl PredictedSums {
    pub(super) fn add(&mut self, paths: &PathTtfts) {
        self.decisions += 1;
        self.in_place_s += paths.in_place_s;
        self.in_place_others_s += paths.in_place_others_s;
        self.pair_s += paths.pair_s();
        self.pair_others_s += paths.prefill_others_s;
        self.transfer_s += paths.transfer_s;
    }
}

/// One disaggregated request between arrival and decode finish.
struct PdRequest {
    /// Prefilled on its decode engine, as a regular request (no prefill worker, no transfer).
    in_place: bool,
    prefill_worker: usize,
    decode_worker: usize,
    /// Kept for the decode engine (cleared when submitted there).
    prompt: Vec<u32>,
    output_tokens: u32,
    /// The prefill half's stats, once it finished.
    prefill: Option<RequestStats>,
    /// When the KV reached the decode engine.
    transferred_us: u64,
}

/// The disaggregated requests in progress.
pub(super) struct PdState {
    setup: PdSetup,
    /// The run's conditional rule (`None`: always a pair).
    pub(super) rule: Option<PdRule>,
    requests: HashMap<u64, PdRequest>,
}

impl PdState {
    pub(super) fn new(setup: &PdSetup) -> PdState {
        PdState { setup: setup.clone(), rule: None, requests: HashMap::new() }
    }

    /// A fresh outcome for this fleet.
    pub(super) fn outcome(&self) -> PdOutcome {
        PdOutcome {
            prefill_engines: self.setup.prefill_workers,
            decode_decisions: vec![0; Reason::ALL.len()],
            ..PdOutcome::default()
        }
    }

    pub(super) fn in_progress(&self) -> bool {
        !self.requests.is_empty()
    }
}

impl Simulation<'_> {
    fn pd_state(&mut self) -> &mut PdState {
        self.pd.as_mut().expect("a disaggregated fleet")
    }

    /// Plans request `id` on the prefill and decode pools as the gateway does (always a pair,
    /// or with the run's rule the decode worker first, or kv_aware's prediction across the pair),
    /// then submits its prefill half, or the whole request in place on its decode engine.
    pub(super) fn arrive_disaggregated(
        &mut self,
        now: u64,
        id: u64,
        prompt: Vec<u32>,
        prompt_tokens: u32,
        output_tokens: u32,
    ) {
        // Every disaggregated plan has a decode worker; a pair has a prefill worker too.
        let planned = self.plan_sent(now, id, &prompt, prompt_tokens);
        let Some([prefill_worker, Some(decode_worker)]) = planned.map(|sent| sent.workers) else {
            self.outcome.unrouted += 1;
            self.prompt = prompt;
            return;
        };
        let Some(prefill_worker) = prefill_worker else {
            let request = PdRequest {
                in_place: true,
                prefill_worker: 0,
                decode_worker,
                prompt: Vec::new(),
                output_tokens,
                prefill: None,
                transferred_us: now,
            };
            self.pd_state().requests.insert(id, request);
            let engine = self.pools[1].first_engine + decode_worker;
            self.engines[engine].submit(
                now,
                EngineRequest::new(id, prompt, output_tokens),
                &mut self.outputs,
            );
            self.after_engine_call(engine, now);
            return;
        };
        self.start_pair(now, id, prompt, output_tokens, prefill_worker, decode_worker);
    }

    /// Submits the prefill half of a pair.
    fn start_pair(
        &mut self,
        now: u64,
        id: u64,
        prompt: Vec<u32>,
        output_tokens: u32,
        prefill_worker: usize,
        decode_worker: usize,
    ) {
        let request = PdRequest {
            in_place: false,
            prefill_worker,
            decode_worker,
            prompt: prompt.clone(),
            output_tokens,
            prefill: None,
            transferred_us: 0,
        };
        self.pd_state().requests.insert(id, request);
        let engine = self.pools[0].first_engine + prefill_worker;
        let prefill = EngineRequest::new(id, prompt, 1);
        self.engines[engine].submit_as(now, prefill, PdStage::Prefill, &mut self.outputs);
        self.after_engine_call(engine, now);
    }

    /// Request `id` finished on engine `engine` of pool `pool` at `now` (its in-flight count
    /// already dropped): a prefill starts its KV transfer, a decode completes the request. The
    /// prompt tokens an engine computed count for it (a prefill, or a request in place; a
    /// pair's decode computes none).
    pub(super) fn disaggregated_finished(
        &mut self,
        pool: usize,
        engine: usize,
        now: u64,
        id: u64,
        stats: RequestStats,
    ) {
        let computed = u64::from(stats.prompt_tokens.saturating_sub(stats.cached_tokens));
        let state = self.pd.as_mut().expect("a disaggregated fleet");
        let in_place = pool == 1 && state.requests.get(&id).is_some_and(|request| request.in_place);
        if pool == 0 || in_place {
            self.outcome.prefill_tokens_by_engine[engine] += computed;
        }
        let state = self.pd_state();
        if pool == 0 {
            let transfer_us = state.setup.transfer_us(stats.prompt_tokens);
            let request = state.requests.get_mut(&id).expect("a prefill in progress");
            request.prefill = Some(stats);
            self.push(now.max(stats.finished_us) + transfer_us, Event::KvTransferred(id));
            return;
        }
        let request = state.requests.remove(&id).expect("a decode in progress");
        let outcome = self.outcome.pd.as_mut().expect("a disaggregated outcome");
        if request.in_place {
            outcome.in_place += 1;
            self.outcome.finished.push(stats);
            self.outcome.finished_requests.push(self.order[id as usize]);
            return;
        }
        outcome.pairs += 1;
        let prefill = request.prefill.expect("decoded after its prefill");
        outcome.decoded += 1;
        outcome.decode_queue_us_sum += stats.admitted_us.saturating_sub(request.transferred_us);
        self.outcome.finished.push(RequestStats {
            prompt_tokens: prefill.prompt_tokens,
            cached_tokens: prefill.cached_tokens,
            offloaded_tokens: prefill.offloaded_tokens,
            completion_tokens: stats.completion_tokens,
            arrival_us: prefill.arrival_us,
            admitted_us: prefill.admitted_us,
            first_token_us: stats.first_token_us,
            finished_us: stats.finished_us,
        });
        self.outcome.finished_requests.push(self.order[id as usize]);
    }

    /// Request `id` was refused by an engine of pool `pool` (its in-flight count there already
    /// dropped): a refused prefill also leaves its decode worker, which never got it.
    pub(super) fn disaggregated_rejected(&mut self, pool: usize, id: u64) {
        let request = self.pd_state().requests.remove(&id).expect("a request in progress");
        if pool == 0 {
            self.pools[1].ended(request.decode_worker, id);
        }
    }

    /// Request `id`'s KV reached its decode engine: the prefill engine releases it and the
    /// decode engine takes the request.
    pub(super) fn kv_transferred(&mut self, now: u64, id: u64) {
        let request = self.pd_state().requests.get_mut(&id).expect("a transfer in progress");
        request.transferred_us = now;
        let prompt = std::mem::take(&mut request.prompt);
        let (prefill_worker, decode_worker, output_tokens) =
            (request.prefill_worker, request.decode_worker, request.output_tokens);
        let finished_us = request.prefill.map_or(now, |stats| stats.finished_us);
        if let Some(outcome) = &mut self.outcome.pd {
            outcome.transfers += 1;
            outcome.transfer_us_sum += now - finished_us;
        }
        let prefill_engine = self.pools[0].first_engine + prefill_worker;
        self.engines[prefill_engine].release_held(now, id, &mut self.outputs);
        self.after_engine_call(prefill_engine, now);
        let decode_engine = self.pools[1].first_engine + decode_worker;
        let decode = EngineRequest::new(id, prompt, output_tokens);
        self.engines[decode_engine].submit_as(now, decode, PdStage::Decode, &mut self.outputs);
        self.after_engine_call(decode_engine, now);
    }
}
