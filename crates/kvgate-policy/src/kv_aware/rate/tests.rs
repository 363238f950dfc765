//! The learner: a busy engine teaches its rates, an unmeasured one is predicted at the fleet's,
//! noise never separates equal engines (property), and the fleet-wide mode.

use super::*;

fn report(at_ms: u64, queued: u64) -> LoadSample {
    LoadSample { fetched_at_ms: at_ms, num_waiting_uncached_tokens: queued, ..LoadSample::default() }
}

fn settings(per_engine: bool) -> RateSettings {
    RateSettings {
        prefill_tokens_per_sec: 8_000.0,
        decode_ms_per_request: 0.35,
        learn: true,
        per_engine,
        min_observations: 3,
        smoothing: 0.1,
        grid_step: 1.25,
        prior_observations: 0.0,
        max_ratio: 0.0,
        saturated_intervals: false,
    }
}

/// `worker` computes `rate` tokens/s for `steps` reports 500 ms apart from `start_ms`, its queue
/// staying at 50,000 tokens (what arrives is what it computes).
fn busy(
    rates: &mut EngineRates,
    routed: &mut RoutedLog,
    worker: WorkerId,
    rate: f64,
    start_ms: u64,
    steps: u64,
) {
    rates.observe(worker, &report(start_ms, 50_000), routed, 500);
    for step in 1..=steps {
        routed.record(worker, start_ms + step * 500 - 250, rate / 2.0, 1_000_000);
        rates.observe(worker, &report(start_ms + step * 500, 50_000), routed, 500);
    }
}

#[test]
fn a_busy_engine_teaches_its_own_rate_and_an_unmeasured_one_gets_the_fleets() {
    let mut routed = RoutedLog::default();
    let mut rates = EngineRates::new(settings(true));
    busy(&mut rates, &mut routed, 1, 16_000.0, 0, 40);
    busy(&mut rates, &mut routed, 2, 8_000.0, 0, 40);
    let estimate = rates.engines[&1].prefill.running.rate().unwrap();
    assert!((estimate - 16_000.0).abs() < 500.0, "{estimate}");
    // The fleet's mean (12,000) on the grid is 12,500; engine 1 one step above it (15,625),
    // engine 2 two below (8,000).
    assert_eq!(rates.rates(1).prefill_tokens_per_sec, 8_000.0 * 1.25f64.powi(3));
    assert_eq!(rates.rates(2).prefill_tokens_per_sec, 8_000.0);
    // Engine 3 was never busy: the fleet's rate.
    rates.observe(3, &report(20_000, 0), &routed, 500);
    assert_eq!(rates.rates(3).prefill_tokens_per_sec, 12_500.0);
    // Two busy intervals are not enough to trust its own estimate.
    busy(&mut rates, &mut routed, 3, 4_000.0, 30_000, 2);
    assert_eq!(rates.rates(3).prefill_tokens_per_sec, 12_500.0);
    // Measured: the fleet's mean falls to 9,333 (grid: 10,000) and engine 3 is four steps below
    // it; the others keep their rates (15,625 = two steps above 10,000; 8,000 = one below).
    busy(&mut rates, &mut routed, 3, 4_000.0, 40_000, 2);
    assert_eq!(rates.rates(3).prefill_tokens_per_sec, 10_000.0 / 1.25f64.powi(4));
    assert_eq!(rates.rates(1).prefill_tokens_per_sec, 8_000.0 * 1.25f64.powi(3));
    assert_eq!(rates.rates(2).prefill_tokens_per_sec, 8_000.0);
    rates.forget(1);
    assert!(!rates.engines.contains_key(&1));
}

#[test]
fn the_fleet_wide_mode_predicts_every_engine_at_the_mean() {
    let mut routed = RoutedLog::default();
    let mut rates = EngineRates::new(settings(false));
    busy(&mut rates, &mut routed, 1, 16_000.0, 0, 40);
    busy(&mut rates, &mut routed, 2, 8_000.0, 0, 40);
    assert_eq!(rates.rates(1), rates.rates(2));
    assert_eq!(rates.rates(1).prefill_tokens_per_sec, 12_500.0);
}

