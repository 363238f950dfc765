//! Benchmarks for kvgate-index: `match_and_insert` latency (criterion, plus a per-call p50/p99
//! report), eviction time, and heap bytes per stored element, on realistic seeded workloads.
//!
//! Workload (text flavour, deterministic seeded RNG): a pool of system prompts; conversations =
//! system prompt + user/assistant turns. The tree is built by inserting every turn's prompt of
//! each conversation for its (sticky) tenant until it holds the target number of elements.
//! Queries of exactly `len` bytes then keep the conversations going: 80% continue a recent
//! conversation (its history, grown by fresh turns if shorter than the prompt, plus a fresh user
//! message of 200..1000 bytes), 15% retry a conversation prefix unchanged, 5% open a new
//! conversation (document QA: `len` fresh bytes after a known system prompt). A cache-aware
//! choice (the best-matching tenant if it matched at least half the prompt, else round-robin)
//! picks the tenant, and the prompt is inserted for it. The tree is trimmed back to its built
//! size by eviction (outside the timed region) whenever it grows 20% past it.
//!
//! Env: `KVGATE_BENCH_SIZES` (millions of elements, default `1,10`), `KVGATE_BENCH_TENANTS`
//! (default `8,64`).

// Wall-clock timing belongs to the bench harness, not to the pure core the clippy.toml guards.
#![allow(clippy::disallowed_types)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion};
use kvgate_index::{PrefixMatch, RadixTree, TenantId, TextTree, TokenTree};
use kvgate_trace::percentile;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SYSTEM_PROMPTS: usize = 48;
const QUERY_LENS: [usize; 3] = [1_000, 10_000, 100_000];

struct Conversation {
    text: Vec<u8>,
    /// Byte offsets at which a prompt was sent (end of each user message).
    prompt_ends: Vec<usize>,
}

/// Pseudo-English words, Zipf-ish frequencies.
struct Words(Vec<Vec<u8>>);

impl Words {
    fn new(rng: &mut StdRng) -> Self {
        const LETTERS: &[u8] = b"etaoinshrdlucmfwypvbgkjqxz";
        let skewed = |rng: &mut StdRng, n: usize| rng.random_range(0..n).min(rng.random_range(0..n));
        Words(
            (0..4000)
                .map(|_| {
                    let n = rng.random_range(1..10);
                    (0..n).map(|_| LETTERS[skewed(rng, LETTERS.len())]).collect()
                })
                .collect(),
        )
    }

    /// Appends words until `out` grew by at least `n` bytes.
    fn append(&self, rng: &mut StdRng, out: &mut Vec<u8>, n: usize) {
        let target = out.len() + n;
        while out.len() < target {
            let i = rng.random_range(0..self.0.len()).min(rng.random_range(0..self.0.len()));
            out.extend_from_slice(&self.0[i]);
            out.push(if rng.random_range(0..12) == 0 { b'.' } else { b' ' });
        }
    }

    /// Appends user/assistant turns until `conv` holds at least `len` bytes.
    fn extend_turns(&self, rng: &mut StdRng, conv: &mut Conversation, len: usize) {
        while conv.text.len() < len {
            conv.text.extend_from_slice(b"\n<|user|>");
            let n = rng.random_range(50..500);
            self.append(rng, &mut conv.text, n);
            conv.prompt_ends.push(conv.text.len());
            conv.text.extend_from_slice(b"\n<|assistant|>");
            let n = rng.random_range(200..2000);
            self.append(rng, &mut conv.text, n);
        }
    }
}

struct Corpus {
    words: Words,
    system: Vec<Vec<u8>>,
    /// Oldest first.
    convs: Vec<Conversation>,
    bytes: usize,
}

impl Corpus {
    fn new(rng: &mut StdRng) -> Self {
        let words = Words::new(rng);
        let system = (0..SYSTEM_PROMPTS)
            .map(|i| {
                let mut s = format!("<|system|>You are assistant #{i}. ").into_bytes();
                let n = rng.random_range(300..3000);
                words.append(rng, &mut s, n);
                s
            })
            .collect();
        Corpus { words, system, convs: Vec::new(), bytes: 0 }
    }

    /// A new conversation of at least `len` bytes.
    fn conversation(&self, rng: &mut StdRng, len: usize) -> Conversation {
        let mut conv = Conversation {
            text: self.system[rng.random_range(0..self.system.len())].clone(),
            prompt_ends: Vec::new(),
        };
        self.words.extend_turns(rng, &mut conv, len);
        conv
    }

