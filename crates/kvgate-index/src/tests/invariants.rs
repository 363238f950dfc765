//! Structural invariant checker used by every test after every mutation.

use std::collections::HashMap;

use crate::node::{NodeId, ROOT};
use crate::{RadixTree, TenantId};

impl<T: Copy + Eq + Ord + std::hash::Hash + std::fmt::Debug> RadixTree<T> {
    /// Panics with a description if any structural invariant is broken.
    pub(crate) fn check_invariants(&self) {
        let root = &self.nodes[ROOT as usize];
        assert!(root.label.is_empty(), "root label");
        assert!(root.tenants.is_empty(), "root tenants");
        assert_eq!(root.parent, ROOT, "root parent");

        let mut total = 0usize;
        let mut sizes: HashMap<TenantId, usize> = HashMap::new();
        let mut reached = 0usize;
        let mut stack: Vec<NodeId> = vec![ROOT];
        while let Some(id) = stack.pop() {
            let node = &self.nodes[id as usize];
            assert!(!node.is_free(), "free node {id} reachable");
            if id != ROOT {
                reached += 1;
                assert!(!node.label.is_empty(), "empty label on node {id}");
                assert!(!node.tenants.is_empty(), "tenantless node {id} kept");
                total += node.label.len();
                for e in &node.tenants {
                    *sizes.entry(e.tenant).or_default() += node.label.len();
                }
            }
            assert!(
                node.tenants.windows(2).all(|w| w[0].tenant < w[1].tenant),
                "tenant list of {id} not strictly sorted"
            );
            assert!(
                node.children.windows(2).all(|w| w[0].0 < w[1].0),
                "children of {id} not strictly sorted"
            );
            for &(first, c) in &node.children {
                let child = &self.nodes[c as usize];
                assert_eq!(child.parent, id, "parent link of {c}");
                assert!(child.label.first() == Some(&first), "child key of {c}");
                if id != ROOT {
                    for ce in &child.tenants {
                        assert!(node.holds(ce.tenant), "tenancy not prefix-closed at {c}");
                    }
                }
                stack.push(c);
            }
            for &(_, c) in &node.children {
                let child = &self.nodes[c as usize];
                assert_eq!(child.depth, node.depth + child.label.len() as u32, "depth of {c}");
                if id != ROOT {
                    for ce in &child.tenants {
                        let pe = node.tenants[node.tenant_pos(ce.tenant).unwrap()];
                        assert!(pe.last_access >= ce.last_access, "child {c} newer than parent");
                    }
                }
            }
        }
        assert_eq!(reached, self.live, "live count");
        assert_eq!(reached, self.node_count());
        assert_eq!(total, self.total, "total elements");
        assert_eq!(sizes, self.sizes, "tenant sizes");
        let free = self.nodes.iter().filter(|n| n.is_free()).count();
        assert_eq!(free, self.free.len(), "free list");
        assert_eq!(free + reached + 1, self.nodes.len(), "arena accounting");
        for &f in &self.free {
            assert!(self.nodes[f as usize].is_free(), "free list slot {f} in use");
        }
    }

    /// Reference eviction, straight from the definition: while a tenant is over the bound, drop
    /// its leaf (held node with no held child) with the oldest time, deepest first, then lowest
    /// slot. Quadratic; for tests only.
    pub(crate) fn naive_evict(&mut self, bound: usize) -> usize {
        let mut evicted = 0;
        for t in self.tenants() {
            while self.tenant_size(t) > bound {
                let leaf = (1..self.nodes.len())
                    .filter(|&id| {
                        let n = &self.nodes[id];
                        n.holds(t) && n.children.iter().all(|&(_, c)| !self.nodes[c as usize].holds(t))
                    })
                    .min_by_key(|&id| {
                        let n = &self.nodes[id];
                        (n.tenants[n.tenant_pos(t).unwrap()].last_access, u32::MAX - n.depth, id)
                    })
                    .expect("a tenant over the bound holds a leaf");
                let node = &mut self.nodes[leaf];
                node.tenants.remove(node.tenant_pos(t).unwrap());
                let len = node.label.len();
                if node.tenants.is_empty() {
                    self.free_batch(&[leaf as NodeId]);
                }
                evicted += len;
                let size = self.sizes.get_mut(&t).unwrap();
                *size -= len;
                if *size == 0 {
                    self.sizes.remove(&t);
                }
            }
        }
        evicted
    }
}
