//! Prints a trace's hit-rate references (infinite-cache ceiling, pooled LRU, pooled Belady) for fleets of given KV sizes; without sizes, checks the conversation trace's S1-S4 figures of `shared/bench/SCENARIOS.md`.
//!
//! ```sh
//! cargo run --release -p kvgate-sim --example references -- ../shared/traces/conversation_trace.jsonl
//! cargo run --release -p kvgate-sim --example references -- TRACE 2097152 4194304
//! ```
//!
//! Without fleet sizes the three scenario fleets (8 x 262,144, 8 x 131,072, 8 x 1,048,576 KV
//! tokens) are computed and compared with SCENARIOS.md's figures; a difference of 0.05 point or
//! more is an error. (Too slow in a debug build for a unit test.)

use anyhow::Context;
use kvgate_sim::{Trace, TraceFormat};

/// A fleet to compute the references for.
struct Fleet {
    name: &'static str,
    kv_tokens: u64,
    /// Pooled LRU and pooled Belady hit rates (%) per SCENARIOS.md.
    expected: Option<(f64, f64)>,
}

const SCENARIOS: [Fleet; 3] = [
    Fleet { name: "S1-S2", kv_tokens: 8 * 262_144, expected: Some((8.9, 32.8)) },
    Fleet { name: "S3", kv_tokens: 8 * 131_072, expected: Some((5.6, 25.9)) },
    Fleet { name: "S4", kv_tokens: 8 * 1_048_576, expected: Some((27.1, 37.4)) },
];

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().context("usage: references TRACE [FLEET_KV_TOKENS...]")?;
    let sizes: Vec<u64> = args
        .map(|arg| arg.parse().with_context(|| format!("fleet KV tokens must be an integer, got {arg:?}")))
        .collect::<anyhow::Result<_>>()?;
    let trace = Trace::load(path.as_ref(), TraceFormat::Mooncake)?;
    let ceiling = trace.cache_ceiling();
    println!(
        "{} requests, {} prompt tokens; ceiling {:.2}%",
        trace.requests.len(),
        ceiling.prompt_tokens,
        ceiling.rate() * 100.0
    );
    println!(
        "| fleet | KV tokens | pooled LRU | pooled Belady | expected |\n| --- | ---: | ---: | ---: | --- |"
    );
    let fleets: Vec<Fleet> = if sizes.is_empty() {
        SCENARIOS.into()
    } else {
        sizes.iter().map(|&kv_tokens| Fleet { name: "-", kv_tokens, expected: None }).collect()
    };
    let mut off = Vec::new();
    for Fleet { name, kv_tokens: tokens, expected } in fleets {
        let lru = trace.pooled_lru(tokens).rate() * 100.0;
        let belady = trace.pooled_belady(tokens).rate() * 100.0;
        let shown = expected.map_or("-".to_string(), |(l, b)| format!("{l:.1}% / {b:.1}%"));
        println!("| {name} | {tokens} | {lru:.2}% | {belady:.2}% | {shown} |");
        if let Some((want_lru, want_belady)) = expected {
            if (lru - want_lru).abs() >= 0.05 || (belady - want_belady).abs() >= 0.05 {
                off.push(name);
            }
        }
    }
    anyhow::ensure!(off.is_empty(), "differs from SCENARIOS.md: {}", off.join(", "));
    Ok(())
}
