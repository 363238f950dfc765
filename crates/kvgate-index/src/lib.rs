//! kvgate-index: the approximate prefix index (a per-model radix tree of which tenant was sent which prefix, and when).
//!
//! The crate is a pure core: no I/O, no clock, no threads, no randomness. Time is an input
//! (`now: u64`, milliseconds from a caller-defined epoch).
//!
//! * [`RadixTree<T>`] is generic over the element: `u8` for UTF-8 prompt text ([`TextTree`]) and
//!   `u32` for token ids ([`TokenTree`]); one implementation serves both.
//! * [`RadixTree::match_and_insert`] does the routing hot path in one descent: match, let the
//!   caller choose a tenant from the [`PrefixMatch`], insert for that tenant.
//! * [`RadixTree::evict`] is a per-tenant LRU bound; [`RadixTree::remove_tenant`] drops a worker.

mod evict;
mod matching;
mod node;
mod tree;

#[cfg(test)]
mod tests;

pub use matching::PrefixMatch;
pub use tree::RadixTree;

/// Worker id, assigned by the host.
pub type TenantId = u32;

/// Radix tree over the UTF-8 bytes of prompt text.
pub type TextTree = RadixTree<u8>;

/// Radix tree over token ids.
pub type TokenTree = RadixTree<u32>;
