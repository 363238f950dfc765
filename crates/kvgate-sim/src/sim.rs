//! The discrete-event simulation of one policy: trace arrivals routed by the gateway's policy onto simulated engines, with a simulated load monitor and policy maintenance, all in virtual time.
//!
//! Events live in one binary heap ordered by (virtual time, kind, worker): at equal times engine
//! steps complete first (finished requests leave the in-flight counts), then the load monitor
//! samples, then the policy is maintained, then requests arrive. Everything is a function of the
//! trace, the options and the seed: no wall clock, no thread, no unordered iteration.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use std::sync::Arc;

use kvgate_engine::{Engine, EngineConfig, EngineOutput, EngineRequest, KvEvent, RequestStats};
use kvgate_index::{
    ApproxIndex, BlockIndex, CacheBlocks, CacheId, InFlightBlocks, InFlightPrompt, PrefixIndex, StoredBlocks,
};
use kvgate_policy::{
    build_policy, Candidate, IndexKind, LoadSample, Policy, PolicyConfig, Reason, RouteRequest, RoutingKey,
    SelectContext,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::trace::{extend_prompt_tokens, Trace};

/// Virtual microseconds between `Policy::maintain` calls (the gateway calls it every second).
pub const MAINTAIN_INTERVAL_US: u64 = 1_000_000;

/// What one simulation needs besides the policy.
#[derive(Clone, Debug)]
pub struct SimSetup {
    pub n_workers: usize,
    pub engine: EngineConfig,
    /// Trace timestamps are divided by this.
    pub rate_scale: f64,
    pub load_monitor_interval_ms: u64,
    pub seed: u64,
}

/// Per-engine KV usage at one load-monitor tick.
#[derive(Clone, Debug, PartialEq)]
pub struct KvTick {
    pub at_us: u64,
    pub token_usage: Vec<f64>,
}

/// Everything a simulation observed; summarised by `report`.
#[derive(Clone, Debug, Default)]
pub struct SimOutcome {
    /// Stats of the finished requests, in finishing order.
    pub finished: Vec<RequestStats>,
    /// Requests the policy found no worker for.
    pub unrouted: u64,
    /// Requests an engine refused (e.g. larger than its KV cache).
    pub rejected: u64,
    /// Decisions by reason, indexed like `Reason::ALL`.
    pub decisions: Vec<u64>,
    /// Decisions by the prefix index they consulted, indexed like `IndexKind::ALL`.
    pub index_decisions: [u64; 2],
    /// KV events the engines emitted that the exact index refused (should stay 0).
    pub refused_kv_events: u64,
    /// Sum over decisions of the chosen worker's prefix match rate, and of the best one.
    pub chosen_match_sum: f64,
    pub best_match_sum: f64,
    pub match_decisions: u64,
    /// Load-monitor ticks from the first arrival until the fleet is idle.
    pub kv_ticks: Vec<KvTick>,
    pub first_arrival_us: u64,
    pub last_event_us: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    EngineStep(usize),
    LoadMonitor,
    Maintain,
    Arrival,
}

/// Progress callback: (requests arrived so far, virtual time in µs).
pub type Progress<'a> = &'a mut dyn FnMut(usize, u64);

/// Runs `trace` through a fresh policy built from `policy` and a fresh fleet.
///
/// Prefix-aware routing consults, as in the gateway, the host's index for the model: the exact
/// index fed by the engines' KV events when the policy uses it (the simulated engines' events
/// always flow, so `prefix_index=auto` is exact here), else the approximate tree.
pub fn simulate(
    trace: &Trace,
    setup: &SimSetup,
    policy: &PolicyConfig,
    progress: Progress<'_>,
) -> SimOutcome {
    let prefix = if policy.uses_exact_index() {
        let index = Arc::new(BlockIndex::new());
        let caches = (0..setup.n_workers as u32)
            .map(|worker| CacheBlocks::new(index.clone(), CacheId { worker, rank: 0 }))
            .collect();
        let in_flight = InFlightBlocks::new(index.clone());
        Prefix::Exact { index, caches, in_flight, prompts: std::collections::HashMap::new() }
    } else {
        Prefix::Approximate(Box::new(ApproxIndex::new(policy.tree_settings())))
    };
    Simulation::new(trace, setup, build_policy(policy), prefix).run(progress)
}

/// The model's prefix index, as the host keeps it.
enum Prefix {
    Approximate(Box<ApproxIndex>),
    /// The engines' KV events applied, one writer per engine, and the prompts in flight (as the
    /// gateway counts them until their requests end).
    Exact {
        index: Arc<BlockIndex>,
        caches: Vec<CacheBlocks>,
        in_flight: InFlightBlocks,
        prompts: std::collections::HashMap<u64, InFlightPrompt>,
    },
}

impl Prefix {
    fn index(&self) -> &dyn PrefixIndex {
        match self {
            Prefix::Approximate(tree) => &**tree,
            Prefix::Exact { index, .. } => &**index,
        }
    }
}

struct Simulation<'a> {
    trace: &'a Trace,
    setup: &'a SimSetup,
    policy: Arc<dyn Policy>,
    needs_loads: bool,
    prefix: Prefix,
    engines: Vec<Engine>,
    in_flight: Vec<u64>,
    loads: Vec<Option<LoadSample>>,
    /// The engine-step time each engine has in the heap (stale heap entries are skipped).
    scheduled: Vec<Option<u64>>,
    heap: BinaryHeap<Reverse<(u64, Event)>>,
    order: Vec<usize>,
    arrival_us: Vec<u64>,
    next_arrival: usize,
    rng: StdRng,
    outputs: Vec<EngineOutput>,
    prompt: Vec<u32>,
    outcome: SimOutcome,
}