#[test]
fn decode_speed_is_learned_from_throughput_while_nothing_is_prefilled() {
    let routed = RoutedLog::default();
    let mut rates = EngineRates::new(settings(true));
    for step in 0..10u64 {
        // 64 running requests at 5,700 tokens/s: each adds 0.175 ms to a step (a 2x engine).
        let sample = LoadSample { num_running_reqs: 64, gen_throughput: 5_700.0, ..report(step * 500, 0) };
        rates.observe(1, &sample, &routed, 500);
    }
    let ms = rates.rates(1).decode_ms_per_request;
    assert!((ms - 0.35 / 2.0).abs() < 0.03, "{ms}");
    // Too few running requests to learn from: the configured value.
    let sample = LoadSample { num_running_reqs: 2, gen_throughput: 100.0, ..report(0, 0) };
    rates.observe(2, &sample, &routed, 500);
    assert_eq!(rates.rates(2).decode_ms_per_request, ms, "the fleet's: engine 1's");
}

#[test]
fn noise_around_a_grid_rate_keeps_it_exactly() {
    let step = 1.25;
    for estimate in [6_900.0, 7_300.0, 8_000.0, 8_700.0, 9_300.0] {
        assert_eq!(snap(8_000.0, estimate, 8_000.0, step), 8_000.0, "{estimate}");
    }
    // Well past the middle of the step: one step up, and it stays there when the estimate
    // wavers back below the middle.
    let up = snap(8_000.0, 10_200.0, 8_000.0, step);
    assert_eq!(up, 10_000.0);
    assert_eq!(snap(up, 8_800.0, 8_000.0, step), 10_000.0);
    assert_eq!(snap(up, 7_000.0, 8_000.0, step), 8_000.0 / step);
}

#[test]
fn an_idle_engine_or_learning_off_teaches_nothing() {
    let routed = RoutedLog::default();
    let mut rates = EngineRates::new(settings(true));
    rates.observe(1, &report(0, 0), &routed, 500);
    rates.observe(1, &report(1_000, 0), &routed, 500);
    assert_eq!(rates.rates(1).prefill_tokens_per_sec, 8_000.0);
    let mut off = EngineRates::new(RateSettings { learn: false, ..settings(true) });
    off.observe(1, &report(0, 40_000), &routed, 500);
    off.observe(1, &report(1_000, 1_000), &routed, 500);
    assert_eq!(off.rates(1).prefill_tokens_per_sec, 8_000.0);
}

proptest::proptest! {
    /// Equal engines measured with up to 10% noise are predicted at exactly the same rate: noise
    /// never steers between them (what made the first per-engine learner harmful).
    #[test]
    fn equal_engines_stay_equal_under_noise(
        k in -3i32..=3,
        noise in proptest::collection::vec(-0.1f64..0.1, 4 * 30),
    ) {
        let true_rate = 8_000.0 * 1.25f64.powi(k);
        let mut routed = RoutedLog::default();
        let mut rates = EngineRates::new(settings(true));
        for worker in 0..4u32 {
            rates.observe(worker, &report(0, 50_000), &routed, 500);
        }
        for step in 1..=30u64 {
            for worker in 0..4u32 {
                let rate = true_rate * (1.0 + noise[(step as usize - 1) * 4 + worker as usize]);
                routed.record(worker, step * 500 - 250, rate / 2.0, 1_000_000);
                rates.observe(worker, &report(step * 500, 50_000), &routed, 500);
            }
        }
        let used: Vec<f64> = (0..4).map(|w| rates.rates(w).prefill_tokens_per_sec).collect();
        proptest::prop_assert!(used.iter().all(|&r| r == used[0]), "{used:?}");
        proptest::prop_assert!((used[0] / true_rate - 1.0).abs() < 1e-9, "{} vs {true_rate}", used[0]);
    }
}

