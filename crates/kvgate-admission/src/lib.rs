//! kvgate-admission: which proxied request may go now, on `kvgate-observe` (a tenant's share of
//! the KV cache, for `max_kv_share`).
//!
//! `Admission` checks a request's tenant quotas, the gateway-wide rate limit and the concurrency
//! limit, and queues it (priority classes, then weighted fair queuing on tokens per tenant, bent
//! toward cache locality) when no slot is free. The `Permit` it hands out becomes an
//! `AdmissionHold`, which the response body keeps until the answer ends and tells the tokens the
//! answer really used.

pub mod admission;
