//! Behaviour tests of the whole engine: timing, prefix reuse, eviction, queueing, events, determinism.

mod mixed;
mod pd;

use proptest::prelude::*;

use crate::*;

/// Distinct tokens: `n` tokens starting at `start` (two prompts with different starts share nothing).
fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

fn request(id: u64, prompt: Vec<u32>, output_tokens: u32) -> EngineRequest {
    EngineRequest::new(id, prompt, output_tokens)
}

/// Everything an engine emitted for a workload.
#[derive(Debug, Default, PartialEq)]
struct Trace {
    outputs: Vec<EngineOutput>,
    kv_batches: Vec<KvEventBatch>,
}

impl Trace {
    fn stats(&self, id: u64) -> RequestStats {
        self.outputs
            .iter()
            .find_map(|output| match output {
                EngineOutput::Finished { id: i, stats } if *i == id => Some(*stats),
                _ => None,
            })
            .unwrap_or_else(|| panic!("request {id} did not finish: {:?}", self.outputs))
    }

    fn events(&self) -> impl Iterator<Item = &KvEvent> {
        self.kv_batches.iter().flat_map(|batch| &batch.events)
    }
}

/// One step of a test workload.
#[derive(Clone, Debug)]
enum Action {
    Submit(u64, EngineRequest),
    /// A submission for one half of a disaggregated request.
    SubmitAs(u64, EngineRequest, PdStage),
    Cancel(u64, u64),
    /// `release_held` of a finished prefill-only request's KV.
    Release(u64, u64),
}

impl Action {
    fn at(&self) -> u64 {
        match self {
            Action::Submit(at, _)
            | Action::SubmitAs(at, _, _)
            | Action::Cancel(at, _)
            | Action::Release(at, _) => *at,
        }
    }
}

/// Replays `actions` (sorted by time) against a fresh engine, runs it until idle, and checks
/// invariants after every call.
fn simulate(config: EngineConfig, actions: Vec<Action>) -> (Engine, Trace) {
    let mut engine = Engine::new(config);
    let mut trace = Trace::default();
    for action in actions {
        while let Some(at) = engine.next_event_time().filter(|&at| at <= action.at()) {
            engine.advance(at, &mut trace.outputs);
            engine.check_invariants();
        }
        match action {
            Action::Submit(at, request) => engine.submit(at, request, &mut trace.outputs),
            Action::SubmitAs(at, request, stage) => engine.submit_as(at, request, stage, &mut trace.outputs),
            Action::Cancel(_, id) => {
                engine.cancel(id);
            }
            Action::Release(at, id) => {
                engine.release_held(at, id, &mut trace.outputs);
            }
        }
        engine.check_invariants();
        trace.kv_batches.extend(engine.drain_kv_events());
    }
    while let Some(at) = engine.next_event_time() {
        engine.advance(at, &mut trace.outputs);
        engine.check_invariants();
        trace.kv_batches.extend(engine.drain_kv_events());
    }
    (engine, trace)
}

fn submits(requests: Vec<(u64, EngineRequest)>) -> Vec<Action> {
    requests.into_iter().map(|(at, request)| Action::Submit(at, request)).collect()
}

/// A small pool for eviction and queueing cases: 8 blocks of 4 tokens.
fn small_config() -> EngineConfig {
    EngineConfig { kv_capacity_tokens: 32, block_size: 4, ..EngineConfig::default() }
}

#[test]
fn hand_computed_timing_for_one_request() {
    let (_, trace) =
        simulate(EngineConfig::default(), submits(vec![(1_000, request(7, tokens(0, 4096), 3))]));
    // 2 prefill steps of 2,048 tokens at 8,000 tokens/s = 512 ms, then 2 decode steps of
    // 6 ms + 0.35 ms x 1 = 6.35 ms each.
    assert_eq!(
        trace.outputs,
        [
            EngineOutput::FirstToken { id: 7, at: 513_000 },
            EngineOutput::Token { id: 7, at: 519_350 },
            EngineOutput::Token { id: 7, at: 525_700 },
            EngineOutput::Finished {
                id: 7,
                stats: RequestStats {
                    prompt_tokens: 4096,
                    cached_tokens: 0,
                    offloaded_tokens: 0,
                    completion_tokens: 3,
                    arrival_us: 1_000,
                    admitted_us: 1_000,
                    first_token_us: 513_000,
                    finished_us: 525_700,
                },
            },
        ]
    );
    assert_eq!(trace.stats(7).ttft_us(), 512_000);
}

