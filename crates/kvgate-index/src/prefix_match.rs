//! [`PrefixMatch`], the per-tenant matched lengths of one query, the descent's [`Step`], and the
//! fast edge comparison: what the tree's read side produces, apart from the descent itself.

use crate::node::NodeId;
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
    pub(crate) best: usize,
    /// `(tenant, matched_len)` with `matched_len > 0`, sorted by tenant.
    pub(crate) entries: Vec<(TenantId, usize)>,
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

    /// Iterates `(tenant, credited_len)` for every tenant with `matched_len > 0`, by tenant id
    /// ([`Self::credited`] of each, in one pass: the discounted credits are merged in as the
    /// entries go, not looked up one tenant at a time).
    pub fn iter_credited(&self) -> impl Iterator<Item = (TenantId, usize)> + '_ {
        let mut discounted = self.discounted.iter().peekable();
        self.entries.iter().map(move |&(tenant, matched)| {
            while discounted.next_if(|&&(id, _)| id < tenant).is_some() {}
            match discounted.next_if(|&&(id, _)| id == tenant) {
                Some(&(_, credited)) => (tenant, credited),
                None => (tenant, matched),
            }
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The one pass gives every tenant's credit as `credited` looks it up.
        #[test]
        fn iter_credited_is_credited_of_each(
            matches in proptest::collection::btree_map(0u32..500, (1usize..100, 0usize..100), 0..60),
        ) {
            let mut prefix = PrefixMatch::empty(100);
            for (&tenant, &(matched, credited)) in &matches {
                prefix.push_credited(tenant, matched, credited.min(matched));
            }
            let looked_up: Vec<(TenantId, usize)> =
                prefix.iter().map(|(tenant, _)| (tenant, prefix.credited(tenant))).collect();
            prop_assert_eq!(prefix.iter_credited().collect::<Vec<_>>(), looked_up);
        }
    }
}
