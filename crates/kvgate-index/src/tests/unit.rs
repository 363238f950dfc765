//! Unit tests, run through the same suite for the text (`u8`) and token (`u32`) flavours.

/// Expands the suite for one element type; `$conv` maps a `char` of the test strings to an element.
macro_rules! unit_suite {
    ($modname:ident, $elem:ty, $conv:expr) => {
        mod $modname {
            use crate::{PrefixMatch, RadixTree, TenantId};

            type Tree = RadixTree<$elem>;

            fn k(s: &str) -> Vec<$elem> {
                s.chars().map($conv).collect()
            }

            fn m(tree: &Tree, s: &str) -> PrefixMatch {
                tree.check_invariants();
                let pm = tree.prefix_match(&k(s));
                assert_eq!(pm.query_len(), s.chars().count());
                pm
            }

            fn ins(tree: &mut Tree, s: &str, t: TenantId, now: u64) {
                tree.insert(&k(s), t, now);
                tree.check_invariants();
            }

            #[test]
            fn empty_tree_matches_nothing() {
                let tree = Tree::new();
                let pm = m(&tree, "hello");
                assert_eq!(pm.best(), 0);
                assert_eq!(pm.matched(1), 0);
                assert_eq!(pm.iter().count(), 0);
                assert_eq!(tree.total_elements(), 0);
                assert_eq!(tree.node_count(), 0);
                assert_eq!(m(&tree, "").best(), 0);
            }

            #[test]
            fn basic_insert_and_match() {
                let mut tree = Tree::new();
                ins(&mut tree, "hello world", 1, 10);
                assert_eq!(m(&tree, "hello world").matched(1), 11);
                assert_eq!(m(&tree, "hello").matched(1), 5);
                assert_eq!(m(&tree, "help").matched(1), 3);
                assert_eq!(m(&tree, "xyz").matched(1), 0);
                assert_eq!(m(&tree, "hello world!!").matched(1), 11);
                assert_eq!(m(&tree, "hello world!!").best(), 11);
                assert_eq!(m(&tree, "hello").matched(2), 0);
                assert_eq!(tree.total_elements(), 11);
                assert_eq!(tree.node_count(), 1);
                assert_eq!(tree.tenant_size(1), 11);
                assert_eq!(tree.tenant_size(2), 0);
                // Reads do not split.
                assert_eq!(tree.node_count(), 1);
            }

            #[test]
            fn empty_key_is_a_noop() {
                let mut tree = Tree::new();
                ins(&mut tree, "", 1, 1);
                assert_eq!(tree.node_count(), 0);
                assert_eq!(tree.tenant_size(1), 0);
                assert!(tree.tenants().is_empty());
            }

            #[test]
            fn split_keeps_tenants_and_lengths() {
                let mut tree = Tree::new();
                ins(&mut tree, "hello world", 1, 1);
                ins(&mut tree, "hello there", 2, 2);
                assert_eq!(tree.node_count(), 3);
                assert_eq!(tree.total_elements(), 6 + 5 + 5);
                assert_eq!(tree.tenant_size(1), 11);
                assert_eq!(tree.tenant_size(2), 11);
                let pm = m(&tree, "hello world");
                assert_eq!(pm.matched(1), 11);
                assert_eq!(pm.matched(2), 6);
                assert_eq!(pm.best(), 11);
                assert_eq!(pm.iter().collect::<Vec<_>>(), vec![(1, 11), (2, 6)]);
                let pm = m(&tree, "hello thorn");
                assert_eq!(pm.matched(1), 6);
                assert_eq!(pm.matched(2), 8);
                let pm = m(&tree, "hell");
                assert_eq!((pm.matched(1), pm.matched(2)), (4, 4));
            }

            #[test]
            fn insert_prefix_of_an_edge_splits_it() {
                let mut tree = Tree::new();
                ins(&mut tree, "abcdef", 1, 1);
                ins(&mut tree, "abc", 2, 2);
                assert_eq!(tree.node_count(), 2);
                assert_eq!(tree.total_elements(), 6);
                let pm = m(&tree, "abcdef");
                assert_eq!((pm.matched(1), pm.matched(2)), (6, 3));
                let pm = m(&tree, "abcx");
                assert_eq!((pm.matched(1), pm.matched(2)), (3, 3));
                // Re-inserting the same key for a holder changes nothing structurally.
                ins(&mut tree, "abcdef", 1, 3);
                assert_eq!(tree.node_count(), 2);
                assert_eq!(tree.tenant_size(1), 6);
            }

            #[test]
            fn multiple_tenants_and_branching() {
                let mut tree = Tree::new();
                ins(&mut tree, "system: be nice. user: hi", 1, 1);
                ins(&mut tree, "system: be nice. user: hello", 2, 2);
                ins(&mut tree, "system: be terse. user: hi", 3, 3);
                ins(&mut tree, "other", 4, 4);
                let pm = m(&tree, "system: be nice. user: hi there");
                assert_eq!(pm.matched(1), 25);
                assert_eq!(pm.matched(2), 24);
                assert_eq!(pm.matched(3), 11);
                assert_eq!(pm.matched(4), 0);
                assert_eq!(pm.best(), 25);
                assert_eq!(pm.iter().count(), 3);
                assert_eq!(tree.tenants(), vec![1, 2, 3, 4]);
            }

            #[test]
            fn match_and_insert_sees_the_match_and_inserts_the_choice() {
                let mut tree = Tree::new();
                ins(&mut tree, "abcdef", 7, 1);
                let key = k("abcxyz");
                let got = tree.match_and_insert(&key, 5, |pm| {
                    assert_eq!(pm.matched(7), 3);
                    assert_eq!(pm.query_len(), 6);
                    None
                });
                assert_eq!(got, None);
                tree.check_invariants();
                assert_eq!(tree.node_count(), 1, "no insert when choose returns None");
                let got = tree.match_and_insert(&key, 6, |pm| {
                    assert_eq!(pm.best(), 3);
                    Some(9)
                });
                assert_eq!(got, Some(9));
                tree.check_invariants();
                let pm = m(&tree, "abcxyz");
                assert_eq!((pm.matched(7), pm.matched(9)), (3, 6));
                assert_eq!(tree.tenant_size(9), 6);
                // Full hit for the holder: refresh only.
                let got = tree.match_and_insert(&key, 7, |pm| Some(pm.iter().max_by_key(|e| e.1).unwrap().0));
                assert_eq!(got, Some(9));
                assert_eq!(tree.total_elements(), 9);
            }

            #[test]
            fn remove_tenant_everywhere() {
                let mut tree = Tree::new();
                ins(&mut tree, "hello world", 1, 1);
                ins(&mut tree, "hello there", 2, 2);
                ins(&mut tree, "goodbye", 2, 3);
                tree.remove_tenant(2);
                tree.check_invariants();
                for q in ["hello world", "hello there", "goodbye", "hello"] {
                    assert_eq!(m(&tree, q).matched(2), 0, "{q}");
                }
                assert_eq!(m(&tree, "hello world").matched(1), 11);
                assert_eq!(tree.total_elements(), 11);
                assert_eq!(tree.tenant_size(2), 0);
                tree.remove_tenant(1);
                tree.check_invariants();
                assert_eq!(tree.node_count(), 0);
                assert_eq!(tree.total_elements(), 0);
                tree.remove_tenant(42); // unknown tenant: no-op
                                        // Freed slots are reused.
                ins(&mut tree, "again", 3, 4);
                assert_eq!(m(&tree, "again").matched(3), 5);
            }

            #[test]
            fn evict_removes_oldest_first_and_respects_bound() {
                let mut tree = Tree::new();
                ins(&mut tree, "aaaaaaaaaa", 1, 1);
                ins(&mut tree, "bbbbbbbbbb", 1, 2);
                ins(&mut tree, "cccccccccc", 1, 3);
                ins(&mut tree, "dddddddddd", 2, 1);
                assert_eq!(tree.evict(30), 0);
                assert_eq!(tree.evict(20), 10);
                tree.check_invariants();
                assert_eq!(tree.tenant_size(1), 20);
                assert_eq!(m(&tree, "aaaaaaaaaa").matched(1), 0);
                assert_eq!(m(&tree, "bbbbbbbbbb").matched(1), 10);
                assert_eq!(m(&tree, "cccccccccc").matched(1), 10);
                assert_eq!(m(&tree, "dddddddddd").matched(2), 10, "other tenant untouched");
                assert_eq!(tree.total_elements(), 30);
                assert_eq!(tree.evict(0), 30);
                tree.check_invariants();
                assert_eq!(tree.node_count(), 0);
                assert!(tree.tenants().is_empty());
            }

            #[test]
            fn evict_walks_up_chains_and_keeps_shared_nodes() {
                let mut tree = Tree::new();
                // Tenant 1: a chain whose deep part is older than its other branch.
                ins(&mut tree, "prefix-one-two", 1, 1);
                ins(&mut tree, "prefix-three", 1, 5);
                ins(&mut tree, "pre", 2, 6);
                assert_eq!(tree.tenant_size(1), 14 + 5);
                assert_eq!(tree.tenant_size(2), 3);
                // Bound 12: drop "one-two" (ts 1, 7 elements) -> 12 left.
                assert_eq!(tree.evict(12), 7);
                tree.check_invariants();
                assert_eq!(tree.tenant_size(1), 12);
                assert_eq!(m(&tree, "prefix-one-two").matched(1), 7);
                assert_eq!(m(&tree, "prefix-three").matched(1), 12);
                // Bound 6: "three" (5) then its parent "fix-" (4) become leaves in turn;
                // "pre" stays (tenant 1 is within the bound again, tenant 2 never exceeded it).
                assert_eq!(tree.evict(6), 9);
                tree.check_invariants();
                assert_eq!(tree.tenant_size(1), 3);
                let pm = m(&tree, "prefix-three");
                assert_eq!((pm.matched(1), pm.matched(2)), (3, 3));
                assert_eq!(tree.total_elements(), 3);
                assert_eq!(tree.node_count(), 1);
            }

            #[test]
            fn split_preserves_timestamps_for_eviction() {
                let mut tree = Tree::new();
                ins(&mut tree, "shared-old", 1, 1);
                ins(&mut tree, "zzzz", 1, 2);
                // Tenant 2 splits "shared-old" at a later time: tenant 1 keeps ts 1 on "sha",
                // so "sha" goes before "zzzz" (ts 2) once "red-old" is gone.
                ins(&mut tree, "sha", 2, 9);
                assert_eq!(tree.evict(4), 10);
                tree.check_invariants();
                assert_eq!(m(&tree, "shared-old").matched(1), 0);
                assert_eq!(m(&tree, "zzzz").matched(1), 4);
                assert_eq!(m(&tree, "shared-new").matched(2), 3);
            }

            #[test]
            fn match_and_insert_refreshes_timestamps() {
                let mut tree = Tree::new();
                ins(&mut tree, "first key", 1, 1);
                ins(&mut tree, "second key", 1, 2);
                tree.match_and_insert(&k("first key"), 3, |_| Some(1));
                assert_eq!(tree.evict(9), 10);
                assert_eq!(m(&tree, "first key").matched(1), 9);
                assert_eq!(m(&tree, "second key").matched(1), 0);
            }

            #[test]
            fn wide_fanout_nodes() {
                // More than 8 children per node: the child lookup switches to binary search.
                let mut tree = Tree::new();
                let firsts: Vec<char> = ('A'..='Z').chain('a'..='z').collect();
                for (i, &c) in firsts.iter().enumerate() {
                    ins(&mut tree, &format!("{c}-root"), (i % 3) as TenantId, i as u64);
                    ins(&mut tree, &format!("shared:{c}-leaf"), 7, i as u64);
                }
                for (i, &c) in firsts.iter().enumerate() {
                    assert_eq!(m(&tree, &format!("{c}-root")).matched((i % 3) as TenantId), 6);
                    assert_eq!(m(&tree, &format!("shared:{c}-leaf!")).matched(7), 13);
                    assert_eq!(m(&tree, &format!("shared:{c}-x")).matched(7), 9);
                }
                assert_eq!(m(&tree, "shared:?").matched(7), 7);
                assert_eq!(m(&tree, "?").best(), 0);
            }

            #[test]
            fn heap_bytes_cover_the_labels() {
                let mut tree = Tree::new();
                for i in 0..50u64 {
                    ins(&mut tree, &format!("common system prompt {i} then more"), (i % 5) as TenantId, i);
                }
                let bytes = tree.approx_heap_bytes();
                assert!(bytes >= tree.total_elements() * std::mem::size_of::<$elem>());
                assert!(tree.node_count() > 50);
            }
        }
    };
}

unit_suite!(text, u8, |c: char| c as u8);

#[test]
fn trees_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<crate::TextTree>();
    assert_send_sync::<crate::TokenTree>();
    assert_send_sync::<crate::PrefixMatch>();
}
unit_suite!(token, u32, |c: char| 70_000 + c as u32);