#[test]
fn ttft_grows_with_uncached_prompt_length() {
    let ttft = |n| {
        let (_, trace) = simulate(EngineConfig::default(), submits(vec![(0, request(1, tokens(0, n), 1))]));
        trace.stats(1).ttft_us()
    };
    let ttfts: Vec<u64> = [100, 1000, 2048, 3000, 9000].into_iter().map(ttft).collect();
    assert_eq!(ttfts, [12_500, 125_000, 256_000, 375_000, 1_125_000]);
}

#[test]
fn repeated_prefix_is_cached_and_prefills_faster() {
    let prompt = tokens(0, 4096);
    let mut shares_half = tokens(0, 2048);
    shares_half.extend(tokens(100_000, 2048));
    let (engine, trace) = simulate(
        EngineConfig::default(),
        submits(vec![
            (0, request(1, prompt.clone(), 1)),
            (1_000_000, request(2, prompt, 1)),
            (2_000_000, request(3, shares_half, 1)),
        ]),
    );
    assert_eq!(trace.stats(1).cached_tokens, 0);
    // Fully cached: every block matches, but the last token is always computed, and with it the
    // whole last block (a hit is block-aligned: N - block size).
    assert_eq!(trace.stats(2).cached_tokens, 4080);
    assert_eq!(trace.stats(2).ttft_us(), 2_000); // 16 tokens at 8,000 tokens/s
    assert_eq!(trace.stats(3).cached_tokens, 2048);
    assert_eq!(trace.stats(3).ttft_us(), 256_000);
    let load = engine.load(3_000_000);
    assert_eq!(load.total_prompt_tokens, 3 * 4096);
    assert_eq!(load.total_cached_tokens, 4080 + 2048);
    assert!((load.cache_hit_rate - 6128.0 / 12288.0).abs() < 1e-12);
}

#[test]
fn prefix_cache_off_caches_nothing() {
    let config = EngineConfig { prefix_cache: false, ..EngineConfig::default() };
    let (_, trace) = simulate(
        config,
        submits(vec![(0, request(1, tokens(0, 512), 1)), (1_000_000, request(2, tokens(0, 512), 1))]),
    );
    assert_eq!(trace.stats(2).cached_tokens, 0);
    assert!(trace.kv_batches.is_empty());
}

#[test]
fn lru_evicts_oldest_unreferenced_prefix_first() {
    let a = tokens(0, 8);
    let b = tokens(1_000, 8);
    let c = tokens(2_000, 20);
    let a_hashes = prompt_block_hashes(&a, 4);
    let (_, trace) = simulate(
        small_config(),
        submits(vec![
            (0, request(1, a.clone(), 1)),         // 3 blocks; leaves A's 2 cached
            (1_000_000, request(2, b.clone(), 1)), // leaves B's 2 cached
            (2_000_000, request(3, c, 1)),         // needs 6 of 8: evicts A (oldest)
            (3_000_000, request(4, b, 1)),
            (4_000_000, request(5, a, 1)),
        ]),
    );
    let removed: Vec<&Vec<u64>> = trace
        .events()
        .filter_map(|event| match event {
            KvEvent::BlockRemoved { block_hashes, .. } => Some(block_hashes),
            _ => None,
        })
        .collect();
    // A's tail is released (and evicted) before its head.
    assert_eq!(removed[0], &vec![a_hashes[1], a_hashes[0]]);
    // 8 tokens held: the last block is recomputed with the last token.
    assert_eq!(trace.stats(4).cached_tokens, 4);
    assert_eq!(trace.stats(5).cached_tokens, 0);
}

