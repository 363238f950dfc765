//! A pool of plain values: a policy, fixed candidates and an approximate prefix tree, some
//! workers possibly down, and, when asked, a load order kept of them. What the plan's tests and
//! the fleet benchmark plan on; a host with live workers (the gateway, the simulator) implements
//! [`Pool`] over what it keeps.

use std::sync::Arc;

use kvgate_index::{ApproxIndex, IndexKind, IndexView, PrefixIndex, PrefixIndexMode, ReadOnlyTree};
use kvgate_policy::{build_policy, Candidate, Policy, PolicyConfig, RouteRequest, WorkerId};

use crate::{IndexMode, KeptOrder, LoadOrder, Offer, Planning, Pool};

/// Workers with fixed loads under one policy, on an approximate tree (no KV events).
pub struct FixedPool {
    pub policy: Arc<dyn Policy>,
    /// Each worker's requests in flight and last load sample, as the plan is offered them.
    pub workers: Vec<Candidate>,
    /// Workers of the pool that are not routable.
    pub down: Vec<WorkerId>,
    pub tree: ApproxIndex,
    /// The workers' load order ([`FixedPool::keep_order`]) and each one's place in `workers`.
    order: Option<(LoadOrder, kvgate_policy::WorkerMap<usize>)>,
    /// Whether a large plan reads the kept order (the fleet bench turns it off for the offer's
    /// path, on the same pool).
    pub read_order: bool,
}

impl FixedPool {
    /// `workers` under the policy `config` builds, on an empty tree of its settings.
    pub fn new(config: &PolicyConfig, workers: Vec<Candidate>) -> FixedPool {
        FixedPool {
            policy: build_policy(config),
            workers,
            down: Vec::new(),
            tree: ApproxIndex::new(config.tree_settings()),
            order: None,
            read_order: true,
        }
    }

    /// `workers` under `policy` on `tree`.
    pub fn with_tree(policy: Arc<dyn Policy>, workers: Vec<Candidate>, tree: ApproxIndex) -> FixedPool {
        FixedPool { policy, workers, down: Vec::new(), tree, order: None, read_order: true }
    }

    /// Keeps a load order of the workers from now on (or brings it up to `workers` after they
    /// were changed in place): a large plan reads it instead of the offer.
    pub fn keep_order(&mut self) {
        let (order, places) = self.order.get_or_insert_with(Default::default);
        for (at, worker) in self.workers.iter().enumerate() {
            order.set(*worker);
            places.insert(worker.id, at);
        }
    }

    /// Sets one worker's requests in flight and load sample, in the kept order too.
    pub fn set_worker(&mut self, worker: Candidate) {
        if let Some(at) = self.workers.iter().position(|c| c.id == worker.id) {
            self.workers[at] = worker;
        }
        if let Some((order, _)) = &mut self.order {
            order.set(worker);
        }
    }
}

/// The pool's tree: learning for a live plan, read only for a dry run.
pub enum TreeView<'a> {
    Learning(&'a ApproxIndex),
    ReadOnly(ReadOnlyTree<'a>),
}

impl IndexView for TreeView<'_> {
    fn kind(&self) -> IndexKind {
        IndexKind::Approximate
    }

    fn with<R>(&self, use_index: impl FnOnce(&dyn PrefixIndex) -> R) -> R {
        match self {
            TreeView::Learning(tree) => use_index(*tree),
            TreeView::ReadOnly(tree) => use_index(tree),
        }
    }
}

impl Pool for FixedPool {
    type Index<'a> = TreeView<'a>;

    fn policy(&self) -> &dyn Policy {
        &*self.policy
    }

    fn offer(&self, tried: &[WorkerId]) -> Offer {
        let candidates = self
            .workers
            .iter()
            .filter(|c| !tried.contains(&c.id) && !self.down.contains(&c.id))
            .copied()
            .collect();
        Offer { candidates, events_flowing: false }
    }

    fn member(&self, worker: WorkerId) -> Option<bool> {
        let known = match &self.order {
            Some((_, places)) => places.contains_key(&worker),
            None => self.workers.iter().any(|c| c.id == worker),
        };
        known.then(|| !self.down.contains(&worker))
    }

    fn with_order(&self, search: &mut dyn FnMut(KeptOrder<'_>)) -> bool {
        let Some((order, places)) = self.order.as_ref().filter(|_| self.read_order) else { return false };
        let lookup = |id: WorkerId| {
            let at = *places.get(&id)?;
            self.workers.get(at).filter(|c| c.id == id && !self.down.contains(&id)).copied()
        };
        let mut down: Vec<WorkerId> =
            self.down.iter().copied().filter(|id| places.contains_key(id)).collect();
        down.sort_unstable();
        down.dedup();
        let routable = self.workers.len() - down.len();
        search(KeptOrder { order, lookup: &lookup, routable, events_flowing: false });
        true
    }

    fn index_mode(&self) -> IndexMode {
        IndexMode { mode: PrefixIndexMode::Auto, has_kv_events: false }
    }

    fn prefix_index(
        &self,
        _kind: IndexKind,
        planning: Planning,
        _request: &RouteRequest<'_>,
    ) -> TreeView<'_> {
        match planning {
            Planning::Live => TreeView::Learning(&self.tree),
            Planning::DryRun => TreeView::ReadOnly(ReadOnlyTree(&self.tree)),
        }
    }
}
