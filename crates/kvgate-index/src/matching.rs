//! Read side of the tree: the single descent along a query, the fast edge comparison, and
//! [`PrefixMatch`], the per-tenant matched lengths built from the descent's path.

use crate::node::{Node, NodeId, ROOT};
use crate::tree::RadixTree;
use crate::TenantId;

/// Per-tenant matched length for one query.
///
/// A tenant's matched length is the number of leading query elements found in the tree on nodes
/// that tenant holds (a partial match inside an edge counts for the tenants of that edge's node).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    query_len: usize,
    best: usize,
    /// `(tenant, matched_len)` with `matched_len > 0`, sorted by tenant.
    entries: Vec<(TenantId, usize)>,
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

    fn clear(&mut self, query_len: usize) {
        self.query_len = query_len;
        self.best = 0;
        self.entries.clear();
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
            path.push(Step {
                node: child,
                end: pos,
                full,
            });
            if !full {
                break;
            }
            node = child;
        }
        pos
    }

    /// Fills `out` from a descent `path` (see [`RadixTree::descend`]).
    ///
    /// Tenancy is prefix-closed, so each node's tenant set is a subset of its parent's. Walking the
    /// path bottom-up, a node contributes only the tenants missing from the node below it, and a
    /// node whose set has the same size as the one below it contributes nothing.
    pub(crate) fn fill_match(&self, query_len: usize, path: &[Step], out: &mut PrefixMatch) {
        out.clear(query_len);
        let Some(last) = path.last() else {
            return;
        };
        out.best = last.end;
        let mut below: Option<&Node<T>> = None;
        for step in path.iter().rev() {
            let node = &self.nodes[step.node as usize];
            match below {
                None => out
                    .entries
                    .extend(node.tenants.iter().map(|e| (e.tenant, step.end))),
                Some(b) if b.tenants.len() == node.tenants.len() => continue,
                Some(b) => {
                    let mut j = 0;
                    let sub = &b.tenants;
                    for e in &node.tenants {
                        if j < sub.len() && sub[j].tenant == e.tenant {
                            j += 1;
                        } else {
                            out.entries.push((e.tenant, step.end));
                        }
                    }
                }
            }
            below = Some(node);
        }
        out.entries.sort_unstable_by_key(|e| e.0);
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
