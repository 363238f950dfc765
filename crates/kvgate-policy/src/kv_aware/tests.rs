//! kv_aware decision tests: queued work, cached prefixes, the overload ceiling (property), the
//! fluid queue between load samples, and temperature sampling.

use kvgate_index::ApproxIndex;
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::*;
use crate::{LoadSample, PolicyKind, PromptKey, RoutingKey};

const POLL_MS: u64 = 1000;
const NOW: u64 = 10_000;

fn config() -> PolicyConfig {
    PolicyConfig { policy: PolicyKind::KvAware, ..PolicyConfig::default() }
}

/// Candidates 0.. with fresh samples: (pending prefill tokens, KV usage).
fn pool(samples: &[(u64, f64)]) -> Vec<Candidate> {
    samples
        .iter()
        .enumerate()
        .map(|(i, &(waiting, kv))| Candidate {
            id: i as u32,
            in_flight: 0,
            load: Some(LoadSample {
                num_waiting_uncached_tokens: waiting,
                token_usage: kv,
                max_total_num_tokens: 1_000_000,
                fetched_at_ms: NOW,
                ..LoadSample::default()
            }),
        })
        .collect()
}

struct Harness {
    policy: KvAwarePolicy,
    index: ApproxIndex,
    rng: SmallRng,
    now_ms: u64,
}

impl Harness {
    fn new(config: PolicyConfig) -> Self {
        Self {
            index: ApproxIndex::new(config.tree_settings()),
            policy: KvAwarePolicy::new(&config),
            rng: SmallRng::seed_from_u64(3),
            now_ms: NOW,
        }
    }

    /// Routes `tokens` (a prompt of token ids, 1 per element).
    fn route(&mut self, tokens: &[u32], candidates: &[Candidate]) -> Decision {
        let request = RouteRequest {
            key: RoutingKey::Tokens(tokens),
            prompt_tokens: tokens.len() as u64,
            session: None,
        };
        let mut ctx = SelectContext {
            now_ms: self.now_ms,
            load_poll_interval_ms: POLL_MS,
            rng: &mut self.rng,
            prefix_index: Some(&self.index),
        };
        crate::test_support::route(&self.policy, &request, Candidates::new(candidates).unwrap(), &mut ctx)
    }
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 100_000 + i).collect()
}

#[test]
fn the_engine_with_the_least_queued_prefill_wins() {
    let mut h = Harness::new(config());
    let d = h.route(&prompt(1, 1600), &pool(&[(16_000, 0.1), (800, 0.1), (8_000, 0.1)]));
    assert_eq!((d.worker, d.reason), (1, Reason::KvAware));
    let p = d.predicted.unwrap();
    assert!((p.queue_s - 0.1).abs() < 1e-9 && (p.prefill_s - 0.2).abs() < 1e-9, "{p:?}");
    // The runner-up: the engine with 8,000 tokens queued (1 s), the same prefill and KV terms.
    assert!((p.runner_up_s.unwrap() - (1.0 + p.prefill_s + p.kv_s)).abs() < 1e-9, "{p:?}");
    let alone = h.route(&prompt(2, 1600), &pool(&[(0, 0.1)]));
    assert_eq!(alone.predicted.unwrap().runner_up_s, None, "one candidate: no runner-up");
}

#[test]
fn a_cached_prefix_is_worth_its_prefill_time_and_no_more() {
    // Weight 0: the predicted time to first token alone.
    let mut h = Harness::new(PolicyConfig { kv_aware_prefill_cost_weight: 0.0, ..config() });
    let conversation = prompt(7, 8_000);
    h.index.record(PromptKey::Tokens(&conversation), 2, NOW);
    // Equal queues: the holder saves 8,000 tokens of prefill (1 s).
    let d = h.route(&conversation, &pool(&[(0, 0.1), (0, 0.1), (0, 0.1)]));
    assert_eq!(d.worker, 2);
    assert_eq!(d.matches.unwrap().chosen_match_rate, 1.0);
    // The conversation's next turns (not the same prompt again: a sample of the prompt routed
    // moments ago would follow it).
    let turn = |n: u32| -> Vec<u32> { conversation.iter().copied().chain(prompt(20 + n, 8)).collect() };
    // The holder has 0.5 s of work queued: still sooner.
    assert_eq!(h.route(&turn(1), &pool(&[(0, 0.1), (0, 0.1), (4_000, 0.1)])).worker, 2);
    // 2 s queued on the holder: prefilling elsewhere is sooner.
    let d = h.route(&turn(2), &pool(&[(0, 0.1), (1_000, 0.1), (16_000, 0.1)]));
    assert_eq!(d.worker, 0);
    assert_eq!(d.matches.unwrap().chosen_match_rate, 0.0);
}

