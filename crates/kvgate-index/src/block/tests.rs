//! Block index tests: small cases, a differential proptest against a naive model of each engine
//! cache, and queries running concurrently with a writer.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;

const BS: u32 = 2;

fn gpu() -> &'static Residency {
    static GPU: std::sync::OnceLock<Residency> = std::sync::OnceLock::new();
    GPU.get_or_init(Residency::gpu)
}

fn stored<'a>(hashes: &'a [u64], parent: Option<u64>, tokens: &'a [u32]) -> StoredBlocks<'a> {
    StoredBlocks {
        group: 0,
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: BS,
        lookahead: &[],
        opaque: &[],
        namespace: Namespace::BASE,
        residency: gpu(),
    }
}

fn overlap(index: &BlockIndex, tokens: &[u32]) -> Vec<(TenantId, usize)> {
    overlap_in(index, tokens, Namespace::BASE)
}

fn overlap_in(index: &BlockIndex, tokens: &[u32], namespace: Namespace<'_>) -> Vec<(TenantId, usize)> {
    let mut out = PrefixMatch::default();
    index.overlap(tokens, namespace, &mut out);
    assert_eq!(out.query_len(), tokens.len());
    out.iter().collect()
}

/// (tenant, matched, credited) for every tenant that matched.
fn credited(index: &BlockIndex, tokens: &[u32]) -> Vec<(TenantId, usize, usize)> {
    let mut out = PrefixMatch::default();
    index.overlap(tokens, Namespace::BASE, &mut out);
    out.iter().map(|(tenant, matched)| (tenant, matched, out.credited(tenant))).collect()
}

fn residency(medium: &str) -> Residency {
    Residency::of(Some(medium), None, None)
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
    assert_eq!(cache.apply_removed(0, &[11, 99], gpu()), 1, "an unknown hash is ignored and counted");
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(7, 2)], "a hole stops the match");
    assert_eq!(index.worker_blocks(7), 2);
    cache.clear();
    assert!(index.is_empty());
    assert_eq!(index.worker_blocks(7), 0);
}

#[test]
fn the_served_match_never_includes_the_prompts_last_token() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 7, rank: 0 });
    cache.apply_stored(stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])).unwrap();
    let served = |tokens: &[u32]| {
        let mut out = PrefixMatch::default();
        index.served_overlap(tokens, Namespace::BASE, &mut out);
        let mut hashed = PrefixMatch::default();
        index.served_overlap_hashed(&index.prompt_hashes(tokens, Namespace::BASE), &mut hashed);
        assert_eq!(out.matched(7), hashed.matched(7), "hashed once or not, the same");
        (out.matched(7), out.query_len())
    };
    // Held whole, 6 tokens (3 blocks): the engine recomputes the last block with the last token.
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(7, 6)]);
    assert_eq!(served(&[1, 2, 3, 4, 5, 6]), (4, 6));
    // One token more: every held block is served.
    assert_eq!(served(&[1, 2, 3, 4, 5, 6, 7]), (6, 7));
    assert_eq!(served(&[1, 2, 3]), (2, 3));
    assert_eq!(served(&[1, 2]), (0, 2));
    assert_eq!(served(&[1]), (0, 1));
    assert_eq!(served(&[]), (0, 0));
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
    assert_eq!(cache.apply_removed(0, &[3], gpu()), 0);
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
    let zero = StoredBlocks { block_size: 0, ..stored(&[1], None, &[1, 2]) };
    assert_eq!(cache.apply_stored(zero), Err(ApplyError::ZeroBlockSize));
    let lookahead = StoredBlocks { lookahead: &[3, 4, 5], ..stored(&[1, 2], None, &[1, 2, 3, 4]) };
    assert_eq!(
        cache.apply_stored(lookahead),
        Err(ApplyError::PerBlockCount { lookahead: 3, opaque: 0, blocks: 2 })
    );
    assert!(index.is_empty());
    for size in 1..=MAX_LAYOUTS as u32 {
        let tokens: Vec<u32> = (0..size).collect();
        let hashes = [u64::from(size)];
        let event = StoredBlocks { block_size: size, ..stored(&hashes, None, &tokens) };
        cache.apply_stored(event).unwrap();
    }
    let fifth = StoredBlocks { block_size: 9, ..stored(&[9], None, &[0; 9]) };
    let layout = Layout { block_size: 9, lookahead: 0 };
    assert_eq!(cache.apply_stored(fifth), Err(ApplyError::TooManyLayouts { got: layout }));
    assert_eq!(index.len(), MAX_LAYOUTS);
    assert_eq!(index.block_size(), 1, "the first layout seen");
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
    // Offloaded to the CPU tier, then dropped from the GPU: still held, credited as CPU.
    let cpu = residency("CPU");
    other.apply_stored(StoredBlocks { residency: &cpu, ..stored(&[5, 6], None, &[1, 2, 3, 4]) }).unwrap();
    other.apply_removed(0, &[5, 6], &Residency::of(Some("gpu"), None, None));
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(1, 6), (3, 4)]);
    // 4 tokens in host memory at the default 0.95 and 2 on the GPU: 5.8, rounded to 6.
    assert_eq!(credited(&index, &[1, 2, 3, 4, 5, 6]), [(1, 6, 6), (3, 4, 4)]);
    other.apply_removed(0, &[5], &cpu);
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(3, 4)]);
    drop(rank1);
    assert_eq!(overlap(&index, &[1, 2, 3, 4]), [(3, 2)], "a dropped writer takes its blocks along");
    assert_eq!(index.worker_blocks(3), 1);
}

