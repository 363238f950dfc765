//! Property tests against a naive reference (a list of `(key, tenant)` pairs), run for both flavours.

/// Expands the properties for one element type; `$conv` maps a small symbol (`u8` in 0..4) to an element.
macro_rules! prop_suite {
    ($modname:ident, $elem:ty, $conv:expr) => {
        mod $modname {
            use std::collections::{HashMap, HashSet};

            use proptest::prelude::*;

            use crate::{PrefixMatch, RadixTree, TenantId};

            type E = $elem;
            const TENANTS: TenantId = 4;

            #[derive(Clone, Debug)]
            enum Op {
                Insert(Vec<E>, TenantId),
                /// choice: 0..TENANTS = that tenant, TENANTS = None, above = the best-matching tenant.
                MatchInsert(Vec<E>, u32),
                Remove(TenantId),
                Evict(usize),
            }

            fn key() -> impl Strategy<Value = Vec<E>> {
                // A 3-symbol alphabet and short keys: lots of shared prefixes and splits.
                prop::collection::vec((0u8..3).prop_map($conv), 0..16)
            }

            fn op(with_evict: bool) -> impl Strategy<Value = Op> {
                let evict_weight = if with_evict { 2 } else { 0 };
                prop_oneof![
                    6 => (key(), 0..TENANTS).prop_map(|(k, t)| Op::Insert(k, t)),
                    6 => (key(), 0..TENANTS + 2).prop_map(|(k, c)| Op::MatchInsert(k, c)),
                    1 => (0..TENANTS).prop_map(Op::Remove),
                    evict_weight => (0usize..30).prop_map(Op::Evict),
                ]
            }

            /// The naive model: every inserted `(key, tenant)` pair still alive.
            #[derive(Default)]
            struct Reference {
                pairs: Vec<(Vec<E>, TenantId)>,
            }

            fn lcp(a: &[E], b: &[E]) -> usize {
                a.iter().zip(b).take_while(|(x, y)| x == y).count()
            }

            impl Reference {
                fn matched(&self, q: &[E], t: TenantId) -> usize {
                    self.pairs
                        .iter()
                        .filter(|p| p.1 == t)
                        .map(|p| lcp(&p.0, q))
                        .max()
                        .unwrap_or(0)
                }
                fn distinct_prefixes(&self, t: Option<TenantId>) -> usize {
                    let mut set: HashSet<&[E]> = HashSet::new();
                    for (k, pt) in &self.pairs {
                        if t.is_none_or(|t| t == *pt) {
                            for i in 1..=k.len() {
                                set.insert(&k[..i]);
                            }
                        }
                    }
                    set.len()
                }
            }

            fn assert_match_exact(pm: &PrefixMatch, reference: &Reference, q: &[E]) {
                assert_eq!(pm.query_len(), q.len());
                let mut best = 0;
                for t in 0..TENANTS {
                    let want = reference.matched(q, t);
                    assert_eq!(pm.matched(t), want, "tenant {t}, query {q:?}");
                    best = best.max(want);
                }
                assert_eq!(pm.best(), best);
                let listed: Vec<_> = pm.iter().collect();
                let want: Vec<_> = (0..TENANTS)
                    .map(|t| (t, reference.matched(q, t)))
                    .filter(|e| e.1 > 0)
                    .collect();
                assert_eq!(listed, want);
            }

            fn best_tenant(pm: &PrefixMatch) -> TenantId {
                pm.iter().max_by_key(|&(t, l)| (l, std::cmp::Reverse(t))).map_or(0, |e| e.0)
            }

            fn choose(pm: &PrefixMatch, c: u32) -> Option<TenantId> {
                match c {
                    c if c < TENANTS => Some(c),
                    c if c == TENANTS => None,
                    _ => Some(best_tenant(pm)),
                }
            }

            proptest! {
                #![proptest_config(ProptestConfig::with_cases(256))]

                /// Without eviction the tree is exactly the reference: per-tenant match lengths,
                /// tenant sizes and total elements (= distinct non-empty prefixes).
                #[test]
                fn differential_against_reference(
                    ops in prop::collection::vec(op(false), 1..40),
                    queries in prop::collection::vec(key(), 1..8),
                ) {
                    let mut tree: RadixTree<E> = RadixTree::new();
                    let mut reference = Reference::default();
                    for (now, op) in ops.into_iter().enumerate() {
                        let now = now as u64 + 1;
                        match op {
                            Op::Insert(k, t) => {
                                tree.insert(&k, t, now);
                                reference.pairs.push((k, t));
                            }
                            Op::MatchInsert(k, c) => {
                                let got = tree.match_and_insert(&k, now, |pm| {
                                    assert_match_exact(pm, &reference, &k);
                                    choose(pm, c)
                                });
                                if let Some(t) = got {
                                    reference.pairs.push((k, t));
                                }
                            }
                            Op::Remove(t) => {
                                tree.remove_tenant(t);
                                reference.pairs.retain(|p| p.1 != t);
                                for (k, _) in &reference.pairs {
                                    prop_assert_eq!(tree.prefix_match(k).matched(t), 0);
                                }
                            }
                            Op::Evict(_) => unreachable!(),
                        }
                        tree.check_invariants();
                        prop_assert_eq!(tree.total_elements(), reference.distinct_prefixes(None));
                        for t in 0..TENANTS {
                            prop_assert_eq!(tree.tenant_size(t), reference.distinct_prefixes(Some(t)));
                        }
                    }
                    let inserted: Vec<Vec<E>> = reference.pairs.iter().map(|p| p.0.clone()).collect();
                    for q in queries.iter().chain(&inserted) {
                        assert_match_exact(&tree.prefix_match(q), &reference, q);
                    }
                }

                /// With eviction: matches never exceed the reference, every tenant ends within the
                /// bound, the evicted count adds up, and LRU keeps each tenant's newest key when it
                /// fits the bound.
                #[test]
                fn eviction_properties(
                    ops in prop::collection::vec(op(true), 1..50),
                    queries in prop::collection::vec(key(), 1..8),
                ) {
                    let mut tree: RadixTree<E> = RadixTree::new();
                    let mut reference = Reference::default();
                    // Per tenant: its newest key and whether it is known to be fully held.
                    let mut newest: HashMap<TenantId, (Vec<E>, bool)> = HashMap::new();
                    for (now, op) in ops.into_iter().enumerate() {
                        let now = now as u64 + 1;
                        match op {
                            Op::Insert(k, t) => {
                                tree.insert(&k, t, now);
                                newest.insert(t, (k.clone(), true));
                                reference.pairs.push((k, t));
                            }
                            Op::MatchInsert(k, c) => {
                                if let Some(t) = tree.match_and_insert(&k, now, |pm| choose(pm, c)) {
                                    newest.insert(t, (k.clone(), true));
                                    reference.pairs.push((k, t));
                                }
                            }
                            Op::Remove(t) => {
                                tree.remove_tenant(t);
                                reference.pairs.retain(|p| p.1 != t);
                                newest.remove(&t);
                                for (k, _) in &reference.pairs {
                                    prop_assert_eq!(tree.prefix_match(k).matched(t), 0);
                                }
                            }
                            Op::Evict(bound) => {
                                let before: Vec<usize> = (0..TENANTS).map(|t| tree.tenant_size(t)).collect();
                                let evicted = tree.evict(bound);
                                let mut drop = 0;
                                for t in 0..TENANTS {
                                    let after = tree.tenant_size(t);
                                    prop_assert!(after <= bound, "tenant {} holds {} > {}", t, after, bound);
                                    prop_assert!(after <= before[t as usize]);
                                    if before[t as usize] <= bound {
                                        prop_assert_eq!(after, before[t as usize]);
                                    }
                                    drop += before[t as usize] - after;
                                }
                                prop_assert_eq!(evicted, drop);
                                for (t, (k, intact)) in newest.iter_mut() {
                                    if k.len() > bound {
                                        *intact = false;
                                    } else if *intact {
                                        prop_assert_eq!(tree.prefix_match(k).matched(*t), k.len(),
                                            "newest key of tenant {} evicted", t);
                                    }
                                }
                            }
                        }
                        tree.check_invariants();
                        prop_assert!(tree.total_elements() <= reference.distinct_prefixes(None));
                        let inserted: Vec<Vec<E>> = reference.pairs.iter().map(|p| p.0.clone()).collect();
                        for q in queries.iter().chain(&inserted) {
                            let pm = tree.prefix_match(q);
                            for t in 0..TENANTS {
                                prop_assert!(pm.matched(t) <= reference.matched(q, t));
                            }
                        }
                    }
                }

                /// Eviction equals the reference LRU-leaf eviction, also when the caller's clock
                /// is not monotonic (times are random here).
                #[test]
                fn eviction_matches_naive_lru(
                    ops in prop::collection::vec((op(true), 0u64..12), 1..50),
                ) {
                    let mut tree: RadixTree<E> = RadixTree::new();
                    let mut keys: Vec<Vec<E>> = Vec::new();
                    for (op, now) in ops {
                        match op {
                            Op::Insert(k, t) => {
                                tree.insert(&k, t, now);
                                keys.push(k);
                            }
                            Op::MatchInsert(k, c) => {
                                tree.match_and_insert(&k, now, |pm| choose(pm, c));
                                keys.push(k);
                            }
                            Op::Remove(t) => tree.remove_tenant(t),
                            Op::Evict(bound) => {
                                let mut naive = tree.clone();
                                let want = naive.naive_evict(bound);
                                let got = tree.evict(bound);
                                prop_assert_eq!(got, want);
                                prop_assert_eq!(tree.total_elements(), naive.total_elements());
                                prop_assert_eq!(tree.node_count(), naive.node_count());
                                for t in 0..TENANTS {
                                    prop_assert_eq!(tree.tenant_size(t), naive.tenant_size(t));
                                }
                                for k in &keys {
                                    prop_assert_eq!(tree.prefix_match(k), naive.prefix_match(k));
                                }
                            }
                        }
                        tree.check_invariants();
                    }
                }
            }
        }
    };
}

prop_suite!(text, u8, |s: u8| b'a' + s);
prop_suite!(token, u32, |s: u8| 1_000_000 + u32::from(s));
