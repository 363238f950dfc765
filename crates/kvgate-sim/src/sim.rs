//! The discrete-event simulation of one policy: trace arrivals routed by the gateway's policy onto simulated engines, with a simulated load monitor and policy maintenance, all in virtual time.
//!
//! Events live in one binary heap ordered by (virtual time, kind, engine): at equal times engine
//! steps complete first (finished requests leave the in-flight counts), then KV transfers of a
//! disaggregated fleet land, then the load monitor samples, then the policies are maintained,
//! then requests arrive (in arrival order). Everything is a function of the trace, the options
//! and the seed: no wall clock, no thread, no unordered iteration.
//!
//! A request arrives at its timestamp, except a later turn of a session, which arrives once its
//! previous turn ended plus its think time (closed loop, `arrivals.rs`).
//!
//! The fleet is one pool of engines ([`Fleet::Regular`]) or a prefill and a decode pool
//! ([`Fleet::Disaggregated`], `pd.rs`), each pool routed by its own policy on its own in-flight
//! counts, load samples and prefix index (`pool.rs`), as the gateway keeps them per role.

mod admission;
mod arrivals;
mod pd;
mod pool;
mod routing;

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvgate_engine::{Engine, EngineConfig, EngineOutput, EngineRequest, KvEventBatch, RequestStats};
use kvgate_policy::{OverloadSettings, PolicyConfig, Reason};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use crate::outside::{OutsidePolicy, OutsideRequest};
pub use admission::AdmissionSetup;
use kvgate_trace::{extend_prompt_tokens, Trace};
pub use pd::{PdOutcome, PdSetup};
pub use pool::SimPool;

/// Virtual microseconds between `Policy::maintain` calls (the gateway calls it every second).
pub const MAINTAIN_INTERVAL_US: u64 = 1_000_000;

/// What one simulation needs besides the policy.
#[derive(Clone, Debug)]
pub struct SimSetup {
    pub fleet: Fleet,
    /// The reference engine (what every engine is unless `engines` says otherwise).
    pub engine: EngineConfig,
    /// Each engine's configuration, in fleet order (a disaggregated fleet's prefill engines
    /// first): `engine` with its `--worker-speeds` and `--worker-kv-capacity-tokens` entries.
    pub engines: Vec<EngineConfig>,
    /// Trace timestamps are divided by this.
    pub rate_scale: f64,
    pub load_monitor_interval_ms: u64,
    pub seed: u64,
    /// The gateway's concurrency cap and fair queue in front of the fleet (none by default).
    pub admission: AdmissionSetup,
    /// The gateway's per-worker overload protection (`--worker-overload-*`; off by default).
    pub overload: OverloadSettings,
    /// Each trace request's prompt tokens, by trace index, when they are not the trace's words
    /// (`--tokenizer-path`: the real engines' tokens).
    pub prompts: Option<Prompts>,
}

/// Prompt tokens by trace index (shared by every run of one report).
#[derive(Clone, PartialEq)]
pub struct Prompts(std::sync::Arc<Vec<Vec<u32>>>);

impl Prompts {
    pub fn new(prompts: Vec<Vec<u32>>) -> Prompts {
        Prompts(std::sync::Arc::new(prompts))
    }

    pub fn get(&self, trace_index: usize) -> Option<&[u32]> {
        self.0.get(trace_index).map(Vec::as_slice)
    }
}

impl std::fmt::Debug for Prompts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Prompts({} requests)", self.0.len())
    }
}

/// The engines and how requests reach them.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fleet {
    /// `n_workers` engines that prefill and decode, routed by the run's policy.
    Regular { n_workers: usize },
    /// A prefill/decode disaggregated fleet: the run's policy routes the prefill engines.
    Disaggregated(Box<PdSetup>),
}

impl Fleet {
    /// Every engine of the fleet.
    pub fn n_engines(&self) -> usize {
        match self {
            Fleet::Regular { n_workers } => *n_workers,
            Fleet::Disaggregated(pd) => pd.prefill_workers + pd.decode_workers,
        }
    }

