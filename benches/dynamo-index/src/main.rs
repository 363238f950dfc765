//! kvgate's exact block index (`kvgate_index::BlockIndex`) side by side with Dynamo's indexers
//! (`dynamo-kv-router` 1.6.1 from crates.io: `PositionalIndexer` and
//! `ConcurrentRadixTreeCompressed`), on the same event streams and the same queries, in one run.
//!
//! Streams (16-token blocks, 8 engine caches):
//! * `synthetic`: the 1 M-block fleet of kvgate-index's own block bench, with long documents
//!   added: 8,000 chat prompts of 64 blocks (an 8-block system prompt shared by 1 in 32),
//!   500 documents of 512 blocks and 64 of 4,096 blocks, each stored by one cache in events of
//!   32 blocks chained on the previous event's last block.
//! * `trace`: the Mooncake conversation trace (`hash_ids`, one block per id; tokens derived
//!   from the id), each request stored by the cache its conversation sticks to (its second
//!   block picks it), only the blocks that cache does not hold yet.
//!
//! Engine block hashes are Dynamo's own sequence hashes of the blocks (what its positional
//! indexer requires of a publisher); kvgate gets the same hashes as opaque engine hashes and the
//! tokens. Dynamo's events carry each block's token hash, computed by its publisher: the bench
//! computes them before the clock starts, and reports that hashing's cost apart; a second CRTC
//! row ("token hashes in the clock") starts from the same engine event as kvgate (token ids and
//! engine hashes) and converts it, token hashes included, inside the clock.
//!
//! Reports: events/s (stores, then removals of everything, tail first), on one thread and two
//! (kvgate: two writers, each owning half the caches; Dynamo: its `ThreadPoolIndexer` with one
//! or two event threads, and the positional indexer also applied directly); queries/s and
//! per-query p50/p99 for full hits of 64, 512 and 4,096 blocks (plus a fresh tail) and misses,
//! from tokens (each side hashes the prompt its own way) and from block hashes already
//! computed; queries on two threads; heap bytes per block (a counting allocator); `PAIRED`
//! lines: kvgate and CRTC queried in alternating turns (both built), so a slow stretch of a
//! shared machine falls on both.
//!
//! `BENCH_EVENTS=S1.jsonl,S4.jsonl` adds recorded streams (`kvgate sim --kv-events-out`): each
//! engine's stores and removals in their order, kvgate and CRTC only.
//!
//! Env: `BENCH_ONLY=kvgate-apply` (only kvgate's events, for a profiler), `BENCH_ONLY=quick`
//! (synthetic stream, kvgate and CRTC), `BENCH_ONLY=events` (only `BENCH_EVENTS`), `BENCH_QUERIES`
//! (queries per kind, default 4000), `BENCH_APPLY_REPEAT` (every apply line N times, the lines
//! taking turns, medians reported; default 1), `BENCH_TRACE`
//! (default `../shared/traces/conversation_trace.jsonl` from the repository root).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dynamo_kv_router::indexer::concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::positional::{LevelIndex, PositionalIndexer, SearchMode};
use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, compute_seq_hash_for_block, BlockHashOptions, ExternalSequenceBlockHash,
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use kvgate_index::{
    BlockIndex, CacheBlocks, CacheId, Namespace, PrefixMatch, PromptHashes, Residency, StoredBlocks,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rustc_hash::FxHashMap;

// ---------------------------------------------------------------------------------------------
// Heap accounting

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to `System` unchanged; the counter is only arithmetic on sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Streams

const BLOCK: usize = 16;
const CACHES: u32 = 8;
const EVENT_BLOCKS: usize = 32;

/// A prompt as one cache stores it.
struct Prompt {
    cache: u32,
    tokens: Vec<u32>,
}

/// One stored or removed event, as both sides see it.
struct Event {
    cache: u32,
    /// Stored: tokens of the blocks; removed: empty.
    tokens: Vec<u32>,
    parent: Option<u64>,
    /// Engine block hashes (Dynamo's sequence hashes).
    hashes: Vec<u64>,
    /// Dynamo's token hash per block (its publisher's work), stored events only.
    local: Vec<LocalBlockHash>,
}

/// Queries of one class: tokens, and the blocks a hit must match at least.
type QuerySet = Vec<(Vec<u32>, usize)>;

struct Stream {
    name: &'static str,
    stores: Vec<Event>,
    removals: Vec<Event>,
    /// Distinct blocks over all caches, and (cache, block) pairs.
    blocks: usize,
    pairs: usize,
    /// Queries by class: (name, tokens, expected matched blocks).
    queries: Vec<(String, QuerySet)>,
    /// `stores` is a recorded stream of stores and removals in their order (`removals` empty):
    /// a `kvgate sim --kv-events-out` file.
    interleaved: bool,
}

fn dynamo_local(tokens: &[u32]) -> Vec<LocalBlockHash> {
    compute_block_hash_for_seq(tokens, BLOCK as u32, BlockHashOptions::default())
}

/// Turns prompts into events: each cache stores only the blocks it does not hold yet, in events
/// of `EVENT_BLOCKS`; removals take every cache's blocks back, newest event first.
fn events(prompts: &[Prompt]) -> (Vec<Event>, Vec<Event>, usize, usize) {
    let mut held: Vec<HashSet<u64>> = (0..CACHES).map(|_| HashSet::new()).collect();
    let mut distinct = HashSet::new();
    let mut stores = Vec::new();
    for prompt in prompts {
        let local = dynamo_local(&prompt.tokens);
        let seq = compute_seq_hash_for_block(&local);
        let cache = &mut held[prompt.cache as usize];
        let have = seq.iter().take_while(|h| cache.contains(h)).count();
        for start in (have..seq.len()).step_by(EVENT_BLOCKS) {
            let end = (start + EVENT_BLOCKS).min(seq.len());
            stores.push(Event {
                cache: prompt.cache,
                tokens: prompt.tokens[start * BLOCK..end * BLOCK].to_vec(),
                parent: (start > 0).then(|| seq[start - 1]),
                hashes: seq[start..end].to_vec(),
                local: local[start..end].to_vec(),
            });
        }
        for &hash in &seq[have..] {
            cache.insert(hash);
            distinct.insert(hash);
        }
    }
    let pairs = held.iter().map(HashSet::len).sum();
    let removals = stores
        .iter()
        .rev()
        .map(|e| Event {
            cache: e.cache,
            tokens: Vec::new(),
            parent: None,
            hashes: e.hashes.clone(),
            local: Vec::new(),
        })
        .collect();
    (stores, removals, distinct.len(), pairs)
}

fn synthetic(n_queries: usize) -> Stream {
    let mut rng = StdRng::seed_from_u64(0x626c_6f63);
    let fresh = |rng: &mut StdRng, n: usize| (0..n).map(|_| rng.random::<u32>()).collect::<Vec<u32>>();
    let systems: Vec<Vec<u32>> = (0..256).map(|_| fresh(&mut rng, 8 * BLOCK)).collect();
    let mut prompts = Vec::new();
    let mut by_len: HashMap<usize, Vec<usize>> = HashMap::new();
    for i in 0..8_564usize {
        let tokens = if i < 8_000 {
            let mut tokens = systems[i % systems.len()].clone();
            tokens.extend(fresh(&mut rng, 56 * BLOCK));
            tokens
        } else if i < 8_500 {
            fresh(&mut rng, 512 * BLOCK)
        } else {
            fresh(&mut rng, 4096 * BLOCK)
        };
        by_len.entry(tokens.len() / BLOCK).or_default().push(prompts.len());
        prompts.push(Prompt { cache: i as u32 % CACHES, tokens });
    }
    let (stores, removals, blocks, pairs) = events(&prompts);
    let mut queries = Vec::new();
    for len in [64usize, 512, 4096] {
        let set = (0..n_queries.min(512))
            .map(|_| {
                let ids = &by_len[&len];
                let mut tokens = prompts[ids[rng.random_range(0..ids.len())]].tokens.clone();
                tokens.extend(fresh(&mut rng, 100));
                (tokens, len)
            })
            .collect();
        queries.push((format!("hit {len} blocks"), set));
    }
    let misses = (0..512).map(|_| (fresh(&mut rng, 64 * BLOCK), 0)).collect();
    queries.push(("miss 64 blocks".to_string(), misses));
    Stream { name: "synthetic", stores, removals, blocks, pairs, queries, interleaved: false }
}

/// Tokens of a trace block: a function of its id, so a shared id is a shared block.
fn trace_tokens(ids: &[u64]) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(ids.len() * BLOCK);
    for &id in ids {
        let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d;
        for _ in 0..BLOCK {
            x ^= x >> 29;
            x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            tokens.push((x >> 32) as u32);
        }
    }
    tokens
}

