//! The fleet the fleet-size benches decide over (kvgate-policy's `Policy::decide` and
//! kvgate-route's plan, `benches/fleet.rs` in each): `n_workers` workers known to the policy,
//! each with a few requests in flight and a fresh load sample drawn from a seeded RNG, the
//! prompts of four conversations per worker, and the clock that refreshes every sample once a
//! simulated second, as the load monitor does.

use std::sync::Arc;

use kvgate_policy::{
    build_policy, Candidate, LoadSample, Policy, PolicyConfig, PolicyKind, RouteRequest, RoutingKey,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The clock at the start, in ms.
pub const NOW_MS: u64 = 1_000_000;
pub const CONVERSATIONS_PER_WORKER: usize = 4;

/// The policy `kind` over workers `0..n_workers`, their candidates, and the RNG the decisions
/// go on drawing from (seed 7). Env: `KVGATE_BENCH_KV_LEARN=0` turns kv_aware's rate learner off.
pub fn fleet(
    kind: PolicyKind,
    n_workers: usize,
) -> (PolicyConfig, Arc<dyn Policy>, Vec<Candidate>, SmallRng) {
    // `KVGATE_BENCH_KV_LEARN=0`: kv_aware without its rate learner (what the learner costs).
    let learn = std::env::var("KVGATE_BENCH_KV_LEARN").map_or(true, |learn| learn != "0");
    let config = PolicyConfig { policy: kind, kv_aware_learn_prefill_rate: learn, ..PolicyConfig::default() };
    let policy = build_policy(&config);
    for worker in 0..n_workers {
        policy.add_worker(worker as u32, &format!("http://127.0.0.1:{}", 20000 + worker));
    }
    let mut rng = SmallRng::seed_from_u64(7);
    let candidates = (0..n_workers)
        .map(|worker| Candidate {
            id: worker as u32,
            in_flight: rng.random_range(0..4),
            load: Some(LoadSample {
                token_usage: rng.random_range(0.1..0.6),
                num_running_reqs: rng.random_range(0..8),
                num_waiting_reqs: 0,
                num_waiting_uncached_tokens: rng.random_range(0..2000),
                gen_throughput: 1000.0,
                max_total_num_tokens: 100_000,
                fetched_at_ms: NOW_MS - 200,
            }),
        })
        .collect();
    (config, policy, candidates, rng)
}

/// Turn `turn` of conversation `conversation`: one of 16 system prompts, then every turn so far.
pub fn prompt(conversation: usize, turn: usize) -> String {
    let mut text = format!("system prompt {} ", conversation % 16).repeat(40);
    for t in 0..=turn {
        text.push_str(&format!("user {conversation} turn {t}: tell me about topic {} please. ", t * 7));
    }
    text
}

/// The request for `text` (a token per four bytes).
pub fn request(text: &str) -> RouteRequest<'_> {
    RouteRequest { key: RoutingKey::Text(text), prompt_tokens: text.len() as u64 / 4, session: None }
}

/// One millisecond on; every sample refreshed once a simulated second.
pub fn tick(now_ms: &mut u64, candidates: &mut [Candidate]) {
    *now_ms += 1;
    if now_ms.is_multiple_of(1000) {
        for load in candidates.iter_mut().filter_map(|c| c.load.as_mut()) {
            load.fetched_at_ms = *now_ms;
        }
    }
}
