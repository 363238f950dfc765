//! The gateway's admission in front of the fleet, in virtual time: a concurrency cap
//! (`--max-concurrent-requests`) and the queue in front of it, ordered by the gateway's own
//! [`FairQueue`] (priority classes, then weighted fair queuing on tokens per tenant, the tenant
//! and class from the trace line), with locality preferred within `--fairness-locality-bound`.
//!
//! A request that finds a slot free and nobody waiting goes straight on; otherwise it waits, with
//! its locality score taken as it enters (the tokens the routing policy predicts cached where it
//! would route it then, as the gateway scores a waiter). A finished request's slot goes to the
//! next waiter. Without the cap every request goes straight on (no queue, as before).

use kvgate_policy::{FairQueue, PriorityClass};
use serde::Serialize;

use crate::trace::TraceRequest;

/// How requests are admitted.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AdmissionSetup {
    /// Requests routed and not finished at most (`None`: no cap, no queue).
    pub max_concurrent: Option<usize>,
    /// Tokens of virtual-time deficit within which the queue prefers locality (0: strict).
    pub fairness_locality_bound: u64,
    /// Every request as tenant `default`, class `normal` (the gateway without tenants: FIFO).
    pub ignore_tenants: bool,
}

/// A waiting request: its id (arrival index) and locality score.
#[derive(Clone, Copy, Debug)]
pub(super) struct Waiting {
    pub id: u64,
    pub score: u64,
}

pub(super) struct Admission {
    setup: AdmissionSetup,
    in_flight: usize,
    queue: FairQueue<Waiting>,
}

impl Admission {
    pub(super) fn new(setup: &AdmissionSetup) -> Admission {
        Admission { setup: setup.clone(), in_flight: 0, queue: FairQueue::default() }
    }

    /// Whether queued requests are scored for locality (the cap and a bound > 0).
    pub(super) fn scores_locality(&self) -> bool {
        self.setup.max_concurrent.is_some() && self.setup.fairness_locality_bound > 0
    }

    /// Whether requests wait for a slot.
    pub(super) fn waiting(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Whether a request arriving now may go straight on (and then counts as in flight).
    pub(super) fn try_enter(&mut self) -> bool {
        match self.setup.max_concurrent {
            Some(limit) if self.in_flight >= limit || !self.queue.is_empty() => false,
            _ => {
                self.in_flight += 1;
                true
            }
        }
    }

    /// Queues request `id` (`request` its trace line) with its locality `score`.
    pub(super) fn wait(&mut self, id: u64, request: &TraceRequest, score: u64) {
        let (tenant, class) = match self.setup.ignore_tenants {
            true => ("default", PriorityClass::Normal),
            false => (
                request.tenant.as_deref().unwrap_or("default"),
                request.priority.as_deref().and_then(PriorityClass::parse).unwrap_or_default(),
            ),
        };
        // What the gateway charges at admission: the prompt and the most output tokens.
        let tokens = u64::from(request.input_length) + u64::from(request.output_length);
        self.queue.push(class, tenant, 1.0, tokens, Waiting { id, score });
    }

    /// A request left the fleet: its slot goes to the next waiter, whose id is returned (it
    /// counts as in flight).
    pub(super) fn left(&mut self) -> Option<u64> {
        self.setup.max_concurrent?;
        self.in_flight = self.in_flight.saturating_sub(1);
        let next = self.queue.pop_local(self.setup.fairness_locality_bound, |waiting| waiting.score)?;
        self.in_flight += 1;
        Some(next.id)
    }
}