/// A prefix held only in host memory loads back: it saves its tier's weight of the prefill, not
/// all of it (the prediction over the exact index with the default `--kv-tier-weights`).
#[test]
fn a_prefix_in_host_memory_saves_its_tier_weight_of_the_prefill() {
    let config = PolicyConfig { kv_aware_prefill_cost_weight: 0.0, ..config() };
    let index = std::sync::Arc::new(config.block_index());
    let mut cache =
        kvgate_index::CacheBlocks::new(index.clone(), kvgate_index::CacheId { worker: 2, rank: 0 });
    let conversation = prompt(7, 8_000);
    let hashes: Vec<u64> = (0..500).collect();
    let cpu = kvgate_index::Residency::of(Some("CPU"), None, None);
    let stored = kvgate_index::StoredBlocks {
        group: 0,
        block_hashes: &hashes,
        parent_block_hash: None,
        token_ids: &conversation,
        block_size: 16,
        lookahead: &[],
        opaque: &[],
        namespace: kvgate_index::Namespace::BASE,
        residency: &cpu,
    };
    cache.apply_stored(stored).unwrap();
    let policy = KvAwarePolicy::new(&config);
    let mut rng = SmallRng::seed_from_u64(3);
    let request =
        RouteRequest { key: RoutingKey::Tokens(&conversation), prompt_tokens: 8_000, session: None };
    let mut ctx = SelectContext {
        now_ms: NOW,
        load_poll_interval_ms: POLL_MS,
        rng: &mut rng,
        prefix_index: Some(&*index),
    };
    let candidates = pool(&[(0, 0.1), (0, 0.1), (0, 0.1)]);
    let d = crate::test_support::route(&policy, &request, Candidates::new(&candidates).unwrap(), &mut ctx);
    assert_eq!(d.worker, 2);
    let p = d.predicted.unwrap();
    // 8,000 tokens at 8,000 tokens/s is 1 s of prefill; from host memory (weight 0.95) 5% of it,
    // for the 7,984 tokens the engine serves from cache (all but the last block: the last token
    // is always computed), the last 16 in full.
    assert!((p.prefill_s - (7_984.0 * 0.05 + 16.0) / 8_000.0).abs() < 1e-4, "{p:?}"); // credit in whole tokens
    assert_eq!(d.matches.unwrap().chosen_match_rate, 7_984.0 / 8_000.0);
}

#[test]
fn recomputing_a_prefix_costs_more_than_its_own_wait() {
    // The default weight 8: recomputing 1 s of prefill elsewhere costs 9 s.
    let mut h = Harness::new(config());
    let conversation = prompt(7, 8_000);
    h.index.record(PromptKey::Tokens(&conversation), 2, NOW);
    let d = h.route(&conversation, &pool(&[(0, 0.1), (1_000, 0.1), (16_000, 0.1)]));
    assert_eq!(d.worker, 2, "2 s of queue is worth waiting for");
    let p = d.predicted.unwrap();
    assert_eq!((p.queue_s, p.prefill_s), (2.0, 0.0));
    let d = h.route(&conversation, &pool(&[(0, 0.1), (1_000, 0.1), (80_000, 0.1)]));
    assert_eq!(d.worker, 0, "10 s of queue is not");
}

#[test]
fn routed_prompts_fill_an_engines_queue_until_its_next_report() {
    let mut h = Harness::new(config());
    let candidates = pool(&[(0, 0.1), (0, 0.1)]);
    let mut chosen = Vec::new();
    for i in 0..6 {
        chosen.push(h.route(&prompt(i, 4_000), &candidates).worker);
    }
    // Without the routed prompts, every request would tie on idle engines; with them, the
    // queues alternate.
    assert_eq!(chosen.iter().filter(|&&w| w == 0).count(), 3, "{chosen:?}");
    // Time drains the queues at the prefill rate: 3 s later (the reports still fresh) both are
    // empty again.
    h.now_ms += 3_000;
    let d = h.route(&prompt(99, 800), &candidates);
    assert_eq!(d.predicted.unwrap().queue_s, 0.0);
}