/// A LoRA adapter's blocks hash apart from the base model's (and from another adapter's), and
/// its stores name it.
#[test]
fn an_adapter_caches_its_own_blocks() {
    let prompt = tokens(0, 32);
    let sql = LoraAdapter { id: 1, name: "sql".into() };
    let mut engine = Engine::new(EngineConfig::default());
    let mut out = Vec::new();
    let adapter =
        |id, lora: &LoraAdapter| EngineRequest { lora: Some(lora.clone()), ..request(id, prompt.clone(), 1) };
    engine.submit(0, adapter(1, &sql), &mut out);
    while let Some(at) = engine.next_event_time() {
        engine.advance(at, &mut out);
    }
    let stored = engine.drain_kv_events().into_iter().flat_map(|batch| batch.events).collect::<Vec<_>>();
    let [KvEvent::BlockStored { block_hashes, lora, .. }] = &stored[..] else { panic!("{stored:?}") };
    assert_eq!(lora.as_ref(), Some(&sql));
    assert_eq!(block_hashes, &adapter_block_hashes(&prompt, 16, Some(&sql)));
    assert_ne!(block_hashes, &prompt_block_hashes(&prompt, 16), "the base model's hashes differ");
    let other = LoraAdapter { id: 2, name: "chat".into() };
    assert_ne!(adapter_block_hashes(&prompt, 16, Some(&other)), *block_hashes);
    assert_eq!(engine.cached_prefix_tokens(&prompt), 0, "the base model has nothing cached");
    engine.submit(1_000_000, adapter(2, &sql), &mut out);
    while let Some(at) = engine.next_event_time() {
        engine.advance(at, &mut out);
    }
    let stats = out.iter().rev().find_map(|o| match o {
        EngineOutput::Finished { id: 2, stats } => Some(*stats),
        _ => None,
    });
    assert_eq!(stats.unwrap().cached_tokens, 16, "the adapter's own blocks hit (all but the last block)");
}

/// The host tier: stored on write (placeholders), a prefix evicted from the GPU but held in host
/// memory counts as cached and loads back, which costs less than computing it and more than a GPU
/// hit; evicted from both, it is computed again.
#[test]
fn a_prefix_in_host_memory_loads_back_instead_of_prefilling() {
    let config = EngineConfig {
        cpu_offload_tokens: 36, // 9 blocks: A, B and C
        cpu_load_tokens_per_sec: 4.0 * small_config().prefill_tokens_per_sec,
        ..small_config()
    };
    let a = tokens(0, 8);
    let b = tokens(1_000, 8);
    let c = tokens(2_000, 20);
    let a_hashes = prompt_block_hashes(&a, 4);
    let b_hashes = prompt_block_hashes(&b, 4);
    let (_, trace) = simulate(
        config,
        submits(vec![
            (0, request(1, a.clone(), 1)),
            (1_000_000, request(2, b.clone(), 1)),        // host: A, B
            (2_000_000, request(3, c, 1)),                // evicts A and B from the GPU
            (3_000_000, request(4, a.clone(), 1)),        // A from host memory
            (4_000_000, request(5, tokens(3_000, 8), 1)), // the host evicts B (least recent)
            (6_000_000, request(7, b, 1)),                // B is gone from both tiers
        ]),
    );
    let placeholders: Vec<&Vec<u64>> = trace
        .events()
        .filter_map(|event| match event {
            KvEvent::BlockStored {
                block_hashes,
                tier: Tier::Cpu,
                token_ids,
                block_size: 0,
                parent_block_hash: None,
                ..
            } => {
                assert!(token_ids.is_empty());
                Some(block_hashes)
            }
            _ => None,
        })
        .collect();
    assert_eq!(placeholders[..2], [&a_hashes, &b_hashes]);
    let fresh = trace.stats(1);
    let loaded = trace.stats(4);
    assert_eq!((loaded.cached_tokens, loaded.offloaded_tokens), (4, 4));
    let ttft = |stats: RequestStats| stats.first_token_us - stats.admitted_us;
    assert!(ttft(loaded) < ttft(fresh), "{} vs {}", ttft(loaded), ttft(fresh));
    assert!(ttft(loaded) > small_config().prefill_step_us(1), "a load takes time");
    let host_removed: Vec<&Vec<u64>> = trace
        .events()
        .filter_map(|event| match event {
            KvEvent::BlockRemoved { block_hashes, tier: Tier::Cpu } => Some(block_hashes),
            _ => None,
        })
        .collect();
    assert!(host_removed.iter().any(|hashes| hashes.contains(&b_hashes[0])));
    assert_eq!(trace.stats(7).cached_tokens, 0);
}