#[test]
fn a_burst_found_cached_counts_at_most_max_ratio_and_a_drained_interval_not_at_all() {
    // Engine 1's interval: 50,000 queued at both ends and 500,000 tokens routed in 500 ms
    // (prompts it found cached): read as 1M tokens/s without a bound, 4x the fleet's with one.
    let mut routed = RoutedLog::default();
    let mut bounded =
        EngineRates::new(RateSettings { max_ratio: 4.0, min_observations: 1, ..settings(true) });
    let mut unbounded = EngineRates::new(RateSettings { min_observations: 1, ..settings(true) });
    routed.record(1, 250, 500_000.0, 1_000_000);
    for rates in [&mut bounded, &mut unbounded] {
        rates.observe(1, &report(0, 50_000), &routed, 500);
        rates.observe(1, &report(500, 50_000), &routed, 500);
    }
    assert_eq!(bounded.engines[&1].prefill.running.rate(), Some(32_000.0));
    assert_eq!(unbounded.engines[&1].prefill.running.rate(), Some(1_000_000.0));
    // A queue of 1,000 tokens at the start cannot keep an 8,000 tokens/s engine busy for
    // 500 ms: with saturated intervals only, nothing is learned from it.
    let mut routed = RoutedLog::default();
    let mut saturated = EngineRates::new(RateSettings { saturated_intervals: true, ..settings(true) });
    routed.record(1, 250, 1_000.0, 1_000_000);
    saturated.observe(1, &report(0, 1_000), &routed, 500);
    saturated.observe(1, &report(500, 1_000), &routed, 500);
    assert_eq!(saturated.engines[&1].prefill.running.rate(), None);
    saturated.observe(1, &report(1_000, 5_000), &routed, 500);
    routed.record(1, 1_250, 4_000.0, 1_000_000);
    saturated.observe(1, &report(1_500, 5_000), &routed, 500);
    assert_eq!(saturated.engines[&1].prefill.running.rate(), Some(8_000.0));
}

#[test]
fn credibility_weighs_a_fast_engine_toward_the_fleet_until_it_is_measured() {
    // The fleet's mean of 16,000 and 8,000 is 12,000 (grid 12,500); with a prior of 10
    // observations and about 10 of its own (smoothing 0.1, decayed), engine 1's estimate is
    // about sqrt(16,000 / 12,500) = 1.13x the fleet's: within the hysteresis, so one grid step
    // (not the three of its own estimate) is not reached.
    let mut routed = RoutedLog::default();
    let mut rates = EngineRates::new(RateSettings { prior_observations: 10.0, ..settings(true) });
    busy(&mut rates, &mut routed, 1, 16_000.0, 0, 40);
    busy(&mut rates, &mut routed, 2, 8_000.0, 0, 40);
    assert_eq!(rates.rates(1).prefill_tokens_per_sec, 12_500.0);
    assert_eq!(rates.rates(2).prefill_tokens_per_sec, 12_500.0 / 1.25);
    // No prior: its own estimate, three steps above 8,000.
    assert_eq!(credible(16_000.0, 10.0, 12_500.0, 0.0), 16_000.0);
    assert_eq!(credible(16_000.0, 0.0, 12_500.0, 0.0), 12_500.0, "no samples: the fleet's");
}

proptest::proptest! {
    /// The credible estimate lies between the fleet's rate and the engine's own, is the fleet's
    /// with no samples, and moves toward the engine's own as its samples grow.
    #[test]
    fn a_credible_estimate_lies_between_the_fleet_rate_and_the_engines_own(
        own in 100.0f64..1e6,
        fleet in 100.0f64..1e6,
        weight in 0.0f64..100.0,
        more in 0.0f64..100.0,
        prior in 0.0f64..100.0,
    ) {
        let estimate = credible(own, weight, fleet, prior);
        let (low, high) = (own.min(fleet), own.max(fleet));
        proptest::prop_assert!(estimate >= low * (1.0 - 1e-12) && estimate <= high * (1.0 + 1e-12), "{estimate}");
        proptest::prop_assert!((credible(own, 0.0, fleet, prior) - fleet).abs() <= fleet * 1e-12 || prior == 0.0);
        let closer = credible(own, weight + more, fleet, prior);
        proptest::prop_assert!((closer.ln() - own.ln()).abs() <= (estimate.ln() - own.ln()).abs() + 1e-9);
    }
}