impl<'a> Simulation<'a> {
    fn new(trace: &'a Trace, setup: &'a SimSetup, policy: Arc<dyn Policy>, prefix: Prefix) -> Self {
        let order = trace.arrival_order();
        let arrival_us = order
            .iter()
            .map(|&i| (trace.requests[i].timestamp_ms * 1000.0 / setup.rate_scale).round() as u64)
            .collect();
        let n = setup.n_workers;
        let engine =
            EngineConfig { emit_kv_events: matches!(prefix, Prefix::Exact { .. }), ..setup.engine.clone() };
        Simulation {
            trace,
            setup,
            needs_loads: policy.needs_loads(),
            policy,
            prefix,
            engines: (0..n).map(|_| Engine::new(engine.clone())).collect(),
            in_flight: vec![0; n],
            loads: vec![None; n],
            scheduled: vec![None; n],
            heap: BinaryHeap::new(),
            order,
            arrival_us,
            next_arrival: 0,
            rng: StdRng::seed_from_u64(setup.seed),
            outputs: Vec::new(),
            prompt: Vec::new(),
            outcome: SimOutcome { decisions: vec![0; Reason::ALL.len()], ..SimOutcome::default() },
        }
    }

    fn push(&mut self, at_us: u64, event: Event) {
        self.heap.push(Reverse((at_us, event)));
    }

    fn run(mut self, progress: Progress<'_>) -> SimOutcome {
        let Some(&first) = self.arrival_us.first() else { return self.outcome };
        self.outcome.first_arrival_us = first;
        self.push(first, Event::Arrival);
        self.push(first, Event::LoadMonitor);
        self.push(first, Event::Maintain);
        while let Some(Reverse((now, event))) = self.heap.pop() {
            match event {
                Event::EngineStep(worker) => {
                    if self.scheduled[worker] != Some(now) {
                        continue; // superseded
                    }
                    self.scheduled[worker] = None;
                    self.engines[worker].advance(now, &mut self.outputs);
                    self.after_engine_call(worker);
                }
                Event::LoadMonitor => {
                    self.sample_loads(now);
                    if self.busy() {
                        self.push(now + self.setup.load_monitor_interval_ms * 1000, Event::LoadMonitor);
                    }
                }
                Event::Maintain => {
                    self.policy.maintain(now / 1000);
                    if let Prefix::Approximate(tree) = &self.prefix {
                        tree.maintain(now / 1000);
                    }
                    if self.busy() {
                        self.push(now + MAINTAIN_INTERVAL_US, Event::Maintain);
                    }
                }
                Event::Arrival => {
                    self.arrive(now);
                    self.next_arrival += 1;
                    if let Some(&at) = self.arrival_us.get(self.next_arrival) {
                        self.push(at, Event::Arrival);
                    }
                    progress(self.next_arrival, now);
                }
            }
            self.outcome.last_event_us = now;
        }
        self.outcome
    }

    /// Whether anything remains to happen: arrivals to come or requests in an engine.
    fn busy(&self) -> bool {
        self.next_arrival < self.order.len() || self.engines.iter().any(|engine| engine.num_requests() > 0)
    }