    fn push(&mut self, conv: Conversation) {
        self.bytes += conv.text.len();
        self.convs.push(conv);
    }

    /// A conversation index biased toward recent ones.
    fn pick_recent(&self, rng: &mut StdRng) -> usize {
        let n = self.convs.len();
        let back = (n as f64 * rng.random::<f64>().powi(2)) as usize;
        n - 1 - back.min(n - 1)
    }

    /// Forgets the oldest conversations once the corpus holds more than `cap` bytes.
    fn cap(&mut self, cap: usize) {
        if self.bytes > cap {
            let drop = self.convs.len() / 4;
            self.bytes -= self.convs.drain(..drop).map(|c| c.text.len()).sum::<usize>();
        }
    }
}

/// Builds a text tree of about `elements` elements over `tenants` tenants.
fn build(elements: usize, tenants: u32, seed: u64) -> (TextTree, Corpus, u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut corpus = Corpus::new(&mut rng);
    let mut tree = TextTree::new();
    let mut now = 0u64;
    while tree.total_elements() < elements {
        // Log-uniform conversation length in [1K, 128K].
        let len = (1000.0 * 128f64.powf(rng.random::<f64>())) as usize;
        let conv = corpus.conversation(&mut rng, len);
        let tenant = corpus.convs.len() as u32 % tenants;
        for &end in &conv.prompt_ends {
            now += 1;
            tree.insert(&conv.text[..end], tenant, now);
        }
        corpus.push(conv);
    }
    (tree, corpus, now)
}

/// Cache-aware choice: the best-matching tenant if it matched at least half the prompt,
/// else round-robin.
fn choose(pm: &PrefixMatch, tenants: u32, rr: &mut u32) -> Option<TenantId> {
    let best = pm.best();
    if best > 0 && best * 2 >= pm.query_len() {
        return pm.iter().find(|&(_, l)| l == best).map(|(t, _)| t);
    }
    *rr = (*rr + 1) % tenants;
    Some(*rr)
}

struct Driver {
    tree: TextTree,
    corpus: Corpus,
    rng: StdRng,
    query: Vec<u8>,
    now: u64,
    rr: u32,
    tenants: u32,
    built_elements: usize,
    trims: usize,
    /// Sum of `best()` and of query lengths, for the matched fraction.
    matched: u64,
    queried: u64,
}

impl Driver {
    fn new(elements: usize, tenants: u32) -> Self {
        let seed = 0x6b76_6761_7465 ^ (elements as u64) ^ (u64::from(tenants) << 40);
        let (tree, corpus, now) = build(elements, tenants, seed);
        Driver {
            built_elements: tree.total_elements(),
            tree,
            corpus,
            rng: StdRng::seed_from_u64(seed + 1),
            query: Vec::new(),
            now,
            rr: 0,
            tenants,
            trims: 0,
            matched: 0,
            queried: 0,
        }
    }

    /// Fills `self.query` with the next prompt, of exactly `len` bytes.
    fn next_query(&mut self, len: usize) {
        let rng = &mut self.rng;
        let corpus = &mut self.corpus;
        let q = &mut self.query;
        q.clear();
        let r = rng.random_range(0..100);
        if r < 5 {
            let conv = corpus.conversation(rng, len);
            q.extend_from_slice(&conv.text[..len]);
            corpus.push(conv);
            corpus.cap(3 * self.built_elements);
            return;
        }
        let i = corpus.pick_recent(rng);
        let tail = if r < 85 { rng.random_range(200..1000).min(len / 4) } else { 0 };
        let keep = len - tail;
        let conv = &mut corpus.convs[i];
        if conv.text.len() < keep {
            let before = conv.text.len();
            corpus.words.extend_turns(rng, conv, keep);
            corpus.bytes += conv.text.len() - before;
        }
        q.extend_from_slice(&conv.text[..keep]);
        if tail > 0 {
            q.extend_from_slice(b"\n<|user|>");
            corpus.words.append(rng, q, tail);
        }
        q.truncate(len);
    }