#[test]
fn temperature_spreads_near_equal_choices_and_zero_does_not() {
    let spread = |temperature: f64| {
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..40 {
            let mut h = Harness::new(PolicyConfig { router_temperature: temperature, ..config() });
            h.rng = SmallRng::seed_from_u64(seed);
            // 0.10 s, 0.11 s and 10 s of queue.
            seen.insert(
                h.route(&prompt(seed as u32, 160), &pool(&[(800, 0.1), (880, 0.1), (80_000, 0.1)])).worker,
            );
        }
        seen
    };
    assert_eq!(spread(0.0), [0].into(), "temperature 0 is the argmin");
    assert_eq!(spread(0.5), [0, 1].into(), "near-equal engines share, the far one never wins");
}

proptest::proptest! {
    /// Never an engine above the overload ceiling while one below exists, whatever the queues.
    #[test]
    fn never_above_the_ceiling_while_one_below_exists(
        samples in proptest::collection::vec((0u64..200_000, 0.0f64..1.0), 1..8),
        cached in 0usize..8,
        temperature in proptest::prop_oneof![proptest::strategy::Just(0.0), 0.0f64..2.0],
    ) {
        let mut h = Harness::new(PolicyConfig {
            overload_token_usage_threshold: 0.8,
            router_temperature: temperature,
            ..config()
        });
        let conversation = prompt(3, 4_000);
        h.index.record(PromptKey::Tokens(&conversation), (cached % samples.len()) as u32, NOW);
        let candidates = pool(&samples);
        let d = h.route(&conversation, &candidates);
        let kv = samples[d.worker as usize].1;
        let below_exists = samples.iter().any(|&(_, k)| k <= 0.8);
        proptest::prop_assert!(kv <= 0.8 || !below_exists, "chose KV {kv} with {samples:?}");
    }
}

proptest::proptest! {
    /// The wait margin: never an engine whose queued prefill alone exceeds the margin times the
    /// best predicted time to first token elsewhere, plus the slack, however long the prefix it
    /// holds (a bound on the best from above: every prompt counted uncached).
    #[test]
    fn never_waits_past_the_margin_for_a_holder(
        queues in proptest::collection::vec(0u64..600_000, 2..8),
        kv in proptest::collection::vec(0.0f64..0.9, 8),
        holder in 0usize..8,
        prompt_len in 1_000u32..40_000,
        margin in 1.0f64..6.0,
        slack_ms in 0.0f64..2_000.0,
    ) {
        let rate = 8_000.0;
        let mut h = Harness::new(PolicyConfig {
            kv_aware_learn_prefill_rate: false,
            kv_aware_prefill_tokens_per_sec: rate,
            kv_aware_wait_margin: margin,
            kv_aware_wait_slack_ms: slack_ms,
            ..config()
        });
        let conversation = prompt(5, prompt_len);
        let holder = (holder % queues.len()) as u32;
        h.index.record(PromptKey::Tokens(&conversation), holder, NOW);
        let samples: Vec<(u64, f64)> = queues.iter().zip(&kv).map(|(&q, &k)| (q, k)).collect();
        let d = h.route(&conversation, &pool(&samples));
        let settings = config();
        let best_upper = samples
            .iter()
            .map(|&(q, k)| {
                (q as f64 + prompt_len as f64) / rate + settings.kv_aware_kv_pressure_weight * k / (1.0 - k)
            })
            .fold(f64::INFINITY, f64::min);
        let queue_s = samples[d.worker as usize].0 as f64 / rate;
        proptest::prop_assert!(
            queue_s <= margin * best_upper + slack_ms / 1000.0 + 1e-9,
            "chose {} (queue {queue_s:.2} s) with best <= {best_upper:.2} s, margin {margin}: {samples:?}",
            d.worker
        );
        if d.worker != holder && samples[holder as usize].0 as f64 / rate > margin * best_upper + slack_ms / 1000.0 {
            proptest::prop_assert_eq!(d.reason, Reason::KvAwareReplicate);
        }
    }
}