fn trace(path: &str, n_queries: usize) -> Option<Stream> {
    let text = std::fs::read_to_string(path).ok()?;
    let requests: Vec<Vec<u64>> = text
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .map(|v| {
            v["hash_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
                .unwrap_or_default()
        })
        .filter(|ids: &Vec<u64>| !ids.is_empty())
        .collect();
    let prompts: Vec<Prompt> = requests
        .iter()
        .map(|ids| Prompt {
            cache: (ids.get(1).unwrap_or(&ids[0]) % u64::from(CACHES)) as u32,
            tokens: trace_tokens(ids),
        })
        .collect();
    let (stores, removals, blocks, pairs) = events(&prompts);
    let mut short = Vec::new();
    let mut long = Vec::new();
    for ids in requests.iter().rev() {
        let set = if ids.len() <= 64 { &mut short } else { &mut long };
        if set.len() < n_queries.min(2048) {
            set.push((trace_tokens(ids), ids.len()));
        }
    }
    Some(Stream {
        name: "trace",
        stores,
        removals,
        blocks,
        pairs,
        queries: vec![
            ("trace requests 1-64 blocks".to_string(), short),
            ("trace requests 65-247 blocks".to_string(), long),
        ],
        interleaved: false,
    })
}

/// A `kvgate sim --kv-events-out` file's first run: the GPU tier's stores and removals of each
/// engine, in order (host-tier placeholders and clears left out; a block's tokens derived from
/// its digest, as the trace stream's from ids). Queries: chains every block of which an engine
/// still holds at the end, from its root, plus a fresh tail.
fn sim_stream(path: &str, n_queries: usize) -> Option<Stream> {
    let text = std::fs::read_to_string(path).ok()?;
    let name: &'static str = Box::leak(
        format!("sim {}", std::path::Path::new(path).file_stem()?.to_string_lossy()).into_boxed_str(),
    );
    let mut run: Option<String> = None;
    let mut stores = Vec::new();
    // Per engine: held block -> (parent, digest).
    let mut held: Vec<HashMap<u64, (Option<u64>, u64)>> = (0..CACHES).map(|_| HashMap::new()).collect();
    let mut skipped = 0usize;
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let this_run = v["run"].as_str().unwrap_or_default().to_string();
        match &run {
            None => run = Some(this_run),
            Some(first) if *first != this_run => break,
            Some(_) => {}
        }
        let engine = v["engine"].as_u64().unwrap_or(u64::MAX);
        if engine >= u64::from(CACHES) {
            skipped += 1;
            continue;
        }
        let cache = engine as u32;
        let ids = |value: &serde_json::Value| -> Vec<u64> {
            value.as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).collect()).unwrap_or_default()
        };
        for event in v["events"].as_array().into_iter().flatten() {
            if let Some(stored) = event.get("BlockStored") {
                if stored["tier"] != "Gpu" || stored["block_size"].as_u64() != Some(BLOCK as u64) {
                    skipped += 1;
                    continue;
                }
                let hashes = ids(&stored["block_hashes"]);
                let digests = ids(&stored["block_digests"]);
                let parent = stored["parent_block_hash"].as_u64();
                if hashes.is_empty() || hashes.len() != digests.len() {
                    skipped += 1;
                    continue;
                }
                let tokens = trace_tokens(&digests);
                let local = dynamo_local(&tokens);
                let mut up = parent;
                for (&hash, &digest) in hashes.iter().zip(&digests) {
                    held[engine as usize].insert(hash, (up, digest));
                    up = Some(hash);
                }
                stores.push(Event { cache, tokens, parent, hashes, local });
            } else if let Some(removed) = event.get("BlockRemoved") {
                if removed["tier"] != "Gpu" {
                    skipped += 1;
                    continue;
                }
                let hashes = ids(&removed["block_hashes"]);
                for hash in &hashes {
                    held[engine as usize].remove(hash);
                }
                stores.push(Event { cache, tokens: Vec::new(), parent: None, hashes, local: Vec::new() });
            }
        }
    }
    if stores.is_empty() {
        return None;
    }
    println!(
        "NOTE | {name} | run {:?}: {} events replayed, {skipped} left out (host tier, other engines) |",
        run.unwrap_or_default(),
        stores.len()
    );
    let mut rng = StdRng::seed_from_u64(0x73696d);
    let (mut short, mut long) = (Vec::new(), Vec::new());
    let mut distinct = HashSet::new();
    for blocks in &held {
        distinct.extend(blocks.keys().copied());
        let mut leaves: Vec<u64> = blocks.keys().copied().collect();
        leaves.sort_unstable();
        for &leaf in &leaves {
            // The chain to the root, if the engine holds every block of it.
            let mut digests = Vec::new();
            let mut at = Some(leaf);
            let whole = loop {
                match at {
                    None => break true,
                    Some(hash) => match blocks.get(&hash) {
                        Some(&(parent, digest)) => {
                            digests.push(digest);
                            at = parent;
                        }
                        None => break false,
                    },
                }
            };
            if !whole {
                continue;
            }
            digests.reverse();
            let set = if digests.len() <= 64 { &mut short } else { &mut long };
            if set.len() < n_queries.min(1024) {
                let mut tokens = trace_tokens(&digests);
                tokens.extend((0..100).map(|_| rng.random::<u32>()));
                set.push((tokens, digests.len()));
            }
        }
    }
    let pairs = held.iter().map(HashMap::len).sum();
    Some(Stream {
        name,
        stores,
        removals: Vec::new(),
        blocks: distinct.len(),
        pairs,
        queries: vec![
            ("held chains 1-64 blocks".to_string(), short),
            ("held chains 65+ blocks".to_string(), long),
        ],
        interleaved: true,
    })
}