    /// The engines the run's policy routes onto and whose caches serve prompts: all of a
    /// regular fleet, the prefill side of a disaggregated one.
    pub fn prompt_engines(&self) -> usize {
        match self {
            Fleet::Regular { n_workers } => *n_workers,
            Fleet::Disaggregated(pd) => pd.prefill_workers,
        }
    }
}

/// Per-engine KV usage at one load-monitor tick (a disaggregated fleet's prefill engines first).
#[derive(Clone, Debug, PartialEq)]
pub struct KvTick {
    pub at_us: u64,
    pub token_usage: Vec<f64>,
}

/// Everything a simulation observed; summarised by `report`.
#[derive(Clone, Debug, Default)]
pub struct SimOutcome {
    /// Stats of the finished requests, in finishing order (a disaggregated request's: its
    /// prefill's prompt, cache hit and admission, its decode's first token and finish). Their
    /// arrival is the request's at the gateway (before any admission queue).
    pub finished: Vec<RequestStats>,
    /// The trace index of each of `finished` (for the per-tenant figures).
    pub finished_requests: Vec<usize>,
    /// Where the TTFT of each of `finished` went (a regular fleet's; empty for a disaggregated
    /// one).
    pub ttft_parts: Vec<TtftParts>,
    /// Requests the policy found no worker for.
    pub unrouted: u64,
    /// Requests an engine refused (e.g. larger than its KV cache).
    pub rejected: u64,
    /// Decisions of the run's policy by reason, indexed like `Reason::ALL`.
    pub decisions: Vec<u64>,
    /// The reason of each trace request's decision (index into `Reason::ALL`; by trace index, like
    /// `finished_requests`), for the TTFT of the requests each reason placed.
    pub reason_by_request: Vec<u8>,
    /// Decisions by the prefix index they consulted, indexed like `IndexKind::ALL`.
    pub index_decisions: [u64; 2],
    /// KV events the engines emitted that the exact index refused (should stay 0).
    pub refused_kv_events: u64,
    /// Sum over decisions of the chosen worker's prefix match rate, and of the best one.
    pub chosen_match_sum: f64,
    pub best_match_sum: f64,
    pub match_decisions: u64,
    /// The run's policy's predicted time to first token, term by term
    /// ([`kvgate_policy::PredictedTtft::terms`]), summed over its decisions that predicted one
    /// (kv_aware's), and how many: the means beside the gateway's `kvgate_predicted_ttft_seconds`.
    pub predicted_sums: [f64; kvgate_policy::PredictedTtft::TERMS.len()],
    pub predicted_decisions: u64,
    /// Load-monitor ticks from the first arrival until the fleet is idle.
    pub kv_ticks: Vec<KvTick>,
    pub first_arrival_us: u64,
    pub last_event_us: u64,
    /// What the decode side of a disaggregated fleet did.
    pub pd: Option<PdOutcome>,
    /// Prompt tokens each engine computed (prompt minus cache hit) for the requests finished
    /// (a regular fleet's; zeros for a disaggregated one).
    pub prefill_tokens_by_engine: Vec<u64>,
    /// The engine that served each of `finished` (a regular fleet's; empty for a disaggregated
    /// one).
    pub finished_engines: Vec<usize>,
    /// When each request arrived at the gateway, by position in arrival order (a session's
    /// later turn: once its previous turn ended, plus its think time).
    pub sent_us: Vec<u64>,
    /// When each request ended (finished, refused or unrouted), by position in arrival order.
    pub ended_us: Vec<Option<u64>>,
    /// What the sessions took (when the trace's requests name sessions).
    pub sessions: Option<kvgate_trace::SessionFigures>,
}