#[test]
fn a_chain_is_one_segment_and_removals_cut_it() {
    // Events continuing a chain's last block grow its segment: one segment for the chain.
    for leaf_first in [false, true] {
        let index = Arc::new(BlockIndex::new());
        let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 0, rank: 0 });
        cache.apply_stored(stored(&[1, 2, 3], None, &[1, 2, 3, 4, 5, 6])).unwrap();
        cache.apply_stored(stored(&[4, 5], Some(3), &[7, 8, 9, 10])).unwrap();
        cache.apply_stored(stored(&[11, 12, 13], None, &[7, 8, 9, 10, 11, 12])).unwrap();
        assert_eq!(index.segments(), [3, 5]);
        // A branch from the middle of a segment is a segment of its own.
        cache.apply_stored(stored(&[6], Some(2), &[0, 0])).unwrap();
        assert_eq!(index.segments(), [1, 3, 5]);
        assert_eq!(overlap(&index, &[1, 2, 3, 4, 0, 0, 1]), [(0, 6)]);
        let mut chain = vec![11, 12, 13];
        if leaf_first {
            chain.reverse();
        }
        assert_eq!(cache.apply_removed(0, &chain, gpu()), 0);
        assert_eq!(index.segments(), [1, 5], "leaf first: {leaf_first}");
        assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), [(0, 10)]);
        assert_eq!(overlap(&index, &[7, 8, 9, 10, 11, 12]), []);
        // A block leaving from the middle cuts the segment in two; the tail stays held, and
        // matches again once the block is stored back.
        cache.apply_removed(0, &[2], gpu());
        assert_eq!(index.segments(), [1, 1, 3]);
        assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6]), [(0, 2)]);
        cache.apply_stored(stored(&[2], Some(1), &[3, 4])).unwrap();
        assert_eq!(overlap(&index, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), [(0, 10)]);
        assert_eq!(cache.len(), 6);
    }
}

#[test]
fn a_chain_longer_than_a_segment_holds_continues_in_another() {
    // Offsets are 16 bits: past `MAX_SEGMENT_BLOCKS` a chain starts a new segment, and matches,
    // cuts and removals work across the boundary.
    let max = super::cache::MAX_SEGMENT_BLOCKS;
    let blocks = max + 1_000;
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 3, rank: 0 });
    let tokens: Vec<u32> = (0..(blocks * BS as usize) as u32).collect();
    let hashes: Vec<u64> = (1..=blocks as u64).collect();
    let per_event = 700;
    for start in (0..blocks).step_by(per_event) {
        let end = (start + per_event).min(blocks);
        let parent = (start > 0).then(|| hashes[start - 1]);
        let event_tokens = &tokens[start * BS as usize..end * BS as usize];
        cache.apply_stored(stored(&hashes[start..end], parent, event_tokens)).unwrap();
    }
    assert_eq!(index.segments(), [1_000, max]);
    assert_eq!(overlap(&index, &tokens), [(3, tokens.len())]);
    // A cut in the second segment, then one at the boundary.
    cache.apply_removed(0, &[hashes[max + 10]], gpu());
    assert_eq!(index.segments(), [10, 989, max]);
    assert_eq!(overlap(&index, &tokens), [(3, (max + 10) * BS as usize)]);
    cache.apply_removed(0, &[hashes[max - 1]], gpu());
    assert_eq!(index.segments(), [10, 989, max - 1]);
    assert_eq!(overlap(&index, &tokens), [(3, (max - 1) * BS as usize)]);
    assert_eq!(
        cache.content_of(0, hashes[max + 5]),
        index
            .prompt_hashes(&tokens, Namespace::BASE)
            .hashes(Layout { block_size: BS, lookahead: 0 })
            .get(max + 5)
            .copied()
    );
    assert_eq!(cache.len(), blocks - 2);
}

