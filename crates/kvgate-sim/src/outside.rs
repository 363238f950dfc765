//! The outside-policy API: a router that is not one of kvgate's policies (a peer's, e.g. Dynamo's selection core in `benches/dynamo-sim`) run by the simulator on the same trace, engines, clock and report as kvgate's own.
//!
//! The simulator calls an [`OutsidePolicy`] where it would call the gateway's policy, in virtual
//! time: every KV event batch an engine emits, as it emits it ([`OutsidePolicy::kv_events`]);
//! every arriving request, with every engine as a candidate carrying what the gateway would
//! know of it (requests in flight from this router, the load monitor's last sample)
//! ([`OutsidePolicy::select`]); the first token and the end of every request it routed. The
//! outside policy keeps whatever state it likes (its own index, booked loads); the simulator
//! keeps none for it. kvgate's policies never go through this API (they stay pure functions
//! of their inputs, `kvgate_policy::Policy`); it runs on a regular fleet only.

pub use kvgate_engine::{KvEvent, KvEventBatch, Tier};
pub use kvgate_policy::LoadSample;

/// One engine as the outside policy sees it when it chooses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OutsideCandidate {
    /// The engine's index in the fleet, `0..n_workers` (what `select` returns).
    pub worker: usize,
    /// Requests routed there and not finished yet.
    pub in_flight: u64,
    /// The load monitor's last sample of the engine (every `--load-monitor-interval-ms` of
    /// virtual time), `None` before the first.
    pub load: Option<LoadSample>,
}

/// The request to route: what the gateway knows of it on arrival (not its output length).
#[derive(Clone, Copy, Debug)]
pub struct OutsideRequest<'a> {
    /// The simulator's request id, given back in `first_token` and `finished`.
    pub id: u64,
    /// The prompt's token ids (whole KV blocks of `--kv-block-size` tokens, then a tail).
    pub prompt: &'a [u32],
    pub prompt_tokens: u32,
    /// The request's session key (its conversation), as `consistent_hashing` routes by.
    pub session: &'a str,
    /// Virtual time of the arrival, in microseconds.
    pub now_us: u64,
}

/// A router run by the simulator in place of kvgate's policy (see the module doc).
///
/// Calls come in virtual-time order. An engine's KV events reach the policy before any later
/// `select`, as the gateway's KV-event subscriber delivers them (with no delay).
pub trait OutsidePolicy {
    /// Engine `worker` emitted `batches` at virtual time `now_us` (stores, removals, clears).
    fn kv_events(&mut self, worker: usize, batches: &[KvEventBatch], now_us: u64);

    /// The engine for `request`, one of `candidates[..].worker`; `None` leaves the request
    /// unrouted (counted in the report).
    fn select(&mut self, request: &OutsideRequest<'_>, candidates: &[OutsideCandidate]) -> Option<usize>;

    /// Request `id` routed to `worker` produced its first token (its prefill is done).
    fn first_token(&mut self, worker: usize, id: u64, now_us: u64) {
        let _ = (worker, id, now_us);
    }

    /// Request `id` left `worker`: finished, or refused by the engine.
    fn finished(&mut self, worker: usize, id: u64, now_us: u64);
}
