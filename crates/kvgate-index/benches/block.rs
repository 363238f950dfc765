//! Benchmarks of the exact block index: applying KV events (stores and removals) to an index of
//! about 1 M blocks, querying it (p50/p99 per query, one core), and both at once on two threads.
//!
//! Workload (seeded): 8 engine caches of 16-token blocks. 8,000 "chat" prompts of 64 blocks
//! (1,024 tokens: an 8-block system prompt shared with 1 in 256 others, then their own blocks)
//! and 1,000 "document" prompts of 512 blocks (8,192 tokens), each stored by one cache in
//! events of 32 blocks chained on the previous event's last block (as an engine stores a long
//! prefill chunk by chunk): about 1.02 M distinct blocks. Queries are stored prompts plus 100
//! fresh tokens (a hit on one cache, the whole prompt deep) or fresh prompts (a miss: one
//! lookup).
//!
//! Env: `KVGATE_BENCH_QUERIES` (per latency round, default 20000), `KVGATE_BENCH_ONLY=apply`
//! (the store floor and the stores and removals only).

// Wall-clock timing belongs to the bench harness, not to the pure core the clippy.toml guards.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use kvgate_index::{BlockIndex, CacheBlocks, CacheId, Namespace, PrefixMatch, Residency, StoredBlocks};
use kvgate_trace::percentile;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BLOCK: usize = 16;
const CACHES: u32 = 8;
const EVENT_BLOCKS: usize = 32;

struct Prompt {
    cache: usize,
    tokens: Vec<u32>,
    /// Engine hashes of its blocks (unique per prompt and block).
    hashes: Vec<u64>,
}

fn corpus(seed: u64) -> Vec<Prompt> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut fresh = |n: usize| (0..n).map(|_| rng.random::<u32>()).collect::<Vec<u32>>();
    let systems: Vec<Vec<u32>> = (0..32).map(|_| fresh(8 * BLOCK)).collect();
    let mut prompts = Vec::new();
    let mut next_hash = 1u64;
    for i in 0..9_000usize {
        let (blocks, mut tokens) = if i < 8_000 {
            let mut tokens = systems[i % systems.len()].clone();
            tokens.extend(fresh(56 * BLOCK));
            (64, tokens)
        } else {
            (512, fresh(512 * BLOCK))
        };
        tokens.truncate(blocks * BLOCK);
        // Mixed, as engines' hashes are (sequential keys would sit side by side in the maps).
        let hashes = (0..blocks as u64).map(|b| mix(next_hash + b)).collect();
        next_hash += blocks as u64;
        prompts.push(Prompt { cache: i % CACHES as usize, tokens, hashes });
    }
    prompts
}