/// One request's time to first token in parts, in microseconds: they add up to its TTFT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TtftParts {
    /// In the gateway's admission queue: arrival to submission to an engine.
    pub gateway_wait_us: u64,
    /// In the engine's waiting queue: submission to admission (the step running when it came,
    /// then the prefill budget, running slots or KV taken by the requests ahead).
    pub engine_wait_us: u64,
    /// Computing its own uncached prompt (and loading its host-tier prefix) at the engine's
    /// prefill rate.
    pub prefill_own_us: u64,
    /// The rest of admission to first token: the other requests' work in the steps that
    /// carried its prefill (their prefill chunks, and decodes in a mixed batch).
    pub prefill_shared_us: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    EngineStep(usize),
    /// A disaggregated request's KV reached its decode engine.
    KvTransferred(u64),
    LoadMonitor,
    Maintain,
    /// Request `id` (its position in arrival order) arrives at the gateway.
    Arrival(u64),
}

/// Progress callback: (requests arrived so far, virtual time in µs).
pub type Progress<'a> = &'a mut dyn FnMut(usize, u64);

/// Runs `trace` through a fresh policy built from `policy` and a fresh fleet (and, for a
/// disaggregated fleet, a fresh decode-side policy).
///
/// Prefix-aware routing consults, as in the gateway, the host's index for the pool: the exact
/// index fed by the pool's engines' KV events when the policy uses it (the simulated engines'
/// events always flow, so `prefix_index=auto` is exact here), else the approximate tree.
pub fn simulate(
    trace: &Trace,
    setup: &SimSetup,
    policy: &PolicyConfig,
    progress: Progress<'_>,
) -> SimOutcome {
    simulate_with_kv_sink(trace, setup, policy, progress, None)
}

/// [`simulate`], handing every engine's KV event batches to `kv_sink` as they are emitted (the
/// engines then publish KV events whatever the policy).
pub fn simulate_with_kv_sink<'a>(
    trace: &'a Trace,
    setup: &'a SimSetup,
    policy: &PolicyConfig,
    progress: Progress<'_>,
    kv_sink: Option<KvSink<'a>>,
) -> SimOutcome {
    let pools = match &setup.fleet {
        Fleet::Regular { n_workers } => vec![SimPool::new(policy, 0, *n_workers)],
        Fleet::Disaggregated(pd) => vec![
            SimPool::new(policy, 0, pd.prefill_workers),
            SimPool::new(&pd.decode_policy, pd.prefill_workers, pd.decode_workers),
        ],
    };
    let mut simulation = Simulation::new(trace, setup, pools, None, kv_sink);
    if let Some(pd) = &mut simulation.pd {
        pd.rule = policy.pd_rule();
    }
    simulation.run(progress)
}

/// [`simulate`] on a regular fleet of `setup.fleet.n_engines()` engines routed by `policy`
/// (standing in for the one `config` names; `config` still chooses the prefix index): tests of
/// what the host tells a policy.
#[cfg(test)]
pub(crate) fn simulate_with_policy(
    trace: &Trace,
    setup: &SimSetup,
    config: &PolicyConfig,
    policy: std::sync::Arc<dyn kvgate_policy::Policy>,
) -> SimOutcome {
    let pools = vec![SimPool::with_policy(config, policy, 0, setup.fleet.n_engines())];
    Simulation::new(trace, setup, pools, None, None).run(&mut |_, _| {})
}

/// Runs `trace` on a fresh regular fleet of `setup.fleet.n_engines()` engines routed by
/// `outside` instead of a kvgate policy (see [`crate::outside`]): the engines publish KV events
/// to it, and it is told of every first token and finish. A disaggregated `setup.fleet` is
/// simulated as a regular fleet of as many engines (the caller refuses it: [`crate::run_outside`]).
pub fn simulate_outside(
    trace: &Trace,
    setup: &SimSetup,
    outside: &mut dyn OutsidePolicy,
    progress: Progress<'_>,
) -> SimOutcome {
    let pools = vec![SimPool::for_outside(setup.fleet.n_engines())];
    Simulation::new(trace, setup, pools, Some(outside), None).run(progress)
}

