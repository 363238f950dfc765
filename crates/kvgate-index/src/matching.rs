//! Read side of the tree: the single descent along a query, the fast edge comparison, and
//! [`PrefixMatch`], the per-tenant matched lengths built from the descent's path.

use crate::node::{NodeId, ROOT};
use crate::tree::RadixTree;
use crate::TenantId;

/// Per-tenant matched length for one query.
///
/// A tenant's matched length is the number of leading query elements found in the tree on nodes
/// that tenant holds (a partial match inside an edge counts for the tenants of that edge's node).
/// The exact index also says how many of them count once cache tiers are weighed
/// ([`PrefixMatch::credited`]): a block held only in CPU memory earns part of a GPU hit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    query_len: usize,
    best: usize,
    /// `(tenant, matched_len)` with `matched_len > 0`, sorted by tenant.
    entries: Vec<(TenantId, usize)>,
    /// `(tenant, credited_len)` for the tenants whose credit is below their match, sorted.
    discounted: Vec<(TenantId, usize)>,
}

impl PrefixMatch {
    /// Length (elements) of the query this match was computed for.
    pub fn query_len(&self) -> usize {
        self.query_len
    }

    /// Matched length (elements) for a tenant, 0 if none.
    pub fn matched(&self, tenant: TenantId) -> usize {
        match self.entries.binary_search_by(|e| e.0.cmp(&tenant)) {
            Ok(i) => self.entries[i].1,
            Err(_) => 0,
        }
    }

    /// A tenant's matched length weighed by the tiers holding it (at most [`Self::matched`]):
    /// what a policy counts as cached. Equal to the match where every tier is the GPU.
    pub fn credited(&self, tenant: TenantId) -> usize {
        match self.discounted.binary_search_by(|e| e.0.cmp(&tenant)) {
            Ok(i) => self.discounted[i].1,
            Err(_) => self.matched(tenant),
        }
    }

    /// Iterates `(tenant, matched_len)` for every tenant with `matched_len > 0`, by tenant id.
    pub fn iter(&self) -> impl Iterator<Item = (TenantId, usize)> + '_ {
        self.entries.iter().copied()
    }

    /// The largest matched length over all tenants (0 if nothing matched).
    pub fn best(&self) -> usize {
        self.best
    }

    /// Number of tenants with a non-zero match.
    pub fn tenant_count(&self) -> usize {
        self.entries.len()
    }

    /// An empty match for a query of `query_len` elements.
    pub fn empty(query_len: usize) -> Self {
        PrefixMatch { query_len, best: 0, entries: Vec::new(), discounted: Vec::new() }
    }

    pub(crate) fn reset(&mut self, query_len: usize) {
        self.query_len = query_len;
        self.best = 0;
        self.entries.clear();
        self.discounted.clear();
    }

    /// Appends a tenant's matched length; tenants must come in increasing id order.
    pub(crate) fn push(&mut self, tenant: TenantId, matched: usize) {
        debug_assert!(self.entries.last().is_none_or(|&(last, _)| last < tenant));
        self.entries.push((tenant, matched));
        self.best = self.best.max(matched);
    }

    /// Appends a tenant's matched length and its tier-weighed credit (at most the match).
    pub(crate) fn push_credited(&mut self, tenant: TenantId, matched: usize, credited: usize) {
        self.push(tenant, matched);
        if credited < matched {
            self.discounted.push((tenant, credited));
        }
    }
}

/// One node on the descent path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step {
    pub(crate) node: NodeId,
    /// Query position reached at the end of the match inside this node's label.
    pub(crate) end: usize,
    /// Whether the whole label matched (`false`: the descent stopped inside this edge).
    pub(crate) full: bool,
}

/// Length of the common prefix of `a` and `b`.
///
/// Whole-slice equality first (one `memcmp` for byte-like elements, the common case when an edge
/// matches fully), then chunked equality to find the mismatching chunk, then a scalar scan.
#[inline]
pub(crate) fn common_prefix_len<T: Eq>(a: &[T], b: &[T]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    if a == b {
        return n;
    }
    const CHUNK: usize = 64;
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

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
