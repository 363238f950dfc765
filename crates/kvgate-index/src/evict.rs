//! Shrinking the tree: per-tenant LRU eviction of leaves, and removal of a tenant everywhere.

use crate::node::{NodeId, ROOT};
use crate::tree::RadixTree;
use crate::TenantId;

/// One tenant's hold on one node, as an eviction candidate (ordered oldest first).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    last_access: u64,
    /// `u32::MAX - depth`: at equal times, deeper nodes (children) go first.
    shallowness: u32,
    node: NodeId,
    /// Label length of the node (what dropping this hold takes off the tenant's size).
    len: usize,
}

impl<T: Copy + Eq + Ord + std::hash::Hash> RadixTree<T> {
    /// Per-tenant LRU eviction: while a tenant holds more than `max_elements_per_tenant`
    /// elements, drops its least-recently-used leaf (a leaf for a tenant is a node the tenant
    /// holds and none of whose children it holds). Leaves are dropped whole, so a tenant may end
    /// below the bound. Nodes no tenant holds any more are removed.
    ///
    /// Returns the number of elements evicted, summed over tenants (the total decrease of
    /// [`RadixTree::tenant_size`]); `total_elements` decreases by at most that much.
    ///
    /// How: a tenant's time on a node is never older than on the node's children, so in (time,
    /// deepest first) order every node comes after all of its children, and walking that order
    /// the next node is always the tenant's LRU leaf. One sequential scan of the arena collects
    /// each over-bound tenant's holds, a sort per tenant picks the holds to drop, and the drops
    /// are then applied in arena order (random access into a large tree is what costs).
    pub fn evict(&mut self, max_elements_per_tenant: usize) -> usize {
        let bound = max_elements_per_tenant;
        let mut over: Vec<TenantId> =
            self.sizes.iter().filter(|&(_, &s)| s > bound).map(|(&t, _)| t).collect();
        if over.is_empty() {
            return 0;
        }
        over.sort_unstable();

        let mut buckets: Vec<Vec<Candidate>> = vec![Vec::new(); over.len()];
        for (id, node) in self.nodes.iter().enumerate().skip(1) {
            for e in &node.tenants {
                if let Ok(b) = over.binary_search(&e.tenant) {
                    buckets[b].push(Candidate {
                        last_access: e.last_access,
                        shallowness: u32::MAX - node.depth,
                        node: id as NodeId,
                        len: node.label.len(),
                    });
                }
            }
        }

        // Decide, from the scanned copies only.
        let mut drops: Vec<(NodeId, TenantId)> = Vec::new();
        let mut evicted = 0;
        for (tenant, mut bucket) in over.into_iter().zip(buckets) {
            bucket.sort_unstable();
            let before = self.sizes[&tenant];
            let mut size = before;
            for c in bucket {
                if size <= bound {
                    break;
                }
                size -= c.len;
                drops.push((c.node, tenant));
            }
            evicted += before - size;
            if size == 0 {
                self.sizes.remove(&tenant);
            } else {
                self.sizes.insert(tenant, size);
            }
        }

        // Apply, in arena order; nodes left without tenants are freed in one batch.
        drops.sort_unstable();
        let mut emptied: Vec<NodeId> = Vec::new();
        for group in drops.chunk_by(|a, b| a.0 == b.0) {
            let id = group[0].0;
            let node = &mut self.nodes[id as usize];
            if group.len() == node.tenants.len() {
                node.tenants.clear();
            } else {
                let mut k = 0;
                node.tenants.retain(|e| {
                    let drop = k < group.len() && group[k].1 == e.tenant;
                    k += usize::from(drop);
                    !drop
                });
            }
            if node.tenants.is_empty() {
                emptied.push(id);
            }
        }
        self.free_batch(&emptied);
        evicted
    }

    /// Removes `tenant` everywhere at once (worker removed). Nodes left without tenants are
    /// removed from the tree.
    pub fn remove_tenant(&mut self, tenant: TenantId) {
        if self.sizes.remove(&tenant).is_none() {
            return;
        }
        // Tenancy is prefix-closed: the tenant's nodes form a subtree hanging off the root.
        let mut stack: Vec<NodeId> = Vec::new();
        let mut visited: Vec<NodeId> = Vec::new();
        stack.push(ROOT);
        while let Some(id) = stack.pop() {
            let node = &self.nodes[id as usize];
            for &(_, c) in &node.children {
                if self.nodes[c as usize].holds(tenant) {
                    stack.push(c);
                    visited.push(c);
                }
            }
        }
        visited.retain(|&id| {
            let node = &mut self.nodes[id as usize];
            if let Ok(i) = node.tenant_pos(tenant) {
                node.tenants.remove(i);
            }
            node.tenants.is_empty()
        });
        self.free_batch(&visited);
    }
}
