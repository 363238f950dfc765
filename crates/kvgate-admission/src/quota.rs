//! Per-tenant quotas: requests per minute, tokens per minute (a request's prompt plus its
//! maximum output, charged at admission, then corrected to what the engine reported it used)
//! and requests at once, each from the tenant's `tenants:` entry laid over the defaults. A
//! request over any of them is refused whole, with the wait after which it would pass. A
//! request that names no maximum output (open-ended) is charged the output open-ended requests
//! have had lately ([`OutputEstimate`]), so a burst of them is cut at the quota, not after it.
//! Tenants' state is kept for the most recently seen [`MAX_TRACKED_TENANTS`] (a forgotten
//! tenant starts again with full buckets).

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lru::LruCache;

use super::bucket::Bucket;
use super::Used;
use kvgate_gateway_core::config::{TenantLimits, TenantsConfig};
pub use kvgate_gateway_core::tenant::{OverQuota, Quota};

/// Most tenants whose buckets and counts are kept at once.
pub(super) const MAX_TRACKED_TENANTS: usize = 16384;

/// What an open-ended request is charged for its output before any was measured: a chat
/// answer's typical length.
pub(super) const FIRST_OUTPUT_ESTIMATE: f64 = 256.0;
/// Weight of the newest answer in the running output estimate.
const ESTIMATE_WEIGHT: f64 = 0.2;

/// The output tokens of the open-ended requests answered lately (every tenant's; an
/// exponentially weighted mean), charged up front to the next ones.
#[derive(Debug)]
struct OutputEstimate(Mutex<f64>);

impl OutputEstimate {
    fn get(&self) -> f64 {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, completion: u64) {
        let mut mean = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *mean += ESTIMATE_WEIGHT * (completion as f64 - *mean);
    }
}

/// What one request is charged at admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cost {
    /// Its prompt plus its maximum output (0 when nothing needs them).
    pub tokens: u64,
    /// It names no maximum output: its output is estimated.
    pub open_ended: bool,
}

#[derive(Debug)]
struct TenantState {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    max_concurrent: Option<usize>,
    in_flight: usize,
}

impl TenantState {
    fn new(limits: &TenantLimits, now: Instant) -> Self {
        Self {
            requests: limits.requests_per_minute.map(|rpm| Bucket::per_minute(rpm, now)),
            tokens: limits.tokens_per_minute.map(|tpm| Bucket::per_minute(tpm, now)),
            max_concurrent: limits.max_concurrent,
            in_flight: 0,
        }
    }

    /// Takes the request's share of every quota, or none of them; `estimate` is added to an
    /// open-ended request's tokens (never past the quota: the estimate alone refuses nothing).
    /// Returns the tokens charged.
    fn take(&mut self, now: Instant, cost: Cost, estimate: f64) -> Result<u64, OverQuota> {
        let mut tokens = cost.tokens;
        if let Some(max) = self.max_concurrent {
            if self.in_flight >= max {
                let refusal = OverQuota {
                    quota: Quota::MaxConcurrent,
                    limit: max as f64,
                    retry_after: Some(Duration::from_secs(1)),
                };
                return Err(refusal);
            }
        }
        if let Some(bucket) = &mut self.requests {
            if let Err(wait) = bucket.check(now, 1.0) {
                return Err(OverQuota {
                    quota: Quota::RequestsPerMinute,
                    limit: bucket.capacity(),
                    retry_after: Some(wait),
                });
            }
        }
        if let Some(bucket) = &mut self.tokens {
            if cost.open_ended {
                let capacity = bucket.capacity() as u64;
                tokens = tokens.saturating_add(estimate.round() as u64).min(capacity.max(tokens));
            }
            let cost = tokens as f64;
            if cost > bucket.capacity() {
                return Err(OverQuota {
                    quota: Quota::TokensPerMinute,
                    limit: bucket.capacity(),
                    retry_after: None,
                });
            }
            if let Err(wait) = bucket.check(now, cost) {
                return Err(OverQuota {
                    quota: Quota::TokensPerMinute,
                    limit: bucket.capacity(),
                    retry_after: Some(wait),
                });
            }
            bucket.charge(cost);
        }
        if let Some(bucket) = &mut self.requests {
            bucket.charge(1.0);
        }
        self.in_flight += 1;
        Ok(tokens)
    }
}

/// Every tenant's quotas.
pub struct TenantQuotas {
    config: TenantsConfig,
    states: Mutex<LruCache<String, Arc<Mutex<TenantState>>>>,
    estimate: Arc<OutputEstimate>,
}

