//! The admission queue's order, as a pure structure: higher priority classes first; within a
//! class, start-time fair queuing on tokens (a virtual token counter per class). A request's
//! start tag is the later of the class's virtual time and the tenant's last finish tag, its
//! finish tag the start plus its tokens over the tenant's weight; the smallest start tag goes
//! first and moves the class's virtual time to it. Backlogged tenants so receive tokens in
//! proportion to their weights whatever their arrival rates, and a tenant returning from idle
//! starts at the present (no credit saved up while away).

use std::collections::{BTreeMap, HashMap};

use crate::tenant::PriorityClass;

/// Orders a waiting entry within its class: start tag (as ordered bits of a non-negative f64),
/// then arrival.
type Key = (u64, u64);

struct Class<T> {
    virtual_time: f64,
    /// Each tenant's last finish tag (tenants whose tag the virtual time passed are pruned).
    finish: HashMap<String, f64>,
    waiting: BTreeMap<Key, T>,
}

impl<T> Default for Class<T> {
    fn default() -> Self {
        Self { virtual_time: 0.0, finish: HashMap::new(), waiting: BTreeMap::new() }
    }
}

/// Waiting entries of type `T` in the order they are to be served.
pub struct FairQueue<T> {
    classes: [Class<T>; 3],
    /// Where each waiting id is.
    index: HashMap<u64, (usize, Key)>,
    next_id: u64,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self { classes: Default::default(), index: HashMap::new(), next_id: 0 }
    }
}

impl<T> FairQueue<T> {
    /// Adds an entry of `tenant` (its `weight`, > 0) costing `tokens`; returns its id.
    pub fn push(&mut self, class: PriorityClass, tenant: &str, weight: f64, tokens: u64, item: T) -> u64 {
        let queue = &mut self.classes[class.rank()];
        let last = queue.finish.get(tenant).copied().unwrap_or(0.0);
        let start = last.max(queue.virtual_time);
        let finish = start + tokens.max(1) as f64 / weight.max(f64::MIN_POSITIVE);
        match queue.finish.get_mut(tenant) {
            Some(tag) => *tag = finish,
            None => {
                queue.finish.insert(tenant.to_string(), finish);
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let key = (start.to_bits(), id);
        queue.waiting.insert(key, item);
        self.index.insert(id, (class.rank(), key));
        id
    }

    /// The next entry to serve: the highest class's smallest start tag.
    pub fn pop(&mut self) -> Option<T> {
        let rank = (0..self.classes.len()).rev().find(|&rank| !self.classes[rank].waiting.is_empty())?;
        let queue = &mut self.classes[rank];
        let ((start, id), item) = queue.waiting.pop_first()?;
        self.index.remove(&id);
        queue.virtual_time = queue.virtual_time.max(f64::from_bits(start));
        if queue.finish.len() > 64 && queue.finish.len() > 2 * queue.waiting.len() {
            let now = queue.virtual_time;
            queue.finish.retain(|_, finish| *finish > now);
        }
        Some(item)
    }

    /// Takes out the entry `id` (gave up waiting), if it is still waiting.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let (rank, key) = self.index.remove(&id)?;
        self.classes[rank].waiting.remove(&key)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PriorityClass::*;

    #[test]
    fn a_higher_class_is_served_before_a_lower_one_that_waited_longer() {
        let mut queue = FairQueue::default();
        queue.push(Low, "batch", 1.0, 10, "low-1");
        queue.push(Normal, "app", 1.0, 10, "normal-1");
        queue.push(High, "chat", 1.0, 10, "high-1");
        queue.push(Low, "batch", 1.0, 10, "low-2");
        let order: Vec<_> = std::iter::from_fn(|| queue.pop()).collect();
        assert_eq!(order, ["high-1", "normal-1", "low-1", "low-2"]);
    }

    /// Tenants with every request queued at once (a flood beside a steady one) get tokens in
    /// proportion to their weights.
    #[test]
    fn backlogged_tenants_share_tokens_by_weight_whatever_they_queued() {
        for (weights, sizes) in [([1.0, 3.0], [100, 100]), ([1.0, 1.0], [400, 100]), ([2.0, 1.0], [50, 300])]
        {
            let mut queue = FairQueue::default();
            // Tenant 0 floods: ten times the requests of tenant 1.
            for _ in 0..1000 {
                queue.push(Normal, "t0", weights[0], sizes[0], (0, sizes[0]));
            }
            for _ in 0..100 {
                queue.push(Normal, "t1", weights[1], sizes[1], (1, sizes[1]));
            }
            let mut tokens = [0u64; 2];
            // Serve while both are still backlogged.
            for _ in 0..100 {
                let (tenant, size) = queue.pop().unwrap();
                tokens[tenant] += size;
            }
            let share = tokens[0] as f64 / (tokens[0] + tokens[1]) as f64;
            let expected = weights[0] / (weights[0] + weights[1]);
            assert!(
                (share - expected).abs() <= 0.1 * expected,
                "{weights:?} {sizes:?}: {share} vs {expected}"
            );
        }
    }

    #[test]
    fn an_idle_tenant_saves_no_credit_and_removed_entries_are_gone() {
        let mut queue = FairQueue::default();
        for i in 0..10 {
            queue.push(Normal, "busy", 1.0, 100, ("busy", i));
        }
        for _ in 0..5 {
            queue.pop();
        }
        // A newcomer starts at the virtual time (the last start served): it interleaves with the
        // busy tenant, it does not take five in a row.
        let ids: Vec<u64> = (0..5).map(|i| queue.push(Normal, "new", 1.0, 100, ("new", i))).collect();
        let next: Vec<&str> = (0..4).map(|_| queue.pop().unwrap().0).collect();
        assert_eq!(next, ["new", "busy", "new", "busy"]);
        assert_eq!(queue.remove(ids[4]), Some(("new", 4)));
        assert_eq!(queue.remove(ids[4]), None);
        assert_eq!(queue.len(), 5);
    }
}
