//! kvgate-admission: which proxied request may go now, on `kvgate-observe` (a tenant's share of
//! the KV cache, for `max_kv_share`).
//!
//! Admission of proxied requests, in this order: the tenant's quotas (`quota.rs`: requests and
//! tokens per minute, requests at once; over one: 429 with `Retry-After`), the gateway-wide
//! token-bucket rate limit (`--rate-limit-tokens-per-second` requests per second, bursts of up
//! to one second's worth), and the concurrency limit (`--max-concurrent-requests`) with the
//! bounded queue in front of it (`--queue-size` waiting requests, each for at most its class's
//! queue timeout, `--queue-timeout-secs` by default). The queue serves higher priority classes
//! first and, within a class, tenants by weighted fair queuing on tokens
//! (`kvgate_policy::FairQueue`), bent toward cache locality within `--fairness-locality-bound`
//! (each waiter scored as it enters, by the caller: the prompt tokens the routing policy
//! predicts cached where it would route the request). A class's `reserved_concurrency` keeps
//! slots from the classes below it (`kvgate_policy::ClassSlots`), so its requests find one
//! free while lower classes hold the rest. A request that finds the queue full, or no room
//! and no queue, is refused with 429; one that waited its full time gets 408.
//!
//! The `Permit` admission hands out becomes an `AdmissionHold`, which the response body keeps
//! until the answer ends and tells the tokens the answer really used.

mod bucket;
mod hold;
mod quota;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use bucket::Bucket;
pub use hold::{AdmissionHold, Used};
use kvgate_gateway_core::config::TenantsConfig;
use kvgate_gateway_core::error::ApiError;
use kvgate_gateway_core::metrics::{AdmissionMetrics, TenantClassSeries};
use kvgate_gateway_core::tenant::{PriorityClass, DEFAULT_TENANT};
use kvgate_observe::kv_map::KvMap;
use kvgate_policy::{ClassSlots, FairQueue};
use quota::{TenantCharge, TenantQuotas};

/// What admission needs to know of a request.
#[derive(Clone, Copy, Debug)]
pub struct Ticket<'a> {
    pub tenant: &'a str,
    pub class: PriorityClass,
    /// Prompt plus maximum output tokens (0 when nothing needs them).
    pub tokens: u64,
    /// The request names no maximum output: a tokens-per-minute quota charges it the output
    /// estimate on top (`quota.rs`).
    pub open_ended: bool,
}

/// The concurrency limit and the requests waiting for a slot.
struct Slots {
    /// `--fairness-locality-bound` (0: strict fair order).
    locality_bound: u64,
    state: Mutex<SlotState>,
}

/// A waiter's wake-up and its locality score.
type Waiting = (oneshot::Sender<()>, u64);

struct SlotState {
    in_use: ClassSlots,
    waiting: FairQueue<Waiting>,
}

impl SlotState {
    /// Whether a request of `class` arriving now takes a slot at once: one is free for its class
    /// and no request of its class or a higher one waits.
    fn takes_at_once(&self, class: PriorityClass) -> bool {
        self.in_use.may_enter(class) && !self.waiting.waits_at_or_above(class)
    }
}

impl Slots {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Frees a slot `class` held: the waiters it makes room for get one, highest class first.
    fn release(&self, class: PriorityClass) {
        let mut state = self.lock();
        state.in_use.leave(class);
        while let Some(next) = state.waiting.highest_class().filter(|&next| state.in_use.may_enter(next)) {
            let Some((waiter, _)) = state.waiting.pop_local(self.locality_bound, |(_, score)| *score) else {
                break;
            };
            // Handed over even when its receiver is gone: the entry was still queued, so its
            // `Waiter` is alive, and dropping it frees the slot (`leave` finds it popped).
            state.in_use.enter(next);
            let _ = waiter.send(());
        }
    }
}

/// A concurrency slot of a class, held until dropped.
struct Slot(Arc<Slots>, PriorityClass);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.release(self.1);
    }
}

/// A request waiting for a slot: dropped before it got one (gave up, or the client left), it
/// leaves the queue; granted meanwhile, it frees the slot again.
struct Waiter {
    slots: Arc<Slots>,
    class: PriorityClass,
    id: u64,
    settled: bool,
}

