//! The pooled references on hand-made traces with hand-computed answers (the conversation trace's figures of `shared/bench/SCENARIOS.md` are checked in release builds by `examples/references.rs`: too slow for a debug test).

use crate::trace::{Trace, TraceRequest};

/// Requests one millisecond apart, in the order given.
fn trace(requests: &[(u32, &[u64])]) -> Trace {
    let requests = requests
        .iter()
        .enumerate()
        .map(|(i, &(input_length, hash_ids))| TraceRequest {
            timestamp_ms: i as f64,
            input_length,
            output_length: 1,
            hash_ids: hash_ids.to_vec(),
            ..TraceRequest::default()
        })
        .collect();
    Trace { requests }
}

/// Blocks of 512 tokens.
const fn blocks(n: u64) -> u64 {
    n * 512
}

#[test]
fn lru_capacity_is_whole_blocks_rounded_down() {
    let trace = trace(&[(1024, &[1, 2]), (1024, &[1, 2])]);
    assert_eq!(trace.pooled_lru(blocks(2)).cached_tokens, 1024);
    assert_eq!(trace.pooled_lru(blocks(1000)).cached_tokens, 1024);
    // 1,023 tokens hold one block: the first prompt's second block evicts its first, and a block
    // found after a missing one does not count.
    assert_eq!(trace.pooled_lru(blocks(2) - 1).cached_tokens, 0);
    assert_eq!(trace.pooled_lru(511).cached_tokens, 0);
    let empty = trace.pooled_lru(0);
    assert_eq!((empty.cached_tokens, empty.prompt_tokens, empty.capacity_tokens), (0, 2048, 0));
    assert_eq!(empty.rate(), 0.0);
    assert_eq!(trace.pooled_lru(blocks(2)).rate(), 0.5);
}

#[test]
fn lru_partial_last_blocks_take_a_whole_block_and_hits_stop_at_the_prompt() {
    // 600 + 100 tokens in three blocks: two blocks of capacity keep only [1,2]'s second block
    // and [3] (the oldest, block 1, was evicted), so the third request finds nothing.
    let trace_ = trace(&[(600, &[1, 2]), (100, &[3]), (600, &[1, 2])]);
    assert_eq!(trace_.pooled_lru(blocks(2)).cached_tokens, 0);
    assert_eq!(trace_.pooled_lru(blocks(3)).cached_tokens, 600);
    // A shorter prompt is served its own length; a longer one is served the whole partial
    // block of the earlier prompt (blocks are keyed by ids, as for the ceiling).
    assert_eq!(trace(&[(1024, &[1, 2]), (600, &[1, 2])]).pooled_lru(blocks(8)).cached_tokens, 600);
    assert_eq!(trace(&[(600, &[1, 2]), (1024, &[1, 2])]).pooled_lru(blocks(8)).cached_tokens, 1024);
    // Ids beyond input_length are not part of the prompt: they neither take capacity nor hit.
    let extra = trace(&[(512, &[1, 2, 3]), (1536, &[1, 2, 3])]);
    assert_eq!(extra.pooled_lru(blocks(8)).cached_tokens, 512);
    assert_eq!(trace(&[(512, &[1, 2]), (100, &[9]), (512, &[1])]).pooled_lru(blocks(2)).cached_tokens, 512);
}

#[test]
fn lru_counts_the_leading_blocks_of_repeated_prefixes() {
    let trace = trace(&[
        (1024, &[1, 2]),
        (1536, &[1, 2, 3]), // 1024
        (1024, &[5, 2]),    // 0: block 2 follows another prefix here
        (600, &[1, 2]),     // 600
    ]);
    let lru = trace.pooled_lru(blocks(100));
    assert_eq!((lru.cached_tokens, lru.prompt_tokens), (1624, 4184));
    assert_eq!(lru.cached_tokens, trace.cache_ceiling().cached_tokens);
    // Four blocks: [5,2]'s second block evicts block 1 (the oldest), so the last request finds
    // nothing.
    assert_eq!(trace.pooled_lru(blocks(4)).cached_tokens, 1024);
    assert_eq!(trace.pooled_lru(blocks(5)).cached_tokens, 1624);
}

#[test]
fn lru_evicts_the_least_recently_used_and_a_hit_refreshes() {
    // Two blocks. [1] hits and is refreshed, so [3] evicts [2], not [1]; [1] hits again and
    // [2] misses. Without the refresh (FIFO) [3] would evict [1] and only the first hit remain.
    let trace = trace(&[(512, &[1]), (512, &[2]), (512, &[1]), (512, &[3]), (512, &[1]), (512, &[2])]);
    assert_eq!(trace.pooled_lru(blocks(2)).cached_tokens, 1024);
    assert_eq!(trace.pooled_lru(blocks(3)).cached_tokens, 1536);
}

