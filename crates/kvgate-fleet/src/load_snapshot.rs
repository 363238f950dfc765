//! The engines' last loads, by worker: published by the load monitor as an immutable snapshot
//! that the request path reads without locks, and trimmed by whoever removes a worker or marks
//! it unhealthy.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use kvgate_policy::{LoadSample, WorkerId};

/// The latest load sample of each worker, and whether the monitor is polling.
pub struct LoadSnapshot {
    loads: ArcSwap<HashMap<WorkerId, LoadSample>>,
    /// Whether the load monitor polled in its last round (some policy consumes loads).
    active: AtomicBool,
    /// How often the monitor polls; samples older than three intervals are stale.
    pub poll_interval_ms: u64,
}

impl LoadSnapshot {
    pub fn new(poll_interval_ms: u64) -> Self {
        Self {
            loads: ArcSwap::from_pointee(HashMap::new()),
            active: AtomicBool::new(false),
            poll_interval_ms,
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
    }

    /// Keep only the entries of `workers`.
    pub fn retain(&self, workers: &HashSet<WorkerId>) {
        self.loads.rcu(|loads| {
            let mut kept = (**loads).clone();
            kept.retain(|id, _| workers.contains(id));
            kept
        });
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
    }

    pub fn set_active(&self, active: bool) {
        self.active.store(active, Ordering::Relaxed);
    }

    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }
}
