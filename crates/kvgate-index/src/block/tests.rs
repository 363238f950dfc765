//! Block index tests: small cases, a differential proptest against a naive model of each engine
//! cache, and queries running concurrently with a writer.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;

const BS: u32 = 2;

fn stored<'a>(hashes: &'a [u64], parent: Option<u64>, tokens: &'a [u32]) -> StoredBlocks<'a> {
    StoredBlocks {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: BS,
        medium: None,
    }
}

fn overlap(index: &BlockIndex, tokens: &[u32]) -> Vec<(TenantId, usize)> {
    let mut out = PrefixMatch::default();
    index.overlap(tokens, &mut out);
    assert_eq!(out.query_len(), tokens.len());
    out.iter().collect()
}

#[test]
fn a_chain_of_events_is_matched_block_by_block() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 7, rank: 0 });
    cache.apply_stored(stored(&[10, 11], None, &[1, 2, 3, 4])).unwrap();
    cache.apply_stored(stored(&[12], Some(11), &[5, 6])).unwrap();
    assert_eq!(index.block_size(), 2);
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6, 7]), [(7, 6)]);
    assert_eq!(overlap(&index, &[1, 2, 3, 9, 5, 6]), [(7, 2)], "a different second block stops the match");
    assert_eq!(overlap(&index, &[3, 4, 5, 6]), [], "blocks are chained: the same tokens elsewhere differ");
    assert_eq!(cache.apply_removed(&[11, 99], None), 1, "an unknown hash is ignored and counted");
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(7, 2)], "a hole stops the match");
    assert_eq!(index.worker_blocks(7), 2);
    cache.clear();
    assert!(index.is_empty());
    assert_eq!(index.worker_blocks(7), 0);
}

#[test]
fn a_store_past_the_cache_bound_is_refused_alone() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 3, rank: 0 });
    cache.set_max_blocks(3);
    cache.apply_stored(stored(&[1, 2], None, &[1, 2, 3, 4])).unwrap();
    // A million-block event (the attack) is refused whole, and nothing of it is kept.
    let hashes: Vec<u64> = (100..1_000_100).collect();
    let tokens = vec![7u32; hashes.len() * BS as usize];
    assert_eq!(
        cache.apply_stored(stored(&hashes, Some(2), &tokens)),
        Err(ApplyError::OverCapacity { held: 2, adding: 1_000_000, max: 3 })
    );
    assert_eq!((cache.len(), index.worker_blocks(3)), (2, 2));
    // Blocks already held do not count again; the next event within the bound is applied.
    cache.apply_stored(stored(&[2, 3], Some(1), &[3, 4, 5, 6])).unwrap();
    assert_eq!(cache.len(), 3);
    assert!(matches!(
        cache.apply_stored(stored(&[4], Some(3), &[7, 8])),
        Err(ApplyError::OverCapacity { .. })
    ));
    assert_eq!(cache.apply_removed(&[3], None), 0);
    cache.apply_stored(stored(&[4], Some(2), &[7, 8])).unwrap();
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 7, 8]), [(3, 6)]);
}

#[test]
fn bad_events_are_refused_whole() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 1, rank: 0 });
    assert_eq!(cache.apply_stored(stored(&[1], Some(42), &[1, 2])), Err(ApplyError::UnknownParent(42)));
    assert_eq!(
        cache.apply_stored(stored(&[1, 2], None, &[1, 2, 3])),
        Err(ApplyError::TokenCount { tokens: 3, blocks: 2, block_size: 2 })
    );
    let zero = StoredBlocks { block_size: 0, ..stored(&[], None, &[]) };
    assert_eq!(cache.apply_stored(zero), Err(ApplyError::ZeroBlockSize));
    cache.apply_stored(stored(&[1], None, &[1, 2])).unwrap();
    let other_size = StoredBlocks { block_size: 1, ..stored(&[2], None, &[9]) };
    assert_eq!(cache.apply_stored(other_size), Err(ApplyError::BlockSizeMismatch { got: 1, known: 2 }));
    assert_eq!(index.len(), 1);
}