/// Candidates 0.. with fresh samples of a 1,000,000-token KV: (KV usage, running, waiting,
/// tokens generated per second).
fn kv_pool(samples: &[(f64, u64, u64, f64)]) -> Vec<Candidate> {
    samples
        .iter()
        .enumerate()
        .map(|(i, &(usage, running, waiting, gen))| Candidate {
            id: i as u32,
            in_flight: 0,
            load: Some(LoadSample {
                token_usage: usage,
                num_running_reqs: running,
                num_waiting_reqs: waiting,
                gen_throughput: gen,
                max_total_num_tokens: 1_000_000,
                fetched_at_ms: NOW,
                ..LoadSample::default()
            }),
        })
        .collect()
}

/// An agent's session stays with the engine holding its context unless waiting there for KV
/// costs more than recomputing the context elsewhere (issue 41; S11's holders of popular
/// contexts). Engine 1 holds the 80,000-token context (10 s of prefill elsewhere), its KV 90%
/// taken by 40 running requests; engine 0 is idle. A request holds 22,222 tokens (the pool's
/// 1,000,000 in use over 45 running); KV is freed at the decode rate's floor, 2,857 tokens a
/// second. While the holder waits for KV, a copy of the context on the idle engine is charged
/// its prefill and what queues behind it, not the duplicate (`relieve_waiting_holders`).
#[test]
fn an_agent_stays_with_its_context_unless_waiting_for_kv_there_costs_more_than_recomputing() {
    let mut h = Harness::new(config());
    let context = prompt(5, 80_000);
    h.index.record(PromptKey::Tokens(&context), 1, NOW);
    // Four wait on the holder: with this one they need 11,111 tokens beyond the free 100,000
    // (3.9 s), against 10 s of prefill elsewhere.
    let d = h.route(&context, &kv_pool(&[(0.1, 5, 0, 500.0), (0.9, 40, 4, 2_000.0)]));
    assert_eq!(d.worker, 1);
    let p = d.predicted.unwrap();
    assert!((p.kv_wait_s - 11_111.1 / 2_857.1).abs() < 0.01, "{p:?}");
    assert!((p.total() - p.queue_s - p.prefill_s - p.decode_s - p.kv_s - p.kv_wait_s).abs() < 1e-9);
    // Ten requests wait there for KV: 256,444 tokens to free, 90 s. Recomputing is cheaper.
    let mut h = Harness::new(config());
    h.index.record(PromptKey::Tokens(&context), 1, NOW);
    let d = h.route(&context, &kv_pool(&[(0.1, 5, 0, 500.0), (0.99, 40, 10, 2_000.0)]));
    assert_eq!(d.worker, 0);
    assert_eq!(d.predicted.unwrap().kv_wait_s, 0.0, "the idle engine has room");
    // A snapshot without the KV capacity never drives the wait.
    let mut unknown = kv_pool(&[(0.1, 5, 0, 500.0), (0.99, 40, 10, 2_000.0)]);
    unknown[0].load.as_mut().unwrap().max_total_num_tokens = 0;
    assert!(h.route(&context, &unknown).predicted.unwrap().kv_wait_s == 0.0);
}

