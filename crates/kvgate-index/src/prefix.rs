//! The prefix-index seam: "how much of this prompt does each worker hold", answered by the
//! approximate tree (what was routed where) or the exact block index (what the engines reported
//! holding), behind one trait so that policies stay ignorant of which.

use std::sync::Mutex;

use crate::block::{BlockIndex, Namespace, PromptHashes};
use crate::{PrefixMatch, TenantId, TextTree, TokenTree};

/// Which index answered a prefix query.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IndexKind {
    /// The radix tree of what this gateway routed where.
    Approximate,
    /// The block index fed by the engines' KV events.
    Exact,
}

impl IndexKind {
    pub const ALL: [IndexKind; 2] = [IndexKind::Approximate, IndexKind::Exact];

    pub fn as_str(self) -> &'static str {
        match self {
            IndexKind::Approximate => "approximate",
            IndexKind::Exact => "exact",
        }
    }
}

/// A prompt as an index sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptKey<'a> {
    Text(&'a str),
    Tokens(&'a [u32]),
}

/// A prefix index as a routing policy uses it.
pub trait PrefixIndex: Send + Sync {
    fn kind(&self) -> IndexKind;

    /// One routing step: computes each worker's overlap with `key`, calls `choose` with it
    /// exactly once, and, for an index that learns from routing, records the chosen worker as
    /// holding `key` at `now_ms`. Returns what `choose` returned.
    fn route(
        &self,
        key: PromptKey<'_>,
        now_ms: u64,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId>;

    /// How much a worker holds (tree elements, or blocks), for "smallest holder" strategies.
    fn tenant_size(&self, tenant: TenantId) -> usize;
}

/// A host's view of its indexes for one decision (the tree or the exact index, learning or read
/// only, as the host chose): it names the kind and lends the index that answers, and is a
/// [`PrefixIndex`] through it.
pub trait IndexView: Send + Sync {
    /// The kind the decision counts as made on.
    fn kind(&self) -> IndexKind;

    /// `use_index` on the index that answers.
    fn with<R>(&self, use_index: impl FnOnce(&dyn PrefixIndex) -> R) -> R;
}

impl<T: IndexView> PrefixIndex for T {
    fn kind(&self) -> IndexKind {
        IndexView::kind(self)
    }

    fn route(
        &self,
        key: PromptKey<'_>,
        now_ms: u64,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId> {
        self.with(|index| index.route(key, now_ms, choose))
    }

    fn tenant_size(&self, tenant: TenantId) -> usize {
        self.with(|index| index.tenant_size(tenant))
    }
}

/// Settings of the approximate index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeSettings {
    /// Most elements (text bytes or token ids) kept per worker; LRU leaves go first.
    pub max_elements_per_tenant: usize,
    /// Milliseconds between evictions.
    pub eviction_interval_ms: u64,
    /// Token-id prompts are matched and recorded in whole blocks of this many tokens.
    pub block_size: usize,
}

#[derive(Debug, Default)]
struct Trees {
    text: TextTree,
    tokens: TokenTree,
    last_eviction_ms: Option<u64>,
}

/// The approximate index: radix trees (text and token ids) of the prompts routed to each worker.
#[derive(Debug)]
pub struct ApproxIndex {
    settings: TreeSettings,
    trees: Mutex<Trees>,
}

impl ApproxIndex {
    pub fn new(settings: TreeSettings) -> Self {
        let settings = TreeSettings { block_size: settings.block_size.max(1), ..settings };
        Self { settings, trees: Mutex::new(Trees::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Trees> {
        self.trees.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Token-id prompts are matched in whole blocks of this many tokens.
    pub fn block_size(&self) -> usize {
        self.settings.block_size
    }

    /// Like [`PrefixIndex::route`], but records nothing: what the tree would answer.
    pub(crate) fn peek(
        &self,
        key: PromptKey<'_>,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId> {
        let block_size = self.settings.block_size;
        let matched = match key {
            PromptKey::Text(text) if !text.is_empty() => self.lock().text.prefix_match(text.as_bytes()),
            PromptKey::Tokens(ids) if ids.len() >= block_size => {
                let whole_blocks = ids.len() / block_size * block_size;
                self.lock().tokens.prefix_match(&ids[..whole_blocks])
            }
            _ => PrefixMatch::default(),
        };
        choose(&matched)
    }

    /// Records that `tenant` was sent `key` at `now_ms`.
    pub fn record(&self, key: PromptKey<'_>, tenant: TenantId, now_ms: u64) {
        self.route(key, now_ms, &mut |_| Some(tenant));
    }

    /// Periodic maintenance on the host's clock: per-worker LRU eviction every
    /// `eviction_interval_ms` (the first call only starts the clock), and at once when a worker
    /// holds more than twice its bound (prompts arriving faster than the interval evicts them:
    /// what clients send cannot grow the tree past that between two calls' worth of traffic).
    pub fn maintain(&self, now_ms: u64) {
        let mut trees = self.lock();
        let bound = self.settings.max_elements_per_tenant;
        let far_over = trees.text.max_tenant_size() > bound.saturating_mul(2)
            || trees.tokens.max_tenant_size() > bound.saturating_mul(2);
        let due = match trees.last_eviction_ms {
            None => {
                trees.last_eviction_ms = Some(now_ms);
                far_over
            }
            Some(last) => far_over || now_ms.saturating_sub(last) >= self.settings.eviction_interval_ms,
        };
        if due {
            trees.last_eviction_ms = Some(now_ms);
            trees.text.evict(bound);
            trees.tokens.evict(bound);
        }
    }

    /// A worker left for good.
    pub fn remove_tenant(&self, tenant: TenantId) {
        let mut trees = self.lock();
        trees.text.remove_tenant(tenant);
        trees.tokens.remove_tenant(tenant);
    }
}

impl PrefixIndex for ApproxIndex {
    fn kind(&self) -> IndexKind {
        IndexKind::Approximate
    }

    fn route(
        &self,
        key: PromptKey<'_>,
        now_ms: u64,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId> {
        let block_size = self.settings.block_size;
        match key {
            PromptKey::Text(text) if !text.is_empty() => {
                self.lock().text.match_and_insert(text.as_bytes(), now_ms, choose)
            }
            PromptKey::Tokens(ids) if ids.len() >= block_size => {
                let whole_blocks = ids.len() / block_size * block_size;
                self.lock().tokens.match_and_insert(&ids[..whole_blocks], now_ms, choose)
            }
            _ => choose(&PrefixMatch::default()),
        }
    }

    fn tenant_size(&self, tenant: TenantId) -> usize {
        let trees = self.lock();
        trees.text.tenant_size(tenant) + trees.tokens.tenant_size(tenant)
    }
}

impl PrefixIndex for BlockIndex {
    fn kind(&self) -> IndexKind {
        IndexKind::Exact
    }

    /// The base model's blocks (see [`NamespacedExact`] for an adapter's or a salted
    /// request's). Text keys match nothing: the exact index knows token ids only.
    fn route(
        &self,
        key: PromptKey<'_>,
        now_ms: u64,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId> {
        NamespacedExact { exact: self, namespace: Namespace::BASE, hashes: None }.route(key, now_ms, choose)
    }

    fn tenant_size(&self, tenant: TenantId) -> usize {
        self.worker_blocks(tenant)
    }
}

/// The exact index as one request sees it: the blocks of its namespace (its LoRA adapter, its
/// cache salt) only.
#[derive(Clone, Copy)]
pub struct NamespacedExact<'a> {
    pub exact: &'a BlockIndex,
    pub namespace: Namespace<'a>,
    /// The prompt's block hashes in `namespace`, when the host computed them already
    /// ([`BlockIndex::prompt_hashes`], so it hashes a prompt once for several uses).
    pub hashes: Option<&'a PromptHashes>,
}

impl PrefixIndex for NamespacedExact<'_> {
    fn kind(&self) -> IndexKind {
        IndexKind::Exact
    }

    fn route(
        &self,
        key: PromptKey<'_>,
        _now_ms: u64,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId> {
        let mut matched = PrefixMatch::default();
        match (key, self.hashes) {
            // What the engine would serve from cache (never the prompt's last token).
            (PromptKey::Tokens(_), Some(hashes)) => self.exact.served_overlap_hashed(hashes, &mut matched),
            (PromptKey::Tokens(ids), None) => self.exact.served_overlap(ids, self.namespace, &mut matched),
            _ => {}
        }
        choose(&matched)
    }

    fn tenant_size(&self, tenant: TenantId) -> usize {
        self.exact.worker_blocks(tenant)
    }
}

/// Routes on the exact index and also records each choice in the approximate tree, so the tree
/// is warm when the host has to fall back to it (a worker whose events stopped).
#[derive(Clone, Copy)]
pub struct ExactRecordingTree<'a> {
    pub exact: &'a BlockIndex,
    /// The request's namespace in the exact index.
    pub namespace: Namespace<'a>,
    /// As [`NamespacedExact::hashes`].
    pub hashes: Option<&'a PromptHashes>,
    pub tree: &'a ApproxIndex,
}

impl PrefixIndex for ExactRecordingTree<'_> {
    fn kind(&self) -> IndexKind {
        IndexKind::Exact
    }

    fn route(
        &self,
        key: PromptKey<'_>,
        now_ms: u64,
        choose: &mut dyn FnMut(&PrefixMatch) -> Option<TenantId>,
    ) -> Option<TenantId> {
        let chosen = NamespacedExact { exact: self.exact, namespace: self.namespace, hashes: self.hashes }
            .route(key, now_ms, choose);
        if let Some(tenant) = chosen {
            self.tree.record(key, tenant, now_ms);
        }
        chosen
    }

    fn tenant_size(&self, tenant: TenantId) -> usize {
        self.exact.tenant_size(tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_far_over_its_bound_is_evicted_before_the_interval() {
        let settings =
            TreeSettings { max_elements_per_tenant: 1000, eviction_interval_ms: 120_000, block_size: 1 };
        let index = ApproxIndex::new(settings);
        index.maintain(0);
        // Prompts faster than the interval evicts: within twice the bound, they wait for it.
        let prompt = |i: usize| format!("{i:04}{}", "x".repeat(296));
        for i in 0..6 {
            index.record(PromptKey::Text(&prompt(i)), 1, i as u64);
        }
        index.maintain(1_000);
        let held = index.lock().text.tenant_size(1);
        assert!(held > 1000 && held <= 2000, "{held}: under twice the bound, kept until the interval");
        for i in 6..20 {
            index.record(PromptKey::Text(&prompt(i)), 1, i as u64);
        }
        index.maintain(2_000);
        assert!(index.lock().text.tenant_size(1) <= 1000, "far over: evicted at once");
        index.maintain(120_000);
        assert!(index.lock().text.tenant_size(1) <= 1000);
    }
}
