//! Shrinking the tree: per-tenant LRU eviction of leaves, and removal of a tenant everywhere.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::node::{NodeId, ROOT};
use crate::tree::RadixTree;
use crate::TenantId;

impl<T: Copy + Eq + Ord + std::hash::Hash> RadixTree<T> {
    /// Per-tenant LRU eviction: while a tenant holds more than `max_elements_per_tenant`
    /// elements, drops its least-recently-used leaves (a leaf for a tenant is a node the tenant
    /// holds and none of whose children it holds; ties broken by node slot). Leaves are dropped
    /// whole, so a tenant may end below the bound. Nodes no tenant holds any more are removed.
    ///
    /// Returns the number of elements evicted, summed over tenants (the total decrease of
    /// [`RadixTree::tenant_size`]); `total_elements` decreases by at most that much.
    pub fn evict(&mut self, max_elements_per_tenant: usize) -> usize {
        let bound = max_elements_per_tenant;
        let mut over: Vec<TenantId> =
            self.sizes.iter().filter(|&(_, &s)| s > bound).map(|(&t, _)| t).collect();
        if over.is_empty() {
            return 0;
        }
        over.sort_unstable();

        // Every current leaf of every over-bound tenant, oldest first.
        let mut heap: BinaryHeap<Reverse<(u64, NodeId, TenantId)>> = BinaryHeap::new();
        for (id, node) in self.nodes.iter().enumerate().skip(1) {
            if node.is_free() {
                continue;
            }
            for e in &node.tenants {
                if e.children == 0 && over.binary_search(&e.tenant).is_ok() {
                    heap.push(Reverse((e.last_access, id as NodeId, e.tenant)));
                }
            }
        }

        let mut evicted = 0;
        while let Some(Reverse((_, id, tenant))) = heap.pop() {
            let size = self.sizes.get_mut(&tenant).expect("tenant has a size");
            if *size <= bound {
                continue;
            }
            let node = &mut self.nodes[id as usize];
            let Ok(i) = node.tenant_pos(tenant) else {
                debug_assert!(false, "heap entry for a node the tenant no longer holds");
                continue;
            };
            node.tenants.remove(i);
            let len = node.label.len();
            let parent = node.parent;
            let orphan = node.tenants.is_empty();
            *size -= len;
            let still_over = *size > bound;
            evicted += len;
            if *size == 0 {
                self.sizes.remove(&tenant);
            }
            if parent != ROOT {
                let p = &mut self.nodes[parent as usize];
                let j = p.tenant_pos(tenant).expect("tenancy is prefix-closed");
                let e = &mut p.tenants[j];
                e.children -= 1;
                if e.children == 0 && still_over {
                    heap.push(Reverse((e.last_access, parent, tenant)));
                }
            }
            if orphan {
                self.unlink_and_free(id);
            }
        }
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
        for &id in &visited {
            let node = &mut self.nodes[id as usize];
            if let Ok(i) = node.tenant_pos(tenant) {
                node.tenants.remove(i);
            }
        }
        // Children were visited after their parents: free bottom-up.
        for &id in visited.iter().rev() {
            if self.nodes[id as usize].tenants.is_empty() {
                self.unlink_and_free(id);
            }
        }
    }
}