#[test]
fn a_tier_change_gives_the_block_a_segment_of_its_own() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 0, rank: 0 });
    let disk = residency("DISK");
    cache.apply_stored(stored(&[1, 2, 3, 4], None, &[1, 2, 3, 4, 5, 6, 7, 8])).unwrap();
    let copy = StoredBlocks { residency: &disk, ..stored(&[1, 2, 3, 4], None, &[1, 2, 3, 4, 5, 6, 7, 8]) };
    cache.apply_stored(copy).unwrap();
    assert_eq!(index.segments(), [4], "a disk copy beside the GPU one changes no weight");
    cache.apply_removed(0, &[2], gpu());
    assert_eq!(index.segments(), [1, 1, 2]);
    // Blocks 0, 2, 3 on the GPU (6 tokens), block 1 on disk only (2 tokens at 0.25).
    assert_eq!(credited(&index, &[1, 2, 3, 4, 5, 6, 7, 8]), [(0, 8, 7)]);
    cache.apply_stored(stored(&[2], Some(1), &[3, 4])).unwrap();
    assert_eq!(credited(&index, &[1, 2, 3, 4, 5, 6, 7, 8]), [(0, 8, 8)]);
}

#[test]
fn two_engine_hashes_for_one_content_hold_it_until_both_go() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 0, rank: 0 });
    cache.apply_stored(stored(&[1], None, &[1, 2])).unwrap();
    cache.apply_stored(stored(&[2], None, &[1, 2])).unwrap();
    cache.apply_removed(0, &[1], gpu());
    assert_eq!(overlap(&index, &[1, 2]), [(0, 2)]);
    cache.apply_removed(0, &[2], gpu());
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
                    index.overlap(tokens, Namespace::BASE, &mut out);
                    let now = out.matched(9);
                    assert!(now >= last && now % 2 == 0, "{last} then {now}");
                    last = now;
                }
            });
        }
    });
    assert_eq!(overlap(&index, &tokens), [(9, 400)]);
}

#[test]
fn groups_are_keyed_apart_and_only_the_first_is_walked() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 1, rank: 0 });
    cache.apply_stored(stored(&[10, 11], None, &[1, 2, 3, 4])).unwrap();
    // The same engine hashes in a sliding-window group, which then drops its oldest block.
    cache.apply_stored(StoredBlocks { group: 1, ..stored(&[10, 11], None, &[1, 2, 3, 4]) }).unwrap();
    assert_eq!(cache.apply_removed(1, &[10], gpu()), 0);
    assert_eq!(overlap(&index, &[1, 2, 3, 4]), [(1, 4)], "group 0 is untouched");
    let held: Vec<(u32, u64)> = cache.holdings().iter().map(|b| (b.group, b.engine_hash)).collect();
    assert_eq!(held, [(0, 10), (0, 11), (1, 11)]);
    // A state group's 64-token block and a partial tail block under it: sizes of its own.
    let tokens: Vec<u32> = (0..8).collect();
    let big = StoredBlocks { group: 2, block_size: 8, ..stored(&[20], None, &tokens) };
    cache.apply_stored(big).unwrap();
    let tail = StoredBlocks { group: 2, ..stored(&[21], Some(20), &[8, 9]) };
    cache.apply_stored(tail).unwrap();
    assert_eq!(index.layouts(), [Layout { block_size: 2, lookahead: 0 }], "group 0's layout only");
    assert_eq!(cache.len(), 5);
    // A parent is looked up in the event's own group.
    let orphan = StoredBlocks { group: 1, ..stored(&[12], Some(20), &[5, 6]) };
    assert_eq!(cache.apply_stored(orphan), Err(ApplyError::UnknownParent(20)));
}