/// Requests routed to an engine since its report count at what a running request holds, on an
/// engine with room too: each takes KV for its answer, even a sample of a prompt cached there
/// (S10: a burst of samples piled onto the holder of their prompt, its wait predicted at 0).
#[test]
fn requests_routed_since_the_report_take_kv_on_every_engine() {
    let mut h = Harness::new(config());
    let question = prompt(9, 100);
    h.index.record(PromptKey::Tokens(&question), 0, NOW);
    // 900,000 in use by 30 running (30,000 each), nothing waiting: three more fit in the
    // 100,000 free, the fourth waits for 20,000 to be freed.
    let room = kv_pool(&[(0.9, 30, 0, 2_000.0)]);
    let waits: Vec<f64> = (0..5).map(|_| h.route(&question, &room).predicted.unwrap().kv_wait_s).collect();
    assert_eq!(&waits[..3], &[0.0; 3], "{waits:?}");
    assert!(waits[3] > 0.0 && waits[4] > waits[3], "{waits:?}");
    // Four waiting need 120,000 of the 100,000 free: each request routed since queues behind them.
    let mut h = Harness::new(config());
    h.index.record(PromptKey::Tokens(&question), 0, NOW);
    let taken = kv_pool(&[(0.9, 30, 4, 2_000.0)]);
    let waits: Vec<f64> = (0..3).map(|_| h.route(&question, &taken).predicted.unwrap().kv_wait_s).collect();
    assert!(waits[0] > 0.0 && waits[1] > waits[0] && waits[2] > waits[1], "{waits:?}");
    assert!((waits[1] - waits[0] - 30_000.0 / 2_857.1).abs() < 0.01, "{waits:?}");
}

/// A full engine frees the KV its running requests hold as fast as the pool finishes them
/// (each frees its prompt and its answer), when that beats the tokens generated over the KV in
/// use (a lower bound); either alone when the other is unknown.
#[test]
fn kv_is_freed_as_fast_as_the_pool_finishes_requests() {
    let report = |running| LoadSample {
        token_usage: 0.9,
        num_running_reqs: running,
        max_total_num_tokens: 1_000_000,
        ..LoadSample::default()
    };
    let (busy, quiet) = (report(30), report(10));
    // 3 + 1 of their 40 running requests finish a second: a tenth.
    let finished = crate::kv_wait::kv_finished_share([(&busy, Some(3.0)), (&quiet, Some(1.0))]);
    assert_eq!(finished, Some(0.1));
    assert_eq!(crate::kv_wait::kv_finished_share([(&busy, None), (&quiet, Some(1.0))]), Some(0.1));
    assert_eq!(crate::kv_wait::kv_finished_share([(&busy, None)]), None, "not measured yet");
    assert_eq!(pool_freed_share(Some(0.01), finished), Some(0.1));
    assert_eq!(pool_freed_share(Some(0.2), finished), Some(0.2), "never below the tokens generated");
    assert_eq!(pool_freed_share(Some(0.01), None), Some(0.01));
    assert_eq!(pool_freed_share(None, finished), Some(0.1));
    assert_eq!(pool_freed_share(None, None), None);
}

/// The settings of the relief tests: the duplicate charged 8x its prefill.
fn relief_settings() -> PredictSettings {
    PredictSettings {
        kv_pressure_weight: 0.0,
        prefill_cost_weight: 8.0,
        queue_cost_weight: 1.0,
        decode_stall_weight: 0.0,
    }
}

/// A scored candidate of the relief tests, charged 10x its prefill for recomputing it.
fn relief_candidate(predicted: PredictedTtft, running: u64, routed_load: f64) -> Scored {
    let predicted = PredictedTtft { recompute_s: predicted.prefill_s * 10.0, ..predicted };
    Scored {
        predicted,
        uncached: 0.0,
        allowed: true,
        waits_too_long: false,
        followers: 0.0,
        held: 0,
        running,
        routed_load,
    }
}

/// Each candidate's recompute charge after the relief.
fn recompute(scored: &[Scored]) -> Vec<f64> {
    scored.iter().map(|s| s.predicted.recompute_s).collect()
}

/// While every holder of the prompt waits for KV, an engine that admits the request now (no
/// wait for KV, no prefill queued) is not charged for duplicating the prefix (the queue behind
/// its prefill still is); a holder that admits it now keeps the charge everywhere.
#[test]
fn a_prefix_whose_holders_wait_for_kv_is_worth_copying() {
    let settings = relief_settings();
    let scored = |kv_wait_s: f64, prefill_s: f64| {
        relief_candidate(PredictedTtft { prefill_s, kv_wait_s, ..PredictedTtft::default() }, 1, 0.0)
    };
    // Two holders waiting 20 and 30 s; without the prefix, a free engine, one waiting for KV
    // and one with prefill queued.
    let mut queued = scored(0.0, 4.0);
    queued.predicted.queue_s = 2.0;
    let mut all = vec![scored(20.0, 0.1), scored(30.0, 0.1), scored(0.0, 4.0), scored(5.0, 4.0), queued];
    relieve_waiting_holders(&mut all, [100, 100, 0, 0, 0].into_iter(), settings);
    assert_eq!(
        recompute(&all),
        vec![1.0, 1.0, 8.0, 40.0, 40.0],
        "only the free engine's copy is free of charge"
    );
    let mut one_admits = vec![scored(20.0, 0.1), scored(0.0, 0.1), scored(0.0, 4.0)];
    relieve_waiting_holders(&mut one_admits, [100, 100, 0].into_iter(), settings);
    assert_eq!(recompute(&one_admits), vec![1.0, 1.0, 40.0]);
    let mut nobody_holds = vec![scored(20.0, 4.0), scored(0.0, 4.0)];
    relieve_waiting_holders(&mut nobody_holds, [0, 0].into_iter(), settings);
    assert_eq!(recompute(&nobody_holds), vec![40.0, 40.0]);
}

