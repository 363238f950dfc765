//! The radix tree itself: node arena with free list, per-tenant sizes, the insert path (edge
//! splits, tenant refresh) and the one-descent `match_and_insert` hot path, plus size accounting.

use std::collections::HashMap;
use std::mem::size_of;

use crate::node::{Node, NodeId, TenantEntry, FREE, ROOT};
use crate::prefix_match::{PrefixMatch, Step};
use crate::TenantId;

/// Approximate prefix index: a radix tree recording which tenants were sent which key prefixes
/// and when.
///
/// Tenancy is prefix-closed: a tenant holding a node holds all its ancestors. Nodes no tenant
/// holds are removed. Generic over the element (`u8` text bytes or `u32` token ids).
#[derive(Clone, Debug)]
pub struct RadixTree<T> {
    /// Node arena; slot [`ROOT`] is the root, free slots have `parent == FREE`.
    pub(crate) nodes: Vec<Node<T>>,
    /// Free arena slots.
    pub(crate) free: Vec<NodeId>,
    /// Elements held per tenant (sum of the label lengths of the nodes it holds).
    pub(crate) sizes: HashMap<TenantId, usize>,
    /// Sum of the label lengths of all live nodes.
    pub(crate) total: usize,
    /// Live nodes, root excluded.
    pub(crate) live: usize,
    /// Reused buffers for the hot path (no allocation per call once warm).
    scratch_path: Vec<Step>,
    scratch_match: PrefixMatch,
}

impl<T: Copy + Eq + Ord + std::hash::Hash> Default for RadixTree<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Copy + Eq + Ord + std::hash::Hash> RadixTree<T> {
    /// An empty tree.
    pub fn new() -> Self {
        RadixTree {
            nodes: vec![Node::new(Box::default(), ROOT, 0)],
            free: Vec::new(),
            sizes: HashMap::new(),
            total: 0,
            live: 0,
            scratch_path: Vec::new(),
            scratch_match: PrefixMatch::default(),
        }
    }

    /// One descent: walks the tree matching `key`, computes the [`PrefixMatch`], calls `choose`
    /// with it; if `choose` returns `Some(tenant)`, inserts `key` for that tenant, continuing from
    /// where the match stopped and refreshing the tenant's last-access time to `now` on every node
    /// of the path. Returns whatever `choose` returned.
    ///
    /// Times should come from a non-decreasing clock; if `now` is older than a time already
    /// recorded on a node, the later time is kept (a node's time never goes backwards, which
    /// keeps a parent at least as recent as its children for [`RadixTree::evict`]).
    ///
    /// Allocates only for what it stores: the new leaf's label and, when the match stops inside
    /// an edge, the two halves of the split edge.
    pub fn match_and_insert<F>(&mut self, key: &[T], now: u64, choose: F) -> Option<TenantId>
    where
        F: FnOnce(&PrefixMatch) -> Option<TenantId>,
    {
        let mut path = std::mem::take(&mut self.scratch_path);
        let mut matched = std::mem::take(&mut self.scratch_match);
        let pos = self.descend(key, &mut path);
        self.fill_match(key.len(), &path, &mut matched);
        let chosen = choose(&matched);
        if let Some(tenant) = chosen {
            self.insert_along(key, pos, &path, tenant, now);
        }
        self.scratch_path = path;
        self.scratch_match = matched;
        chosen
    }

    /// Inserts `key` for `tenant`, refreshing its last-access time to `now` along the path
    /// (same as [`RadixTree::match_and_insert`] with a fixed choice).
    pub fn insert(&mut self, key: &[T], tenant: TenantId, now: u64) {
        let mut path = std::mem::take(&mut self.scratch_path);
        let pos = self.descend(key, &mut path);
        self.insert_along(key, pos, &path, tenant, now);
        self.scratch_path = path;
    }

    /// Elements held by `tenant` (sum of the label lengths of the nodes it holds).
    pub fn tenant_size(&self, tenant: TenantId) -> usize {
        self.sizes.get(&tenant).copied().unwrap_or(0)
    }

    /// The most elements one tenant holds (0 for an empty tree).
    pub fn max_tenant_size(&self) -> usize {
        self.sizes.values().copied().max().unwrap_or(0)
    }

