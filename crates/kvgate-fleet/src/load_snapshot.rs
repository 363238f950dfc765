//! The engines' last loads, by worker: published by the load monitor as an immutable snapshot
//! that the request path reads without locks, and trimmed by whoever removes a worker or marks
//! it unhealthy. Every change is told to the large pools' load orders too (`pool_order`), so an
//! order's samples are the snapshot's.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use kvgate_policy::{LoadSample, WorkerId};

use crate::pool_order::OrderBook;

/// The latest load sample of each worker, and whether the monitor is polling.
pub struct LoadSnapshot {
    loads: ArcSwap<HashMap<WorkerId, LoadSample>>,
    /// Whether the load monitor polled in its last round (some policy consumes loads).
    active: AtomicBool,
    /// How often the monitor polls; samples older than three intervals are stale.
    pub poll_interval_ms: u64,
    /// The load orders of the large pools (the registry's).
    orders: Arc<OrderBook>,
}

impl LoadSnapshot {
    /// A snapshot that tells no load order (no pool of the registry is large, or none is kept).
    pub fn new(poll_interval_ms: u64) -> Self {
        Self::with_orders(poll_interval_ms, Arc::default())
    }

    /// A snapshot whose changes move the workers of `orders` (`Registry::orders`).
    pub fn with_orders(poll_interval_ms: u64, orders: Arc<OrderBook>) -> Self {
        Self {
            loads: ArcSwap::from_pointee(HashMap::new()),
            active: AtomicBool::new(false),
            poll_interval_ms,
            orders,
        }
    }

    /// The current snapshot (cheap; no lock, no reference count taken).
    pub fn load(&self) -> Guard<Arc<HashMap<WorkerId, LoadSample>>> {
        self.loads.load()
    }

    /// Forget a worker's entry at once (it was removed, or is no longer healthy).
    pub fn forget(&self, worker: WorkerId) {
        self.loads.rcu(|loads| {
            let mut next = (**loads).clone();
            next.remove(&worker);
            next
        });
        self.orders.set_loads([(worker, None)]);
        crate::worker::moved();
    }

    /// Keep only the entries of `workers`.
    pub fn retain(&self, workers: &HashSet<WorkerId>) {
        // Nothing to drop (the usual case): no copy of the snapshot.
        if self.loads.load().keys().all(|id| workers.contains(id)) {
            return;
        }
        let mut dropped = Vec::new();
        self.loads.rcu(|loads| {
            dropped.clear();
            let mut kept = (**loads).clone();
            kept.retain(|id, _| {
                let keep = workers.contains(id);
                if !keep {
                    dropped.push(*id);
                }
                keep
            });
            kept
        });
        self.orders.set_loads(dropped.into_iter().map(|id| (id, None)));
    }

    /// Publish samples that arrived, except those of workers not in `registered`.
    pub fn publish(&self, arrived: &[(WorkerId, LoadSample)], registered: &HashSet<WorkerId>) {
        self.loads.rcu(|loads| {
            let mut next = (**loads).clone();
            for (id, sample) in arrived {
                if registered.contains(id) {
                    next.insert(*id, *sample);
                }
            }
            next
        });
        let published = arrived.iter().filter(|(id, _)| registered.contains(id));
        self.orders.set_loads(published.map(|&(id, sample)| (id, Some(sample))));
    }

    pub fn set_active(&self, active: bool) {
        self.active.store(active, Ordering::Relaxed);
    }

    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }
}