impl Waiter {
    /// Leaves the queue; `false` when the slot was already handed over.
    fn leave(&mut self) -> bool {
        self.settled = true;
        self.slots.lock().waiting.remove(self.id).is_some()
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if !self.settled && !self.leave() {
            self.slots.release(self.class);
        }
    }
}

/// What an admitted request holds until its answer ends: its concurrency slot and its share of
/// its tenant's quotas.
#[derive(Default)]
pub struct Permit {
    #[allow(dead_code, reason = "held: its Drop frees the slot")]
    slot: Option<Slot>,
    tenant: Option<TenantCharge>,
}

impl Permit {
    /// Whether the answer's usage is wanted: a tokens-per-minute charge is corrected with it.
    pub fn wants_usage(&self) -> bool {
        self.tenant.as_ref().is_some_and(TenantCharge::counts_tokens)
    }

    /// The permit as something to hold until the answer ends (`None` when it holds nothing).
    pub fn into_hold(self) -> Option<Box<dyn AdmissionHold>> {
        (self.slot.is_some() || self.tenant.is_some()).then(|| Box::new(self) as Box<dyn AdmissionHold>)
    }
}

impl AdmissionHold for Permit {
    fn wants_usage(&self) -> bool {
        Permit::wants_usage(self)
    }

    fn used(&mut self, used: Used) {
        if let Some(charge) = &mut self.tenant {
            charge.settle(used);
        }
    }
}

pub struct Admission {
    slots: Option<Arc<Slots>>,
    bucket: Option<Mutex<Bucket>>,
    queue_size: usize,
    queued: AtomicUsize,
    /// Each class's queue timeout, by rank.
    class_timeouts: [Duration; 3],
    tenants: TenantQuotas,
    labels: TenantLabels,
    metrics: AdmissionMetrics,
    /// Each tenant's share of the fleet's KV (`max_kv_share`).
    kv_map: Arc<KvMap>,
}

/// Decrements the queue depth when the wait ends, however it ends.
struct Queued<'a>(&'a Admission);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
        self.0.metrics.queue_depth.dec();
    }
}

/// The gateway-wide limits.
pub struct Limits {
    pub max_concurrent: Option<usize>,
    pub rate_per_sec: Option<f64>,
    pub queue_size: usize,
    pub queue_timeout: Duration,
    /// `--fairness-locality-bound`.
    pub locality_bound: u64,
}

/// The `tenant` label of the per-tenant series: the tenants named in `tenants:` or by a client
/// key, and `default`; every other tenant is counted as `other`, so the series stay bounded
/// whatever clients put in a header. Each label's series are resolved once per class and kept
/// with it, so admitting a request hashes no label and allocates nothing.
struct TenantLabels {
    named: std::sync::RwLock<HashMap<String, Arc<TenantSeries>>>,
    other: Arc<TenantSeries>,
}

/// One tenant label and its series, by class (made on the class's first request).
pub struct TenantSeries {
    label: Arc<str>,
    classes: [OnceLock<TenantClassSeries>; 3],
}

impl TenantSeries {
    fn new(label: &str) -> Arc<Self> {
        Arc::new(Self { label: label.into(), classes: Default::default() })
    }

    fn of(&self, class: PriorityClass, metrics: &AdmissionMetrics) -> &TenantClassSeries {
        self.classes[class.rank()].get_or_init(|| metrics.tenant_class_series(&self.label, class.as_str()))
    }
}

/// Most distinct tenant labels.
const MAX_TENANT_LABELS: usize = 1000;
const OTHER_TENANTS: &str = "other";

impl TenantLabels {
    fn new<'a>(names: impl Iterator<Item = &'a str>) -> Self {
        let labels = TenantLabels { named: Default::default(), other: TenantSeries::new(OTHER_TENANTS) };
        labels.extend(names);
        labels
    }

    fn extend<'a>(&self, names: impl Iterator<Item = &'a str>) {
        let mut named = self.named.write().unwrap_or_else(|p| p.into_inner());
        for name in std::iter::once(DEFAULT_TENANT).chain(names) {
            if named.len() >= MAX_TENANT_LABELS {
                break;
            }
            named.entry(name.to_string()).or_insert_with(|| TenantSeries::new(name));
        }
    }

    fn series(&self, tenant: &str) -> Arc<TenantSeries> {
        let named = self.named.read().unwrap_or_else(|p| p.into_inner());
        named.get(tenant).unwrap_or(&self.other).clone()
    }
}