#[test]
fn adapters_and_salts_match_only_their_own_requests() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 1, rank: 0 });
    let sql = Namespace::adapter("sql-lora");
    let salted = Namespace::BASE.with_salt(Some("tenant-a"));
    cache.apply_stored(StoredBlocks { namespace: sql, ..stored(&[1, 2], None, &[1, 2, 3, 4]) }).unwrap();
    // A continuation inherits its parent's namespace, whatever the event says.
    cache.apply_stored(stored(&[3], Some(2), &[5, 6])).unwrap();
    cache.apply_stored(StoredBlocks { namespace: salted, ..stored(&[7], None, &[1, 2]) }).unwrap();
    let prompt = [1, 2, 3, 4, 5, 6];
    assert_eq!(overlap(&index, &prompt), [], "base requests never see adapter or salted blocks");
    assert_eq!(overlap_in(&index, &prompt, sql), [(1, 6)]);
    assert_eq!(overlap_in(&index, &prompt, Namespace::adapter("other")), []);
    assert_eq!(overlap_in(&index, &prompt, salted), [(1, 2)]);
    assert_eq!(overlap_in(&index, &prompt, Namespace::BASE.with_salt(Some("tenant-b"))), []);
    let id_only = Namespace { adapter: Some(Adapter::Id(7)), cache_salt: None };
    cache.apply_stored(StoredBlocks { namespace: id_only, ..stored(&[8], None, &[9, 9]) }).unwrap();
    assert_eq!(overlap_in(&index, &[9, 9], id_only), [(1, 2)]);
    assert_eq!(overlap_in(&index, &[9, 9], Namespace::adapter("7")), []);
    // Extra keys kvgate cannot reproduce (an image): no request matches that block or its children.
    cache
        .apply_stored(StoredBlocks { opaque: &[0x1234, 0], ..stored(&[30, 31], None, &[7, 7, 8, 8]) })
        .unwrap();
    assert_eq!(overlap(&index, &[7, 7, 8, 8]), []);
}

#[test]
fn a_lookahead_block_needs_its_next_token() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 4, rank: 0 });
    // Blocks [1,2] and [3,4], each hashed with the token after it (3, then 5).
    let event = StoredBlocks { lookahead: &[3, 5], ..stored(&[1, 2], None, &[1, 2, 3, 4]) };
    cache.apply_stored(event).unwrap();
    assert_eq!(index.layouts(), [Layout { block_size: 2, lookahead: 1 }]);
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5]), [(4, 4)]);
    assert_eq!(overlap(&index, &[1, 2, 3, 4]), [(4, 2)], "the second block's next token is unknown");
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 6]), [(4, 2)], "another next token is another block");
    let in_flight = InFlightBlocks::new(index.clone());
    let prompt = in_flight.add(5, &[1, 2, 3, 4, 5], Namespace::BASE);
    assert_eq!(overlap(&index, &[1, 2, 3, 4, 5]), [(4, 4), (5, 4)], "in flight, cut the same way");
    in_flight.remove(prompt);
}