/// A request's hold on its tenant's quotas: one request at once until dropped; what it was
/// charged goes back with [`TenantCharge::refund`] when it is refused later on.
#[derive(Debug)]
pub struct TenantCharge {
    state: Arc<Mutex<TenantState>>,
    tokens: u64,
    /// Set for an open-ended request: its output goes into the estimate.
    estimate: Option<Arc<OutputEstimate>>,
}

impl TenantCharge {
    /// Whether the tenant has a tokens-per-minute quota to correct.
    pub fn counts_tokens(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).tokens.is_some()
    }

    /// The request used `used` (the engine's prompt and output): the difference from what it
    /// was charged at admission is given back, or charged on top (the bucket may owe).
    pub fn settle(&mut self, used: Used) {
        if let Some(estimate) = self.estimate.take() {
            estimate.record(used.completion);
        }
        let tokens = used.prompt.saturating_add(used.completion);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bucket) = &mut state.tokens {
            let charged = self.tokens as f64;
            let used = tokens as f64;
            if used < charged {
                bucket.refund(charged - used);
            } else {
                bucket.charge(used - charged);
            }
        }
        self.tokens = tokens;
    }

    /// The request was not served after all: its request and tokens are given back.
    pub fn refund(self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bucket) = &mut state.requests {
            bucket.refund(1.0);
        }
        if let Some(bucket) = &mut state.tokens {
            bucket.refund(self.tokens as f64);
        }
    }
}

impl Drop for TenantCharge {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.in_flight = state.in_flight.saturating_sub(1);
    }
}

fn limits_anything(limits: &TenantLimits) -> bool {
    limits.requests_per_minute.is_some()
        || limits.tokens_per_minute.is_some()
        || limits.max_concurrent.is_some()
}

impl TenantQuotas {
    pub fn new(config: TenantsConfig) -> Self {
        let capacity = NonZeroUsize::new(MAX_TRACKED_TENANTS).expect("not zero");
        let estimate = Arc::new(OutputEstimate(Mutex::new(FIRST_OUTPUT_ESTIMATE)));
        Self { config, states: Mutex::new(LruCache::new(capacity)), estimate }
    }

    pub fn config(&self) -> &TenantsConfig {
        &self.config
    }

    /// Whether some tenant has a tokens-per-minute quota (requests are then sized).
    pub fn counts_tokens(&self) -> bool {
        self.config.defaults.tokens_per_minute.is_some()
            || self.config.named.values().any(|limits| limits.tokens_per_minute.is_some())
    }

    /// The tenant's weight in the fair queue.
    pub fn weight(&self, tenant: &str) -> f64 {
        self.config.limits(tenant).weight.unwrap_or(1.0)
    }

    /// Charges one request of `tokens` (its whole cost) to `tenant`, or says which quota it is
    /// over. `None`: the tenant has no quota.
    #[cfg(test)]
    pub fn take(&self, tenant: &str, tokens: u64, now: Instant) -> Result<Option<TenantCharge>, OverQuota> {
        self.take_cost(tenant, Cost { tokens, open_ended: false }, now)
    }

