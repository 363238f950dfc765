//! A large pool's load order (`kvgate_route::LoadOrder`), kept as its workers' loads change, so
//! that a decision's candidate search reads the fronts of the orders instead of every worker.
//!
//! Kept for a pool of more than [`ORDER_ABOVE`] workers (the plan shortlists above
//! `kvgate_route::SHORTLIST_ABOVE` routable ones), dropped when it shrinks to half that; a small
//! pool's requests pay nothing for it. It holds the pool's healthy workers, each with its requests
//! in flight (moved by the worker's `begin_request` and `end_request`) and the load sample the
//! gateway's `LoadSnapshot` holds for it (moved when the snapshot publishes, forgets or trims).
//! A worker whose circuit is open stays in it: the search's lookup leaves it out.
//!
//! Every change of a worker is made by reading the worker's state again under the order's lock
//! ([`PoolOrder::refresh`]), so concurrent changes leave the order as the last of them saw it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kvgate_policy::{Candidate, LoadSample, WorkerId};
use kvgate_route::LoadOrder;

/// A pool of more workers than this keeps a load order (one of at most half as many drops it).
pub const ORDER_ABOVE: usize = kvgate_route::SHORTLIST_ABOVE;

/// What an order reads of a worker (under the order's lock) and tells it: the registry's
/// `Worker` is one; the order does not name it, so the worker may name its order.
pub trait OrderMember {
    fn member_id(&self) -> WorkerId;
    fn member_healthy(&self) -> bool;
    fn member_in_flight(&self) -> u64;
    /// The order it is kept in from now on (`None`: none).
    fn keep_in(&self, order: Option<Arc<PoolOrder>>);
}

/// One pool's order.
#[derive(Debug, Default)]
pub struct PoolOrder {
    order: Mutex<LoadOrder>,
}

impl PoolOrder {
    fn lock(&self) -> MutexGuard<'_, LoadOrder> {
        self.order.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `worker`'s place as its state is now: in the order with its requests in flight while it is
    /// healthy (its sample kept, none for a worker new to the order), out of it otherwise.
    pub fn refresh(&self, worker: &impl OrderMember) {
        let mut order = self.lock();
        let id = worker.member_id();
        if worker.member_healthy() {
            let load = order.get(id).and_then(|known| known.load);
            order.set(Candidate { id, in_flight: worker.member_in_flight(), load });
        } else {
            order.remove(id);
        }
    }

    fn remove(&self, worker: WorkerId) {
        self.lock().remove(worker);
    }

    /// Runs `search` on the order (its lock held meanwhile).
    pub fn with<R>(&self, search: impl FnOnce(&LoadOrder) -> R) -> R {
        search(&self.lock())
    }
}

/// Which order each worker of a large pool is in: the registry attaches and detaches workers, the
/// load snapshot tells the orders of the samples it publishes.
#[derive(Debug, Default)]
pub struct OrderBook {
    orders: Mutex<HashMap<WorkerId, Arc<PoolOrder>>>,
}

impl OrderBook {
    fn lock(&self) -> MutexGuard<'_, HashMap<WorkerId, Arc<PoolOrder>>> {
        self.orders.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `worker` is kept in `order` from now on (and out of any order it was in).
    pub(crate) fn attach(&self, worker: &impl OrderMember, order: &Arc<PoolOrder>) {
        let id = worker.member_id();
        let previous = self.lock().insert(id, order.clone());
        if let Some(previous) = previous.filter(|previous| !Arc::ptr_eq(previous, order)) {
            previous.remove(id);
        }
        worker.keep_in(Some(order.clone()));
        order.refresh(worker);
    }

    /// `worker` left its pool, or its pool keeps no order any more.
    pub(crate) fn detach(&self, worker: &impl OrderMember) {
        worker.keep_in(None);
        let id = worker.member_id();
        if let Some(order) = self.lock().remove(&id) {
            order.remove(id);
        }
    }

    /// The workers whose sample changed (`None`: forgotten), each moved in its order.
    pub fn set_loads(&self, loads: impl IntoIterator<Item = (WorkerId, Option<LoadSample>)>) {
        let orders = self.lock();
        if orders.is_empty() {
            return;
        }
        for (id, load) in loads {
            if let Some(order) = orders.get(&id) {
                order.lock().set_load(id, load);
            }
        }
    }

    /// Whether any worker is kept in an order.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

#[cfg(test)]
mod tests;
