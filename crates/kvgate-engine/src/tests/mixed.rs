//! Mixed batching (`EngineConfig::mixed_batching`): the running decodes ride in every prefill
//! step, as vLLM v1's scheduler (`vllm/v1/core/sched/scheduler.py`, main at commit 00024d31:
//! the running requests first, one token per decode, then waiting prompts while `token_budget >
//! 0`) and SGLang's `--enable-mixed-chunk` batch them.

use super::*;

fn token_times(trace: &Trace, id: u64) -> Vec<u64> {
    trace
        .outputs
        .iter()
        .filter_map(|output| match output {
            EngineOutput::Token { id: i, at } if *i == id => Some(*at),
            _ => None,
        })
        .collect()
}

/// A decoding request and a 3,000-token prompt arriving mid-decode: mixed, every prefill step
/// also gives the decode a token, and the prompt's chunks are its budget less that decode's
/// token (2,047 tokens, 255.875 ms, plus a 6.35 ms decode of one; then 953 tokens, 119.125 ms,
/// plus 6.35 ms); unmixed, the decode stalls for the whole prefill.
#[test]
fn mixed_batching_carries_the_decodes_through_the_prefill_steps() {
    let workload = |mixed_batching| {
        let config = EngineConfig { mixed_batching, ..EngineConfig::default() };
        simulate(
            config,
            submits(vec![
                (0, request(1, tokens(0, 16), 200)),
                (100_000, request(2, tokens(10_000, 3000), 1)),
            ]),
        )
        .1
    };
    let mixed = workload(true);
    let b = mixed.stats(2);
    assert_eq!(b.first_token_us, b.admitted_us + 255_875 + 6_350 + 119_125 + 6_350);
    let during_prefill: Vec<u64> = token_times(&mixed, 1)
        .into_iter()
        .filter(|&at| at > b.admitted_us && at <= b.first_token_us)
        .collect();
    assert_eq!(during_prefill, [b.admitted_us + 262_225, b.first_token_us]);

    let unmixed = workload(false);
    let b = unmixed.stats(2);
    assert_eq!(b.first_token_us, b.admitted_us + 375_000);
    assert!(token_times(&unmixed, 1).iter().all(|&at| at <= b.admitted_us || at > b.first_token_us));
    // The same work either way: the decode finishes no later mixed than unmixed.
    assert!(mixed.stats(1).finished_us <= unmixed.stats(1).finished_us);
}

/// With no decode running, a mixed engine's steps are the unmixed engine's.
#[test]
fn mixed_batching_without_decodes_changes_nothing() {
    let prompts =
        || submits(vec![(0, request(1, tokens(0, 3000), 1)), (0, request(2, tokens(10_000, 1000), 1))]);
    let mixed = simulate(EngineConfig { mixed_batching: true, ..EngineConfig::default() }, prompts()).1;
    assert_eq!(mixed, simulate(EngineConfig::default(), prompts()).1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Mixed batching with priority scheduling loses and duplicates nothing, and keeps the
    /// accounting `simulate` checks after every call.
    #[test]
    fn mixed_batching_ends_every_request_once(
        actions in workload_strategy(),
        priorities in prop::collection::vec(-2i32..3, 40),
    ) {
        let config = EngineConfig { mixed_batching: true, priority_scheduling: true, ..tight_config() };
        ends_every_request_once(config, actions, &priorities)?;
    }
}
