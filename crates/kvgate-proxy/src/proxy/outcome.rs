//! What executing a route plan left: the worker's answer on its way to the client ([`Served`]),
//! what a failed attempt left ([`Failure`]) and the plan's [`Outcome`]. The attempt, the pair,
//! the stream migration and the response all speak of them, so they stand apart from all four
//! and the four import one another one way (the response continues a stream through the
//! migration, never the reverse).

use std::sync::Arc;

use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::conn::UpstreamBody;
use kvgate_gateway_core::error::ApiError;
use kvgate_observe::accuracy::{Learn, Probe};
use kvgate_policy::{Decision, PdChoice};

use crate::body::InFlight;

/// A worker's answer on its way to the client.
pub(super) struct Served {
    pub response: http::Response<UpstreamBody>,
    pub in_flight: InFlight,
    /// The worker whose answer this is (the decode side of a pair).
    pub worker: Arc<Worker>,
    pub decision: Decision,
    /// The prefill side of a disaggregated pair.
    pub prefill: Option<(Arc<Worker>, Decision)>,
    /// What the exact index predicted cached on `worker` (requests routed on token ids).
    pub probe: Option<Probe>,
    /// What kv_aware predicted for the request, to learn from its time to first token.
    pub learn: Option<Learn>,
    /// A disaggregated fleet's path for the request, and why (set by the retry loop).
    pub pd: Option<PdChoice>,
}

/// What a failed attempt left, returned to the client when no retry is possible.
pub(super) enum Failure {
    /// An error answer, not yet read: passed through as is.
    Response(Box<Served>),
    /// No worker could be reached.
    Unreachable(String),
    /// No worker sent its response head in time.
    TimedOut(f64),
}

impl Failure {
    /// What failed, as the trace names it.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Failure::Response(_) => "status",
            Failure::Unreachable(_) => "connect",
            Failure::TimedOut(_) => "timeout",
        }
    }
}

/// The outcome of executing one route plan.
pub(super) enum Outcome {
    Done(Box<Served>),
    /// Nothing reached the client: try again without the failed worker.
    Retry {
        failure: Failure,
        failed: u32,
    },
    Fatal(ApiError),
}