struct Simulation<'a> {
    trace: &'a Trace,
    setup: &'a SimSetup,
    /// The regular pool, or the prefill then the decode pool; engines in pool order.
    pools: Vec<SimPool>,
    /// Disaggregated requests between arrival and decode finish.
    pd: Option<pd::PdState>,
    admission: admission::Admission,
    engines: Vec<Engine>,
    /// The engine-step time each engine has in the heap (stale heap entries are skipped).
    scheduled: Vec<Option<u64>>,
    heap: BinaryHeap<Reverse<(u64, Event)>>,
    order: Vec<usize>,
    /// When each request arrives (a session's later turn: set once its previous turn ended).
    arrival_us: Vec<u64>,
    arrivals: arrivals::Arrivals,
    rng: StdRng,
    outputs: Vec<EngineOutput>,
    prompt: Vec<u32>,
    /// The arriving request's session key (see [`session_key`]), reused between requests.
    session: String,
    outcome: SimOutcome,
    /// The router of an outside-policy run (pool 0's policy is then never asked).
    outside: Option<&'a mut dyn OutsidePolicy>,
    /// Where every engine's KV event batches go as they are emitted (`--kv-events-out`).
    kv_sink: Option<KvSink<'a>>,
}

/// Receives each engine's KV event batches (engine index in fleet order), in emission order.
pub type KvSink<'a> = &'a mut dyn FnMut(usize, &KvEventBatch);

/// A trace request's session key, what `consistent_hashing` and `manual` route by: the line's
/// `session_id` (what `kvgate replay` sends as the routing key), else its conversation, i.e. the
/// first prefix block after the trace's shared first block (the conversation trace's turns of one
/// conversation share their leading blocks; the first block is a system prompt common to all).
fn session_key(request: &kvgate_trace::TraceRequest, into: &mut String) {
    use std::fmt::Write;
    into.clear();
    if let Some(session) = &request.session_id {
        into.push_str(session);
        return;
    }
    let block = request.hash_ids.get(1).or(request.hash_ids.first()).copied().unwrap_or(0);
    let _ = write!(into, "conversation-{block}");
}

impl<'a> Simulation<'a> {
    fn new(
        trace: &'a Trace,
        setup: &'a SimSetup,
        pools: Vec<SimPool>,
        outside: Option<&'a mut dyn OutsidePolicy>,
        kv_sink: Option<KvSink<'a>>,
    ) -> Self {
        let order = trace.arrival_order();
        let arrivals = arrivals::Arrivals::new(trace, &order, setup.rate_scale);
        let arrival_us = (0..order.len()).map(|position| arrivals.schedule.timestamp_us(position)).collect();
        let mut engines = Vec::new();
        let mut pools = pools;
        for pool in &mut pools {
            for worker in 0..pool.n_workers() {
                let config = setup.engines.get(pool.first_engine + worker).unwrap_or(&setup.engine);
                pool.learn_layout(worker, config.block_size);
                engines.push(Engine::new(EngineConfig {
                    emit_kv_events: pool.wants_kv_events() || outside.is_some() || kv_sink.is_some(),
                    ..config.clone()
                }));
            }
        }
        let n = engines.len();
        let pd = match &setup.fleet {
            Fleet::Regular { .. } => None,
            Fleet::Disaggregated(pd) => Some(pd::PdState::new(pd)),
        };
        Simulation {
            trace,
            setup,
            pools,
            outcome: SimOutcome {
                decisions: vec![0; Reason::ALL.len()],
                reason_by_request: vec![0; trace.requests.len()],
                pd: pd.as_ref().map(pd::PdState::outcome),
                prefill_tokens_by_engine: vec![0; n],
                ended_us: vec![None; trace.requests.len()],
                ..SimOutcome::default()
            },
            pd,
            admission: admission::Admission::new(&setup.admission),
            engines,
            scheduled: vec![None; n],
            heap: BinaryHeap::new(),
            order,
            arrival_us,
            arrivals,
            rng: StdRng::seed_from_u64(setup.seed),
            outputs: Vec::new(),
            prompt: Vec::new(),
            session: String::new(),
            outside,
            kv_sink,
        }
    }