    /// Tenants currently holding at least one node, sorted.
    pub fn tenants(&self) -> Vec<TenantId> {
        let mut v: Vec<TenantId> = self.sizes.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Elements stored in the tree (sum of all edge-label lengths).
    pub fn total_elements(&self) -> usize {
        self.total
    }

    /// Number of nodes, the root excluded (0 for an empty tree).
    pub fn node_count(&self) -> usize {
        self.live
    }

    /// Approximate heap bytes owned by the tree: the arena, every node's label, children and
    /// tenant buffers, the free list, the tenant-size map and the scratch buffers. O(nodes).
    pub fn approx_heap_bytes(&self) -> usize {
        let arena = self.nodes.capacity() * size_of::<Node<T>>();
        let owned: usize = self.nodes.iter().map(Node::heap_bytes).sum();
        // hashbrown: one (key, value) slot plus one control byte per bucket (~8/7 of capacity).
        let map = self.sizes.capacity() * (size_of::<(TenantId, usize)>() + 1) * 8 / 7;
        let scratch = self.scratch_path.capacity() * size_of::<Step>()
            + self.scratch_match.tenant_count() * size_of::<(TenantId, usize)>();
        arena + owned + self.free.capacity() * size_of::<NodeId>() + map + scratch
    }

    // ---- internals -------------------------------------------------------------------------

    pub(crate) fn alloc(&mut self, node: Node<T>) -> NodeId {
        self.live += 1;
        self.total += node.label.len();
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                let id = NodeId::try_from(self.nodes.len()).expect("radix tree arena overflow");
                assert!(id != FREE, "radix tree arena overflow");
                self.nodes.push(node);
                id
            }
        }
    }

    /// Frees a batch of tenantless nodes (whose children are all in the batch too), touching
    /// the surviving parents in arena order.
    pub(crate) fn free_batch(&mut self, ids: &[NodeId]) {
        if ids.is_empty() {
            return;
        }
        let mut gone = vec![false; self.nodes.len()];
        for &id in ids {
            gone[id as usize] = true;
        }
        let mut parents: Vec<NodeId> =
            ids.iter().map(|&id| self.nodes[id as usize].parent).filter(|&p| !gone[p as usize]).collect();
        parents.sort_unstable();
        parents.dedup();
        for p in parents {
            self.nodes[p as usize].children.retain(|&(_, c)| !gone[c as usize]);
        }
        for &id in ids {
            let node = std::mem::replace(&mut self.nodes[id as usize], Node::new(Box::default(), FREE, 0));
            debug_assert!(node.tenants.is_empty());
            self.live -= 1;
            self.total -= node.label.len();
            self.free.push(id);
        }
    }

    /// Splits node `id` after `at` label elements; returns the new upper node, which takes the
    /// original's place under its parent and copies its tenants (with their timestamps).
    fn split(&mut self, id: NodeId, at: usize) -> NodeId {
        let node = &mut self.nodes[id as usize];
        debug_assert!(at > 0 && at < node.label.len());
        let upper_label: Box<[T]> = node.label[..at].into();
        node.label = node.label[at..].into();
        let lower_first = node.label[0];
        let parent = node.parent;
        let tenants = node
            .tenants
            .iter()
            .map(|e| TenantEntry { tenant: e.tenant, last_access: e.last_access })
            .collect();
        let depth = node.depth - node.label.len() as u32;
        let mut upper = Node::new(upper_label, parent, depth);
        upper.children.push((lower_first, id));
        upper.tenants = tenants;
        let first = upper.label[0];
        // Label elements move from the node to the upper node: the total is unchanged.
        self.total -= at;
        let up = self.alloc(upper);
        self.nodes[id as usize].parent = up;
        self.nodes[parent as usize].set_child(first, up);
        up
    }

    /// Gives `tenant` node `id` (whose parent it already holds) or refreshes it to `now` (or
    /// keeps a later time if the caller's clock went back).
    /// Returns the label length if the tenant newly holds the node, else 0.
    #[inline]
    fn touch(&mut self, id: NodeId, tenant: TenantId, now: u64) -> usize {
        let node = &mut self.nodes[id as usize];
        match node.tenant_pos(tenant) {
            Ok(i) => {
                let e = &mut node.tenants[i];
                e.last_access = e.last_access.max(now);
                0
            }
            Err(i) => {
                node.tenants.insert(i, TenantEntry { tenant, last_access: now });
                node.label.len()
            }
        }
    }

    /// Completes an insert after a descent that reached `pos` along `path`.
    fn insert_along(&mut self, key: &[T], pos: usize, path: &[Step], tenant: TenantId, now: u64) {
        let mut added = 0;
        let mut last = ROOT;
        let mut start = 0;
        for step in path {
            let mut id = step.node;
            if !step.full {
                // The descent stopped inside this edge: split so the matched part is a node.
                id = self.split(id, step.end - start);
            }
            added += self.touch(id, tenant, now);
            last = id;
            start = step.end;
        }
        if pos < key.len() {
            let depth = u32::try_from(key.len()).expect("key longer than u32::MAX elements");
            let mut leaf = Node::new(key[pos..].into(), last, depth);
            leaf.tenants.push(TenantEntry { tenant, last_access: now });
            let first = key[pos];
            let len = key.len() - pos;
            let id = self.alloc(leaf);
            self.nodes[last as usize].set_child(first, id);
            added += len;
        }
        if added > 0 {
            *self.sizes.entry(tenant).or_insert(0) += added;
        }
    }
}
