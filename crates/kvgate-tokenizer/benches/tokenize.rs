//! The cost of turning chat requests into token ids with the tiny Hugging Face tokenizer, with the segment cache off, cold (emptied before each request) and warm: an 8 KB chat (render + encode, render alone, encode alone, from the raw body, on 1 and 2 threads), a 20-turn conversation (1 and 2 threads), and the mock.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvgate_tokenizer::{ChatOptions, Tokenizer, TokenizerOptions};
use serde_json::json;

/// About 8 KB of prose, code and numbers (the shape of make_reference.py's long case).
fn user_text() -> String {
    let paragraph = "The gateway routes each request to the engine replica that already holds the longest \
        prefix of its prompt in the KV cache, unless that replica is overloaded. \
        fn select(&self, request: &Request) -> Result<Decision, NoRoute> { todo!() } \
        Latency p50=12.5ms p99=184ms; hit rate 73.2% over 10000 requests.\n";
    let mut text = String::new();
    let mut index = 0;
    while text.len() < 8192 {
        text.push_str(&format!("{index}. {paragraph}"));
        index += 1;
    }
    text
}

/// The tiny tokenizer with the default segment cache, or with none.
fn tiny(cache: bool) -> Tokenizer {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join("tiny-chatml");
    let segment_cache_tokens = if cache { TokenizerOptions::DEFAULT_SEGMENT_CACHE_TOKENS } else { 0 };
    Tokenizer::from_path_with_options(
        &model,
        None,
        &TokenizerOptions { segment_cache_tokens, ..TokenizerOptions::default() },
    )
    .expect("load tiny-chatml")
}

const TURNS: usize = 20;

/// The raw bodies of one 20-turn conversation: request `k` holds the system message, the `k`
/// earlier user/assistant exchanges and a new ~400-byte user message. `id` makes every
/// conversation's text unique (as different users' conversations are).
fn conversation(id: u64) -> Vec<String> {
    let mut messages = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    let mut bodies = Vec::with_capacity(TURNS);
    for turn in 0..TURNS {
        let user = format!(
            "Conversation {id}, question {turn}: the replica that holds the longest cached prefix \
             answers fastest, but how should the gateway weigh that against a queue of {turn} \
             waiting requests when the prefix is only {id} blocks long? Please explain the trade-off \
             with numbers, say p50=12.5ms and p99=184ms, and show the decision as a small Rust \
             function: fn pick(load: u32, overlap: u32) -> bool {{ todo!() }}."
        );
        messages.push(json!({"role": "user", "content": user}));
        bodies.push(json!({"model": "tiny", "messages": messages, "stream": true}).to_string());
        let answer = format!(
            "Answer {turn}: route to the cached replica unless its queue is longer than {id} requests."
        );
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    bodies
}

/// Runs `work(thread, iteration)` `iters` times on each of `threads` threads at once and returns
/// the CPU time a thread spent, on average: the machine is shared, so other processes' use of
/// the cores must not count, while what the threads cost each other (locks, cache lines) does.
fn concurrent(threads: usize, iters: u64, work: &(impl Fn(usize, u64) + Sync)) -> Duration {
    let total: Duration = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                scope.spawn(move || {
                    let start = ThreadClock::start();
                    (0..iters).for_each(|iteration| work(thread, iteration));
                    start.elapsed()
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().expect("bench thread")).sum()
    });
    total / threads as u32
}

/// This thread's CPU time, from Linux's /proc/thread-self/schedstat (nanoseconds on a CPU);
/// wall time where that file cannot be read.
enum ThreadClock {
    Cpu(u64),
    Wall(Instant),
}

impl ThreadClock {
    fn cpu_nanos() -> Option<u64> {
        let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        stat.split_whitespace().next()?.parse().ok()
    }

    fn start() -> ThreadClock {
        ThreadClock::cpu_nanos().map_or_else(|| ThreadClock::Wall(Instant::now()), ThreadClock::Cpu)
    }

    fn elapsed(&self) -> Duration {
        match self {
            ThreadClock::Cpu(start) => {
                Duration::from_nanos(ThreadClock::cpu_nanos().unwrap_or(*start).saturating_sub(*start))
            }
            ThreadClock::Wall(start) => start.elapsed(),
        }
    }
}