    fn arrive(&mut self, now: u64) {
        let request = &self.trace.requests[self.order[self.next_arrival]];
        let mut prompt = std::mem::take(&mut self.prompt);
        prompt.clear();
        extend_prompt_tokens(request, &mut prompt);
        let candidates: Vec<Candidate> = (0..self.engines.len())
            .map(|worker| Candidate {
                id: worker as u32,
                in_flight: self.in_flight[worker],
                load: self.loads[worker],
            })
            .collect();
        let route =
            RouteRequest { key: RoutingKey::Tokens(&prompt), prompt_tokens: u64::from(request.input_length), session: None };
        let mut ctx = SelectContext {
            now_ms: now / 1000,
            load_poll_interval_ms: self.setup.load_monitor_interval_ms,
            rng: &mut self.rng,
            prefix_index: Some(self.prefix.index()),
        };
        let decision = match self.policy.select(&route, &candidates, &mut ctx) {
            Ok(decision) => decision,
            Err(_) => {
                self.outcome.unrouted += 1;
                self.prompt = prompt;
                return;
            }
        };
        let reason_index = Reason::ALL.iter().position(|&r| r == decision.reason).unwrap_or(0);
        self.outcome.decisions[reason_index] += 1;
        if let Some(kind) = decision.index {
            self.outcome.index_decisions[IndexKind::ALL.iter().position(|&k| k == kind).unwrap_or(0)] += 1;
        }
        if let Some(matches) = decision.matches {
            self.outcome.chosen_match_sum += matches.chosen_match_rate;
            self.outcome.best_match_sum += matches.best_match_rate;
            self.outcome.match_decisions += 1;
        }
        let worker = decision.worker as usize;
        self.in_flight[worker] += 1;
        if let Prefix::Exact { in_flight, prompts, .. } = &mut self.prefix {
            prompts.insert(self.next_arrival as u64, in_flight.add(worker as u32, &prompt));
        }
        let engine_request =
            EngineRequest { id: self.next_arrival as u64, prompt, output_tokens: request.output_length };
        self.engines[worker].submit(now, engine_request, &mut self.outputs);
        self.after_engine_call(worker);
    }

    /// Accounts the outputs of an engine call, applies its KV events to the exact index, and puts
    /// the engine's next step in the heap.
    fn after_engine_call(&mut self, worker: usize) {
        if let Prefix::Exact { caches, .. } = &mut self.prefix {
            for batch in self.engines[worker].drain_kv_events() {
                for event in &batch.events {
                    if !apply_event(&mut caches[worker], event) {
                        self.outcome.refused_kv_events += 1;
                    }
                }
            }
        }
        let mut outputs = std::mem::take(&mut self.outputs);
        for output in outputs.drain(..) {
            match output {
                EngineOutput::Finished { id, stats } => {
                    self.request_ended(id);
                    self.in_flight[worker] -= 1;
                    self.outcome.finished.push(stats);
                }
                EngineOutput::Rejected { id, .. } => {
                    self.request_ended(id);
                    self.in_flight[worker] -= 1;
                    self.outcome.rejected += 1;
                }
                EngineOutput::FirstToken { .. } | EngineOutput::Token { .. } => {}
            }
        }
        self.outputs = outputs;
        let next = self.engines[worker].next_event_time();
        if next != self.scheduled[worker] {
            self.scheduled[worker] = next;
            if let Some(at) = next {
                self.push(at, Event::EngineStep(worker));
            }
        }
    }

    /// A request left its engine: its prompt is no longer counted in flight.
    fn request_ended(&mut self, id: u64) {
        if let Prefix::Exact { in_flight, prompts, .. } = &mut self.prefix {
            if let Some(prompt) = prompts.remove(&id) {
                in_flight.remove(prompt);
            }
        }
    }

    /// The load monitor's tick: every engine's load, published to the policy if it reads loads
    /// (as the gateway polls only then), and recorded for the KV metrics either way.
    fn sample_loads(&mut self, now: u64) {
        let mut usage = Vec::with_capacity(self.engines.len());
        for worker in 0..self.engines.len() {
            self.engines[worker].advance(now, &mut self.outputs);
            self.after_engine_call(worker);
            let load = self.engines[worker].load(now);
            usage.push(load.token_usage);
            if self.needs_loads {
                self.loads[worker] = Some(LoadSample {
                    token_usage: load.token_usage,
                    num_running_reqs: load.num_running_reqs,
                    num_waiting_reqs: load.num_waiting_reqs,
                    num_waiting_uncached_tokens: load.num_waiting_uncached_tokens,
                    gen_throughput: load.gen_throughput,
                    max_total_num_tokens: load.max_total_num_tokens,
                    fetched_at_ms: now / 1000,
                });
            }
        }
        self.outcome.kv_ticks.push(KvTick { at_us: now, token_usage: usage });
    }
}

/// Applies one engine KV event to its cache's writer; false when the index refused it.
fn apply_event(cache: &mut CacheBlocks, event: &KvEvent) -> bool {
    match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => cache
            .apply_stored(StoredBlocks {
                block_hashes,
                parent_block_hash: *parent_block_hash,
                token_ids,
                block_size: *block_size,
                medium: None,
            })
            .is_ok(),
        KvEvent::BlockRemoved { block_hashes } => {
            cache.apply_removed(block_hashes, None);
            true
        }
        KvEvent::AllBlocksCleared => {
            cache.clear();
            true
        }
    }
}