#[test]
fn blocks_in_use_are_not_evicted() {
    // A holds its 2 prompt blocks while decoding; B needs all free blocks but may not take A's.
    let (_, trace) = simulate(
        small_config(),
        submits(vec![
            (0, request(1, tokens(0, 8), 10)),       // 5 blocks, long decode
            (10_000, request(2, tokens(500, 8), 6)), // 4 blocks: must wait for A
        ]),
    );
    let a = trace.stats(1);
    let b = trace.stats(2);
    assert_eq!(b.admitted_us, a.finished_us);
    assert!(!trace.events().any(|e| matches!(e, KvEvent::BlockRemoved { .. })));
}

#[test]
fn request_waits_when_kv_is_full_and_is_admitted_after_another_finishes() {
    let mut engine = Engine::new(small_config());
    let mut out = Vec::new();
    // A needs ceil((20 + 10) / 4) = 8 blocks: the whole cache.
    engine.submit(0, request(1, tokens(0, 20), 10), &mut out);
    engine.submit(0, request(2, tokens(100, 4), 1), &mut out);
    let load = engine.load(0);
    assert_eq!((load.num_running_reqs, load.num_waiting_reqs), (1, 1));
    // A's 20 tokens are admitted but not prefilled yet; B's 4 are queued: both count.
    assert_eq!(load.num_waiting_uncached_tokens, 24);
    assert_eq!(load.token_usage, 1.0);
    while let Some(at) = engine.next_event_time() {
        engine.advance(at, &mut out);
    }
    let finished: Vec<RequestStats> = out
        .iter()
        .filter_map(|o| match o {
            EngineOutput::Finished { stats, .. } => Some(*stats),
            _ => None,
        })
        .collect();
    assert_eq!(finished.len(), 2);
    assert_eq!(finished[1].admitted_us, finished[0].finished_us);
    assert_eq!(engine.load(u64::MAX / 2).token_usage, 0.0);
}

#[test]
fn max_running_requests_queues_the_rest() {
    let config = EngineConfig { max_running_requests: 2, ..EngineConfig::default() };
    let (_, trace) = simulate(
        config,
        submits((1..=3).map(|id| (0, request(id, tokens(id as u32 * 1000, 16), 4))).collect()),
    );
    assert_eq!(trace.stats(1).admitted_us, 0);
    assert_eq!(trace.stats(2).admitted_us, 0);
    assert_eq!(trace.stats(3).admitted_us, trace.stats(1).finished_us);
}

#[test]
fn prefill_is_chunked_fifo_and_has_priority_over_decode() {
    let (_, trace) = simulate(
        EngineConfig::default(),
        submits(vec![(0, request(1, tokens(0, 3000), 2)), (0, request(2, tokens(10_000, 1000), 2))]),
    );
    // Step 1: 2048 of A (256 ms). Step 2: 952 of A + 1000 of B (244 ms). Then decode both.
    assert_eq!(trace.stats(1).first_token_us, 500_000);
    assert_eq!(trace.stats(2).first_token_us, 500_000);
    assert_eq!(trace.stats(1).finished_us, 500_000 + 6_700);
    // A request arriving mid-decode is prefilled before the next decode step.
    let (_, trace) = simulate(
        EngineConfig::default(),
        submits(vec![(0, request(1, tokens(0, 16), 100)), (100_000, request(2, tokens(10_000, 800), 1))]),
    );
    let decode_step_end = trace.outputs.iter().find_map(|o| match o {
        EngineOutput::Token { at, .. } if *at >= 100_000 => Some(*at),
        _ => None,
    });
    let b = trace.stats(2);
    assert_eq!(Some(b.admitted_us), decode_step_end);
    assert_eq!(b.first_token_us, b.admitted_us + 100_000);
}