    fn push(&mut self, at_us: u64, event: Event) {
        self.heap.push(Reverse((at_us, event)));
    }

    fn run(mut self, progress: Progress<'_>) -> SimOutcome {
        let Some(&first) = self.arrival_us.first() else { return self.outcome };
        self.outcome.first_arrival_us = first;
        self.push_next_timed();
        self.push(first, Event::LoadMonitor);
        self.push(first, Event::Maintain);
        while let Some(Reverse((now, event))) = self.heap.pop() {
            match event {
                Event::EngineStep(engine) => {
                    if self.scheduled[engine] != Some(now) {
                        continue; // superseded
                    }
                    self.scheduled[engine] = None;
                    self.engines[engine].advance(now, &mut self.outputs);
                    self.after_engine_call(engine, now);
                }
                Event::KvTransferred(id) => self.kv_transferred(now, id),
                Event::LoadMonitor => {
                    self.sample_loads(now);
                    if self.busy() {
                        self.push(now + self.setup.load_monitor_interval_ms * 1000, Event::LoadMonitor);
                    }
                }
                Event::Maintain => {
                    for pool in &self.pools {
                        pool.maintain(now);
                    }
                    if self.busy() {
                        self.push(now + MAINTAIN_INTERVAL_US, Event::Maintain);
                    }
                }
                Event::Arrival(id) => {
                    self.arrival(now, id);
                    progress(self.arrivals.arrived, now);
                }
            }
            self.outcome.last_event_us = now;
        }
        self.finish_arrivals();
        self.outcome
    }

    /// Whether anything remains to happen: arrivals to come, requests in an engine, or KV on
    /// its way to a decode engine.
    fn busy(&self) -> bool {
        self.arrivals.arrived < self.order.len()
            || self.engines.iter().any(|engine| engine.num_requests() > 0)
            || self.pd.as_ref().is_some_and(|pd| pd.in_progress())
            || self.admission.waiting()
    }

    fn arrive(&mut self, now: u64, id: u64) {
        let request = &self.trace.requests[self.order[id as usize]];
        let mut prompt = std::mem::take(&mut self.prompt);
        let input_length = self.prompt_of(id, &mut prompt);
        let output_tokens = request.output_length;
        session_key(request, &mut self.session);
        if self.pd.is_some() {
            // Every way a disaggregated request can go unrouted is at its arrival.
            let unrouted = self.outcome.unrouted;
            self.arrive_disaggregated(now, id, prompt, input_length, output_tokens);
            if self.outcome.unrouted > unrouted {
                self.turn_ended(id, now, now);
            }
            return;
        }
        if self.outside.is_some() {
            self.arrive_outside(now, id, prompt, input_length, output_tokens);
            return;
        }
        if !self.admission.try_enter(id, request) {
            let score = match self.admission.scores_locality() {
                true => self.predicted_cached(now, id, &prompt, input_length),
                false => 0,
            };
            self.admission.wait(id, request, score);
            self.prompt = prompt;
            return;
        }
        self.submit(now, id, prompt, input_length, output_tokens);
    }

    /// Request `id`'s prompt tokens into `prompt` (cleared first): the trace's words, or the
    /// engines' tokens with `--tokenizer-path`. Returns their count.
    fn prompt_of(&self, id: u64, prompt: &mut Vec<u32>) -> u32 {
        let index = self.order[id as usize];
        prompt.clear();
        match self.setup.prompts.as_ref().and_then(|prompts| prompts.get(index)) {
            Some(tokens) => prompt.extend_from_slice(tokens),
            None => extend_prompt_tokens(&self.trace.requests[index], prompt),
        }
        u32::try_from(prompt.len()).unwrap_or(u32::MAX)
    }

