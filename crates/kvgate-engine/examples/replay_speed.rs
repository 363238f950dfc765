//! Times a synthetic trace-sized replay (12,031 requests over 8 engines, virtual time) to check the model's speed.

#![allow(clippy::disallowed_types)] // the host, not the pure core, reads the clock

use kvgate_engine::{splitmix64, Engine, EngineConfig, EngineOutput, EngineRequest};

fn main() {
    let config = EngineConfig { emit_token_events: false, emit_kv_events: false, ..EngineConfig::default() };
    let n_engines = 8;
    let mut engines: Vec<Engine> = (0..n_engines).map(|_| Engine::new(config.clone())).collect();
    let mut out = Vec::new();
    let started = std::time::Instant::now();
    let (mut finished, mut cached, mut prompt, mut ttft_sum) = (0u64, 0u64, 0u64, 0u64);
    let n_requests = 12_031u64;
    for index in 0..n_requests {
        let r = splitmix64(index);
        let at = index * 3_537_000_000 / n_requests;
        // Input lengths spread 1k..48k (mean ~12k); conversations of 4 turns share prefixes.
        let len = 1_000 + (r % 23_000) as u32 + if r.is_multiple_of(7) { 30_000 } else { 0 };
        let conversation = index / 4;
        let prompt_tokens: Vec<u32> = (0..len).map(|i| (conversation as u32) << 17 ^ i).collect();
        let engine = &mut engines[(conversation % n_engines as u64) as usize];
        engine.submit(at, EngineRequest::new(index, prompt_tokens, 343), &mut out);
        for engine in engines.iter_mut() {
            engine.advance(at, &mut out);
        }
        for output in out.drain(..) {
            if let EngineOutput::Finished { stats, .. } = output {
                finished += 1;
                cached += u64::from(stats.cached_tokens);
                prompt += u64::from(stats.prompt_tokens);
                ttft_sum += stats.ttft_us();
            }
        }
    }
    for engine in engines.iter_mut() {
        while let Some(at) = engine.next_event_time() {
            engine.advance(at, &mut out);
        }
    }
    for output in out.drain(..) {
        if let EngineOutput::Finished { stats, .. } = output {
            finished += 1;
            cached += u64::from(stats.cached_tokens);
            prompt += u64::from(stats.prompt_tokens);
            ttft_sum += stats.ttft_us();
        }
    }
    println!(
        "{finished} finished in {:?}; hit rate {:.3}; mean TTFT {:.3} s",
        started.elapsed(),
        cached as f64 / prompt as f64,
        ttft_sum as f64 / finished as f64 / 1e6
    );
}
