//! Prefill/decode disaggregation in the engine: KV held after a prefill-only request until released, and transferred prompts decoded without prefill.

use proptest::prelude::*;

use super::{request, simulate, small_config, tight_config, tokens, Action};
use crate::*;

fn run_to_idle(engine: &mut Engine, out: &mut Vec<EngineOutput>) {
    while let Some(at) = engine.next_event_time() {
        engine.advance(at, out);
        engine.check_invariants();
    }
}

#[test]
fn held_kv_is_counted_until_released() {
    // 10 prompt tokens + 1 output in blocks of 4: 2 full prompt blocks (cached) + 1 private.
    let (mut engine, trace) =
        simulate(small_config(), vec![Action::SubmitAs(0, request(1, tokens(0, 10), 1), PdStage::Prefill)]);
    assert_eq!(trace.stats(1).completion_tokens, 1);
    assert_eq!((engine.num_requests(), engine.num_held()), (0, 1));
    assert_eq!(engine.held_blocks(1), Some(3));
    let load = engine.load(1_000_000);
    assert_eq!((load.num_running_reqs, load.num_used_tokens), (0, 12));
    assert_eq!((load.token_usage, load.num_evictable_blocks), (3.0 / 8.0, 0));

    let mut out = Vec::new();
    // The id stays taken while its KV is held.
    engine.submit(1_000_000, request(1, tokens(50, 4), 1), &mut out);
    assert_eq!(out, [EngineOutput::Rejected { id: 1, reason: RejectReason::DuplicateId }]);
    // 6 blocks needed, 5 free: the request waits on an idle engine until the release.
    engine.submit(1_000_000, request(2, tokens(100, 20), 4), &mut out);
    engine.check_invariants();
    assert_eq!(engine.next_event_time(), None);
    assert_eq!(engine.load(1_000_000).num_waiting_reqs, 1);

    assert!(engine.release_held(2_000_000, 1, &mut out));
    assert!(!engine.release_held(2_000_000, 1, &mut out));
    assert_eq!(engine.held_blocks(1), None);
    engine.check_invariants();
    run_to_idle(&mut engine, &mut out);
    let admitted = out.iter().find_map(|output| match output {
        EngineOutput::Finished { id: 2, stats } => Some(stats.admitted_us),
        _ => None,
    });
    assert_eq!(admitted, Some(2_000_000));
    // The released prompt blocks stayed in the prefix cache.
    assert_eq!(engine.cached_prefix_tokens(&tokens(0, 10)), 8);
    assert_eq!(engine.load(3_000_000).num_used_tokens, 0);
}

#[test]
fn transferred_prompt_decodes_without_prefill() {
    let prompt = tokens(0, 4096);
    let mut engine = Engine::new(EngineConfig::default());
    let mut out = Vec::new();
    engine.submit_as(1_000, request(7, prompt.clone(), 3), PdStage::Decode, &mut out);
    let load = engine.load(1_000);
    // Nothing to prefill; blocks for prompt + output: ceil(4099 / 16) = 257.
    assert_eq!((load.num_waiting_uncached_tokens, load.num_used_tokens), (0, 257 * 16));
    run_to_idle(&mut engine, &mut out);
    // Three decode steps of 6 ms + 0.35 ms x 1, the first giving the first token (a regular
    // request waits 512 ms of prefill first).
    assert_eq!(
        out,
        [
            EngineOutput::FirstToken { id: 7, at: 7_350 },
            EngineOutput::Token { id: 7, at: 13_700 },
            EngineOutput::Token { id: 7, at: 20_050 },
            EngineOutput::Finished {
                id: 7,
                stats: RequestStats {
                    prompt_tokens: 4096,
                    cached_tokens: 0,
                    offloaded_tokens: 0,
                    completion_tokens: 3,
                    arrival_us: 1_000,
                    admitted_us: 1_000,
                    first_token_us: 7_350,
                    finished_us: 20_050,
                },
            },
        ]
    );
    // The transferred prompt entered the prefix cache at admission.
    let batches = engine.drain_kv_events();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].timestamp_us, 1_000);
    assert!(matches!(&batches[0].events[..],
        [KvEvent::BlockStored { block_hashes, parent_block_hash: None, .. }] if block_hashes.len() == 256));
    assert_eq!(engine.cached_prefix_tokens(&prompt), 4096);
}

#[test]
fn transferred_request_joins_a_running_decode_batch() {
    for emit_token_events in [true, false] {
        let config = EngineConfig { emit_token_events, ..EngineConfig::default() };
        let (_, trace) = simulate(
            config,
            vec![
                Action::Submit(0, request(1, tokens(0, 16), 100)),
                Action::SubmitAs(100_000, request(2, tokens(10_000, 800), 2), PdStage::Decode),
            ],
        );
        let transferred = trace.stats(2);
        // Admitted at the end of the decode step running at 100 ms; no 100 ms of prefill.
        assert!((100_000..106_700).contains(&transferred.admitted_us), "{transferred:?}");
        assert_eq!(transferred.first_token_us, transferred.admitted_us + 6_700);
        assert_eq!(transferred.finished_us, transferred.admitted_us + 2 * 6_700);
        let first_tokens: Vec<u64> = trace
            .outputs
            .iter()
            .filter_map(|output| match output {
                EngineOutput::FirstToken { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        assert_eq!(first_tokens, [1, 2]);
        let tokens_of_2 =
            trace.outputs.iter().filter(|o| matches!(o, EngineOutput::Token { id: 2, .. })).count();
        assert_eq!(tokens_of_2, usize::from(emit_token_events));
    }
}

fn pd_workload_strategy() -> impl Strategy<Value = Vec<Action>> {
    let stage = prop::sample::select(vec![PdStage::Regular, PdStage::Prefill, PdStage::Decode]);
    let action = (0u64..3_000_000, 0u64..30, 0u32..4, 1u32..150, 1u32..40, stage, 0u32..10).prop_map(
        |(at, id, family, len, output, stage, kind)| match kind {
            0 => Action::Cancel(at, id),
            1..=2 => Action::Release(at, id),
            _ => Action::SubmitAs(at, request(id, tokens(family * 10_000, len), output), stage),
        },
    );
    prop::collection::vec(action, 1..60).prop_map(|mut actions| {
        actions.sort_by_key(Action::at);
        actions
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn held_kv_is_accounted_and_everything_drains_once_released(actions in pd_workload_strategy()) {
        // `simulate` checks token_usage in [0, 1] and the block accounting after every call.
        let (mut engine, _) = simulate(tight_config(), actions);
        let mut out = Vec::new();
        let mut now = 10_000_000;
        for _ in 0..100 {
            if engine.num_requests() == 0 && engine.num_held() == 0 {
                break;
            }
            for id in 0..30 {
                engine.release_held(now, id, &mut out);
                engine.check_invariants();
            }
            run_to_idle(&mut engine, &mut out);
            now = engine.next_event_time().unwrap_or(now).max(now) + 1_000_000;
        }
        prop_assert_eq!((engine.num_requests(), engine.num_held()), (0, 0));
        prop_assert_eq!(engine.load(u64::MAX / 2).token_usage, 0.0);
    }

    #[test]
    fn pd_runs_are_deterministic(actions in pd_workload_strategy()) {
        let first = simulate(tight_config(), actions.clone()).1;
        let second = simulate(tight_config(), actions).1;
        prop_assert_eq!(first, second);
    }
}