#[test]
fn a_request_is_looked_up_before_its_blocks_are_placed() {
    // Two blocks: the second request finds both of [1,2] before placing [1,2,3]'s third block,
    // which evicts the oldest (block 1, placed first); so the third request finds nothing.
    let trace_ = trace(&[(1024, &[1, 2]), (1536, &[1, 2, 3]), (1024, &[1, 2])]);
    assert_eq!(trace_.pooled_lru(blocks(2)).cached_tokens, 1024);
    // A prompt longer than the cache evicts its own first blocks, so its repeat finds nothing
    // (under Belady too: the three blocks tie on their next use, the oldest goes first).
    let long = trace(&[(1536, &[1, 2, 3]), (1536, &[1, 2, 3]), (512, &[1])]);
    assert_eq!(long.pooled_lru(blocks(2)).cached_tokens, 0);
    assert_eq!(long.pooled_belady(blocks(2)).cached_tokens, 0);
}

#[test]
fn requests_are_replayed_in_arrival_order() {
    // In file order the 600-token prompt would be served 600 tokens; by time it comes first
    // and the 1,024-token prompt is served both blocks.
    let mut trace = trace(&[(1024, &[1, 2]), (600, &[1, 2])]);
    trace.requests[0].timestamp_ms = 5.0;
    assert_eq!(trace.pooled_lru(blocks(8)).cached_tokens, 1024);
    assert_eq!(trace.pooled_belady(blocks(8)).cached_tokens, 1024);
}

#[test]
fn belady_evicts_the_block_used_again_furthest_ahead() {
    // Two blocks. [3] evicts [2] (next used at request 4) rather than [1] (request 3); LRU
    // evicts [1], then [1] evicts [2]: no hit at all.
    let trace = trace(&[(512, &[1]), (512, &[2]), (512, &[3]), (512, &[1]), (512, &[2])]);
    assert_eq!(trace.pooled_belady(blocks(2)).cached_tokens, 512);
    assert_eq!(trace.pooled_lru(blocks(2)).cached_tokens, 0);
    assert_eq!(trace.pooled_belady(0).cached_tokens, 0);
}

#[test]
fn belady_places_every_block() {
    // One block: [2] is placed although it is never used again, evicting [1] (no bypass).
    let trace = trace(&[(512, &[1]), (512, &[2]), (512, &[1])]);
    assert_eq!(trace.pooled_belady(blocks(1)).cached_tokens, 0);
    assert_eq!(trace.pooled_belady(blocks(2)).cached_tokens, 512);
}

#[test]
fn belady_ties_go_to_the_block_used_longest_ago() {
    // Two blocks: both of [1,2] are next used by request 2, and [3] evicts the one placed
    // first, block 1 (LRU among ties, as SCENARIOS.md's figures need), so nothing is served.
    let tied = trace(&[(1024, &[1, 2]), (512, &[3]), (1024, &[1, 2])]);
    assert_eq!(tied.pooled_belady(blocks(2)).cached_tokens, 0);
    // A hit is a use: [1] served again by request 1 is now the more recent of the tie, so [3]
    // evicts [1,2]'s second block and request 3 finds block 1 (512 + 512 tokens in all).
    let refreshed = trace(&[(1024, &[1, 2]), (512, &[1]), (512, &[3]), (1024, &[1, 2])]);
    assert_eq!(refreshed.pooled_belady(blocks(2)).cached_tokens, 1024);
}

/// Conversations growing turn by turn, with one-off prompts and partial last blocks.
fn conversations() -> Trace {
    let mut requests = Vec::new();
    for i in 0..400u64 {
        let conversation = (i * 7) % 23;
        let turns = 1 + (i / 23) % 9;
        let mut ids: Vec<u64> = (0..turns).map(|t| conversation * 100 + t).collect();
        if i % 5 == 0 {
            ids.push(100_000 + i);
        }
        let input = (ids.len() as u32 * 512).saturating_sub((i as u32 * 37) % 511);
        requests.push(TraceRequest {
            timestamp_ms: i as f64,
            input_length: input,
            output_length: 1,
            hash_ids: ids,
            ..TraceRequest::default()
        });
    }
    Trace { requests }
}

#[test]
fn references_lie_between_nothing_and_the_ceiling() {
    let trace = conversations();
    let ceiling = trace.cache_ceiling();
    assert!(ceiling.cached_tokens > 0);
    for capacity in [0, 1, 4, 16, 64] {
        let (lru, belady) = (trace.pooled_lru(blocks(capacity)), trace.pooled_belady(blocks(capacity)));
        assert_eq!((lru.prompt_tokens, belady.prompt_tokens), (ceiling.prompt_tokens, ceiling.prompt_tokens));
        assert!(lru.cached_tokens <= belady.cached_tokens, "{capacity}: {lru:?} {belady:?}");
        assert!(belady.cached_tokens <= ceiling.cached_tokens, "{capacity}: {belady:?} {ceiling:?}");
    }
    for big in [blocks(10_000), u64::MAX] {
        assert_eq!(trace.pooled_lru(big).cached_tokens, ceiling.cached_tokens);
        assert_eq!(trace.pooled_belady(big).cached_tokens, ceiling.cached_tokens);
    }
    assert_eq!(trace.pooled_lru(blocks(16)), trace.pooled_lru(blocks(16)));
}
