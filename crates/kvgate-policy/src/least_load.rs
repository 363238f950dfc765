//! `least_load`: route to the worker with the least expected wait, never to one that cannot admit
//! a request (its KV taken, requests waiting for it) while another can. The wait is
//! `(queued uncached tokens + prompt tokens routed since) / throughput + w * k / (1 - k)`, where
//! k is the KV usage plus the prompt tokens routed since over the capacity (clamped below 1) and
//! throughput the engine's reported generation throughput, never below the default (an engine
//! generating almost nothing is prefilling or nearly idle, not slow: one reporting 1 token/s
//! would otherwise look 2,000 times slower than one reporting none), plus the wait for KV
//! ([`crate::kv_wait`]): what the requests waiting there and routed there since need, with a
//! request's, beyond the free KV, over the rate running requests free it. The request's own
//! prompt counts in the prefill term only: least_load has no prefix index, so the whole prompt
//! is not what it needs in KV where much of it is cached (an agent's context, a shared
//! document), and an engine's KV wait is the same for every request. Between load samples the
//! requests routed since count, each with its prompt and a running request's KV (in-flight
//! correction): a burst of samples of one prompt is work for the engine (KV and decode) even
//! though it is one prefill. The samples of one prompt (the whole prompt's hash) routed to a
//! worker count their prompt once there (queued prefill and KV): a group is no longer taken for
//! sixteen prompts to compute, and spreads once an engine cannot admit more. Without a fresh
//! sample, in-flight requests count as the mean prompt size each.

use std::sync::Mutex;

use crate::hashing::prompt_key;
use crate::inflight::{fresh_load, RoutedLog, Sent};
use crate::kv_wait::{kv_freed_share, kv_per_request, KvView};
use crate::pick::pick_min_by;
use crate::{
    Candidate, Candidates, Decision, LoadSample, NoRoute, Policy, Reason, RouteRequest, Routed,
    SelectContext, WorkerId,
};

/// The knobs of the expected-wait estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeastLoadSettings {
    pub kv_pressure_weight: f64,
    pub mean_prefill_tokens: f64,
    pub default_throughput: f64,
}

pub struct LeastLoadPolicy {
    settings: LeastLoadSettings,
    routed: Mutex<RoutedLog>,
}

/// How many poll intervals a routing is remembered (the in-flight correction counts it until the
/// worker's next load sample).
const KEEP_POLLS: u64 = 4;

/// Expected waits closer than this many seconds are a tie.
const WAIT_TIE_SECS: f64 = 1e-4;

/// One candidate's expected wait, and whether it admits the request now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpectedWait {
    pub wait_s: f64,
    /// `false` only when the KV of every candidate is known and this one's cannot take the
    /// request before others' requests waiting there are admitted.
    pub admits: bool,
}