// ---------------------------------------------------------------------------------------------
// The indexes under test

fn kvgate_store(cache: &mut CacheBlocks, event: &Event) {
    let stored = StoredBlocks {
        group: 0,
        block_hashes: &event.hashes,
        parent_block_hash: event.parent,
        token_ids: &event.tokens,
        block_size: BLOCK as u32,
        lookahead: &[],
        opaque: &[],
        namespace: Namespace::BASE,
        residency: &Residency::gpu(),
    };
    // A recorded stream's store may name a parent its engine evicted meanwhile (then refused,
    // as the gateway refuses it); the bench's own streams never do.
    let _ = cache.apply_stored(stored);
}

fn kvgate_caches(index: &Arc<BlockIndex>) -> Vec<CacheBlocks> {
    (0..CACHES).map(|worker| CacheBlocks::new(index.clone(), CacheId { worker, rank: 0 })).collect()
}

fn dynamo_event(event: &Event, id: u64) -> RouterEvent {
    dynamo_event_with(event, &event.local, id)
}

/// A `RouterEvent` of `event` with the token hashes `local` (a removal when `event` has none).
fn dynamo_event_with(event: &Event, local: &[LocalBlockHash], id: u64) -> RouterEvent {
    let data = if event.local.is_empty() {
        KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: event.hashes.iter().map(|&h| ExternalSequenceBlockHash(h)).collect(),
        })
    } else {
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: event.parent.map(ExternalSequenceBlockHash),
            start_position: None,
            blocks: event
                .hashes
                .iter()
                .zip(local)
                .map(|(&h, &tokens_hash)| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(h),
                    tokens_hash,
                    mm_extra_info: None,
                })
                .collect(),
        })
    };
    RouterEvent::new(u64::from(event.cache), KvCacheEvent { event_id: id, data, dp_rank: 0 })
}

fn dynamo_events(events: &[Event]) -> Vec<RouterEvent> {
    events.iter().enumerate().map(|(i, e)| dynamo_event(e, i as u64)).collect()
}