#[test]
fn placeholders_and_residencies() {
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 2, rank: 0 });
    let cpu = residency("CPU");
    let placeholder = |hashes: &'static [u64]| StoredBlocks {
        parent_block_hash: None,
        block_size: 0,
        residency: &cpu,
        ..stored(hashes, None, &[])
    };
    // A placeholder for a hash not held yet: the store that follows picks it up.
    cache.apply_stored(placeholder(&[12])).unwrap();
    cache.apply_stored(stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])).unwrap();
    cache.apply_stored(placeholder(&[11])).unwrap();
    let tiers = |cache: &CacheBlocks| -> Vec<String> {
        cache
            .holdings()
            .iter()
            .map(|b| b.residencies.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("+"))
            .collect()
    };
    assert_eq!(tiers(&cache), ["GPU", "GPU+CPU", "GPU+CPU"]);
    assert_eq!(cache.apply_removed(0, &[11], &cpu), 0);
    assert_eq!(tiers(&cache), ["GPU", "GPU", "GPU+CPU"]);
    // The same medium elsewhere, and under another owner: each copy on its own.
    let local = Residency::of(Some("STORAGE"), Some("LOCAL"), None);
    let kvcr = Residency::of(Some("CPU"), None, Some("kvcr"));
    for residency in [&local, &kvcr] {
        cache.apply_stored(StoredBlocks { residency, ..stored(&[10], None, &[1, 2]) }).unwrap();
    }
    assert_eq!(tiers(&cache)[0], "GPU+STORAGE locality=LOCAL+CPU ownership=kvcr");
    cache.apply_removed(0, &[10, 12], &kvcr);
    cache.apply_removed(0, &[10, 11, 12], gpu());
    assert_eq!(tiers(&cache), ["STORAGE locality=LOCAL", "CPU"], "block 11 left with its last tier");
    assert_eq!(credited(&index, &[1, 2, 3, 4]), [(2, 2, 1)], "STORAGE is credited a quarter (0.5 rounds up)");
    assert_eq!(cache.apply_removed(0, &[99], &cpu), 1);
    let flat = Arc::new(BlockIndex::with_tier_weights(TierWeights::flat()));
    let mut flat_cache = CacheBlocks::new(flat.clone(), CacheId { worker: 2, rank: 0 });
    flat_cache.apply_stored(StoredBlocks { residency: &local, ..stored(&[10], None, &[1, 2]) }).unwrap();
    assert_eq!(credited(&flat, &[1, 2]), [(2, 2, 2)], "flat weights count every tier as the GPU");
}

// ---- differential test against a naive model ------------------------------------------------

/// The naive model of one cache: engine hash → (the whole token prefix it ends, tier bits).
type RefCache = HashMap<u64, (Vec<u32>, u8)>;

#[derive(Clone, Debug)]
enum Op {
    /// cache, prompt, first block, last block (exclusive), medium
    Store(usize, usize, usize, usize, u8),
    /// cache, prompt, block, medium
    Remove(usize, usize, usize, u8),
    /// cache, prompt, first block, last block (exclusive), medium, leaf first: one event
    RemoveRun(usize, usize, usize, usize, u8, bool),
    Clear(usize),
    Query(usize),
}

const CACHES: [CacheId; 3] =
    [CacheId { worker: 0, rank: 0 }, CacheId { worker: 0, rank: 1 }, CacheId { worker: 2, rank: 0 }];
const MEDIA: [Option<&str>; 4] = [None, Some("GPU"), Some("CPU"), Some("DISK")];

/// Engine hash of a prompt's block: what an engine would send (depends on the cache for cache 2,
/// as engines with different seeds do).
fn engine_hash(cache: usize, prefix: &[u32]) -> u64 {
    let salt = if cache == 2 { 77 } else { 0 };
    prefix.iter().fold(1469598103934665603u64 ^ salt, |h, &t| (h ^ u64::from(t)).wrapping_mul(1099511628211))
}

fn tier_bit(medium: u8) -> u8 {
    match medium {
        0 | 1 => 1,
        2 => 2,
        _ => 4,
    }
}

/// The default weights of the model's tiers: GPU, CPU, DISK.
fn ref_weight(tiers: u8) -> f64 {
    [(1, 1.0), (2, 0.95), (4, 0.25)]
        .iter()
        .filter(|(bit, _)| tiers & bit != 0)
        .map(|(_, w)| *w)
        .fold(0.0, f64::max)
}

fn ref_overlap(caches: &[RefCache], query: &[u32]) -> Vec<(TenantId, usize, usize)> {
    let mut best: HashMap<TenantId, (usize, u64)> = HashMap::new();
    for (c, cache) in caches.iter().enumerate() {
        // Credit in 1/65,536 of a token, as the index counts it.
        let (mut blocks, mut credit) = (0, 0u64);
        while (blocks + 1) * BS as usize <= query.len() {
            let prefix = &query[..(blocks + 1) * BS as usize];
            let Some((_, tiers)) = cache.values().find(|(held, _)| held.as_slice() == prefix) else { break };
            credit += (ref_weight(*tiers) * 65_536.0).round() as u64 * u64::from(BS);
            blocks += 1;
        }
        if blocks > 0 {
            let entry = best.entry(CACHES[c].worker).or_insert((0, 0));
            let here = (blocks * BS as usize, credit);
            if here.0 > entry.0 || (here.0 == entry.0 && here.1 > entry.1) {
                *entry = here;
            }
        }
    }
    let mut out: Vec<(TenantId, usize, usize)> = best
        .into_iter()
        .map(|(tenant, (matched, credit))| (tenant, matched, ((credit + 32_768) >> 16) as usize))
        .collect();
    out.sort_unstable();
    out
}