impl Admission {
    pub fn new(
        limits: Limits,
        tenants: TenantsConfig,
        metrics: AdmissionMetrics,
        kv_map: Arc<KvMap>,
    ) -> Self {
        let class_timeouts = PriorityClass::ALL.map(|class| {
            tenants
                .classes
                .get(&class)
                .and_then(|settings| settings.queue_timeout_secs)
                .map_or(limits.queue_timeout, Duration::from_secs_f64)
        });
        let labels = TenantLabels::new(tenants.named.keys().map(String::as_str));
        let reserved = tenants.reserved_concurrency();
        Self {
            slots: limits.max_concurrent.map(|limit| {
                Arc::new(Slots {
                    locality_bound: limits.locality_bound,
                    state: Mutex::new(SlotState {
                        in_use: ClassSlots::new(limit, reserved),
                        waiting: FairQueue::default(),
                    }),
                })
            }),
            bucket: limits.rate_per_sec.map(|rate| Mutex::new(Bucket::per_second(rate, Instant::now()))),
            queue_size: limits.queue_size,
            queued: AtomicUsize::new(0),
            class_timeouts,
            tenants: TenantQuotas::new(tenants),
            labels,
            metrics,
            kv_map,
        }
    }

    /// The `tenant` label of `tenant`'s series (the tenants named in `tenants:` or by a client
    /// key, and `default`; `other` for the rest).
    pub fn tenant_label(&self, tenant: &str) -> Arc<str> {
        self.labels.series(tenant).label.clone()
    }