    /// One `match_and_insert` of a fresh `len`-element prompt; returns the time of the call only.
    fn step(&mut self, len: usize) -> Duration {
        self.next_query(len);
        self.now += 1;
        let (tenants, rr) = (self.tenants, &mut self.rr);
        let mut best = 0;
        let t0 = Instant::now();
        let chosen = self.tree.match_and_insert(black_box(&self.query), self.now, |pm| {
            best = pm.best();
            choose(pm, tenants, rr)
        });
        let dt = t0.elapsed();
        black_box(chosen);
        self.matched += best as u64;
        self.queried += len as u64;
        if self.tree.total_elements() > self.built_elements * 6 / 5 {
            self.trim();
        }
        dt
    }

    /// Evicts (untimed) until the tree is back to its built size.
    fn trim(&mut self) {
        self.trims += 1;
        while self.tree.total_elements() > self.built_elements {
            let max = self.tree.tenants().iter().map(|&t| self.tree.tenant_size(t)).max().unwrap_or(0);
            self.tree.evict(max * 97 / 100);
        }
    }

    fn take_matched_fraction(&mut self) -> f64 {
        let f = self.matched as f64 / self.queried.max(1) as f64;
        (self.matched, self.queried) = (0, 0);
        f
    }
}

fn bytes_per_element<T: Copy + Eq + Ord + std::hash::Hash>(tree: &RadixTree<T>) -> f64 {
    tree.approx_heap_bytes() as f64 / tree.total_elements().max(1) as f64
}

fn text_memory_line(name: &str, tree: &TextTree) {
    println!(
        "MEMORY | {name} | text | {} elements | {} nodes | {:.1} MiB | {:.2} B/element |",
        tree.total_elements(),
        tree.node_count(),
        tree.approx_heap_bytes() as f64 / (1 << 20) as f64,
        bytes_per_element(tree),
    );
}

fn memory_report(name: &str, driver: &Driver) {
    text_memory_line(name, &driver.tree);
    // Same conversations as token ids (one token per word or separator run).
    let mut tokens = TokenTree::new();
    let mut ids: Vec<u32> = Vec::new();
    let mut ends: Vec<usize> = Vec::new();
    for (i, conv) in driver.corpus.convs.iter().enumerate() {
        ids.clear();
        ends.clear();
        let mut h: u32 = 0x811c_9dc5;
        for (j, &b) in conv.text.iter().enumerate() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
            if b == b' ' || b == b'.' || b == b'\n' || j + 1 == conv.text.len() {
                ids.push(h % 150_000);
                ends.push(j + 1);
                h = 0x811c_9dc5;
            }
        }
        for (n, &end) in conv.prompt_ends.iter().enumerate() {
            let k = ends.partition_point(|&e| e <= end);
            tokens.insert(&ids[..k], i as u32 % driver.tenants, n as u64);
        }
    }
    println!(
        "MEMORY | {name} | tokens (same prompts) | {} elements | {} nodes | {:.1} MiB | {:.2} B/element |",
        tokens.total_elements(),
        tokens.node_count(),
        tokens.approx_heap_bytes() as f64 / (1 << 20) as f64,
        bytes_per_element(&tokens),
    );
}

/// Per-call latency distribution over `n` fresh calls.
fn percentile_us(sorted: &[Duration], p: f64) -> f64 {
    percentile(sorted, p).as_secs_f64() * 1e6
}

/// Per-call latency distribution over `rounds` x `per_round` fresh calls. Besides the pooled
/// percentiles it prints the median over rounds of each round's p99, which shrugs off rounds hit
/// by CPU contention from other processes on a shared machine.
fn latency_report(name: &str, driver: &mut Driver, len: usize, rounds: usize, per_round: usize) {
    driver.take_matched_fraction();
    let mut all: Vec<Duration> = Vec::with_capacity(rounds * per_round);
    let mut round_p99: Vec<f64> = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let mut round: Vec<Duration> = (0..per_round).map(|_| driver.step(len)).collect();
        round.sort_unstable();
        round_p99.push(percentile_us(&round, 99.0));
        all.extend_from_slice(&round);
    }
    let matched = driver.take_matched_fraction() * 100.0;
    all.sort_unstable();
    round_p99.sort_unstable_by(f64::total_cmp);
    let n = all.len();
    let mean = all.iter().sum::<Duration>().as_secs_f64() * 1e6 / n as f64;
    println!(
        "LATENCY | {name} | {len} | {n} | {matched:.0}% | {mean:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
        percentile_us(&all, 50.0),
        percentile_us(&all, 90.0),
        percentile_us(&all, 99.0),
        round_p99[rounds / 2],
        all[n - 1].as_secs_f64() * 1e6,
    );
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