/// With priority scheduling a more urgent request (lower value, vLLM's convention) jumps the
/// waiting queue and takes the next prefill step's budget ahead of a less urgent prompt already
/// prefilling; first come, first served it waits for both.
#[test]
fn priority_scheduling_serves_the_urgent_prefill_first() {
    let workload = |priority_scheduling| {
        let config = EngineConfig { priority_scheduling, ..EngineConfig::default() };
        simulate(
            config,
            submits(vec![
                (0, request(1, tokens(0, 8192), 2).with_priority(1)),
                (0, request(2, tokens(20_000, 4096), 2).with_priority(1)),
                (100_000, request(3, tokens(40_000, 1000), 2).with_priority(-1)),
            ]),
        )
        .1
    };
    let fifo = workload(false);
    let urgent = workload(true);
    // First come, first served: 8,192 + 4,096 tokens go first (1.536 s), then the 1,000.
    assert!(fifo.stats(3).first_token_us > 1_536_000, "{:?}", fifo.stats(3));
    // By priority: admitted when the first step (2,048 tokens, 256 ms) ends, prefilled in the
    // next one (1,000 of its tokens and 1,048 of request 1's).
    assert_eq!(urgent.stats(3).admitted_us, 256_000);
    assert_eq!(urgent.stats(3).first_token_us, 512_000);
    // The less urgent ones still finish, the first later than first come, first served.
    assert!(urgent.stats(1).first_token_us > fifo.stats(1).first_token_us);
    assert_eq!(urgent.outputs.iter().filter(|o| matches!(o, EngineOutput::Finished { .. })).count(), 3);
}

#[test]
fn a_burst_sharing_a_long_prefix_computes_it_once() {
    // A 20,480-token document, then four questions on it arriving while it is prefilled. A
    // request is admitted (and its prefix matched) only when the prefill budget of the next
    // step is free, and the document's blocks are cached chunk by chunk (vLLM v1, SGLang), so
    // the questions compute only what the document's last chunk had not cached yet.
    let document = tokens(0, 20_480);
    let question = |id: u32| {
        let mut prompt = document.clone();
        prompt.extend(tokens(1_000_000 * id, 200));
        prompt
    };
    let mut requests = vec![(0, request(0, question(0), 1))];
    requests.extend((1..=4).map(|id| (100_000 * u64::from(id), request(u64::from(id), question(id), 1))));
    let (_, trace) = simulate(EngineConfig::default(), submits(requests));
    let first = trace.stats(0);
    assert_eq!(first.cached_tokens, 0);
    let computed: u32 = (1..=4)
        .map(|id| {
            let s = trace.stats(id);
            s.prompt_tokens - s.cached_tokens
        })
        .sum();
    // The first question's last chunk (its 10th of 2,048) shares a step with the second's start:
    // at most that chunk is computed twice, then every later question hits the whole document.
    assert!(computed <= 4 * 200 + 2048, "the questions computed {computed} tokens");
    for id in 2..=4 {
        assert_eq!(trace.stats(id).cached_tokens, 20_480, "question {id} hits the whole document");
    }
    // Reported while the burst waits, the shared document counts once.
    let mut engine = Engine::new(EngineConfig::default());
    let mut outputs = Vec::new();
    for id in 0..5u32 {
        engine.submit(u64::from(id), request(u64::from(id), question(id), 1), &mut outputs);
    }
    assert_eq!(engine.load(10).num_waiting_uncached_tokens, 20_480 + 5 * 200);
    // All five are answered within one document prefill plus the questions' own tokens.
    let last = (0..=4).map(|id| trace.stats(id).first_token_us).max().unwrap();
    assert!(last <= (20_480 + 5 * 200 + 2048) as u64 * 1_000_000 / 8_000, "{last}");
}