    /// Tenants named by client keys get series of their own too.
    pub fn name_tenants<'a>(&self, names: impl Iterator<Item = &'a str>) {
        self.labels.extend(names);
    }

    /// The class `tenants:` gives `tenant`, if any.
    pub fn class_of(&self, tenant: &str) -> Option<PriorityClass> {
        self.tenants.config().limits(tenant).class
    }

    /// Whether requests' token counts matter (a tokens-per-minute quota, or a fair queue).
    pub fn counts_tokens(&self) -> bool {
        self.tenants.counts_tokens() || (self.slots.is_some() && self.queue_size > 0)
    }

    fn refuse(&self, reason: &str, ticket: &Ticket<'_>, tenant: &str) -> ApiError {
        self.metrics.rejected.with_label_values(&[reason]).inc();
        self.metrics.tenant_rejected.with_label_values(&[tenant, ticket.class.as_str(), reason]).inc();
        match reason {
            "rate_limited" => ApiError::RateLimited,
            "queue_timeout" => ApiError::QueueTimeout(self.class_timeouts[ticket.class.rank()].as_secs_f64()),
            _ => {
                ApiError::TooManyRequests(self.slots.as_ref().map_or(0, |slots| slots.lock().in_use.limit()))
            }
        }
    }

    /// Enters the queue, or says why not.
    fn enqueue(&self, reason: &str, ticket: &Ticket<'_>, tenant: &str) -> Result<Queued<'_>, ApiError> {
        let admitted = self
            .queued
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < self.queue_size).then_some(n + 1))
            .is_ok();
        if !admitted {
            return Err(self.refuse(reason, ticket, tenant));
        }
        self.metrics.queue_depth.inc();
        Ok(Queued(self))
    }

    /// A rate-limit token: now (`None`), reserved after a wait the queue allows, or refused.
    fn token(
        &self,
        ticket: &Ticket<'_>,
        tenant: &str,
        timeout: Duration,
    ) -> Result<Option<Duration>, ApiError> {
        let Some(bucket) = &self.bucket else { return Ok(None) };
        let now = Instant::now();
        let mut bucket = bucket.lock().unwrap_or_else(|p| p.into_inner());
        match bucket.take(now) {
            Ok(()) => Ok(None),
            Err(wait) if self.queue_size == 0 || wait > timeout || self.queue_full() => {
                drop(bucket);
                Err(self.refuse("rate_limited", ticket, tenant))
            }
            Err(_) => Ok(Some(bucket.reserve(now))),
        }
    }

    fn queue_full(&self) -> bool {
        self.queued.load(Ordering::Relaxed) >= self.queue_size
    }

    /// Whether waiters are scored for locality (a queue and `--fairness-locality-bound` > 0).
    pub fn scores_locality(&self) -> bool {
        self.slots.as_ref().is_some_and(|slots| slots.locality_bound > 0) && self.queue_size > 0
    }

    /// Admits one request: its tenant's quotas, a rate-limit token and a concurrency slot,
    /// waiting in the queue when allowed.
    #[cfg(test)]
    pub async fn admit(&self, ticket: Ticket<'_>) -> Result<Permit, ApiError> {
        self.admit_scored(ticket, || 0).await
    }

    /// Admits one request as [`Admission::admit`] does; `locality` is called (once, before any
    /// lock is taken) when the request must wait for a slot and waiters are scored: its
    /// locality score.
    pub async fn admit_scored(
        &self,
        ticket: Ticket<'_>,
        locality: impl FnOnce() -> u64,
    ) -> Result<Permit, ApiError> {
        let series = self.labels.series(ticket.tenant);
        let tenant: &str = &series.label;
        let class = ticket.class.as_str();
        let cost = quota::Cost { tokens: ticket.tokens, open_ended: ticket.open_ended };
        let charge = match self.tenants.take_cost(ticket.tenant, cost, Instant::now()) {
            Ok(charge) => charge,
            Err(over) => {
                self.metrics.tenant_rejected.with_label_values(&[tenant, class, over.quota.as_str()]).inc();
                return Err(ApiError::OverQuota { tenant: ticket.tenant.to_string(), over });
            }
        };
        // Nothing can wait without a rate limit or a concurrency limit: no clock read then.
        let started = (self.bucket.is_some() || self.slots.is_some()).then(tokio::time::Instant::now);
        match self.admit_slot(&ticket, tenant, locality).await {
            Ok(slot) => {
                let own = series.of(ticket.class, &self.metrics);
                own.queue_wait.observe(started.map_or(0.0, |started| started.elapsed().as_secs_f64()));
                own.requests.inc();
                own.tokens.inc_by(ticket.tokens);
                Ok(Permit { slot, tenant: charge })
            }
            Err(error) => {
                if let Some(charge) = charge {
                    charge.refund();
                }
                Err(error)
            }
        }
    }

    async fn admit_slot(
        &self,
        ticket: &Ticket<'_>,
        tenant: &str,
        locality: impl FnOnce() -> u64,
    ) -> Result<Option<Slot>, ApiError> {
        let timeout = self.class_timeouts[ticket.class.rank()];
        let deadline = tokio::time::Instant::now() + timeout;
        let mut queued = None;
        if let Some(wait) = self.token(ticket, tenant, timeout)? {
            queued = Some(self.enqueue("rate_limited", ticket, tenant)?);
            tokio::time::sleep(wait).await;
        }
        let Some(slots) = &self.slots else { return Ok(None) };
        // Scored before the lock is held, and only when the request is likely to wait.
        let class = ticket.class;
        let busy = self.scores_locality() && !slots.lock().takes_at_once(class);
        // A tenant over its `max_kv_share` of the fleet's KV waits in fair order only: its
        // requests lose their locality priority before any other tenant's lose their hits.
        let score = if busy && !self.kv_map.over_share(tenant) { locality() } else { 0 };
        let receiver = {
            let mut state = slots.lock();
            if state.takes_at_once(class) {
                state.in_use.enter(class);
                return Ok(Some(Slot(slots.clone(), class)));
            }
            if self.queue_size == 0 {
                drop(state);
                return Err(self.refuse("concurrency", ticket, tenant));
            }
            if queued.is_none() {
                drop(state);
                queued = Some(self.enqueue("queue_full", ticket, tenant)?);
                state = slots.lock();
                if state.takes_at_once(class) {
                    state.in_use.enter(class);
                    return Ok(Some(Slot(slots.clone(), class)));
                }
            }
            let (sender, receiver) = oneshot::channel();
            let weight = self.tenants.weight(ticket.tenant);
            let id = state.waiting.push(ticket.class, ticket.tenant, weight, ticket.tokens, (sender, score));
            (Waiter { slots: slots.clone(), class, id, settled: false }, receiver)
        };
        let (mut waiter, receiver) = receiver;
        let _queued = queued;
        match tokio::time::timeout_at(deadline, receiver).await {
            Ok(Ok(())) => {
                waiter.settled = true;
                Ok(Some(Slot(slots.clone(), class)))
            }
            _ => {
                if waiter.leave() {
                    Err(self.refuse("queue_timeout", ticket, tenant))
                } else {
                    // Handed a slot as the time ran out: take it.
                    Ok(Some(Slot(slots.clone(), class)))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