/// An overloaded holder (more prefill routed to it over the last four polls than it computes in
/// that time) does not keep its sessions from an idle engine that would answer sooner, the whole
/// prompt recomputed: the copy there is not charged the duplicate (issue 41's agents, open loop:
/// every session of a popular application stayed on its holder, engines idle beside it). A
/// holder whose queue drains, a busy engine, or a copy slower than the holder keep the charge.
#[test]
fn an_overloaded_holder_is_relieved_by_an_idle_engine_that_answers_sooner() {
    let settings = relief_settings();
    let scored = |queue_s: f64, prefill_s: f64, running: u64, routed_load: f64| {
        relief_candidate(
            PredictedTtft { queue_s, prefill_s, ..PredictedTtft::default() },
            running,
            routed_load,
        )
    };
    // The holder: 11 s queued, 0.5 s of its own prefill, 1.5x its prefill rate routed to it.
    // Without the context: an idle engine (6 s to recompute it), a busy one, a slow idle one.
    let mut all = vec![
        scored(11.0, 0.5, 30, 1.5),
        scored(0.0, 6.0, 0, 0.0),
        scored(0.0, 6.0, 3, 0.2),
        scored(0.0, 12.0, 0, 0.0),
    ];
    relieve_waiting_holders(&mut all, [100, 0, 0, 0].into_iter(), settings);
    assert_eq!(recompute(&all), vec![5.0, 12.0, 60.0, 120.0], "only the idle engine that answers sooner");
    // The same queue on a holder that drains it (half its rate routed to it): charged as ever.
    let mut drains = vec![scored(11.0, 0.5, 30, 0.5), scored(0.0, 6.0, 0, 0.0)];
    relieve_waiting_holders(&mut drains, [100, 0].into_iter(), settings);
    assert_eq!(recompute(&drains), vec![5.0, 60.0]);
    // Two holders, one of them not overloaded: no relief.
    let mut one_drains =
        vec![scored(11.0, 0.5, 30, 1.5), scored(11.0, 0.5, 30, 0.9), scored(0.0, 6.0, 0, 0.0)];
    relieve_waiting_holders(&mut one_drains, [100, 100, 0].into_iter(), settings);
    assert_eq!(recompute(&one_drains), vec![5.0, 5.0, 60.0]);
}

/// The samples of one prompt routed at once stay together: the prompt routed to an engine
/// moments ago is computed there once, ahead of them, though no index shows it yet (the exact
/// index learns it when the engine reports it stored: S10's samples spread over the pool).
#[test]
fn samples_of_one_prompt_follow_it_before_the_engine_reports_it() {
    let config = config();
    let policy = KvAwarePolicy::new(&config);
    let mut rng = SmallRng::seed_from_u64(3);
    let sample = prompt(4, 6_000);
    let idle = pool(&[(0, 0.0), (0, 0.0), (0, 0.0)]);
    let mut route = || {
        let request = RouteRequest { key: RoutingKey::Tokens(&sample), prompt_tokens: 6_000, session: None };
        let mut ctx =
            SelectContext { now_ms: NOW, load_poll_interval_ms: POLL_MS, rng: &mut rng, prefix_index: None };
        crate::test_support::route(&policy, &request, Candidates::new(&idle).unwrap(), &mut ctx)
    };
    let first = route();
    assert_eq!(first.uncached_tokens, Some(6_000.0));
    for _ in 0..8 {
        let next = route();
        assert_eq!((next.worker, next.uncached_tokens), (first.worker, Some(0.0)));
    }
}