#[test]
fn workers_ranks_and_media() {
    let index = Arc::new(BlockIndex::new());
    let mut rank0 = CacheBlocks::new(index.clone(), CacheId { worker: 3, rank: 0 });
    let mut rank1 = CacheBlocks::new(index.clone(), CacheId { worker: 3, rank: 1 });
    let mut other = CacheBlocks::new(index.clone(), CacheId { worker: 1, rank: 0 });
    rank0.apply_stored(stored(&[1], None, &[1, 2])).unwrap();
    rank1.apply_stored(stored(&[1, 2], None, &[1, 2, 3, 4])).unwrap();
    other.apply_stored(stored(&[5, 6, 7], None, &[1, 2, 3, 4, 5, 6])).unwrap();
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(1, 6), (3, 4)], "a worker's best rank counts");
    // Offloaded to the CPU tier, then dropped from the GPU: still held.
    let cpu = StoredBlocks { medium: Some("CPU"), ..stored(&[5], None, &[1, 2]) };
    other.apply_stored(cpu).unwrap();
    other.apply_removed(&[5], Some("GPU"));
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(1, 6), (3, 4)]);
    other.apply_removed(&[5], Some("CPU"));
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(3, 4)]);
    drop(rank1);
    assert_eq!(overlap(&index, &[1, 2, 3, 4]), [(3, 2)], "a dropped writer takes its blocks along");
    assert_eq!(index.worker_blocks(3), 1);
}

#[test]
fn two_engine_hashes_for_one_content_hold_it_until_both_go() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 0, rank: 0 });
    cache.apply_stored(stored(&[1], None, &[1, 2])).unwrap();
    cache.apply_stored(stored(&[2], None, &[1, 2])).unwrap();
    cache.apply_removed(&[1], None);
    assert_eq!(overlap(&index, &[1, 2]), [(0, 2)]);
    cache.apply_removed(&[2], None);
    assert_eq!(overlap(&index, &[1, 2]), []);
}

#[test]
fn queries_see_a_growing_prefix_while_a_writer_stores_it() {
    let index = Arc::new(BlockIndex::new());
    let tokens: Vec<u32> = (0..400).collect();
    std::thread::scope(|scope| {
        let writer_index = index.clone();
        let tokens_w = &tokens;
        scope.spawn(move || {
            let mut cache = CacheBlocks::new(writer_index, CacheId { worker: 9, rank: 0 });
            for (i, block) in tokens_w.chunks_exact(2).enumerate() {
                let parent = i.checked_sub(1).map(|p| p as u64);
                cache.apply_stored(stored(&[i as u64], parent, block)).unwrap();
            }
            std::mem::forget(cache); // keep the blocks for the final check
        });
        for _ in 0..2 {
            let index = &index;
            let tokens = &tokens;
            scope.spawn(move || {
                let mut last = 0;
                let mut out = PrefixMatch::default();
                for _ in 0..2_000 {
                    index.overlap(tokens, &mut out);
                    let now = out.matched(9);
                    assert!(now >= last && now % 2 == 0, "{last} then {now}");
                    last = now;
                }
            });
        }
    });
    assert_eq!(overlap(&index, &tokens), [(9, 400)]);
}

// ---- differential test against a naive model ------------------------------------------------

/// The naive model of one cache: engine hash → (the whole token prefix it ends, media bits).
type RefCache = HashMap<u64, (Vec<u32>, u8)>;

#[derive(Clone, Debug)]
enum Op {
    /// cache, prompt, first block, last block (exclusive), medium
    Store(usize, usize, usize, usize, u8),
    /// cache, prompt, block, medium
    Remove(usize, usize, usize, u8),
    Clear(usize),
    Query(usize),
}

const CACHES: [CacheId; 3] =
    [CacheId { worker: 0, rank: 0 }, CacheId { worker: 0, rank: 1 }, CacheId { worker: 2, rank: 0 }];
const MEDIA: [Option<&str>; 3] = [None, Some("GPU"), Some("CPU")];

/// Engine hash of a prompt's block: what an engine would send (depends on the cache for cache 2,
/// as engines with different seeds do).
fn engine_hash(cache: usize, prefix: &[u32]) -> u64 {
    let salt = if cache == 2 { 77 } else { 0 };
    prefix.iter().fold(1469598103934665603u64 ^ salt, |h, &t| (h ^ u64::from(t)).wrapping_mul(1099511628211))
}

fn media_bit(medium: u8) -> u8 {
    if medium == 2 {
        2
    } else {
        1
    }
}

fn ref_overlap(caches: &[RefCache], query: &[u32]) -> Vec<(TenantId, usize)> {
    let mut best: HashMap<TenantId, usize> = HashMap::new();
    for (c, cache) in caches.iter().enumerate() {
        let mut blocks = 0;
        while (blocks + 1) * BS as usize <= query.len() {
            let prefix = &query[..(blocks + 1) * BS as usize];
            if !cache.values().any(|(held, _)| held.as_slice() == prefix) {
                break;
            }
            blocks += 1;
        }
        if blocks > 0 {
            let entry = best.entry(CACHES[c].worker).or_insert(0);
            *entry = (*entry).max(blocks * BS as usize);
        }
    }
    let mut out: Vec<(TenantId, usize)> = best.into_iter().collect();
    out.sort_unstable();
    out
}