#[test]
fn token_events_follow_the_output_length_and_can_be_switched_off() {
    let count = |emit_token_events| {
        let config = EngineConfig { emit_token_events, ..EngineConfig::default() };
        let (_, trace) = simulate(config, submits(vec![(0, request(1, tokens(0, 10), 5))]));
        assert_eq!(trace.stats(1).completion_tokens, 5);
        trace.outputs.iter().filter(|o| matches!(o, EngineOutput::Token { .. })).count()
    };
    assert_eq!(count(true), 4);
    assert_eq!(count(false), 0);
}

#[test]
fn rejects_what_can_never_run() {
    let mut engine = Engine::new(small_config());
    let mut out = Vec::new();
    engine.submit(0, request(1, tokens(0, 30), 3), &mut out);
    engine.submit(0, request(2, Vec::new(), 3), &mut out);
    engine.submit(0, request(3, tokens(0, 4), 1), &mut out);
    engine.submit(0, request(3, tokens(0, 4), 1), &mut out);
    assert_eq!(
        out,
        [
            EngineOutput::Rejected {
                id: 1,
                reason: RejectReason::ExceedsKvCapacity { required_tokens: 33, capacity_tokens: 32 }
            },
            EngineOutput::Rejected { id: 2, reason: RejectReason::EmptyPrompt },
            EngineOutput::Rejected { id: 3, reason: RejectReason::DuplicateId },
        ]
    );
    assert_eq!(engine.num_requests(), 1);
}

#[test]
fn cancel_releases_blocks_and_unblocks_the_queue() {
    let mut engine = Engine::new(small_config());
    let mut out = Vec::new();
    engine.submit(0, request(1, tokens(0, 20), 10), &mut out);
    engine.submit(0, request(2, tokens(100, 4), 1), &mut out);
    assert!(engine.cancel(1));
    assert!(!engine.cancel(1));
    engine.check_invariants();
    while let Some(at) = engine.next_event_time() {
        engine.advance(at, &mut out);
        engine.check_invariants();
    }
    let ids: Vec<u64> = out.iter().map(EngineOutput::id).collect();
    assert_eq!(ids, [2, 2]);
    assert_eq!(engine.load(10_000_000).num_used_tokens, 0);
}

#[test]
fn kv_events_describe_stored_blocks_with_increasing_seqs() {
    let prompt = tokens(0, 40);
    let hashes = prompt_block_hashes(&prompt, 16);
    let mut extended = prompt.clone();
    extended.extend(tokens(500, 24));
    let (_, trace) = simulate(
        EngineConfig::default(),
        submits(vec![(0, request(1, prompt.clone(), 2)), (1_000_000, request(2, extended.clone(), 1))]),
    );
    let extended_hashes = prompt_block_hashes(&extended, 16);
    assert_eq!(
        trace.events().collect::<Vec<_>>(),
        [
            &KvEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: None,
                token_ids: prompt[..32].to_vec(),
                block_size: 16,
                tier: Tier::Gpu,
                lora: None,
            },
            &KvEvent::BlockStored {
                block_hashes: extended_hashes[2..].to_vec(),
                parent_block_hash: Some(hashes[1]),
                token_ids: extended[32..64].to_vec(),
                block_size: 16,
                tier: Tier::Gpu,
                lora: None,
            },
        ]
    );
    let seqs: Vec<u64> = trace.kv_batches.iter().map(|b| b.seq).collect();
    assert_eq!(seqs, [0, 1]);
    assert_eq!(trace.kv_batches[1].timestamp_us, trace.stats(2).first_token_us);
}