fn prompts(max_tokens: usize) -> impl Strategy<Value = Vec<Vec<u32>>> {
    prop::collection::vec(prop::collection::vec(0u32..3, 2..max_tokens), 4)
}

fn ops(max_blocks: usize) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (0..3usize, 0..4usize, 0..max_blocks, 0..max_blocks + 1, 0..4u8).prop_map(|(c, p, a, b, m)| Op::Store(c, p, a, b, m)),
        3 => (0..3usize, 0..4usize, 0..max_blocks, 0..4u8).prop_map(|(c, p, b, m)| Op::Remove(c, p, b, m)),
        2 => (0..3usize, 0..4usize, 0..max_blocks, 0..max_blocks + 1, 0..4u8, any::<bool>())
            .prop_map(|(c, p, a, b, m, leaf_first)| Op::RemoveRun(c, p, a, b, m, leaf_first)),
        1 => (0..3usize).prop_map(Op::Clear),
        4 => (0..4usize).prop_map(Op::Query),
    ];
    prop::collection::vec(op, 1..60)
}

proptest! {
    #[test]
    fn matches_a_naive_model_of_every_cache(prompts in prompts(10), ops in ops(5)) {
        check_against_model(prompts, ops)?;
    }

    /// Chains long enough for queries to jump (tests probe 2, 4, 8 ... blocks ahead), with
    /// removals in the middle of them, tier changes, and epochs wrapping every few removals.
    #[test]
    fn long_chains_with_gaps_match_a_naive_model(prompts in prompts(60), ops in ops(30)) {
        check_against_model(prompts, ops)?;
    }
}

