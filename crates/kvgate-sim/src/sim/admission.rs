//! The gateway's admission in front of the fleet, in virtual time: a concurrency cap
//! (`--max-concurrent-requests`) and the queue in front of it, ordered by the gateway's own
//! [`FairQueue`] (priority classes, then weighted fair queuing on tokens per tenant, the tenant
//! from the trace line, the class from its `priority` or the tenant's in `--tenants`, weights
//! from `--tenants`), with locality preferred within `--fairness-locality-bound` and each
//! class's reserved concurrency kept from the classes below it (the gateway's [`ClassSlots`]).
//!
//! A request that finds a slot free for its class and nobody of its class or above waiting goes
//! straight on; otherwise it waits, with its locality score taken as it enters (the tokens the
//! routing policy predicts cached where it would route it then, as the gateway scores a
//! waiter). A finished request's slot goes to the waiters it makes room for. Without the cap
//! every request goes straight on (no queue, as before).

use std::collections::HashMap;

use kvgate_policy::{ClassSlots, FairQueue, PriorityClass, TenantsConfig};
use serde::Serialize;

use kvgate_trace::TraceRequest;

/// How requests are admitted.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AdmissionSetup {
    /// Requests routed and not finished at most (`None`: no cap, no queue).
    pub max_concurrent: Option<usize>,
    /// Tokens of virtual-time deficit within which the queue prefers locality (0: strict).
    pub fairness_locality_bound: u64,
    /// Every request as tenant `default`, class `normal` (the gateway without tenants: FIFO).
    pub ignore_tenants: bool,
    /// The gateway's `tenants:` section (`--tenants`): each tenant's weight and class, each
    /// class's reserved concurrency.
    pub tenants: TenantsConfig,
}

impl AdmissionSetup {
    /// The tenant and class the gateway would give `request`: the trace line's (its `priority`
    /// as the priority header, else the tenant's class in `tenants:`), or `default`/`normal`
    /// with `ignore_tenants`.
    pub fn identify<'a>(&self, request: &'a TraceRequest) -> (&'a str, PriorityClass) {
        if self.ignore_tenants {
            return ("default", PriorityClass::Normal);
        }
        let tenant = request.tenant.as_deref().unwrap_or("default");
        let class = request
            .priority
            .as_deref()
            .and_then(PriorityClass::parse)
            .or_else(|| self.tenants.limits(tenant).class)
            .unwrap_or_default();
        (tenant, class)
    }
}

/// A waiting request: its id (arrival index) and locality score.
#[derive(Clone, Copy, Debug)]
pub(super) struct Waiting {
    pub id: u64,
    pub score: u64,
}

pub(super) struct Admission {
    setup: AdmissionSetup,
    /// The cap's slots by class (`None`: no cap).
    slots: Option<ClassSlots>,
    /// The class of each request holding a slot.
    holding: HashMap<u64, PriorityClass>,
    queue: FairQueue<Waiting>,
}

impl Admission {
    pub(super) fn new(setup: &AdmissionSetup) -> Admission {
        let reserved = setup.tenants.reserved_concurrency();
        Admission {
            setup: setup.clone(),
            slots: setup.max_concurrent.map(|limit| ClassSlots::new(limit, reserved)),
            holding: HashMap::new(),
            queue: FairQueue::default(),
        }
    }

    /// The class the gateway gives `request`, which it forwards to the engine as the
    /// request's priority (`kvgate launch --forward-priority`).
    pub(super) fn class_of(&self, request: &TraceRequest) -> PriorityClass {
        self.setup.identify(request).1
    }

    /// Whether queued requests are scored for locality (the cap and a bound > 0).
    pub(super) fn scores_locality(&self) -> bool {
        self.setup.max_concurrent.is_some() && self.setup.fairness_locality_bound > 0
    }

    /// Whether requests wait for a slot.
    pub(super) fn waiting(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Whether request `id` (`request` its trace line), arriving now, may go straight on (and
    /// then holds a slot): a slot is free for its class and none of its class or above waits.
    pub(super) fn try_enter(&mut self, id: u64, request: &TraceRequest) -> bool {
        let Some(slots) = &mut self.slots else { return true };
        let (_, class) = self.setup.identify(request);
        if !slots.may_enter(class) || self.queue.waits_at_or_above(class) {
            return false;
        }
        slots.enter(class);
        self.holding.insert(id, class);
        true
    }

    /// Queues request `id` (`request` its trace line) with its locality `score`.
    pub(super) fn wait(&mut self, id: u64, request: &TraceRequest, score: u64) {
        let (tenant, class) = self.setup.identify(request);
        let weight = match self.setup.ignore_tenants {
            true => 1.0,
            false => self.setup.tenants.limits(tenant).weight.unwrap_or(1.0),
        };
        // What the gateway charges at admission: the prompt and the most output tokens.
        let tokens = u64::from(request.input_length) + u64::from(request.output_length);
        self.queue.push(class, tenant, weight, tokens, Waiting { id, score });
    }

    /// Request `id` left the fleet: it frees its slot.
    pub(super) fn left(&mut self, id: u64) {
        if let (Some(slots), Some(class)) = (&mut self.slots, self.holding.remove(&id)) {
            slots.leave(class);
        }
    }

    /// The next waiter a free slot admits, if any (it then holds the slot).
    pub(super) fn next(&mut self) -> Option<u64> {
        let slots = self.slots.as_mut()?;
        let class = self.queue.highest_class().filter(|&class| slots.may_enter(class))?;
        let waiting = self.queue.pop_local(self.setup.fairness_locality_bound, |waiting| waiting.score)?;
        slots.enter(class);
        self.holding.insert(waiting.id, class);
        Some(waiting.id)
    }
}
