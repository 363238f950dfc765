//! A pool of plain values: a policy, fixed candidates and an approximate prefix tree, some
//! workers possibly down. What the plan's tests and the fleet benchmark plan on; a host with
//! live workers (the gateway, the simulator) implements [`Pool`] over what it keeps.

use std::sync::Arc;

use kvgate_index::{ApproxIndex, IndexKind, IndexView, PrefixIndex, PrefixIndexMode, ReadOnlyTree};
use kvgate_policy::{build_policy, Candidate, Policy, PolicyConfig, RouteRequest, WorkerId};

use crate::{IndexMode, Offer, Planning, Pool};

/// Workers with fixed loads under one policy, on an approximate tree (no KV events).
pub struct FixedPool {
    pub policy: Arc<dyn Policy>,
    /// Each worker's requests in flight and last load sample, as the plan is offered them.
    pub workers: Vec<Candidate>,
    /// Workers of the pool that are not routable.
    pub down: Vec<WorkerId>,
    pub tree: ApproxIndex,
}

impl FixedPool {
    /// `workers` under the policy `config` builds, on an empty tree of its settings.
    pub fn new(config: &PolicyConfig, workers: Vec<Candidate>) -> FixedPool {
        FixedPool {
            policy: build_policy(config),
            workers,
            down: Vec::new(),
            tree: ApproxIndex::new(config.tree_settings()),
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
        self.workers.iter().any(|c| c.id == worker).then(|| !self.down.contains(&worker))
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
