//! Read side of the tree: the single descent along a query, and the [`PrefixMatch`] built from
//! the descent's path.

use crate::node::ROOT;
use crate::prefix_match::{common_prefix_len, PrefixMatch, Step};
use crate::tree::RadixTree;
use crate::TenantId;

impl<T: Copy + Eq + Ord + std::hash::Hash> RadixTree<T> {
    /// Walks `key` from the root, recording every node touched in `path`.
    /// Returns the query position reached.
    pub(crate) fn descend(&self, key: &[T], path: &mut Vec<Step>) -> usize {
        path.clear();
        let mut node = ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let Some(child) = self.nodes[node as usize].child(key[pos]) else {
                break;
            };
            let label = &self.nodes[child as usize].label;
            // The first element is equal by construction of the child map.
            let l = 1 + common_prefix_len(&label[1..], &key[pos + 1..]);
            pos += l;
            let full = l == label.len();
            path.push(Step { node: child, end: pos, full });
            if !full {
                break;
            }
            node = child;
        }
        pos
    }

    /// Fills `out` from a descent `path` (see [`RadixTree::descend`]).
    ///
    /// Tenancy is prefix-closed, so each node's tenant set is a subset of its parent's and the
    /// first node's set holds every tenant that matched anything. The entries start as that set
    /// (sorted, so no sort is needed); walking down, each time the set shrinks (a smaller set
    /// is a different set) the previous node's tenants get the previous node's end, and deeper
    /// nodes overwrite them. Nodes with an unchanged set cost O(1).
    pub(crate) fn fill_match(&self, query_len: usize, path: &[Step], out: &mut PrefixMatch) {
        out.reset(query_len);
        let Some((first, rest)) = path.split_first() else {
            return;
        };
        out.best = path[path.len() - 1].end;
        let top = &self.nodes[first.node as usize].tenants;
        out.entries.extend(top.iter().map(|e| (e.tenant, first.end)));
        let mut prev = *first;
        let mut prev_len = top.len();
        for step in rest {
            let len = self.nodes[step.node as usize].tenants.len();
            if len != prev_len {
                self.assign(prev, &mut out.entries);
                prev_len = len;
            }
            prev = *step;
        }
        if prev.node != first.node {
            self.assign(prev, &mut out.entries);
        }
    }

    /// Sets the matched length of every tenant of `step`'s node to `step.end` (merge walk: the
    /// node's tenants are a sorted subset of the sorted entries).
    #[inline]
    fn assign(&self, step: Step, entries: &mut [(TenantId, usize)]) {
        let mut j = 0;
        for e in &self.nodes[step.node as usize].tenants {
            while entries[j].0 != e.tenant {
                j += 1;
            }
            entries[j].1 = step.end;
        }
    }

    /// Read-only match of `key` against the tree.
    pub fn prefix_match(&self, key: &[T]) -> PrefixMatch {
        let mut path = Vec::new();
        self.descend(key, &mut path);
        let mut out = PrefixMatch::default();
        self.fill_match(key.len(), &path, &mut out);
        out
    }
}