    /// As [`TenantQuotas::take`], an open-ended request charged the output estimate on top.
    pub fn take_cost(
        &self,
        tenant: &str,
        cost: Cost,
        now: Instant,
    ) -> Result<Option<TenantCharge>, OverQuota> {
        let limits = self.config.limits(tenant);
        if !limits_anything(&limits) {
            return Ok(None);
        }
        let state = {
            let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
            match states.get(tenant) {
                Some(state) => state.clone(),
                None => {
                    let state = Arc::new(Mutex::new(TenantState::new(&limits, now)));
                    states.put(tenant.to_string(), state.clone());
                    state
                }
            }
        };
        let tokens = state.lock().unwrap_or_else(|p| p.into_inner()).take(now, cost, self.estimate.get())?;
        let estimate = cost.open_ended.then(|| self.estimate.clone());
        Ok(Some(TenantCharge { state, tokens, estimate }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas(yaml: &str) -> TenantQuotas {
        TenantQuotas::new(serde_norway::from_str(yaml).unwrap())
    }

    #[test]
    fn each_quota_refuses_with_the_wait_until_it_would_pass() {
        let now = Instant::now();
        let rpm = quotas("defaults: {requests_per_minute: 2}");
        let _a = rpm.take("t", 0, now).unwrap();
        let _b = rpm.take("t", 0, now).unwrap();
        let refused = rpm.take("t", 0, now).unwrap_err();
        assert_eq!(refused.quota, Quota::RequestsPerMinute);
        assert!((refused.retry_after.unwrap().as_secs_f64() - 30.0).abs() < 1e-6, "{refused:?}");
        // Another tenant has its own bucket.
        assert!(rpm.take("u", 0, now).is_ok());

        let tpm = quotas("defaults: {tokens_per_minute: 600}");
        let charge = tpm.take("t", 500, now).unwrap().unwrap();
        let refused = tpm.take("t", 200, now).unwrap_err();
        assert_eq!(refused.quota, Quota::TokensPerMinute);
        assert!((refused.retry_after.unwrap().as_secs_f64() - 10.0).abs() < 1e-6);
        assert_eq!(tpm.take("t", 601, now).unwrap_err().retry_after, None);
        charge.refund();
        assert!(tpm.take("t", 600, now).is_ok());

        let concurrent = quotas("defaults: {max_concurrent: 1}\nnamed: {wide: {max_concurrent: 2}}");
        let held = concurrent.take("t", 0, now).unwrap();
        assert_eq!(concurrent.take("t", 0, now).unwrap_err().quota, Quota::MaxConcurrent);
        drop(held);
        assert!(concurrent.take("t", 0, now).is_ok());
        let _w1 = concurrent.take("wide", 0, now).unwrap();
        assert!(concurrent.take("wide", 0, now).is_ok());
    }

    #[test]
    fn a_charge_is_corrected_both_ways_to_what_was_used() {
        let now = Instant::now();
        let tpm = quotas("defaults: {tokens_per_minute: 1000}");
        let mut charge = tpm.take("t", 800, now).unwrap().unwrap();
        assert!(charge.counts_tokens());
        // Used 100 of the 800 charged: 700 come back.
        charge.settle(Used { prompt: 40, completion: 60 });
        assert!(tpm.take("t", 900, now).is_ok());
        // Used 300 more than charged: the bucket owes.
        let mut over = tpm.take("u", 100, now).unwrap().unwrap();
        over.settle(Used { prompt: 100, completion: 1000 });
        assert_eq!(tpm.take("u", 1, now).unwrap_err().quota, Quota::TokensPerMinute);
    }

    #[test]
    fn an_open_ended_request_is_charged_the_output_open_ended_answers_had() {
        let now = Instant::now();
        let tpm = quotas("defaults: {tokens_per_minute: 1000000}");
        let open = |tokens| Cost { tokens, open_ended: true };
        // Before any answer: the first estimate on top of the prompt.
        let first = tpm.take_cost("t", open(10), now).unwrap().unwrap();
        assert_eq!(first.tokens, 10 + FIRST_OUTPUT_ESTIMATE as u64);
        drop(first);
        for _ in 0..30 {
            let mut charge = tpm.take_cost("t", open(10), now).unwrap().unwrap();
            charge.settle(Used { prompt: 10, completion: 300 });
        }
        // The estimate follows the answers (every tenant's), and never refuses a request alone.
        let learned = tpm.take_cost("u", open(10), now).unwrap().unwrap();
        assert!((300..=310).contains(&learned.tokens), "{}", learned.tokens);
        // A closed request's answer teaches nothing.
        let mut closed = tpm.take_cost("u", Cost { tokens: 20, open_ended: false }, now).unwrap().unwrap();
        closed.settle(Used { prompt: 10, completion: 5 });
        assert!((300..=310).contains(&tpm.take_cost("u", open(10), now).unwrap().unwrap().tokens));
        let small = quotas("defaults: {tokens_per_minute: 100}");
        assert_eq!(small.take_cost("t", open(10), now).unwrap().unwrap().tokens, 100);
        // A request naming its maximum is charged just that.
        assert_eq!(
            tpm.take_cost("v", Cost { tokens: 50, open_ended: false }, now).unwrap().unwrap().tokens,
            50
        );
    }

    #[test]
    fn a_refused_request_takes_nothing() {
        let now = Instant::now();
        let both = quotas("defaults: {requests_per_minute: 1, tokens_per_minute: 100}");
        // Over the token quota: the request quota is not spent either.
        assert!(both.take("t", 200, now).is_err());
        assert!(both.take("t", 50, now).is_ok());
        assert!(quotas("named: {x: {weight: 2}}").take("x", 10, now).unwrap().is_none());
    }
}