fn bench_chat_8kb(c: &mut Criterion) {
    let hf = tiny(true);
    let uncached = tiny(false);
    let mock = Tokenizer::mock();
    let text = user_text();
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": text},
    ]);
    let body = json!({"model": "tiny", "messages": messages, "stream": true}).to_string();
    let options = ChatOptions::default();
    let rendered = hf.render_chat(&messages, &options).expect("render");

    let mut group = c.benchmark_group("chat_8kb");
    group.sample_size(30);
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.bench_function("hf_render_only", |b| {
        b.iter(|| hf.render_chat(black_box(&messages), &options).expect("render"))
    });
    group.bench_function("hf_render_and_encode_cache_off", |b| {
        b.iter(|| uncached.encode_chat(black_box(&messages), &options).expect("encode"))
    });
    group.bench_function("hf_render_and_encode_warm", |b| {
        b.iter(|| hf.encode_chat(black_box(&messages), &options).expect("encode"))
    });
    group.bench_function("hf_encode_prompt_cache_off", |b| {
        b.iter(|| uncached.encode_prompt(black_box(&rendered)).expect("encode"))
    });
    group.bench_function("hf_encode_prompt_warm", |b| {
        b.iter(|| hf.encode_prompt(black_box(&rendered)).expect("encode"))
    });
    group.bench_function("hf_from_request_body_cache_off", |b| {
        b.iter(|| uncached.encode_chat_request(black_box(body.as_bytes())).expect("encode"))
    });
    group.bench_function("hf_from_request_body_cpu_1_threads_cold", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                hf.clear_segment_cache();
                let start = ThreadClock::start();
                black_box(hf.encode_chat_request(black_box(body.as_bytes())).expect("encode"));
                total += start.elapsed();
            }
            total
        })
    });
    group.bench_function("hf_from_request_body_warm", |b| {
        b.iter(|| hf.encode_chat_request(black_box(body.as_bytes())).expect("encode"))
    });
    // CPU time per request of each thread, 1 thread alone or 2 at once.
    for (name, tokenizer) in [("cache_off", &uncached), ("warm", &hf)] {
        for threads in [1, 2] {
            group.bench_function(format!("hf_from_request_body_cpu_{threads}_threads_{name}"), |b| {
                b.iter_custom(|iters| {
                    concurrent(threads, iters, &|_, _| {
                        black_box(tokenizer.encode_chat_request(black_box(body.as_bytes())).expect("encode"));
                    })
                })
            });
        }
    }
    group.bench_function("mock_render_and_encode", |b| {
        b.iter(|| mock.encode_chat(black_box(&messages), &options).expect("encode"))
    });
    group.finish();
}

/// One iteration is a whole new 20-turn conversation (every request re-sends the history) on
/// each thread, measured in CPU time per thread; divide by 20 for the mean cost of a request.
/// With the cache on it is never cleared: it holds the earlier conversations, as in a gateway
/// that has been running a while.
fn bench_conversation(c: &mut Criterion) {
    let mut group = c.benchmark_group("conversation_20_turns");
    group.sample_size(10);
    group.throughput(Throughput::Elements(TURNS as u64));
    let mut next_id = 0u64;
    for (name, tokenizer) in [("cache_off", tiny(false)), ("cache_on", tiny(true))] {
        for threads in [1, 2] {
            group.bench_function(format!("hf_cpu_{threads}_threads_{name}"), |b| {
                b.iter_custom(|iters| {
                    let count = threads as u64 * iters;
                    let conversations: Vec<Vec<String>> =
                        (0..count).map(|i| conversation(next_id + i)).collect();
                    next_id += count;
                    concurrent(threads, iters, &|thread, iteration| {
                        let index = iteration as usize * threads + thread;
                        for body in &conversations[index] {
                            black_box(tokenizer.encode_chat_request(body.as_bytes()).expect("encode"));
                        }
                    })
                })
            });
        }
    }
    group.finish();
}

/// About 8 KB of words never seen before (pseudo-random letters, different every call): the
/// BPE model's own word cache cannot help, as with real users' varied text once it is full.
fn unique_text(seed: u64) -> String {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut text = String::with_capacity(8300);
    while text.len() < 8192 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let length = 2 + (state >> 60) as usize;
        for index in 0..length {
            text.push(char::from(b'a' + ((state >> (index * 4 + 8)) % 26) as u8));
        }
        text.push(if state.is_multiple_of(13) { '\n' } else { ' ' });
    }
    text
}

/// Chats with 8 KB of new words: the per-request cost of tokenizing text the BPE word cache has
/// not seen, and of the segment cache when nothing repeats (every section a miss, the cache full
/// of text never asked for again); 1 thread and 2 at once (CPU time per thread).
fn bench_unique_text(c: &mut Criterion) {
    let mut group = c.benchmark_group("unique_text_8kb");
    group.sample_size(20);
    let mut next_seed = 0u64;
    for (name, tokenizer) in [("cache_off", tiny(false)), ("cache_on", tiny(true))] {
        for threads in [1, 2] {
            group.bench_function(format!("hf_cpu_{threads}_threads_{name}"), |b| {
                b.iter_custom(|iters| {
                    let count = threads as u64 * iters;
                    let bodies: Vec<String> = (0..count)
                        .map(|i| {
                            let messages = json!([{"role": "user", "content": unique_text(next_seed + i)}]);
                            json!({"model": "tiny", "messages": messages}).to_string()
                        })
                        .collect();
                    next_seed += count;
                    concurrent(threads, iters, &|thread, iteration| {
                        let body = &bodies[iteration as usize * threads + thread];
                        black_box(tokenizer.encode_chat_request(body.as_bytes()).expect("encode"));
                    })
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_chat_8kb, bench_conversation, bench_unique_text);
criterion_main!(benches);