/// splitmix64's finalizer: a bijection, so distinct counters stay distinct hashes.
fn mix(x: u64) -> u64 {
    let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Stores a prompt as its engine would: events of `EVENT_BLOCKS` blocks, each chained on the
/// previous one. Returns the number of events.
fn store(cache: &mut CacheBlocks, prompt: &Prompt) -> usize {
    let mut events = 0;
    for (chunk, start) in (0..prompt.hashes.len()).step_by(EVENT_BLOCKS).enumerate() {
        let end = (start + EVENT_BLOCKS).min(prompt.hashes.len());
        let parent = (chunk > 0).then(|| prompt.hashes[start - 1]);
        let event = StoredBlocks {
            group: 0,
            block_hashes: &prompt.hashes[start..end],
            parent_block_hash: parent,
            token_ids: &prompt.tokens[start * BLOCK..end * BLOCK],
            block_size: BLOCK as u32,
            lookahead: &[],
            opaque: &[],
            namespace: Namespace::BASE,
            residency: &Residency::gpu(),
        };
        cache.apply_stored(event).expect("a well-formed event");
        events += 1;
    }
    events
}

fn build(prompts: &[Prompt]) -> (Arc<BlockIndex>, Vec<CacheBlocks>) {
    let index = Arc::new(BlockIndex::new());
    let mut caches: Vec<CacheBlocks> =
        (0..CACHES).map(|worker| CacheBlocks::new(index.clone(), CacheId { worker, rank: 0 })).collect();
    for prompt in prompts {
        store(&mut caches[prompt.cache], prompt);
    }
    (index, caches)
}

/// Stores and removals: every prompt stored once into an empty index, then every prompt removed.
fn apply_report(prompts: &[Prompt]) {
    let index = Arc::new(BlockIndex::new());
    let mut caches: Vec<CacheBlocks> =
        (0..CACHES).map(|worker| CacheBlocks::new(index.clone(), CacheId { worker, rank: 0 })).collect();
    let blocks: usize = prompts.iter().map(|p| p.hashes.len()).sum();
    let started = Instant::now();
    let mut events = 0;
    for prompt in prompts {
        events += store(&mut caches[prompt.cache], prompt);
    }
    let stored = started.elapsed().as_secs_f64();
    println!(
        "APPLY STORE | {} blocks in {events} events | {:.2} s | {:.2} M blocks/s | {:.0} K events/s | index {} blocks |",
        blocks,
        stored,
        blocks as f64 / stored / 1e6,
        events as f64 / stored / 1e3,
        index.len()
    );
    let started = Instant::now();
    let mut removals = 0;
    for prompt in prompts {
        for chunk in prompt.hashes.chunks(EVENT_BLOCKS) {
            caches[prompt.cache].apply_removed(0, chunk, &Residency::gpu());
            removals += 1;
        }
    }
    let removed = started.elapsed().as_secs_f64();
    println!(
        "APPLY REMOVE | {blocks} blocks in {removals} events | {:.2} s | {:.2} M blocks/s | {:.0} K events/s | index {} blocks |",
        removed,
        blocks as f64 / removed / 1e6,
        removals as f64 / removed / 1e3,
        index.len()
    );
}

struct Queries {
    hits_short: Vec<Vec<u32>>,
    hits_long: Vec<Vec<u32>>,
    misses: Vec<Vec<u32>>,
}

fn queries(prompts: &[Prompt], seed: u64) -> Queries {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pick = |long: bool| {
        let range = if long { 8_000..9_000 } else { 0..8_000 };
        let mut tokens = prompts[rng.random_range(range)].tokens.clone();
        tokens.extend((0..100).map(|_| rng.random::<u32>()));
        tokens
    };
    let hits_short = (0..256).map(|_| pick(false)).collect();
    let hits_long = (0..256).map(|_| pick(true)).collect();
    let misses = (0..256).map(|_| (0..1024).map(|_| rng.random::<u32>()).collect()).collect();
    Queries { hits_short, hits_long, misses }
}

/// Per-query latency, one thread, `n` queries per kind.
fn latency_report(index: &BlockIndex, queries: &Queries, n: usize) {
    for (name, set, expect) in [
        ("hit 1K tokens (64 blocks)", &queries.hits_short, 1024),
        ("hit 8K tokens (512 blocks)", &queries.hits_long, 8192),
        ("miss 1K tokens", &queries.misses, 0),
    ] {
        let mut out = PrefixMatch::default();
        let mut times = Vec::with_capacity(n);
        for i in 0..n {
            let query = &set[i % set.len()];
            let started = Instant::now();
            index.overlap(query, Namespace::BASE, &mut out);
            times.push(started.elapsed().as_secs_f64() * 1e6);
            assert_eq!(out.best(), expect, "{name}");
        }
        let total: f64 = times.iter().sum();
        times.sort_by(f64::total_cmp);
        println!(
            "QUERY | {name} | p50 {:.2} us | p99 {:.2} us | max {:.1} us | {:.0} K queries/s |",
            percentile(&times, 50.0),
            percentile(&times, 99.0),
            times[times.len() - 1],
            n as f64 / total * 1e6 / 1e3
        );
    }
}

/// One thread stores and removes prompts (a full index churning) while another queries.
fn concurrent_report(prompts: &[Prompt], queries: &Queries, secs: f64) {
    let (index, mut caches) = build(prompts);
    let stop = AtomicBool::new(false);
    let (blocks_applied, reads, mut times) = std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let mut blocks = 0usize;
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let prompt = &prompts[i % prompts.len()];
                let cache = &mut caches[prompt.cache];
                for chunk in prompt.hashes.chunks(EVENT_BLOCKS) {
                    cache.apply_removed(0, chunk, &Residency::gpu());
                }
                store(cache, prompt);
                blocks += 2 * prompt.hashes.len();
                i += 1;
            }
            blocks
        });
        let reader = scope.spawn(|| {
            let mut out = PrefixMatch::default();
            let mut times = Vec::new();
            let deadline = Instant::now() + Duration::from_secs_f64(secs);
            let mut i = 0;
            while Instant::now() < deadline {
                let query = &queries.hits_short[i % queries.hits_short.len()];
                let started = Instant::now();
                index.overlap(query, Namespace::BASE, &mut out);
                times.push(started.elapsed().as_secs_f64() * 1e6);
                i += 1;
            }
            stop.store(true, Ordering::Relaxed);
            (i, times)
        });
        let (reads, times) = reader.join().unwrap();
        (writer.join().unwrap(), reads, times)
    });
    times.sort_by(f64::total_cmp);
    println!(
        "CONCURRENT | writer {:.2} M blocks/s (stores + removals) | reader {:.0} K queries/s (hit 1K) | p50 {:.2} us | p99 {:.2} us |",
        blocks_applied as f64 / secs / 1e6,
        reads as f64 / secs / 1e3,
        percentile(&times, 50.0),
        percentile(&times, 99.0)
    );
}

