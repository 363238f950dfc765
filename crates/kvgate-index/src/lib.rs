//! kvgate-index: the prefix indexes, approximate (a radix tree of which worker was sent which prefix, and when) and exact (a block index fed by the engines' KV events), behind one seam.
//!
//! The crate is a pure core: no I/O, no clock, no threads, no randomness. Time is an input
//! (`now: u64`, milliseconds from a caller-defined epoch).
//!
//! * [`PrefixIndex`] is the seam policies use: "how much of this prompt does each worker hold",
//!   answered by [`ApproxIndex`] (the trees below) or [`BlockIndex`] (exact, event-fed).
//! * [`BlockIndex`] maps kvgate's chained content hash of each KV block to the engine caches
//!   holding it; [`CacheBlocks`] applies one cache's stored/removed events to it. Queries run
//!   concurrently with writers (sharded locks, one block at a time).
//!
//! * [`choose_index`] is the host's rule for which of the two a request is matched against
//!   (exact when the engines' events flow, else the tree; [`PrefixIndexMode`] forces one).
//!
//! * [`RadixTree<T>`] is generic over the element: `u8` for UTF-8 prompt text ([`TextTree`]) and
//!   `u32` for token ids ([`TokenTree`]); one implementation serves both.
//! * [`RadixTree::match_and_insert`] does the routing hot path in one descent: match, let the
//!   caller choose a tenant from the [`PrefixMatch`], insert for that tenant.
//! * [`RadixTree::evict`] is a per-tenant LRU bound; [`RadixTree::remove_tenant`] drops a worker.
//!
//! ```
//! use kvgate_index::TextTree;
//!
//! let mut tree = TextTree::new();
//! tree.insert(b"<sys>be brief</sys> hello", 1, 10);
//! // Route a prompt: the closure sees the per-tenant match and picks a worker (here the best
//! // match, else worker 2); the prompt is then recorded for it in the same descent.
//! let chosen = tree.match_and_insert(b"<sys>be brief</sys> bonjour", 11, |m| {
//!     assert_eq!(m.matched(1), 20);
//!     m.iter().max_by_key(|&(_, len)| len).map(|(t, _)| t).or(Some(2))
//! });
//! assert_eq!(chosen, Some(1));
//! assert_eq!(tree.prefix_match(b"<sys>be brief</sys> bonjour").matched(1), 27);
//! tree.evict(20); // each tenant keeps at most 20 elements, least recently used leaves go first
//! assert!(tree.tenant_size(1) <= 20);
//! ```

mod accuracy;
mod alignment;
mod block;
mod choice;
mod evict;
mod matching;
mod node;
mod peer;
mod prefix;
mod prefix_match;
mod tree;

#[cfg(test)]
mod tests;

pub use accuracy::{
    AccuracyChange, AccuracySample, AccuracySettings, Disagreement, IndexAccuracy, LikelyCause,
};
pub use alignment::{
    judge_form, judge_sentinel, overall_verdict, served_tokens, FormObservation, IndexRepair, ProbeCause,
    ProbeForm, SentinelObservation, Verdict,
};
pub use block::{
    block_content, content_hash, Adapter, ApplyError, BlockIndex, CacheBlocks, CacheCensus, CacheId, Census,
    CensusOptions, ChainRoot, HeldBlock, Holder, InFlightBlocks, InFlightPrompt, Layout, Namespace,
    PromptHashes, Residency, StoredBlocks, TierWeights, IN_FLIGHT_RANK, MAX_LAYOUTS, ROOT_HASH,
};
pub use choice::{choose_index, IndexInputs, PrefixIndexMode};
pub use peer::{
    prompt_blocks, prompt_hash, PeerBlocks, PeerMerged, PromptBlocks, ReadOnlyTree, TEXT_BLOCK_BYTES,
};
pub use prefix::{
    ApproxIndex, ExactRecordingTree, IndexKind, IndexView, NamespacedExact, PrefixIndex, PromptKey,
    TreeSettings,
};
pub use prefix_match::PrefixMatch;
pub use tree::RadixTree;

/// Worker id, assigned by the host.
pub type TenantId = u32;

/// Radix tree over the UTF-8 bytes of prompt text.
pub type TextTree = RadixTree<u8>;

/// Radix tree over token ids.
pub type TokenTree = RadixTree<u32>;