/// The per-tenant bound that evicts the tree down to about half its elements.
fn half_bound(tree: &TextTree) -> usize {
    let target = tree.total_elements() / 2;
    let (mut lo, mut hi) = (0usize, tree.tenants().iter().map(|&t| tree.tenant_size(t)).max().unwrap_or(0));
    while hi - lo > hi / 100 + 1 {
        let mid = (lo + hi) / 2;
        let mut t = tree.clone();
        t.evict(mid);
        if t.total_elements() > target {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    lo
}

/// Evicts clones of `tree` down to about half its elements (one timed single run, then criterion).
fn evict_bench(c: &mut Criterion, name: &str, tree: &TextTree) {
    let bound = half_bound(tree);
    let mut probe = tree.clone();
    let t0 = Instant::now();
    let evicted = probe.evict(bound);
    println!(
        "EVICT | {name} | bound {bound} | {} -> {} elements | {} -> {} nodes | {evicted} tenant-elements | {:.2} ms (single run) |",
        tree.total_elements(),
        probe.total_elements(),
        tree.node_count(),
        probe.node_count(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    drop(probe);
    let mut g = c.benchmark_group("evict-to-half");
    g.sample_size(10);
    g.bench_function(BenchmarkId::from_parameter(name), |b| {
        b.iter_batched(
            || tree.clone(),
            |mut t| {
                black_box(t.evict(bound));
                t
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

/// A fragmented tree: ~80-element keys, each a random cut of an earlier key plus 16..64 fresh
/// letters, for random tenants. Many nodes with short edges: the hard case for eviction and
/// per-element memory.
fn build_fragmented(elements: usize, tenants: u32, seed: u64) -> TextTree {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tree = TextTree::new();
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut now = 0;
    while tree.total_elements() < elements {
        let mut k = if keys.is_empty() || rng.random_range(0..20) == 0 {
            Vec::new()
        } else {
            let p = &keys[rng.random_range(0..keys.len())];
            p[..rng.random_range(0..=p.len())].to_vec()
        };
        for _ in 0..rng.random_range(16..64) {
            k.push(b'a' + rng.random_range(0..26u8));
        }
        now += 1;
        tree.insert(&k, rng.random_range(0..tenants), now);
        keys.push(k);
    }
    tree
}

fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();

    for millions in env_list("KVGATE_BENCH_SIZES", "1,10") {
        for tenants in env_list("KVGATE_BENCH_TENANTS", "8,64") {
            let name = format!("{millions}M-elems-{tenants}-tenants");
            let t0 = Instant::now();
            let mut driver = Driver::new(millions * 1_000_000, tenants as u32);
            println!(
                "BUILD | {name} | {} conversations | {:.1} s |",
                driver.corpus.convs.len(),
                t0.elapsed().as_secs_f64()
            );
            memory_report(&name, &driver);

            evict_bench(&mut c, &name, &driver.tree);

            {
                let mut g = c.benchmark_group(format!("match_and_insert/text/{name}"));
                for len in QUERY_LENS {
                    g.bench_function(BenchmarkId::from_parameter(len), |b| {
                        b.iter_custom(|iters| (0..iters).map(|_| driver.step(len)).sum())
                    });
                }
                g.finish();
            }

            for (len, rounds, per_round) in [(1_000, 20, 1000), (10_000, 10, 500), (100_000, 10, 100)] {
                latency_report(&name, &mut driver, len, rounds, per_round);
            }
            println!("STATE | {name} | {} trims during the run | load average {} |", driver.trims, loadavg());
            // The tree after the runs: fragmented by the query tails.
            let name = format!("{name}-after-run");
            text_memory_line(&name, &driver.tree);
            evict_bench(&mut c, &name, &driver.tree);
        }
    }
    for millions in env_list("KVGATE_BENCH_SIZES", "1,10") {
        let name = format!("{millions}M-elems-64-tenants-fragmented");
        let tree = build_fragmented(millions * 1_000_000, 64, 0x6672_6167 + millions as u64);
        text_memory_line(&name, &tree);
        evict_bench(&mut c, &name, &tree);
    }
    c.final_summary();
}