    /// Routes admitted request `id` and submits it to its engine.
    fn submit(&mut self, now: u64, id: u64, prompt: Vec<u32>, input_length: u32, output_tokens: u32) {
        let Some(worker) = self.plan_sent(now, id, &prompt, input_length).and_then(|sent| sent.workers[0])
        else {
            self.outcome.unrouted += 1;
            self.prompt = prompt;
            self.turn_ended(id, now, now);
            self.admit_next(now, id);
            return;
        };
        let engine = self.pools[0].first_engine + worker;
        let class = self.admission.class_of(&self.trace.requests[self.order[id as usize]]);
        let request =
            EngineRequest::new(id, prompt, output_tokens).with_priority(class.lower_first_priority());
        self.engines[engine].submit(now, request, &mut self.outputs);
        self.after_engine_call(engine, now);
    }

    /// Routes an arriving request by the outside policy (every engine a candidate).
    fn arrive_outside(
        &mut self,
        now: u64,
        id: u64,
        prompt: Vec<u32>,
        prompt_tokens: u32,
        output_tokens: u32,
    ) {
        let candidates = self.pools[0].outside_candidates();
        let request =
            OutsideRequest { id, prompt: &prompt, prompt_tokens, session: &self.session, now_us: now };
        let outside = self.outside.as_mut().expect("an outside-policy run");
        let Some(worker) = outside.select(&request, &candidates).filter(|&w| w < candidates.len()) else {
            self.outcome.unrouted += 1;
            self.prompt = prompt;
            self.turn_ended(id, now, now);
            return;
        };
        self.pools[0].admit_outside(worker);
        self.engines[worker].submit(now, EngineRequest::new(id, prompt, output_tokens), &mut self.outputs);
        self.after_engine_call(worker, now);
    }

    /// Request `left` left the fleet (finished, refused or unrouted): its slot goes to the
    /// waiters of the admission queue it makes room for, routed now.
    fn admit_next(&mut self, now: u64, left: u64) {
        self.admission.left(left);
        while let Some(id) = self.admission.next() {
            self.submit_waiter(now, id);
        }
    }

    /// Routes and submits the admitted waiter `id`.
    fn submit_waiter(&mut self, now: u64, id: u64) {
        let request = &self.trace.requests[self.order[id as usize]];
        let mut prompt = std::mem::take(&mut self.prompt);
        let input_length = self.prompt_of(id, &mut prompt);
        let output_tokens = request.output_length;
        session_key(request, &mut self.session);
        self.submit(now, id, prompt, input_length, output_tokens);
    }

    /// The pool holding `engine` and the engine's pool-local index.
    fn pool_of(&self, engine: usize) -> (usize, usize) {
        self.pools
            .iter()
            .enumerate()
            .find_map(|(index, pool)| pool.local(engine).map(|worker| (index, worker)))
            .expect("every engine belongs to a pool")
    }

