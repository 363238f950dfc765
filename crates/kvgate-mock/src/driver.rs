//! Drives one `kvgate-engine` model in real time: a tokio task sleeps until the next step ends, advances the engine, and routes outputs to per-request channels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvgate_engine::{Engine, EngineConfig, EngineLoad, EngineOutput, EngineRequest, KvEventBatch, PdStage};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Maps wall time to model time: model microseconds since start, `time_scale` times faster.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EngineClock {
    start: Instant,
    start_unix_secs: f64,
    time_scale: f64,
}

impl EngineClock {
    pub(crate) fn new(time_scale: f64) -> Self {
        Self { start: Instant::now(), start_unix_secs: unix_now_secs(), time_scale }
    }

    /// Model time now, in microseconds.
    pub(crate) fn now_us(&self) -> u64 {
        (self.start.elapsed().as_secs_f64() * 1e6 * self.time_scale) as u64
    }

    /// The wall-clock instant at which model time reaches `model_us`.
    pub(crate) fn instant_at(&self, model_us: u64) -> Instant {
        let secs = model_us as f64 / 1e6 / self.time_scale;
        self.start + Duration::from_secs_f64(secs.min(1e9))
    }

    /// Unix time (seconds) at which model time was `model_us`.
    pub(crate) fn unix_secs_at(&self, model_us: u64) -> f64 {
        self.start_unix_secs + model_us as f64 / 1e6 / self.time_scale
    }
}

pub(crate) fn unix_now_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// Where one live request's outputs go.
struct Listener {
    sender: mpsc::UnboundedSender<EngineOutput>,
    /// Whether it wants `Token` outputs (streaming).
    wants_tokens: bool,
    /// Also told the request's last output (`Finished` or `Rejected`), if given.
    on_end: Option<oneshot::Sender<EngineOutput>>,
}

/// One request for `EngineHandle::submit`.
pub(crate) struct Submission {
    pub(crate) prompt: Vec<u32>,
    pub(crate) output_tokens: u32,
    /// Send `Token` outputs (a whole response needs just the first token and the finish).
    pub(crate) wants_tokens: bool,
    pub(crate) stage: PdStage,
    /// The LoRA adapter the request names as its model.
    pub(crate) lora: Option<kvgate_engine::LoraAdapter>,
    /// Lower first, with `--priority-scheduling`.
    pub(crate) priority: i32,
    /// Receives the request's last output (`Finished` or `Rejected`) even if nobody reads the
    /// stream; dropped unsent when the request is cancelled or the engine shuts down.
    pub(crate) on_end: Option<oneshot::Sender<EngineOutput>>,
}

/// A shareable handle to one engine driven in real time.
#[derive(Clone)]
pub(crate) struct EngineHandle {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<DriverState>,
    wake: Notify,
    clock: EngineClock,
    kv_events: Option<mpsc::UnboundedSender<KvEventBatch>>,
}

struct DriverState {
    engine: Engine,
    /// Each live request's listener.
    streams: HashMap<u64, Listener>,
    outputs: Vec<EngineOutput>,
    next_id: u64,
    closed: bool,
}

impl DriverState {
    /// Sends pending outputs to their requests' channels and KV events to the publisher.
    fn dispatch(&mut self, kv_events: Option<&mpsc::UnboundedSender<KvEventBatch>>) {
        for output in self.outputs.drain(..) {
            let id = output.id();
            let last = matches!(output, EngineOutput::Finished { .. } | EngineOutput::Rejected { .. });
            if last {
                if let Some(listener) = self.streams.remove(&id) {
                    if let Some(on_end) = listener.on_end {
                        let _ = on_end.send(output.clone());
                    }
                    // A closed receiver is cleaned up by its `RequestStream`'s drop.
                    let _ = listener.sender.send(output);
                }
            } else if let Some(listener) = self.streams.get(&id) {
                if listener.wants_tokens || !matches!(output, EngineOutput::Token { .. }) {
                    let _ = listener.sender.send(output);
                }
            }
        }
        if let Some(sender) = kv_events {
            for batch in self.engine.drain_kv_events() {
                let _ = sender.send(batch);
            }
        }
    }
}

impl EngineHandle {
    /// Starts an engine and its driver task. KV event batches go to `kv_events` when given.
    pub(crate) fn spawn(
        config: EngineConfig,
        clock: EngineClock,
        kv_events: Option<mpsc::UnboundedSender<KvEventBatch>>,
    ) -> (Self, JoinHandle<()>) {
        let handle = Self {
            shared: Arc::new(Shared {
                state: Mutex::new(DriverState {
                    engine: Engine::new(config),
                    streams: HashMap::new(),
                    outputs: Vec::new(),
                    next_id: 0,
                    closed: false,
                }),
                wake: Notify::new(),
                clock,
                kv_events,
            }),
        };
        let task = tokio::spawn(handle.clone().drive());
        (handle, task)
    }