#[test]
fn reset_prefix_cache_only_when_nothing_is_in_use() {
    let mut engine = Engine::new(EngineConfig::default());
    let mut out = Vec::new();
    engine.submit(0, request(1, tokens(0, 64), 50), &mut out);
    engine.advance(10_000, &mut out);
    assert!(!engine.reset_prefix_cache(10_000));
    while let Some(at) = engine.next_event_time() {
        engine.advance(at, &mut out);
    }
    assert!(engine.reset_prefix_cache(2_000_000));
    let batches = engine.drain_kv_events();
    assert_eq!(batches.last().unwrap().events, [KvEvent::AllBlocksCleared]);
    engine.submit(3_000_000, request(2, tokens(0, 64), 1), &mut out);
    engine.advance(u64::MAX / 2, &mut out);
    match out.last().unwrap() {
        EngineOutput::Finished { stats, .. } => assert_eq!(stats.cached_tokens, 0),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn gen_throughput_reflects_recent_decode() {
    let mut engine = Engine::new(EngineConfig::default());
    let mut out = Vec::new();
    for id in 0..10 {
        engine.submit(0, request(id, tokens(id as u32 * 100, 16), 1000), &mut out);
    }
    engine.advance(2_000_000, &mut out);
    let load = engine.load(2_000_000);
    // 10 requests decoding, 6 ms + 3.5 ms per step: ~1,053 tokens/s.
    assert!((1000.0..1100.0).contains(&load.gen_throughput), "{load:?}");
    assert_eq!(load.num_running_reqs, 10);
    assert!(load.token_usage > 0.0);
}

fn workload_strategy() -> impl Strategy<Value = Vec<Action>> {
    let action = (0u64..3_000_000, 0u64..40, 0u32..6, 1u32..200, 1u32..80, prop::bool::weighted(0.15))
        .prop_map(|(at, id, family, len, output, cancel)| {
            if cancel {
                Action::Cancel(at, id)
            } else {
                // Prompts of one family share prefixes of varying length.
                Action::Submit(at, request(id, tokens(family * 10_000, len), output))
            }
        });
    prop::collection::vec(action, 1..60).prop_map(|mut actions| {
        actions.sort_by_key(Action::at);
        actions
    })
}

fn tight_config() -> EngineConfig {
    EngineConfig {
        kv_capacity_tokens: 512,
        block_size: 8,
        max_running_requests: 6,
        prefill_chunk_tokens: 64,
        ..EngineConfig::default()
    }
}

/// Submits each distinct request of `actions` once with its id's priority from `priorities`,
/// runs `config`, and checks every request ends exactly once (finished or rejected), none left.
fn ends_every_request_once(
    config: EngineConfig,
    actions: Vec<Action>,
    priorities: &[i32],
) -> Result<(), TestCaseError> {
    let mut submitted = Vec::new();
    let actions: Vec<Action> = actions
        .into_iter()
        .filter_map(|action| match action {
            Action::Submit(at, request) if !submitted.contains(&request.id) => {
                submitted.push(request.id);
                let priority = priorities[request.id as usize];
                Some(Action::Submit(at, request.with_priority(priority)))
            }
            _ => None,
        })
        .collect();
    let (engine, trace) = simulate(config, actions);
    prop_assert_eq!(engine.num_requests(), 0);
    let mut ended: Vec<u64> = trace
        .outputs
        .iter()
        .filter_map(|output| match output {
            EngineOutput::Finished { id, .. } | EngineOutput::Rejected { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    ended.sort_unstable();
    submitted.sort_unstable();
    prop_assert_eq!(ended, submitted);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn token_usage_stays_in_unit_interval(actions in workload_strategy()) {
        // `simulate` checks token_usage in [0, 1] and the block accounting after every call.
        let (engine, trace) = simulate(tight_config(), actions);
        prop_assert_eq!(engine.num_requests(), 0);
        prop_assert_eq!(engine.load(u64::MAX / 2).token_usage, 0.0);
        let seqs: Vec<u64> = trace.kv_batches.iter().map(|b| b.seq).collect();
        prop_assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
    }

    /// Under priority scheduling (random priorities) every request ends exactly once: distinct
    /// ids, no cancels, each finished or rejected once.
    #[test]
    fn priority_scheduling_loses_and_duplicates_nothing(
        actions in workload_strategy(),
        priorities in prop::collection::vec(-2i32..3, 40),
    ) {
        ends_every_request_once(EngineConfig { priority_scheduling: true, ..tight_config() }, actions, &priorities)?;
    }

    #[test]
    fn same_inputs_same_outputs(actions in workload_strategy()) {
        let first = simulate(tight_config(), actions.clone()).1;
        let second = simulate(tight_config(), actions).1;
        prop_assert_eq!(first, second);
    }
}
