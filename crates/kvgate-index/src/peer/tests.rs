//! The peer block index and its merge with a replica's own tree.

use super::*;
use crate::{ApproxIndex, PrefixIndex, PromptKey, TreeSettings};

fn tree(block_size: usize) -> ApproxIndex {
    ApproxIndex::new(TreeSettings {
        max_elements_per_tenant: 1 << 20,
        eviction_interval_ms: 1000,
        block_size,
    })
}

/// Each worker's matched length when routing `key` on `index` (the chooser picks nobody).
fn matched(index: &dyn PrefixIndex, key: PromptKey<'_>) -> (usize, Vec<(TenantId, usize)>) {
    let mut seen = (0, Vec::new());
    index.route(key, 0, &mut |m| {
        seen = (m.query_len(), m.iter().collect());
        None
    });
    seen
}

#[test]
fn leading_blocks_count_consecutive_blocks_from_the_first() {
    let peers = PeerBlocks::new(100);
    peers.record(&[1, 2, 3], 7);
    peers.record(&[1, 2], 9);
    peers.record(&[5, 3], 4); // block 3 under another prefix does not extend anything
    assert_eq!(peers.leading_blocks(&[1, 2, 3, 4]), vec![(7, 3), (9, 2)]);
    assert_eq!(peers.leading_blocks(&[1, 8, 3]), vec![(7, 1), (9, 1)]);
    assert_eq!(peers.leading_blocks(&[6, 3]), vec![], "an unknown first block matches nothing");
    assert_eq!(peers.leading_blocks(&[]), vec![]);
}

#[test]
fn memory_is_bounded_and_the_least_recently_used_blocks_go_first() {
    let peers = PeerBlocks::new(4);
    peers.record(&[1, 2], 0);
    peers.record(&[10, 11], 1);
    assert_eq!(peers.leading_blocks(&[1, 2]), vec![(0, 2)]); // 1 and 2 are now the most recent
    peers.record(&[20, 21], 2);
    assert_eq!(peers.len(), 4);
    assert_eq!(peers.leading_blocks(&[10]), vec![], "the least recently used prompt was evicted");
    assert_eq!(peers.leading_blocks(&[1, 2]), vec![(0, 2)]);
    peers.remove_tenant(0);
    assert_eq!(peers.leading_blocks(&[1, 2]), vec![]);
    assert_eq!(peers.len(), 2);
}

#[test]
fn hashes_are_chained_whole_blocks() {
    let ids: Vec<u32> = (0..40).collect();
    let blocks = prompt_blocks(PromptKey::Tokens(&ids), 16);
    assert_eq!((blocks.hashes.len(), blocks.block_len), (2, 16));
    let other: Vec<u32> = (0..16).chain(100..124).collect();
    let other = prompt_blocks(PromptKey::Tokens(&other), 16);
    assert_eq!(blocks.hashes[0], other.hashes[0]);
    assert_ne!(blocks.hashes[1], other.hashes[1]);
    let text = "x".repeat(TEXT_BLOCK_BYTES * 2 + 5);
    let text_blocks = prompt_blocks(PromptKey::Text(&text), 16);
    assert_eq!(text_blocks.hashes.len(), 2);
    assert_eq!(prompt_blocks(PromptKey::Text("short"), 16).hashes, Vec::<u64>::new());
}

#[test]
fn a_replica_sees_the_longer_of_its_tree_and_its_peers_blocks() {
    let local = tree(4);
    let ids: Vec<u32> = (0..13).collect();
    local.record(PromptKey::Tokens(&ids[..4]), 1, 0);
    local.record(PromptKey::Tokens(&ids[..8]), 2, 0);
    let peers = PeerBlocks::new(100);
    let blocks = prompt_blocks(PromptKey::Tokens(&ids), 4);
    peers.record(&blocks.hashes[..3], 1); // a peer sent 12 tokens to worker 1
    peers.record(&blocks.hashes[..1], 3);
    let merged = PeerMerged { local: &ReadOnlyTree(&local), peers: &peers, blocks: &blocks };
    assert_eq!(matched(&merged, PromptKey::Tokens(&ids)), (12, vec![(1, 12), (2, 8), (3, 4)]));
    // Without peers' blocks the tree alone answers.
    let empty = PeerBlocks::new(100);
    let alone = PeerMerged { local: &ReadOnlyTree(&local), peers: &empty, blocks: &blocks };
    assert_eq!(matched(&alone, PromptKey::Tokens(&ids)), (12, vec![(1, 4), (2, 8)]));
}

#[test]
fn the_read_only_tree_records_nothing_and_the_recording_one_does() {
    let local = tree(1);
    let text = "a prompt routed once";
    let peers = PeerBlocks::new(10);
    let blocks = prompt_blocks(PromptKey::Text(text), 1);
    let dry = PeerMerged { local: &ReadOnlyTree(&local), peers: &peers, blocks: &blocks };
    dry.route(PromptKey::Text(text), 0, &mut |_| Some(5));
    assert_eq!(local.tenant_size(5), 0);
    let live = PeerMerged { local: &local, peers: &peers, blocks: &blocks };
    live.route(PromptKey::Text(text), 0, &mut |_| Some(5));
    assert_eq!(matched(&ReadOnlyTree(&local), PromptKey::Text(text)), (text.len(), vec![(5, text.len())]));
}