    /// Accounts the outputs of an engine call made at `now`, applies its KV events to its pool's
    /// exact index, and puts the engine's next step in the heap.
    fn after_engine_call(&mut self, engine: usize, now: u64) {
        let (pool, worker) = self.pool_of(engine);
        if self.pools[pool].wants_kv_events() || self.outside.is_some() || self.kv_sink.is_some() {
            let batches = self.engines[engine].drain_kv_events();
            if let Some(sink) = self.kv_sink.as_mut() {
                for batch in &batches {
                    sink(engine, batch);
                }
            }
            if let Some(outside) = self.outside.as_mut() {
                if !batches.is_empty() {
                    outside.kv_events(worker, &batches, now);
                }
            }
            self.outcome.refused_kv_events += self.pools[pool].apply_kv_events(worker, &batches);
        }
        let mut outputs = std::mem::take(&mut self.outputs);
        for output in outputs.drain(..) {
            match output {
                EngineOutput::Finished { id, mut stats } => {
                    // Submitted to the engine, and its arrival at the gateway (before any
                    // admission queue).
                    let submitted_us = stats.arrival_us;
                    if self.pd.is_none() {
                        stats.arrival_us = stats.arrival_us.min(self.arrival_us[id as usize]);
                        self.pools[pool].answered(worker, id, &stats, submitted_us);
                    }
                    self.pools[pool].ended(worker, id);
                    if let Some(outside) = self.outside.as_mut() {
                        outside.finished(worker, id, now);
                    }
                    if self.pd.is_some() {
                        self.disaggregated_finished(pool, engine, now, id, stats);
                    } else {
                        self.outcome.prefill_tokens_by_engine[engine] +=
                            u64::from(stats.prompt_tokens.saturating_sub(stats.cached_tokens));
                        let config = self.engines[engine].config();
                        let uncached = stats.prompt_tokens.saturating_sub(stats.cached_tokens)
                            + config.load_work_tokens(stats.offloaded_tokens);
                        let prefill_us = stats.first_token_us.saturating_sub(stats.admitted_us);
                        let context = stats.prompt_tokens.saturating_sub(uncached);
                        let own_us = config.prefill_step_us(uncached.into())
                            + config.context_us(EngineConfig::context_pairs(context, uncached));
                        let prefill_own_us = own_us.min(prefill_us);
                        self.outcome.ttft_parts.push(TtftParts {
                            gateway_wait_us: submitted_us - stats.arrival_us,
                            engine_wait_us: stats.admitted_us.saturating_sub(submitted_us),
                            prefill_own_us,
                            prefill_shared_us: prefill_us - prefill_own_us,
                        });
                        self.outcome.finished.push(stats);
                        self.outcome.finished_requests.push(self.order[id as usize]);
                        self.outcome.finished_engines.push(engine);
                        self.admit_next(now, id);
                    }
                }
                EngineOutput::Rejected { id, .. } => {
                    self.pools[pool].ended(worker, id);
                    self.turn_ended(id, now, now);
                    if let Some(outside) = self.outside.as_mut() {
                        outside.finished(worker, id, now);
                    }
                    if self.pd.is_some() {
                        self.disaggregated_rejected(pool, id);
                    } else {
                        self.admit_next(now, id);
                    }
                    self.outcome.rejected += 1;
                }
                EngineOutput::FirstToken { id, at } => {
                    if let Some(outside) = self.outside.as_mut() {
                        outside.first_token(worker, id, at);
                    }
                }
                EngineOutput::Token { .. } => {}
            }
        }
        self.outputs = outputs;
        self.note_finished(now);
        let next = self.engines[engine].next_event_time();
        if next != self.scheduled[engine] {
            self.scheduled[engine] = next;
            if let Some(at) = next {
                self.push(at, Event::EngineStep(engine));
            }
        }
    }

    /// The load monitor's tick: every engine's load, published to its pool's policy if it reads
    /// loads (as the gateway polls only then), and recorded for the KV metrics either way.
    fn sample_loads(&mut self, now: u64) {
        let mut usage = Vec::with_capacity(self.engines.len());
        for engine in 0..self.engines.len() {
            self.engines[engine].advance(now, &mut self.outputs);
            self.after_engine_call(engine, now);
            let load = self.engines[engine].load(now);
            usage.push(load.token_usage);
            let (pool, worker) = self.pool_of(engine);
            self.pools[pool].record_load(
                worker,
                pool::load_sample(&load, now),
                self.setup.overload.enabled(),
                self.setup.load_monitor_interval_ms,
            );
            if pool > 0 {
                if let Some(pd) = &mut self.outcome.pd {
                    pd.decode_uncached_tokens_max =
                        pd.decode_uncached_tokens_max.max(load.num_waiting_uncached_tokens);
                }
            }
        }
        self.outcome.kv_ticks.push(KvTick { at_us: now, token_usage: usage });
    }
}