#[test]
fn an_interval_whose_queue_waits_for_kv_teaches_no_prefill_rate() {
    // S11's holder of a popular context: its KV full of answers being decoded, its waiting
    // questions (cached prompts) admitted only as answers finish, so its queued prefill drains
    // at the rate answers end, not at the prefill rate. Read as prefill, an interval that
    // computed 1,000 of 51,000 tokens says 2,000 tokens/s, and the fleet's rate collapsed.
    let kv_bound = |at_ms, queued| LoadSample {
        token_usage: 0.99,
        num_running_reqs: 30,
        num_waiting_reqs: 40,
        max_total_num_tokens: 262_144,
        ..report(at_ms, queued)
    };
    let mut routed = RoutedLog::default();
    let mut rates = EngineRates::new(RateSettings { min_observations: 1, ..settings(true) });
    rates.observe(1, &kv_bound(0, 50_000), &routed, 500);
    routed.record(1, 250, 1_000.0, 1_000_000);
    rates.observe(1, &kv_bound(500, 50_000), &routed, 500);
    assert_eq!(rates.engines[&1].prefill.running.rate(), None);
    // Nor the interval from the last KV-bound report to one with room.
    rates.observe(1, &report(1_000, 46_000), &routed, 500);
    assert_eq!(rates.engines[&1].prefill.running.rate(), None);
    // Between two reports with room, the rate is learned as before.
    routed.record(1, 1_250, 0.0, 1_000_000);
    rates.observe(1, &report(1_500, 42_000), &routed, 500);
    assert_eq!(rates.engines[&1].prefill.running.rate(), Some(8_000.0));
}

#[test]
fn the_predicted_wait_for_kv_is_not_learned_as_prefill() {
    // An engine whose reports teach no prefill rate (vLLM's): every answer waited 5 s for KV,
    // then computed its prompt at 8,000 tokens/s.
    let learn = |predicted_wait_s: f64| {
        let mut rates = EngineRates::new(settings(false));
        let used = Rates { prefill_tokens_per_sec: 8_000.0, decode_ms_per_request: 0.35, ..Rates::default() };
        for i in 0..32u32 {
            let prompt = 2_000 + 500 * i;
            let answer = crate::Answered {
                worker: 1,
                predicted: crate::kv_aware::PredictedTtft {
                    kv_wait_s: predicted_wait_s,
                    rates: used,
                    ..Default::default()
                },
                prompt_tokens: prompt,
                cached_tokens: 0,
                ttft_s: 5.0 + f64::from(prompt) / 8_000.0,
            };
            rates.observe_answer(1, &answer);
        }
        rates.rates(1)
    };
    let learned = learn(5.0);
    assert!(learned.base_s < 0.05, "the predicted wait is not a fixed cost: {learned:?}");
    assert!((learned.prefill_tokens_per_sec - 8_000.0).abs() < 400.0, "{learned:?}");
    // Left in (a wait the decision did not predict), the wait is learned as prefill: the engine
    // looks four times slower than it is.
    let unpredicted = learn(0.0);
    assert!(unpredicted.prefill_tokens_per_sec < 4_000.0, "{unpredicted:?}");
}

#[test]
fn requests_finished_are_those_routed_less_the_growth_of_running_and_waiting() {
    let mut rates = EngineRates::new(settings(false));
    let mut routed = RoutedLog::default();
    let at = |at_ms, running, waiting| LoadSample {
        fetched_at_ms: at_ms,
        num_running_reqs: running,
        num_waiting_reqs: waiting,
        ..LoadSample::default()
    };
    rates.observe(1, &at(1_000, 8, 2), &routed, 1_000);
    assert_eq!(rates.finished_per_sec_of(1), None, "one report says nothing");
    // Five routed in the second; running and waiting grew by two: three finished.
    for ms in [1_100, 1_300, 1_500, 1_700, 1_900] {
        routed.record(1, ms, 100.0, 10_000);
    }
    rates.observe(1, &at(2_000, 11, 1), &routed, 1_000);
    assert_eq!(rates.finished_per_sec_of(1), Some(3.0));
    assert_eq!(rates.finished_per_sec_of(2), None);
}