fn prompts() -> impl Strategy<Value = Vec<Vec<u32>>> {
    prop::collection::vec(prop::collection::vec(0u32..3, 2..10), 4)
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (0..3usize, 0..4usize, 0..5usize, 0..6usize, 0..3u8).prop_map(|(c, p, a, b, m)| Op::Store(c, p, a, b, m)),
        3 => (0..3usize, 0..4usize, 0..5usize, 0..3u8).prop_map(|(c, p, b, m)| Op::Remove(c, p, b, m)),
        1 => (0..3usize).prop_map(Op::Clear),
        4 => (0..4usize).prop_map(Op::Query),
    ];
    prop::collection::vec(op, 1..60)
}

proptest! {
    #[test]
    fn matches_a_naive_model_of_every_cache(prompts in prompts(), ops in ops()) {
        let index = Arc::new(BlockIndex::new());
        let twin = Arc::new(BlockIndex::new());
        let mut writers: Vec<CacheBlocks> = CACHES.iter().map(|&id| CacheBlocks::new(index.clone(), id)).collect();
        let mut twins: Vec<CacheBlocks> = CACHES.iter().map(|&id| CacheBlocks::new(twin.clone(), id)).collect();
        let mut model: Vec<RefCache> = vec![RefCache::new(); CACHES.len()];
        for op in ops {
            match op {
                Op::Store(c, p, first, end, medium) => {
                    let prompt = &prompts[p];
                    let n_blocks = prompt.len() / BS as usize;
                    let (first, end) = (first.min(n_blocks), end.min(n_blocks));
                    if first >= end {
                        continue;
                    }
                    let bs = BS as usize;
                    let hashes: Vec<u64> = (first..end).map(|b| engine_hash(c, &prompt[..(b + 1) * bs])).collect();
                    let parent = first.checked_sub(1).map(|b| engine_hash(c, &prompt[..(b + 1) * bs]));
                    let tokens = &prompt[first * bs..end * bs];
                    let event = StoredBlocks { medium: MEDIA[medium as usize], ..stored(&hashes, parent, tokens) };
                    let applied = writers[c].apply_stored(event);
                    prop_assert_eq!(&applied, &twins[c].apply_stored(event));
                    let parent_known = parent.is_none_or(|h| model[c].contains_key(&h));
                    prop_assert_eq!(applied.is_ok(), parent_known, "{:?}", applied);
                    if parent_known {
                        for b in first..end {
                            let prefix = prompt[..(b + 1) * bs].to_vec();
                            let hash = engine_hash(c, &prefix);
                            let entry = model[c].entry(hash).or_insert((prefix, 0));
                            entry.1 |= media_bit(medium);
                        }
                    }
                }
                Op::Remove(c, p, block, medium) => {
                    let prompt = &prompts[p];
                    let end = (block + 1) * BS as usize;
                    if end > prompt.len() {
                        continue;
                    }
                    let hash = engine_hash(c, &prompt[..end]);
                    let unknown = writers[c].apply_removed(&[hash], MEDIA[medium as usize]);
                    twins[c].apply_removed(&[hash], MEDIA[medium as usize]);
                    prop_assert_eq!(unknown == 1, !model[c].contains_key(&hash));
                    if let Some(entry) = model[c].get_mut(&hash) {
                        entry.1 &= !media_bit(medium);
                        if entry.1 == 0 {
                            model[c].remove(&hash);
                        }
                    }
                }
                Op::Clear(c) => {
                    writers[c].clear();
                    twins[c].clear();
                    model[c].clear();
                }
                Op::Query(p) => {
                    let query = &prompts[p];
                    prop_assert_eq!(overlap(&index, query), ref_overlap(&model, query), "query {:?}", query);
                }
            }
            for (c, writer) in writers.iter().enumerate() {
                let distinct: std::collections::HashSet<&Vec<u32>> = model[c].values().map(|(p, _)| p).collect();
                prop_assert_eq!(writer.len(), distinct.len());
            }
            prop_assert_eq!(index.dump(), twin.dump(), "two indexes fed the same events agree");
        }
        drop(writers);
        prop_assert!(index.is_empty(), "dropping every writer empties the index");
    }
}
