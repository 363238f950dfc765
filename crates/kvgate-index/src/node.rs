//! Arena node of the radix tree: edge label, depth, parent link, children keyed by first element,
//! and the sorted per-node tenant list with last-access times.

use crate::TenantId;

/// Index of a node in the arena.
pub(crate) type NodeId = u32;

/// The root: empty label, never holds tenants, never freed.
pub(crate) const ROOT: NodeId = 0;

/// `parent` value of a slot on the free list.
pub(crate) const FREE: NodeId = NodeId::MAX;

/// One tenant's hold on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TenantEntry {
    pub(crate) tenant: TenantId,
    /// Last access time (caller's clock) of this tenant on this node. Never older than the
    /// tenant's time on any child of the node (refreshes take the max), which is what lets
    /// eviction find LRU leaves by sorting.
    pub(crate) last_access: u64,
}

/// A node: the edge label leading into it from its parent, plus bookkeeping.
#[derive(Clone, Debug)]
pub(crate) struct Node<T> {
    /// Edge label; non-empty for every live node except the root.
    pub(crate) label: Box<[T]>,
    /// Parent node, [`FREE`] when the slot is on the free list (the root's parent is itself).
    pub(crate) parent: NodeId,
    /// Key position at the end of this node's label (the root's is 0).
    pub(crate) depth: u32,
    /// Children sorted by the first element of their label.
    pub(crate) children: Vec<(T, NodeId)>,
    /// Tenants holding this node, sorted by tenant id.
    pub(crate) tenants: Vec<TenantEntry>,
}

impl<T: Copy + Ord> Node<T> {
    pub(crate) fn new(label: Box<[T]>, parent: NodeId, depth: u32) -> Self {
        Node { label, parent, depth, children: Vec::new(), tenants: Vec::new() }
    }

    #[cfg(test)]
    pub(crate) fn is_free(&self) -> bool {
        self.parent == FREE
    }

    /// The child whose label starts with `first`.
    #[inline]
    pub(crate) fn child(&self, first: T) -> Option<NodeId> {
        let c = &self.children;
        // Small fan-out is the common case: a linear scan beats the binary search's branches.
        if c.len() <= 8 {
            return c.iter().find(|(k, _)| *k == first).map(|&(_, id)| id);
        }
        c.binary_search_by(|(k, _)| k.cmp(&first)).ok().map(|i| c[i].1)
    }

    /// Points the child slot for `first` at `id` (inserting the slot if absent).
    pub(crate) fn set_child(&mut self, first: T, id: NodeId) {
        match self.children.binary_search_by(|(k, _)| k.cmp(&first)) {
            Ok(i) => self.children[i].1 = id,
            Err(i) => self.children.insert(i, (first, id)),
        }
    }

    #[inline]
    pub(crate) fn tenant_pos(&self, tenant: TenantId) -> Result<usize, usize> {
        self.tenants.binary_search_by(|e| e.tenant.cmp(&tenant))
    }

    #[inline]
    pub(crate) fn holds(&self, tenant: TenantId) -> bool {
        self.tenant_pos(tenant).is_ok()
    }

    /// Heap bytes owned by this node (label, children and tenant buffers).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.label.len() * std::mem::size_of::<T>()
            + self.children.capacity() * std::mem::size_of::<(T, NodeId)>()
            + self.tenants.capacity() * std::mem::size_of::<TenantEntry>()
    }
}