fn check_against_model(prompts: Vec<Vec<u32>>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    {
        let index = Arc::new(BlockIndex::new());
        let twin = Arc::new(BlockIndex::new());
        let mut writers: Vec<CacheBlocks> =
            CACHES.iter().map(|&id| CacheBlocks::new(index.clone(), id)).collect();
        let mut twins: Vec<CacheBlocks> =
            CACHES.iter().map(|&id| CacheBlocks::new(twin.clone(), id)).collect();
        let mut model: Vec<RefCache> = vec![RefCache::new(); CACHES.len()];
        let residencies: Vec<Residency> = MEDIA.iter().map(|m| Residency::of(*m, None, None)).collect();
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
                    let hashes: Vec<u64> =
                        (first..end).map(|b| engine_hash(c, &prompt[..(b + 1) * bs])).collect();
                    let parent = first.checked_sub(1).map(|b| engine_hash(c, &prompt[..(b + 1) * bs]));
                    let tokens = &prompt[first * bs..end * bs];
                    let event = StoredBlocks {
                        residency: &residencies[medium as usize],
                        ..stored(&hashes, parent, tokens)
                    };
                    let applied = writers[c].apply_stored(event);
                    prop_assert_eq!(&applied, &twins[c].apply_stored(event));
                    let parent_known = parent.is_none_or(|h| model[c].contains_key(&h));
                    prop_assert_eq!(applied.is_ok(), parent_known, "{:?}", applied);
                    if parent_known {
                        for b in first..end {
                            let prefix = prompt[..(b + 1) * bs].to_vec();
                            let hash = engine_hash(c, &prefix);
                            let entry = model[c].entry(hash).or_insert((prefix, 0));
                            entry.1 |= tier_bit(medium);
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
                    let unknown = writers[c].apply_removed(0, &[hash], &residencies[medium as usize]);
                    twins[c].apply_removed(0, &[hash], &residencies[medium as usize]);
                    prop_assert_eq!(unknown == 1, !model[c].contains_key(&hash));
                    if let Some(entry) = model[c].get_mut(&hash) {
                        entry.1 &= !tier_bit(medium);
                        if entry.1 == 0 {
                            model[c].remove(&hash);
                        }
                    }
                }
                Op::RemoveRun(c, p, first, end, medium, leaf_first) => {
                    let prompt = &prompts[p];
                    let bs = BS as usize;
                    let end = end.min(prompt.len() / bs);
                    let mut hashes: Vec<u64> =
                        (first..end).map(|b| engine_hash(c, &prompt[..(b + 1) * bs])).collect();
                    if leaf_first {
                        hashes.reverse();
                    }
                    let residency = &residencies[medium as usize];
                    let unknown = writers[c].apply_removed(0, &hashes, residency);
                    twins[c].apply_removed(0, &hashes, residency);
                    prop_assert_eq!(unknown, hashes.iter().filter(|h| !model[c].contains_key(h)).count());
                    for hash in &hashes {
                        if let Some(entry) = model[c].get_mut(hash) {
                            entry.1 &= !tier_bit(medium);
                            if entry.1 == 0 {
                                model[c].remove(hash);
                            }
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
                    prop_assert_eq!(credited(&index, query), ref_overlap(&model, query), "query {:?}", query);
                }
            }
            for (c, writer) in writers.iter().enumerate() {
                let distinct: std::collections::HashSet<&Vec<u32>> =
                    model[c].values().map(|(p, _)| p).collect();
                prop_assert_eq!(writer.len(), distinct.len());
            }
            prop_assert_eq!(index.dump(), twin.dump(), "two indexes fed the same events agree");
        }
        drop(writers);
        prop_assert!(index.is_empty(), "dropping every writer empties the index");
    }
    Ok(())
}

/// The census: blocks per cache and tier, copies, who holds a watched block, the probe's blocks
/// left out, and a sample that scales back to the distinct count.
#[test]
fn a_census_counts_holdings_copies_and_watched_holders() {
    let index = Arc::new(BlockIndex::new());
    let mut a = CacheBlocks::new(index.clone(), CacheId { worker: 1, rank: 0 });
    let mut b = CacheBlocks::new(index.clone(), CacheId { worker: 2, rank: 0 });
    // A shared two-block system prompt on both, a third block on each of its own, and on b a
    // block of its own offloaded to host memory.
    a.apply_stored(stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])).unwrap();
    b.apply_stored(stored(&[20, 21, 22], None, &[1, 2, 3, 4, 7, 8])).unwrap();
    let cpu = residency("CPU");
    b.apply_stored(StoredBlocks { residency: &cpu, ..stored(&[23], Some(22), &[9, 9]) }).unwrap();
    let in_flight = InFlightBlocks::new(index.clone());
    let _prompt = in_flight.add(1, &[40, 41, 42, 43], Namespace::BASE);
    let prompt = index.prompt_hashes(&[1, 2, 3, 4], Namespace::BASE);
    let second = prompt.hashes(index.layouts()[0])[1];
    let watched: std::collections::HashSet<u64> = [second].into();
    let none = std::collections::HashSet::new();
    let census = index.census(CensusOptions { max_sampled: 1_000, watched: &watched, excluded: &none });
    assert_eq!(census.block_size, 2);
    assert_eq!(census.sample_modulus, 1);
    assert_eq!(census.held_blocks, 7, "in-flight prompts are no holdings");
    assert_eq!(census.distinct_blocks(), 5.0);
    assert!((census.copies_per_block() - 7.0 / 5.0).abs() < 1e-9);
    let a_count = &census.caches[&CacheId { worker: 1, rank: 0 }];
    assert_eq!((a_count.blocks, a_count.sampled_alone), (3, 1));
    let b_count = &census.caches[&CacheId { worker: 2, rank: 0 }];
    assert_eq!(b_count.by_tier.get("CPU"), Some(&1), "{b_count:?}");
    assert_eq!((b_count.blocks, b_count.sampled_alone), (4, 2));
    let holders: Vec<TenantId> = census.watched[&second].iter().map(|holder| holder.cache.worker).collect();
    assert_eq!(holders, [1, 2], "the shared prefix's second block is on both");
    // The probe's blocks left out; a sample of a quarter scales back.
    let probe: std::collections::HashSet<u64> = prompt.hashes(index.layouts()[0]).iter().copied().collect();
    let census = index.census(CensusOptions { max_sampled: 1_000, watched: &none, excluded: &probe });
    assert_eq!(census.held_blocks, 3, "the shared system prompt was the probe's");
    let sampled = index.census(CensusOptions { max_sampled: 2, watched: &none, excluded: &none });
    assert_eq!(sampled.sample_modulus, 4);
    assert!(sampled.sampled.keys().all(|hash| hash % 4 == 0));
}