    fn lock(&self) -> MutexGuard<'_, DriverState> {
        self.shared.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The driver loop: advance to now, then sleep until the running step ends or a submit.
    async fn drive(self) {
        loop {
            let next = {
                let mut state = self.lock();
                if state.closed {
                    return;
                }
                let now = self.shared.clock.now_us();
                let DriverState { engine, outputs, .. } = &mut *state;
                engine.advance(now, outputs);
                state.dispatch(self.shared.kv_events.as_ref());
                state.engine.next_event_time()
            };
            match next {
                Some(model_us) => {
                    let deadline = self.shared.clock.instant_at(model_us);
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => {}
                        () = self.shared.wake.notified() => {}
                    }
                }
                None => self.shared.wake.notified().await,
            }
        }
    }

    /// Submits a request now; its outputs arrive on the returned stream.
    pub(crate) fn submit(&self, submission: Submission) -> RequestStream {
        let Submission { prompt, output_tokens, wants_tokens, stage, lora, priority, on_end } = submission;
        let (sender, receiver) = mpsc::unbounded_channel();
        let id = {
            let mut state = self.lock();
            let id = state.next_id;
            state.next_id += 1;
            if state.closed {
                // Dropping the senders ends the stream (and `on_end`) at once.
                drop((sender, on_end));
            } else {
                state.streams.insert(id, Listener { sender, wants_tokens, on_end });
                let now = self.shared.clock.now_us();
                let DriverState { engine, outputs, .. } = &mut *state;
                engine.submit_as(
                    now,
                    EngineRequest { id, prompt, output_tokens, lora, priority },
                    stage,
                    outputs,
                );
                state.dispatch(self.shared.kv_events.as_ref());
            }
            id
        };
        self.shared.wake.notify_one();
        RequestStream { id, receiver, engine: self.clone(), done: false }
    }

    /// Releases the KV held by the finished `PdStage::Prefill` request `id` (its engine id,
    /// from its `Finished` output); returns whether it held any.
    pub(crate) fn release_held(&self, id: u64) -> bool {
        let released = {
            let mut state = self.lock();
            let now = self.shared.clock.now_us();
            let DriverState { engine, outputs, .. } = &mut *state;
            let released = engine.release_held(now, id, outputs);
            state.dispatch(self.shared.kv_events.as_ref());
            released
        };
        // Freed blocks may have let queued requests in: the driver replans its sleep.
        self.shared.wake.notify_one();
        released
    }

    /// Tokens per KV block.
    pub(crate) fn block_size(&self) -> u32 {
        self.lock().engine.config().block_size
    }

    /// The engine's load now.
    pub(crate) fn load(&self) -> EngineLoad {
        let mut state = self.lock();
        let now = self.shared.clock.now_us();
        let DriverState { engine, outputs, .. } = &mut *state;
        engine.advance(now, outputs);
        state.dispatch(self.shared.kv_events.as_ref());
        state.engine.load(now)
    }

    /// Leading prompt tokens whose KV blocks the engine's prefix cache holds now.
    pub(crate) fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        let mut state = self.lock();
        let now = self.shared.clock.now_us();
        let DriverState { engine, outputs, .. } = &mut *state;
        engine.advance(now, outputs);
        state.dispatch(self.shared.kv_events.as_ref());
        state.engine.cached_prefix_tokens(prompt)
    }

    /// Blocks in the engine's prefix cache now.
    pub(crate) fn cached_blocks(&self) -> usize {
        let mut state = self.lock();
        let now = self.shared.clock.now_us();
        let DriverState { engine, outputs, .. } = &mut *state;
        engine.advance(now, outputs);
        state.dispatch(self.shared.kv_events.as_ref());
        state.engine.cached_blocks()
    }

    /// Clears the prefix cache if nothing uses it (SGLang `/flush_cache`).
    pub(crate) fn flush_cache(&self) -> bool {
        let mut state = self.lock();
        let now = self.shared.clock.now_us();
        let DriverState { engine, outputs, .. } = &mut *state;
        engine.advance(now, outputs);
        let flushed = state.engine.reset_prefix_cache(now);
        state.dispatch(self.shared.kv_events.as_ref());
        flushed
    }

    /// Restarts the engine model as a crashed process comes back: an empty prefix cache, its KV
    /// event sequence from 0, every request it was serving ended (their streams close). Nothing
    /// is published until its next step.
    pub(crate) fn restart(&self) {
        let mut state = self.lock();
        let config = state.engine.config().clone();
        state.engine = Engine::new(config);
        state.streams.clear();
        state.outputs.clear();
        drop(state);
        self.shared.wake.notify_one();
    }

    /// Stops the driver and ends every open request stream.
    pub(crate) fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.streams.clear();
        drop(state);
        self.shared.wake.notify_one();
    }

    fn cancel(&self, id: u64) {
        let mut state = self.lock();
        state.streams.remove(&id);
        state.engine.cancel(id);
    }
}

/// The outputs of one submitted request. Dropping it before `Finished` cancels the request
/// in the engine (a client disconnect).
pub(crate) struct RequestStream {
    id: u64,
    receiver: mpsc::UnboundedReceiver<EngineOutput>,
    engine: EngineHandle,
    done: bool,
}

impl RequestStream {
    /// The next output; `None` if the engine shut down.
    pub(crate) async fn next(&mut self) -> Option<EngineOutput> {
        let output = self.receiver.recv().await;
        self.mark(&output);
        output
    }

    /// The next output if one is ready (`None` also when none is ready yet).
    pub(crate) fn try_next(&mut self) -> Option<EngineOutput> {
        match self.receiver.try_recv() {
            Ok(output) => {
                let output = Some(output);
                self.mark(&output);
                output
            }
            Err(mpsc::error::TryRecvError::Empty) => None,
            Err(mpsc::error::TryRecvError::Disconnected) => {
                self.done = true;
                None
            }
        }
    }

    fn mark(&mut self, output: &Option<EngineOutput>) {
        match output {
            Some(EngineOutput::Finished { .. } | EngineOutput::Rejected { .. }) | None => {
                self.done = true;
            }
            Some(_) => {}
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            self.engine.cancel(self.id);
        }
    }
}