/// A sample stays with its prompt though another engine holding most of it is predicted
/// sooner: the prompt's decision placed its samples, and a sample weighed alone left it (S10 at
/// full size: 223 of 756 prompts' samples split over engines, a third more prompt tokens
/// computed, the samples that left waiting longer). Once waiting there is predicted beyond the
/// wait margin (4x the best + 1 s by default), or the engine is above the overload ceiling, the
/// sample is weighed as any request: a flood of one prompt does not drown its engine.
#[test]
fn a_sample_stays_with_its_prompt_while_its_engine_may_be_chosen() {
    // Engines 0.. with fresh samples: (queued prefill tokens, KV usage, running, waiting).
    let engines = |samples: &[(u64, f64, u64, u64)]| -> Vec<Candidate> {
        samples
            .iter()
            .enumerate()
            .map(|(i, &(queued, usage, running, waiting))| Candidate {
                id: i as u32,
                in_flight: 0,
                load: Some(LoadSample {
                    num_waiting_uncached_tokens: queued,
                    token_usage: usage,
                    num_running_reqs: running,
                    num_waiting_reqs: waiting,
                    gen_throughput: 2_000.0,
                    max_total_num_tokens: 1_000_000,
                    fetched_at_ms: NOW,
                }),
            })
            .collect()
    };
    let family = |n: u32| -> Vec<u32> { prompt(1, 7_680).into_iter().chain(prompt(10 + n, 300)).collect() };
    let idle = (0, 0.1, 5, 0);
    // A task family's first prompt on one engine; its second on the other (the first engine
    // waiting a minute for KV), which then holds the prompt and the first engine its family.
    let route_sample = |prompts_engine: (u64, f64, u64, u64), config: PolicyConfig| {
        let mut h = Harness::new(config);
        let first = h.route(&family(1), &engines(&[idle, idle])).worker as usize;
        let mut reports = [idle; 2];
        reports[first] = (0, 0.99, 40, 10);
        let holder = h.route(&family(2), &engines(&reports)).worker as usize;
        assert_ne!(holder, first);
        // The family's engine has 1 s of prefill queued; the prompt's engine reports `prompts_engine`.
        let mut reports = [(8_000, 0.1, 5, 0); 2];
        reports[holder] = prompts_engine;
        (holder, h.route(&family(2), &engines(&reports)))
    };
    // The prompt's engine: KV 90% taken, one request waiting, predicted 2.5 s against 2.0 s on
    // the family's engine (its queue and 300 tokens to compute there, cost 2.3 s), within the
    // margin (4 x 2.0 + 1 s).
    let (holder, sample) = route_sample((0, 0.9, 40, 1), config());
    let predicted = sample.predicted.unwrap();
    assert_eq!((sample.worker as usize, sample.uncached_tokens), (holder, Some(0.0)), "{predicted:?}");
    assert!(predicted.total() > 2.0, "{predicted:?}");
    // Ten requests waiting for KV there: a wait of a minute and more, past the margin.
    let (holder, sample) = route_sample((0, 0.99, 40, 10), config());
    assert_ne!(sample.worker as usize, holder, "{:?}", sample.predicted);
    // Above the overload ceiling, the sample leaves.
    let ceiling = PolicyConfig { overload_token_usage_threshold: 0.85, ..config() };
    let (holder, sample) = route_sample((0, 0.9, 40, 1), ceiling);
    assert_ne!(sample.worker as usize, holder);
}