#[test]
fn an_engine_whose_reports_show_its_queue_is_predicted_at_their_rates_not_at_the_answers_fit() {
    // S10's rollouts: a burst a step, the reports observed only when a request is sent, so one
    // showed prefill queued but no observed interval had it queued at both ends (no busy
    // interval: no rate measured). The answers, as a wall clock measured them, say 4,000
    // tokens/s.
    let learn = |per_engine: bool, queued: u64| {
        let routed = RoutedLog::default();
        let mut rates = EngineRates::new(settings(per_engine));
        for (at_ms, queued) in [(0, 0), (1_000, queued), (45_000, 0)] {
            rates.observe(1, &report(at_ms, queued), &routed, 1_000);
        }
        assert_eq!(rates.engines[&1].prefill.running.observations, 0, "no busy interval");
        let used = Rates { prefill_tokens_per_sec: 8_000.0, decode_ms_per_request: 0.35, ..Rates::default() };
        for i in 0..32u32 {
            let prompt = 2_000 + 500 * i;
            let answer = crate::Answered {
                worker: 1,
                predicted: crate::kv_aware::PredictedTtft { rates: used, ..Default::default() },
                prompt_tokens: prompt,
                cached_tokens: 0,
                ttft_s: 0.05 + f64::from(prompt) / 4_000.0,
            };
            rates.observe_answer(1, &answer);
        }
        rates.rates(1)
    };
    for per_engine in [false, true] {
        let got = learn(per_engine, 9_000);
        // The configured rates; the base what they leave unexplained (the median answer's).
        assert_eq!((got.prefill_tokens_per_sec, got.decode_ms_per_request), (8_000.0, 0.35), "{got:?}");
        assert_eq!(got.context_ns_per_pair, 0.0, "{got:?}");
        assert!((got.base_s - (0.05 + 10_000.0 / 8_000.0)).abs() < 1e-9, "{got:?}");
        // Reports that never say what is queued (vLLM's): the answers' fit.
        let fitted = learn(per_engine, 0);
        assert!((fitted.prefill_tokens_per_sec - 4_000.0).abs() < 200.0, "{fitted:?}");
        assert!(fitted.base_s < 0.1, "{fitted:?}");
    }
    // Forgotten, an engine no longer counts as one whose reports show the queue.
    let mut rates = EngineRates::new(settings(false));
    rates.observe(1, &report(1_000, 9_000), &RoutedLog::default(), 1_000);
    assert!(rates.reports_show_queue(2));
    rates.forget(1);
    assert!(!rates.reports_show_queue(2));
}

#[test]
fn answers_that_waited_longer_for_kv_than_predicted_lengthen_the_predicted_wait() {
    let mut rates = EngineRates::new(settings(false));
    assert_eq!(rates.rates(1).kv_wait_scale, 1.0);
    let answered = |predicted: Rates, kv_wait_s: f64, ttft_s: f64| crate::Answered {
        worker: 1,
        predicted: crate::kv_aware::PredictedTtft {
            queue_s: 0.5,
            prefill_s: 0.25,
            kv_wait_s,
            rates: predicted,
            ..Default::default()
        },
        prompt_tokens: 2_000,
        cached_tokens: 0,
        ttft_s,
    };
    // Predicted 4 s for KV after 0.75 s of queue and prefill; each took 8 s more than those.
    for _ in 0..16 {
        let used = rates.rates(1);
        rates.observe_answer(1, &answered(used, 4.0 * used.kv_wait_scale, 0.75 + 8.0));
    }
    let learned = rates.rates(1).kv_wait_scale;
    assert!((learned - 2.0).abs() < 1e-9, "the scale the answers say: {learned}");
    assert_eq!(rates.rates(2).kv_wait_scale, learned, "the fleet's, for every engine");
    // Predicted at the learned scale, the same waits teach the same scale (the model's wait is
    // what is compared, not the scaled one).
    for _ in 0..64 {
        let used = rates.rates(1);
        rates.observe_answer(1, &answered(used, 4.0 * used.kv_wait_scale, 0.75 + 8.0));
    }
    assert!((rates.rates(1).kv_wait_scale - 2.0).abs() < 1e-9);
    // Answers that predicted no wait teach nothing of it, nor those whose predicted wait is less
    // than the rest of their prediction (0.75 s): their time beyond it is that rest's error.
    for _ in 0..64 {
        rates.observe_answer(1, &answered(rates.rates(1), 0.0, 0.5));
        let used = rates.rates(1);
        rates.observe_answer(1, &answered(used, 0.5 * used.kv_wait_scale, 0.75 + 8.0));
    }
    assert!((rates.rates(1).kv_wait_scale - 2.0).abs() < 1e-9);
    let off = EngineRates::new(RateSettings { learn: false, ..settings(false) });
    assert_eq!(off.rates(1).kv_wait_scale, 1.0, "not learned when learning is off");
}