impl LeastLoadPolicy {
    pub fn new(settings: LeastLoadSettings) -> Self {
        Self { settings, routed: Mutex::new(RoutedLog::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RoutedLog> {
        self.routed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The request's prompt tokens (the mean prompt when unknown): all of it counts as computed
    /// where it goes (least_load knows no prefix index).
    fn prompt_tokens(&self, request: &RouteRequest<'_>) -> f64 {
        match request.prompt_tokens {
            0 => self.settings.mean_prefill_tokens,
            known => known as f64,
        }
    }

    /// Expected wait of `request` on each candidate.
    pub fn expected_waits(
        &self,
        _request: &RouteRequest<'_>,
        candidates: &[Candidate],
        routed: &RoutedLog,
        ctx: &SelectContext<'_>,
    ) -> Vec<ExpectedWait> {
        let s = &self.settings;
        let loads: Vec<Option<LoadSample>> =
            candidates.iter().map(|c| fresh_load(c, ctx.now_ms, ctx.load_poll_interval_ms)).collect();
        let per_request = kv_per_request(loads.iter().flatten()).unwrap_or(s.mean_prefill_tokens);
        let freed_share = kv_freed_share(loads.iter().flatten());
        let views: Vec<Option<KvView>> = candidates
            .iter()
            .zip(&loads)
            .map(|(c, load)| {
                let load = load.as_ref()?;
                KvView::of(
                    load,
                    routed.sent_since(c.id, load.fetched_at_ms),
                    per_request,
                    freed_share,
                    s.default_throughput,
                )
            })
            .collect();
        // A partial snapshot never keeps an engine out.
        let kv_known = views.iter().all(Option::is_some);
        candidates
            .iter()
            .zip(loads.iter().zip(&views))
            .map(|(c, (load, view))| match load {
                Some(load) => {
                    let since: Sent = routed.sent_since(c.id, load.fetched_at_ms);
                    let tokens = load.num_waiting_uncached_tokens as f64 + since.tokens;
                    let throughput = load.gen_throughput.max(s.default_throughput);
                    let mut k = load.token_usage;
                    if load.max_total_num_tokens > 0 {
                        k += since.tokens / load.max_total_num_tokens as f64;
                    }
                    let k = k.clamp(0.0, 0.99);
                    let (kv_wait, admits) = match view {
                        Some(view) => {
                            let need = view.need(0.0);
                            (view.wait_s(need), view.admits(need))
                        }
                        None => (0.0, true),
                    };
                    let wait_s = tokens / throughput + s.kv_pressure_weight * k / (1.0 - k) + kv_wait;
                    ExpectedWait { wait_s, admits: admits || !kv_known }
                }
                None => ExpectedWait {
                    wait_s: c.in_flight as f64 * s.mean_prefill_tokens / s.default_throughput,
                    admits: true,
                },
            })
            .collect()
    }
}

impl Policy for LeastLoadPolicy {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn needs_loads(&self) -> bool {
        true
    }

    /// The prompt's size and identity: the samples of one prompt are one prefill.
    fn needs_routing_key(&self) -> bool {
        true
    }

    /// The least expected wait among the candidates that admit the request now, or among all
    /// when none does (ties: fewer in flight, then at random).
    fn decide(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let routed = self.lock();
        let waits = self.expected_waits(request, &candidates, &routed, ctx);
        let any_admits = waits.iter().any(|w| w.admits);
        let open = (0..candidates.len()).filter(|&i| waits[i].admits || !any_admits);
        let key = |i: usize| ((waits[i].wait_s / WAIT_TIE_SECS) as i64, candidates[i].in_flight);
        let index = pick_min_by(open, key, ctx.rng).expect("not empty");
        Ok(Decision::plain(candidates[index].id, Reason::LeastLoad))
    }

    /// The request counts on its worker until the next load sample: its prompt tokens (or the
    /// mean prompt when unknown) as queued prefill, and itself as a request taking KV.
    fn on_routed(&self, routed: &Routed<'_>) {
        let sent = Sent { requests: 1.0, tokens: self.prompt_tokens(routed.request) };
        let keep_ms = routed.load_poll_interval_ms.saturating_mul(KEEP_POLLS);
        let prompt = prompt_key(routed.request);
        self.lock().record_prompt(routed.decision.worker, routed.now_ms, sent, prompt, keep_ms);
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.lock().forget(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, ctx_rng, route};
    use crate::LoadSample;

    const SETTINGS: LeastLoadSettings = LeastLoadSettings {
        kv_pressure_weight: 0.15,
        mean_prefill_tokens: 1024.0,
        default_throughput: 2000.0,
    };

    fn sample(waiting_tokens: u64, usage: f64) -> Option<LoadSample> {
        Some(LoadSample {
            num_waiting_uncached_tokens: waiting_tokens,
            token_usage: usage,
            max_total_num_tokens: 100_000,
            fetched_at_ms: 1000,
            ..LoadSample::default()
        })
    }

    #[test]
    fn prefers_the_idle_engine() {
        let policy = LeastLoadPolicy::new(SETTINGS);
        let mut pool = candidates(&[0, 0, 0]);
        pool[0].load = sample(8000, 0.2);
        pool[1].load = sample(0, 0.1);
        pool[2].load = sample(0, 0.8);
        let mut rng = ctx_rng(1);
        let mut ctx =
            SelectContext { now_ms: 1000, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let d = route(&policy, &RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx);
        assert_eq!((d.worker, d.reason), (1, Reason::LeastLoad));
    }

    #[test]
    fn inflight_correction_spreads_a_burst_between_samples() {
        let policy = LeastLoadPolicy::new(SETTINGS);
        let mut pool = candidates(&[0, 0]);
        pool[0].load = sample(0, 0.1);
        pool[1].load = sample(0, 0.1);
        let mut rng = ctx_rng(2);
        let mut ctx =
            SelectContext { now_ms: 1500, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let request = RouteRequest { key: crate::RoutingKey::None, prompt_tokens: 4000, session: None };
        let mut counts = [0; 2];
        for _ in 0..10 {
            counts[route(&policy, &request, Candidates::new(&pool).unwrap(), &mut ctx).worker as usize] += 1;
        }
        assert_eq!(counts, [5, 5], "the same stale sample, yet the burst alternates");
    }

    /// Two engines, each reported at 1,000 ms running 10 requests that generate 1,000 tokens a
    /// second, at `usage` of `capacity` KV tokens.
    fn decoding_pair(usage: f64, capacity: u64) -> Vec<Candidate> {
        let mut pool = candidates(&[0, 0]);
        for candidate in &mut pool {
            candidate.load = Some(LoadSample {
                token_usage: usage,
                num_running_reqs: 10,
                gen_throughput: 1000.0,
                max_total_num_tokens: capacity,
                fetched_at_ms: 1000,
                ..LoadSample::default()
            });
        }
        pool
    }

    #[test]
    fn the_samples_of_one_prompt_count_its_prefill_once_per_engine() {
        let pool = decoding_pair(0.1, 1_000_000);
        let prompt: Vec<u32> = (0..8000).collect();
        let burst = |key| {
            let policy = LeastLoadPolicy::new(LeastLoadSettings { default_throughput: 1000.0, ..SETTINGS });
            let mut rng = ctx_rng(4);
            let mut ctx = SelectContext {
                now_ms: 1200,
                load_poll_interval_ms: 1000,
                rng: &mut rng,
                prefix_index: None,
            };
            let request = RouteRequest { key, prompt_tokens: 8000, session: None };
            for _ in 0..16 {
                route(&policy, &request, Candidates::new(&pool).unwrap(), &mut ctx);
            }
            let waits = policy.expected_waits(&request, &pool, &policy.lock(), &ctx);
            waits.iter().map(|w| w.wait_s).fold(0.0, f64::max)
        };
        // Sixteen samples over two engines: one prefill of 8,000 tokens queued on each (8 s at
        // 1,000 tokens a second), not eight.
        let samples = burst(crate::RoutingKey::Tokens(&prompt));
        assert!((8.0..9.0).contains(&samples), "{samples}");
        // Without the prompt's identity, sixteen prompts of 8,000 tokens.
        let unknown = burst(crate::RoutingKey::None);
        assert!(unknown > 60.0, "{unknown}");
    }

    /// The samples of one prompt routed since the report each take what a running request
    /// holds in KV (prompt shared, answers not; SMG's expected wait knows no answer's size):
    /// counted at nothing, S10's bursts of samples all looked admitted on one engine.
    #[test]
    fn the_samples_of_one_prompt_each_take_kv() {
        // 10 running in 50,000 tokens: 5,000 a request.
        let pool = decoding_pair(0.5, 100_000);
        let policy = LeastLoadPolicy::new(LeastLoadSettings { default_throughput: 1000.0, ..SETTINGS });
        let mut rng = ctx_rng(7);
        let mut ctx =
            SelectContext { now_ms: 1200, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let prompt: Vec<u32> = (0..8000).collect();
        let request =
            RouteRequest { key: crate::RoutingKey::Tokens(&prompt), prompt_tokens: 8000, session: None };
        for _ in 0..24 {
            route(&policy, &request, Candidates::new(&pool).unwrap(), &mut ctx);
        }
        // Twelve on each: 50,000 + 12 x 5,000 taken of 100,000, so the next one waits for KV.
        let waits = policy.expected_waits(&request, &pool, &policy.lock(), &ctx);
        assert!(waits.iter().all(|w| !w.admits), "{waits:?}");
    }

    #[test]
    fn an_engine_generating_almost_nothing_is_not_taken_for_a_slow_one() {
        // Three engines with the same queue: one reports no throughput, one 1 token/s (busy
        // with prefill, or nearly idle), one 500. Each looks as fast as the default says, not
        // 2,000 times slower for reporting 1 instead of 0; a faster one above the default wins.
        let policy = LeastLoadPolicy::new(SETTINGS);
        let mut pool = candidates(&[0, 0, 0, 0]);
        for (candidate, gen) in pool.iter_mut().zip([0.0, 1.0, 500.0, 4000.0]) {
            candidate.load = Some(LoadSample { gen_throughput: gen, ..sample(4000, 0.2).unwrap() });
        }
        let mut rng = ctx_rng(5);
        let ctx =
            SelectContext { now_ms: 1000, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let waits: Vec<f64> = policy
            .expected_waits(&RouteRequest::EMPTY, &pool, &policy.lock(), &ctx)
            .iter()
            .map(|w| w.wait_s)
            .collect();
        assert_eq!(waits[0], waits[1]);
        assert_eq!(waits[0], waits[2]);
        assert!(waits[3] < waits[0], "{waits:?}");
        assert!((2.0..2.1).contains(&waits[0]), "4,000 tokens at the default 2,000 a second: {waits:?}");
    }

    #[test]
    fn a_long_prompt_needs_what_a_request_holds_not_its_whole_length_in_kv() {
        // least_load has no prefix index: a 60,000-token prompt (an agent's context, mostly
        // cached where its session ran) is not kept off an engine with 30,000 tokens of KV free
        // and nothing waiting, nor made to wait there for KV; its prompt counts as prefill.
        let policy = LeastLoadPolicy::new(SETTINGS);
        let mut pool = candidates(&[0, 0]);
        for (candidate, usage) in pool.iter_mut().zip([0.7, 0.1]) {
            candidate.load = Some(LoadSample {
                token_usage: usage,
                num_running_reqs: 8,
                gen_throughput: 2000.0,
                max_total_num_tokens: 100_000,
                fetched_at_ms: 1000,
                ..LoadSample::default()
            });
        }
        let mut rng = ctx_rng(6);
        let ctx =
            SelectContext { now_ms: 1000, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let request = RouteRequest { key: crate::RoutingKey::None, prompt_tokens: 60_000, session: None };
        let waits = policy.expected_waits(&request, &pool, &policy.lock(), &ctx);
        assert!(waits.iter().all(|w| w.admits), "{waits:?}");
        // Only the KV-pressure term tells them apart: 0.15 x 0.7 / 0.3 against 0.15 x 0.1 / 0.9.
        assert!(
            (waits[0].wait_s - 0.35).abs() < 1e-9 && (waits[1].wait_s - 0.15 / 9.0).abs() < 1e-9,
            "{waits:?}"
        );
    }

    proptest::proptest! {
        /// least_load never picks an engine whose KV is full with requests waiting while another
        /// engine has room for the request, whatever the queues and throughputs say, through a
        /// burst routed between two load samples.
        #[test]
        fn never_an_engine_that_cannot_admit_while_another_has_room(
            engines in proptest::collection::vec(
                (0u8..3, 0.0f64..1.0, 10u64..200, 0u64..20, 0u64..400_000, 0.0f64..5_000.0),
                2..8,
            ),
            prompts in proptest::collection::vec(0u64..10_000, 1..5),
            seed in 0u64..1000,
        ) {
            let policy = LeastLoadPolicy::new(SETTINGS);
            let mut pool = candidates(&vec![0; engines.len()]);
            // Kind 0: full, requests waiting; kind 1: half free or more, nothing waiting; 2: any.
            // Every engine runs at least 10 requests, so a request holds at most a tenth of an
            // engine's KV, and a burst of 4 prompts of at most 10,000 tokens fits in half of it.
            let mut full = Vec::new();
            let mut room = false;
            for (candidate, &(kind, usage, running, waiting, queued, gen)) in pool.iter_mut().zip(&engines) {
                let (token_usage, num_waiting_reqs) = match kind {
                    0 => (1.0, waiting.max(1)),
                    1 => (usage * 0.5, 0),
                    _ => (usage, waiting),
                };
                if kind == 0 {
                    full.push(candidate.id);
                }
                room |= kind == 1;
                candidate.load = Some(LoadSample {
                    token_usage,
                    num_running_reqs: running,
                    num_waiting_reqs,
                    num_waiting_uncached_tokens: queued,
                    gen_throughput: gen,
                    max_total_num_tokens: 100_000,
                    fetched_at_ms: 1000,
                });
            }
            let mut rng = ctx_rng(seed);
            let mut ctx =
                SelectContext { now_ms: 1500, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
            for tokens in prompts {
                let request = RouteRequest { key: crate::RoutingKey::None, prompt_tokens: tokens, session: None };
                let worker = route(&policy, &request, Candidates::new(&pool).unwrap(), &mut ctx).worker;
                proptest::prop_assert!(!(room && full.contains(&worker)), "picked full engine {worker}");
            }
        }
    }

    #[test]
    fn without_samples_in_flight_counts_decide() {
        let policy = LeastLoadPolicy::new(SETTINGS);
        let pool = candidates(&[7, 2, 9]);
        let mut rng = ctx_rng(3);
        let mut ctx =
            SelectContext { now_ms: 0, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        assert_eq!(route(&policy, &RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx).worker, 1);
    }
}