/// One index built from a stream's stores, for queries.
enum Built {
    Kvgate(Arc<BlockIndex>, #[allow(dead_code)] Vec<CacheBlocks>),
    Positional(Arc<PositionalIndexer>),
    Crtc(ThreadPoolIndexer<ConcurrentRadixTreeCompressed>),
}

impl Built {
    fn name(&self) -> &'static str {
        match self {
            Built::Kvgate(..) => "kvgate BlockIndex",
            Built::Positional(_) => "Dynamo PositionalIndexer",
            Built::Crtc(_) => "Dynamo ConcurrentRadixTreeCompressed",
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime")
}

/// Events per second applying `stores` then `removals`: (store events/s, store blocks/s,
/// removal events/s, removal blocks/s).
type Apply = (f64, f64, f64, f64);

fn blocks_of(events: &[Event]) -> usize {
    events.iter().map(|e| e.hashes.len()).sum()
}

fn rates(stream: &Stream, store_s: f64, remove_s: f64) -> Apply {
    (
        stream.stores.len() as f64 / store_s,
        blocks_of(&stream.stores) as f64 / store_s,
        stream.removals.len() as f64 / remove_s,
        blocks_of(&stream.removals) as f64 / remove_s,
    )
}

fn apply_kvgate(stream: &Stream, threads: usize) -> Apply {
    let index = Arc::new(BlockIndex::new());
    let mut caches = kvgate_caches(&index);
    let run = |caches: &mut Vec<CacheBlocks>, events: &[Event]| {
        let started = Instant::now();
        if threads == 1 {
            for event in events {
                kvgate_store_or_remove(&mut caches[event.cache as usize], event);
            }
        } else {
            let (low, high) = caches.split_at_mut(CACHES as usize / 2);
            std::thread::scope(|scope| {
                for (half, offset) in [(low, 0u32), (high, CACHES / 2)] {
                    scope.spawn(move || {
                        for event in events.iter().filter(|e| (e.cache >= CACHES / 2) == (offset > 0)) {
                            kvgate_store_or_remove(&mut half[(event.cache - offset) as usize], event);
                        }
                    });
                }
            });
        }
        started.elapsed().as_secs_f64()
    };
    let store_s = run(&mut caches, &stream.stores);
    if !stream.interleaved {
        assert_eq!(index.len(), stream.blocks, "kvgate holds every distinct block");
    }
    let remove_s = run(&mut caches, &stream.removals);
    if !stream.interleaved {
        assert_eq!(index.len(), 0);
    }
    rates(stream, store_s, remove_s)
}

fn kvgate_store_or_remove(cache: &mut CacheBlocks, event: &Event) {
    if event.local.is_empty() {
        cache.apply_removed(0, &event.hashes, &Residency::gpu());
    } else {
        kvgate_store(cache, event);
    }
}

/// Dynamo's positional indexer fed directly (no channel), one or two threads each owning half
/// the caches (its per-worker maps are the event thread's state).
fn apply_positional_direct(stream: &Stream, threads: usize) -> Apply {
    let index = PositionalIndexer::new_with_mode(32, SearchMode::Strided);
    let stores = dynamo_events(&stream.stores);
    let removals = dynamo_events(&stream.removals);
    let mut maps: Vec<FxHashMap<WorkerWithDpRank, LevelIndex>> =
        (0..threads).map(|_| FxHashMap::default()).collect();
    let run = |maps: &mut Vec<FxHashMap<WorkerWithDpRank, LevelIndex>>, events: Vec<RouterEvent>| {
        let per_thread = CACHES as usize / threads;
        let mut lanes: Vec<Vec<RouterEvent>> = (0..threads).map(|_| Vec::new()).collect();
        for event in events {
            lanes[event.worker_id as usize / per_thread].push(event);
        }
        let index = &index;
        let started = Instant::now();
        std::thread::scope(|scope| {
            for (map, lane) in maps.iter_mut().zip(lanes) {
                scope.spawn(move || {
                    for event in lane {
                        index.apply_event(map, event, None).expect("applies");
                    }
                });
            }
        });
        started.elapsed().as_secs_f64()
    };
    let store_s = run(&mut maps, stores);
    let remove_s = run(&mut maps, removals);
    rates(stream, store_s, remove_s)
}

fn apply_thread_pool<T: SyncIndexer>(stream: &Stream, backend: T, threads: usize) -> Apply {
    let rt = runtime();
    let stores = dynamo_events(&stream.stores);
    let removals = dynamo_events(&stream.removals);
    let indexer = ThreadPoolIndexer::new(backend, threads, BLOCK as u32);
    let run = |events: Vec<RouterEvent>| {
        let started = Instant::now();
        for event in events {
            indexer.enqueue_event(event).expect("queued");
        }
        rt.block_on(indexer.flush_and_wait()).expect("flushed");
        started.elapsed().as_secs_f64()
    };
    let store_s = run(stores);
    let remove_s = run(removals);
    rates(stream, store_s, remove_s)
}

/// Like [`apply_thread_pool`], but from the same engine event kvgate starts from (token ids and
/// engine block hashes): the conversion Dynamo's publisher makes, its token hashes per block
/// (`compute_block_hash_for_seq`) and the `RouterEvent`, runs inside the clock, on the thread
/// that enqueues (as kvgate hashes inside its timed store). The like-for-like row.
fn apply_thread_pool_from_engine<T: SyncIndexer>(stream: &Stream, backend: T, threads: usize) -> Apply {
    let rt = runtime();
    let indexer = ThreadPoolIndexer::new(backend, threads, BLOCK as u32);
    let run = |events: &[Event]| {
        let started = Instant::now();
        for (i, event) in events.iter().enumerate() {
            let converted = if event.local.is_empty() {
                dynamo_event(event, i as u64)
            } else {
                dynamo_event_with(event, &dynamo_local(&event.tokens), i as u64)
            };
            indexer.enqueue_event(converted).expect("queued");
        }
        rt.block_on(indexer.flush_and_wait()).expect("flushed");
        started.elapsed().as_secs_f64()
    };
    let store_s = run(&stream.stores);
    let remove_s = run(&stream.removals);
    rates(stream, store_s, remove_s)
}

fn build(stream: &Stream, which: usize) -> Built {
    match which {
        0 => {
            let index = Arc::new(BlockIndex::new());
            let mut caches = kvgate_caches(&index);
            for event in &stream.stores {
                kvgate_store_or_remove(&mut caches[event.cache as usize], event);
            }
            Built::Kvgate(index, caches)
        }
        1 => {
            let index = Arc::new(PositionalIndexer::new_with_mode(32, SearchMode::Strided));
            let mut map = FxHashMap::default();
            for event in dynamo_events(&stream.stores) {
                index.apply_event(&mut map, event, None).expect("applies");
            }
            std::mem::forget(map);
            Built::Positional(index)
        }
        _ => {
            let rt = runtime();
            let indexer = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BLOCK as u32);
            for event in dynamo_events(&stream.stores) {
                indexer.enqueue_event(event).expect("queued");
            }
            rt.block_on(indexer.flush_and_wait()).expect("flushed");
            Built::Crtc(indexer)
        }
    }
}

/// Matched blocks of the best cache, from tokens (each side hashes its own way).
fn query_tokens(built: &Built, tokens: &[u32], out: &mut PrefixMatch) -> usize {
    match built {
        Built::Kvgate(index, _) => {
            index.overlap(tokens, Namespace::BASE, out);
            out.best() / BLOCK
        }
        Built::Positional(index) => best(&index.find_matches(&dynamo_local(tokens), false)),
        Built::Crtc(indexer) => best(&indexer.backend().find_matches(&dynamo_local(tokens), false)),
    }
}

/// A query's block hashes, computed before the clock starts: kvgate's chained content hashes
/// (`BlockIndex::prompt_hashes`), Dynamo's token hashes.
enum Hashed {
    Kvgate(PromptHashes),
    Dynamo(Vec<LocalBlockHash>),
}

fn hashed(built: &Built, tokens: &[u32]) -> Hashed {
    match built {
        Built::Kvgate(index, _) => Hashed::Kvgate(index.prompt_hashes(tokens, Namespace::BASE)),
        _ => Hashed::Dynamo(dynamo_local(tokens)),
    }
}

/// The same from block hashes already computed.
fn query_hashes(built: &Built, query: &Hashed, out: &mut PrefixMatch) -> usize {
    match (built, query) {
        (Built::Kvgate(index, _), Hashed::Kvgate(hashes)) => {
            index.overlap_hashed(hashes, out);
            out.best() / BLOCK
        }
        (Built::Positional(index), Hashed::Dynamo(local)) => best(&index.find_matches(local, false)),
        (Built::Crtc(indexer), Hashed::Dynamo(local)) => best(&indexer.backend().find_matches(local, false)),
        _ => unreachable!("hashed for this index"),
    }
}

fn best(scores: &dynamo_kv_router::protocols::OverlapScores) -> usize {
    scores.scores.values().copied().max().unwrap_or(0) as usize
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

struct Latency {
    p50: f64,
    p99: f64,
    per_s: f64,
}

fn measure(n: usize, mut call: impl FnMut(usize)) -> Latency {
    // Warm: every query of a set once (sets hold at most 2,048), so both sides are timed on the
    // same cache state.
    for i in 0..n.min(2048) {
        call(i);
    }
    let mut times = Vec::with_capacity(n);
    let started = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        call(i);
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let total = started.elapsed().as_secs_f64();
    times.sort_by(f64::total_cmp);
    Latency { p50: percentile(&times, 50.0), p99: percentile(&times, 99.0), per_s: n as f64 / total }
}

fn query_report(stream: &Stream, built: &Built, n: usize) {
    for (class, set) in &stream.queries {
        if set.is_empty() {
            continue;
        }
        let mut out = PrefixMatch::default();
        let lat = measure(n, |i| {
            let (tokens, expect) = &set[i % set.len()];
            let got = query_tokens(built, tokens, &mut out);
            assert!(
                got >= *expect && got <= tokens.len() / BLOCK,
                "{} {class}: {got} blocks, expected {expect}",
                built.name()
            );
        });
        println!(
            "QUERY | {} | {} | {class} | from tokens | 1 thread | p50 {:.2} us | p99 {:.2} us | {:.0} K queries/s |",
            stream.name,
            built.name(),
            lat.p50,
            lat.p99,
            lat.per_s / 1e3
        );
        let prepared: Vec<Hashed> = set.iter().map(|(t, _)| hashed(built, t)).collect();
        {
            let lat = measure(n, |i| {
                let got = query_hashes(built, &prepared[i % prepared.len()], &mut out);
                let (tokens, expect) = &set[i % set.len()];
                assert!(
                    got >= *expect && got <= tokens.len() / BLOCK,
                    "{} {class}: {got} blocks from hashes",
                    built.name()
                );
            });
            println!(
                "QUERY | {} | {} | {class} | from block hashes | 1 thread | p50 {:.2} us | p99 {:.2} us | {:.0} K queries/s |",
                stream.name,
                built.name(),
                lat.p50,
                lat.p99,
                lat.per_s / 1e3
            );
        }
        // Two threads querying at once.
        let started = Instant::now();
        std::thread::scope(|scope| {
            for t in 0..2 {
                scope.spawn(move || {
                    let mut out = PrefixMatch::default();
                    for i in 0..n {
                        black_box(query_tokens(built, &set[(i * 2 + t) % set.len()].0, &mut out));
                    }
                });
            }
        });
        let per_s = 2.0 * n as f64 / started.elapsed().as_secs_f64();
        println!(
            "QUERY | {} | {} | {class} | from tokens | 2 threads | {:.0} K queries/s |",
            stream.name,
            built.name(),
            per_s / 1e3
        );
    }
}

/// kvgate and CRTC on the same queries in turns: `TURNS` rounds of `n / TURNS` calls each, the
/// two indexes alternating, every call's time pooled per side (a slow stretch of a shared
/// machine then falls on both, not on whichever ran then). Prints p50, p99, queries/s of each
/// and kvgate's ratios (above 1: kvgate ahead).
fn paired_report(stream: &Stream, kvgate: &Built, crtc: &Built, n: usize) {
    const TURNS: usize = 8;
    let per_turn = (n / TURNS).max(1);
    for (class, set) in &stream.queries {
        if set.is_empty() {
            continue;
        }
        let prepared: Vec<[Hashed; 2]> =
            set.iter().map(|(t, _)| [hashed(kvgate, t), hashed(crtc, t)]).collect();
        for from_tokens in [true, false] {
            let mut out = PrefixMatch::default();
            let mut call = |side: usize, i: usize| {
                let built = if side == 0 { kvgate } else { crtc };
                let (tokens, expect) = &set[i % set.len()];
                let got = match from_tokens {
                    true => query_tokens(built, tokens, &mut out),
                    false => query_hashes(built, &prepared[i % set.len()][side], &mut out),
                };
                assert!(
                    got >= *expect && got <= tokens.len() / BLOCK,
                    "{} {class}: {got} blocks",
                    built.name()
                );
            };
            for side in 0..2 {
                for i in 0..set.len().min(2048) {
                    call(side, i);
                }
            }
            let mut times: [Vec<f64>; 2] = [Vec::with_capacity(n), Vec::with_capacity(n)];
            for turn in 0..TURNS {
                for side in [turn % 2, 1 - turn % 2] {
                    for k in 0..per_turn {
                        let t = Instant::now();
                        call(side, turn * per_turn + k);
                        times[side].push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
            }
            let stats = |times: &mut Vec<f64>| {
                let per_s = times.len() as f64 / (times.iter().sum::<f64>() / 1e6);
                times.sort_by(f64::total_cmp);
                (percentile(times, 50.0), percentile(times, 99.0), per_s)
            };
            let (k50, k99, kq) = stats(&mut times[0]);
            let (c50, c99, cq) = stats(&mut times[1]);
            println!(
                "PAIRED | {} | {class} | {} | kvgate p50 {k50:.2} us p99 {k99:.2} us {:.0} K/s | CRTC p50 {c50:.2} us p99 {c99:.2} us {:.0} K/s | ratio p50 {:.2}x p99 {:.2}x queries/s {:.2}x |",
                stream.name,
                if from_tokens { "from tokens" } else { "from block hashes" },
                kq / 1e3,
                cq / 1e3,
                c50 / k50,
                c99 / k99,
                kq / cq,
            );
        }
    }
}

fn hashing_report(stream: &Stream, n: usize) {
    // What Dynamo's side does before its index sees a query or an event: token hashes per block.
    for (class, set) in &stream.queries {
        let lat = measure(n, |i| {
            black_box(dynamo_local(&set[i % set.len()].0));
        });
        println!(
            "HASH | {} | {class} | Dynamo token hashes of the query | p50 {:.2} us | p99 {:.2} us |",
            stream.name, lat.p50, lat.p99
        );
    }
    // kvgate hashes a query while it walks; this is that hashing alone (one stored event first,
    // so the index knows the layout).
    let mut cache = CacheBlocks::new(Arc::new(BlockIndex::new()), CacheId { worker: 0, rank: 0 });
    kvgate_store(&mut cache, &stream.stores[0]);
    let layouts = cache.index().clone();
    for (class, set) in &stream.queries {
        let lat = measure(n, |i| {
            black_box(layouts.prompt_hashes(&set[i % set.len()].0, Namespace::BASE));
        });
        println!(
            "HASH | {} | {class} | kvgate content hashes of the query | p50 {:.2} us | p99 {:.2} us |",
            stream.name, lat.p50, lat.p99
        );
        let lat = measure(n, |i| {
            let tokens = &set[i % set.len()].0;
            let mut parent = kvgate_index::ROOT_HASH;
            let hashes: Vec<u64> = tokens
                .chunks_exact(BLOCK)
                .map(|block| {
                    parent = kvgate_index::block_content(parent, block, &[], 0);
                    parent
                })
                .collect();
            black_box(hashes);
        });
        println!(
            "HASH | {} | {class} | kvgate block_content loop alone | p50 {:.2} us | p99 {:.2} us |",
            stream.name, lat.p50, lat.p99
        );
    }
    let started = Instant::now();
    for event in &stream.stores {
        black_box(dynamo_local(&event.tokens));
    }
    let s = started.elapsed().as_secs_f64();
    println!(
        "HASH | {} | stored events | Dynamo publisher token hashes | {:.0} K events/s | {:.2} M blocks/s |",
        stream.name,
        stream.stores.len() as f64 / s / 1e3,
        blocks_of(&stream.stores) as f64 / s / 1e6
    );
}

/// One apply line: its name, its threads, and how to measure it once.
type ApplyLine<'a> = (&'static str, usize, Box<dyn Fn() -> Apply + 'a>);

fn apply_report(stream: &Stream) {
    let crtc = "Dynamo ConcurrentRadixTreeCompressed (ThreadPoolIndexer)";
    let mut lines: Vec<ApplyLine> = vec![
        ("kvgate BlockIndex", 1, Box::new(|| apply_kvgate(stream, 1))),
        ("kvgate BlockIndex", 2, Box::new(|| apply_kvgate(stream, 2))),
    ];
    // Dynamo's positional indexer needs its own sequence hashes as engine hashes (a recording
    // has the simulated engines'): kvgate and CRTC only there.
    if !stream.interleaved {
        let positional = || PositionalIndexer::new_with_mode(32, SearchMode::Strided);
        lines.extend([
            (
                "Dynamo PositionalIndexer (direct)",
                1,
                Box::new(|| apply_positional_direct(stream, 1)) as Box<dyn Fn() -> Apply>,
            ),
            ("Dynamo PositionalIndexer (direct)", 2, Box::new(|| apply_positional_direct(stream, 2))),
            (
                "Dynamo PositionalIndexer (ThreadPoolIndexer)",
                1,
                Box::new(move || apply_thread_pool(stream, positional(), 1)),
            ),
            (
                "Dynamo PositionalIndexer (ThreadPoolIndexer)",
                2,
                Box::new(move || apply_thread_pool(stream, positional(), 2)),
            ),
        ]);
    }
    lines.extend([
        (
            crtc,
            1,
            Box::new(|| apply_thread_pool(stream, ConcurrentRadixTreeCompressed::new(), 1))
                as Box<dyn Fn() -> Apply>,
        ),
        (crtc, 2, Box::new(|| apply_thread_pool(stream, ConcurrentRadixTreeCompressed::new(), 2))),
        (
            CRTC_FROM_ENGINE,
            1,
            Box::new(|| apply_thread_pool_from_engine(stream, ConcurrentRadixTreeCompressed::new(), 1)),
        ),
        (
            CRTC_FROM_ENGINE,
            2,
            Box::new(|| apply_thread_pool_from_engine(stream, ConcurrentRadixTreeCompressed::new(), 2)),
        ),
    ]);
    // `BENCH_APPLY_REPEAT=N`: every line measured N times, the lines taking turns (so a slow
    // stretch of a shared machine falls on all of them), each figure the median of its N.
    let repeat: usize =
        std::env::var("BENCH_APPLY_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let mut runs: Vec<Vec<Apply>> = lines.iter().map(|_| Vec::new()).collect();
    for _ in 0..repeat {
        for (line, out) in lines.iter().zip(&mut runs) {
            out.push((line.2)());
        }
    }
    let median = |runs: &[Apply], pick: fn(&Apply) -> f64| {
        let mut values: Vec<f64> = runs.iter().map(pick).collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let measured: Vec<(&str, usize, Apply)> = lines
        .iter()
        .zip(&runs)
        .map(|(line, runs)| {
            let apply =
                (median(runs, |a| a.0), median(runs, |a| a.1), median(runs, |a| a.2), median(runs, |a| a.3));
            (line.0, line.1, apply)
        })
        .collect();
    if repeat > 1 {
        println!("NOTE | {} | apply figures: medians of {repeat} turns |", stream.name);
    }
    print_apply(stream, measured);
}

/// CRTC fed from the engine events kvgate starts from, token hashing in the clock.
const CRTC_FROM_ENGINE: &str =
    "Dynamo ConcurrentRadixTreeCompressed (ThreadPoolIndexer, token hashes in the clock)";

fn print_apply(stream: &Stream, lines: Vec<(&str, usize, Apply)>) {
    for (name, threads, (se, sb, re, rb)) in lines {
        if stream.interleaved {
            println!(
                "APPLY | {} | {name} | {threads} thread(s) | stores and removals in order {:.0} K events/s = {:.2} M blocks/s |",
                stream.name,
                se / 1e3,
                sb / 1e6,
            );
            continue;
        }
        println!(
            "APPLY | {} | {name} | {threads} thread(s) | store {:.0} K events/s = {:.2} M blocks/s | remove {:.0} K events/s = {:.2} M blocks/s |",
            stream.name,
            se / 1e3,
            sb / 1e6,
            re / 1e3,
            rb / 1e6,
        );
    }
}

/// What any store must do per block, on this stream's stored events: one insert into its
/// cache's map of engine hashes with a 16-byte entry (kvgate's `EngineBlock` map and CRTC's
/// per-worker lookup, `FxHashMap<ExternalSequenceBlockHash, Arc<Node>>`, both are), and for
/// kvgate the content hash of the block's tokens (Dynamo's token hash is its publisher's, out of
/// the clock). Nanoseconds per block, best of three.
fn floor_report(stream: &Stream) {
    let blocks = blocks_of(&stream.stores) as f64;
    let best =
        |mut run: Box<dyn FnMut() -> f64>| (0..3).map(|_| run()).fold(f64::INFINITY, f64::min) * 1e9 / blocks;
    let hashing = best(Box::new(|| {
        let started = Instant::now();
        let mut sum = 0u64;
        for event in stream.stores.iter().filter(|e| !e.local.is_empty()) {
            let mut parent = kvgate_index::ROOT_HASH;
            for block in event.tokens.chunks_exact(BLOCK) {
                parent = kvgate_index::block_content(parent, block, &[], 0);
            }
            sum = sum.wrapping_add(parent);
        }
        black_box(sum);
        started.elapsed().as_secs_f64()
    }));
    let insert = best(Box::new(|| {
        let mut maps: Vec<FxHashMap<u64, u64>> = (0..CACHES).map(|_| FxHashMap::default()).collect();
        let started = Instant::now();
        for event in stream.stores.iter().filter(|e| !e.local.is_empty()) {
            let map = &mut maps[event.cache as usize];
            for &hash in &event.hashes {
                map.insert(hash, hash);
            }
        }
        let secs = started.elapsed().as_secs_f64();
        black_box(&maps);
        secs
    }));
    println!(
        "FLOOR | {} | per stored block: content hash {hashing:.1} ns | map insert (16-byte entry) {insert:.1} ns |",
        stream.name
    );
}

fn main() {
    let n: usize = std::env::var("BENCH_QUERIES").ok().and_then(|v| v.parse().ok()).unwrap_or(4000);
    let trace_path =
        std::env::var("BENCH_TRACE").unwrap_or_else(|_| "../shared/traces/conversation_trace.jsonl".into());
    // `BENCH_ONLY=events`: only the recorded streams of `BENCH_EVENTS`.
    let only_events = std::env::var("BENCH_ONLY").is_ok_and(|only| only == "events");
    let mut streams = if only_events { Vec::new() } else { vec![synthetic(n)] };
    match trace(&trace_path, n).filter(|_| !only_events) {
        Some(stream) => streams.push(stream),
        None => println!("NOTE | no trace at {trace_path}: trace stream skipped |"),
    }
    // `BENCH_EVENTS=S1.jsonl,S4.jsonl`: recorded `kvgate sim --kv-events-out` streams.
    for path in std::env::var("BENCH_EVENTS").unwrap_or_default().split(',').filter(|p| !p.is_empty()) {
        match sim_stream(path, n) {
            Some(stream) => streams.push(stream),
            None => println!("NOTE | no events in {path}: skipped |"),
        }
    }
    // `BENCH_ONLY=kvgate-apply`: only kvgate's events (for a profiler).
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "kvgate-apply") {
        for stream in &streams {
            let (se, sb, re, rb) = apply_kvgate(stream, 1);
            println!(
                "APPLY | {} | kvgate BlockIndex | 1 thread(s) | store {:.0} K events/s = {:.2} M blocks/s | remove {:.0} K events/s = {:.2} M blocks/s |",
                stream.name, se / 1e3, sb / 1e6, re / 1e3, rb / 1e6
            );
        }
        return;
    }
    // `BENCH_ONLY=quick`: the synthetic stream, kvgate and CRTC only (while iterating).
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "quick") {
        let stream = &streams[0];
        floor_report(stream);
        for threads in [1, 2] {
            let (_, sb, _, rb) = apply_kvgate(stream, threads);
            let (_, csb, _, crb) = apply_thread_pool(stream, ConcurrentRadixTreeCompressed::new(), threads);
            let (_, esb, _, erb) =
                apply_thread_pool_from_engine(stream, ConcurrentRadixTreeCompressed::new(), threads);
            println!(
                "APPLY | {} | {threads} thread(s) | kvgate store {sb_m:.2} / remove {rb_m:.2} M blocks/s | CRTC {csb_m:.2} / {crb_m:.2} | ratio {:.2}x / {:.2}x | CRTC hashing in the clock {esb_m:.2} / {erb_m:.2} | ratio {:.2}x / {:.2}x |",
                stream.name,
                sb / csb,
                rb / crb,
                sb / esb,
                rb / erb,
                esb_m = esb / 1e6,
                erb_m = erb / 1e6,
                sb_m = sb / 1e6,
                rb_m = rb / 1e6,
                csb_m = csb / 1e6,
                crb_m = crb / 1e6,
            );
        }
        for which in [0, 2] {
            let before = live();
            let built = build(stream, which);
            println!(
                "MEMORY | {} | {:.0} B per block |",
                built.name(),
                (live() - before) as f64 / stream.blocks as f64
            );
            query_report(stream, &built, n);
        }
        return;
    }
    for stream in &streams {
        println!(
            "STREAM | {} | {} stored events ({} blocks) | {} removal events | {} distinct blocks | {} (cache, block) pairs |",
            stream.name,
            stream.stores.len(),
            blocks_of(&stream.stores),
            stream.removals.len(),
            stream.blocks,
            stream.pairs
        );
        floor_report(stream);
        apply_report(stream);
        hashing_report(stream, n);
        for which in 0..3 {
            if stream.interleaved && which == 1 {
                continue;
            }
            let before = live();
            let built = build(stream, which);
            let heap = live() - before;
            println!(
                "MEMORY | {} | {} | heap {:.1} MiB | {:.0} B per distinct block | {:.0} B per (cache, block) pair |",
                stream.name,
                built.name(),
                heap as f64 / (1 << 20) as f64,
                heap as f64 / stream.blocks as f64,
                heap as f64 / stream.pairs as f64
            );
            query_report(stream, &built, n);
        }
        paired_report(stream, &build(stream, 0), &build(stream, 2), n);
    }
}