/// A new prompt's decision places the samples that will follow it too: its predicted wait
/// counts once per request expected to follow it (the pool's recent followers per leading
/// request), so a holder of its prefix with a queue loses to an idle engine sooner when whole
/// groups of samples arrive (S10: a task family's new prompts queued 3 s deep on the one
/// engine holding the family's prefix while another got none).
#[test]
fn a_prompt_sampled_n_times_weighs_its_wait_n_times() {
    let family = prompt(5, 8_000);
    let new_prompt: Vec<u32> = family.iter().copied().chain(prompt(6, 1_000)).collect();
    // Engine 2 holds the family's prefix behind 3 s of queued prefill; 0 and 1 are idle.
    let candidates = pool(&[(0, 0.1), (0, 0.1), (24_000, 0.1)]);
    let mut alone = Harness::new(config());
    alone.index.record(PromptKey::Tokens(&family), 2, NOW);
    let d = alone.route(&new_prompt, &candidates);
    assert_eq!(d.worker, 2, "one request: 3 s of queue is cheaper than recomputing 8,000 tokens");

    let mut sampled = Harness::new(config());
    sampled.index.record(PromptKey::Tokens(&family), 2, NOW);
    let other = prompt(7, 3_000);
    let first = sampled.route(&other, &candidates).worker;
    for _ in 0..11 {
        assert_eq!(sampled.route(&other, &candidates).worker, first, "the samples stay together");
    }
    let d = sampled.route(&new_prompt, &candidates);
    assert!(d.worker != 2 && d.worker != first, "12 requests wait 3 s there: {d:?}");
    assert_eq!(d.uncached_tokens, Some(9_000.0));
}

/// The first sample to follow a prompt is admitted while the prompt's prefill still runs and
/// computes again what is still queued of it: the engine's queue counts that work (S10's
/// followers computed 235K tokens the queue never had), though the decision charges it nothing
/// (the samples go where the prompt went). Later samples, and a first one arriving once the
/// prompt is computed, add nothing.
#[test]
fn the_first_sample_to_follow_a_prompt_computes_what_is_still_queued_of_it() {
    let candidates = pool(&[(0, 0.1), (0, 0.1)]);
    let queued_on = |h: &Harness, worker: WorkerId| {
        let state = h.policy.lock();
        let engine = candidates.iter().find(|c| c.id == worker).unwrap();
        queued_tokens(engine, engine.load.as_ref(), &state.routed, h.now_ms, 8_000.0)
    };
    let sampled = prompt(8, 3_000);
    let mut h = Harness::new(config());
    let leader = h.route(&sampled, &candidates);
    assert_eq!(leader.uncached_tokens, Some(3_000.0));
    for _ in 0..3 {
        let follower = h.route(&sampled, &candidates);
        assert_eq!((follower.worker, follower.uncached_tokens), (leader.worker, Some(0.0)));
    }
    assert_eq!(queued_on(&h, leader.worker), 6_000.0, "the prompt, and once more for the first follower");

    // 0.25 s later, 1,000 of the prompt's 3,000 tokens are still queued: the first follower
    // computes those again.
    let mut late = Harness::new(config());
    let leader = late.route(&sampled, &candidates);
    late.now_ms += 250;
    late.route(&sampled, &candidates);
    assert_eq!(queued_on(&late, leader.worker), 2_000.0);
    // Once the prompt is computed, nothing.
    let mut done = Harness::new(config());
    let leader = done.route(&sampled, &candidates);
    done.now_ms += 500;
    done.route(&sampled, &candidates);
    assert_eq!(queued_on(&done, leader.worker), 0.0);
}

#[test]
fn the_learned_kv_wait_scale_multiplies_the_models_wait() {
    // A full engine (50 running, 10 waiting): the model's wait is what kv_wait.rs says; the
    // learned scale (rate/kv_wait_scale.rs) multiplies it.
    let load = LoadSample {
        token_usage: 1.0,
        num_running_reqs: 50,
        num_waiting_reqs: 10,
        gen_throughput: 1_000.0,
        max_total_num_tokens: 100_000,
        ..LoadSample::default()
    };
    let rates = Rates { prefill_tokens_per_sec: 8_000.0, decode_ms_per_request: 2.0, ..Rates::default() };
    let wait = |scale: f64| {
        let rates = Rates { kv_wait_scale: scale, ..rates };
        kv_wait_s(Some(&load), Sent::default(), 2_000.0, Some(0.01), rates, 0.0)
    };
    assert_eq!(wait(1.0), 22.0, "22 requests' KV short, one request's freed a second");
    assert_eq!(wait(2.0), 44.0);
    assert_eq!(kv_wait_s(None, Sent::default(), 2_000.0, Some(0.01), rates, 0.0), 0.0);
}