/// The memory floor: random lookups in a plain `HashMap<u64, u64>` of 1 M entries, 512 keys per
/// "query" (what one 8K-token query must at least do: one random access per block).
fn floor_report(n: usize) {
    let mut rng = StdRng::seed_from_u64(3);
    let keys: Vec<u64> = (0..1_000_000).map(|_| rng.random()).collect();
    let map: std::collections::HashMap<u64, u64> = keys.iter().map(|&k| (k, k ^ 1)).collect();
    let mut times = Vec::with_capacity(n / 10);
    let mut sum = 0u64;
    for _ in 0..n / 10 {
        let start = rng.random_range(0..keys.len() - 512);
        let started = Instant::now();
        for key in &keys[start..start + 512] {
            sum = sum.wrapping_add(*map.get(key).unwrap_or(&0));
        }
        times.push(started.elapsed().as_secs_f64() * 1e6);
    }
    black_box(sum);
    times.sort_by(f64::total_cmp);
    println!(
        "FLOOR | 512 random lookups in a 1 M-entry HashMap<u64, u64> | p50 {:.2} us | p99 {:.2} us | {:.0} ns per lookup |",
        percentile(&times, 50.0),
        percentile(&times, 99.0),
        percentile(&times, 50.0) * 1000.0 / 512.0
    );
}

/// What a store must at least do per block, on the same prompts and engine hashes: hash its
/// tokens (kvgate's content hash), and one insert into its cache's map of engine hashes, with
/// a 24-byte value (an entry of 32 bytes) and an 8-byte one (16 bytes).
fn store_floor_report(prompts: &[Prompt]) {
    let blocks: usize = prompts.iter().map(|p| p.hashes.len()).sum();
    let per_block = |secs: f64| secs * 1e9 / blocks as f64;
    let started = Instant::now();
    let mut sum = 0u64;
    for prompt in prompts {
        let mut parent = kvgate_index::ROOT_HASH;
        for block in prompt.tokens.chunks_exact(BLOCK) {
            parent = kvgate_index::block_content(parent, block, &[], 0);
        }
        sum = sum.wrapping_add(parent);
    }
    black_box(sum);
    let hashing = per_block(started.elapsed().as_secs_f64());
    fn inserts<V: Copy>(prompts: &[Prompt], value: V) -> f64 {
        let mut maps: Vec<nohash_hasher::IntMap<u64, V>> = (0..CACHES).map(|_| Default::default()).collect();
        let started = Instant::now();
        for prompt in prompts {
            let map = &mut maps[prompt.cache];
            for &hash in &prompt.hashes {
                map.insert(hash, value);
            }
        }
        let secs = started.elapsed().as_secs_f64();
        black_box(&maps);
        secs
    }
    let wide = per_block(inserts(prompts, [0u64; 3]));
    let narrow = per_block(inserts(prompts, 0u64));
    println!(
        "STORE FLOOR | {blocks} blocks | content hash {hashing:.1} ns/block | map insert, 32-byte entry {wide:.1} ns/block | 16-byte entry {narrow:.1} ns/block |"
    );
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let n: usize = std::env::var("KVGATE_BENCH_QUERIES").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let prompts = corpus(0x626c_6f63);
    store_floor_report(&prompts);
    apply_report(&prompts);
    if std::env::var("KVGATE_BENCH_ONLY").is_ok_and(|only| only == "apply") {
        return;
    }
    let (index, _caches) = build(&prompts);
    println!("INDEX | {} blocks | {} caches |", index.len(), CACHES);
    let queries = queries(&prompts, 7);
    latency_report(&index, &queries, n);
    floor_report(n);
    {
        let mut g = c.benchmark_group("block_index/overlap");
        for (name, set) in
            [("hit-1k", &queries.hits_short), ("hit-8k", &queries.hits_long), ("miss-1k", &queries.misses)]
        {
            let mut out = PrefixMatch::default();
            let mut i = 0;
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    i += 1;
                    index.overlap(black_box(&set[i % set.len()]), Namespace::BASE, &mut out);
                })
            });
        }
        g.finish();
    }
    concurrent_report(&prompts, &queries, 3.0);
    c.final_summary();
}
