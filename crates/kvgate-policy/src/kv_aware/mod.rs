//! `kv_aware`: route each request to the engine where it is predicted to get its first token
//! soonest, counting what its prefill costs everyone else. The prediction ([`predict`]) adds the
//! prefill work queued on the engine, the request's own uncached tokens there (prompt minus the
//! prefix that engine holds, from the host's prefix index: exact when the engines' KV events
//! flow, else the approximate tree), over the prefill rate, plus decode and KV-pressure terms,
//! and the wait for KV ([`crate::kv_wait`]): on an engine whose KV is taken (by answers being
//! decoded, say) a request waits until running requests free what the requests ahead of it and
//! it need, however little prefill is queued there. So an agent's session stays with the engine
//! holding its context unless waiting there costs more than recomputing the context elsewhere.
//! The cost minimised is that prediction plus `kv_aware_prefill_cost_weight` times the
//! request's own prefill time: recomputing a prefix another engine holds delays every request
//! queued behind it, takes engine time from decoding, and duplicates the prefix in a second
//! cache (minimising the prediction alone loses 18% of the hits on S4 and makes end-to-end
//! latency worse; see docs/BENCHMARKS.md). Engines above the overload ceiling are never chosen
//! while one below exists. With `--router-temperature` above 0 the choice is sampled (softmax of
//! the costs relative to the best one) instead of the minimum.

mod favoured;
mod predict;
mod rate;

use std::collections::BTreeMap;
use std::sync::Mutex;

use kvgate_index::PrefixMatch;
use rand::Rng;

pub use predict::{predict, queued_tokens, EngineView, PredictSettings, PredictedTtft};
pub use rate::{EngineRates, RateSettings, Rates};

use crate::cache_aware::kv_usable;
use crate::config::PolicyConfig;
use crate::hashing::prompt_key;
use crate::inflight::{fresh_load, RoutedLog, Sent, WorkerLog};
use crate::kv_wait::{kv_finished_share, kv_freed_share, kv_per_request, KvView};
use crate::pick::pick_min_by;
use crate::{
    Candidate, Candidates, Decision, MatchInfo, NoRoute, Policy, Reason, RouteRequest, Routed, SelectContext,
    WorkerId,
};

/// Load-poll intervals the requests routed to each worker are remembered for.
const ROUTED_POLLS: u64 = 4;

/// Load reports taken under one hold of the policy's lock ([`Policy::on_load_reports`]): a
/// decision waits behind at most this many (about 0.3 ms of keying at 10,000 engines).
const REPORTS_PER_LOCK: usize = 256;

/// Predictions closer than this many seconds are a tie (broken by in-flight count, then at random).
const TIE_SECS: f64 = 1e-4;

#[derive(Clone, Copy, Debug)]
struct Settings {
    predict: PredictSettings,
    overload: f64,
    /// A candidate whose queue alone exceeds `wait_margin` x the best predicted TTFT plus
    /// `wait_slack_s` is not chosen (see the module doc).
    wait_margin: f64,
    wait_slack_s: f64,
    temperature: f64,
}

pub struct KvAwarePolicy {
    settings: Settings,
    state: Mutex<State>,
}

struct State {
    /// Uncached prompt tokens routed to each worker, by routing time: the arrivals of each
    /// engine's fluid prefill queue between its load reports.
    routed: RoutedLog,
    rates: EngineRates,
    /// When the pool's recent requests were routed.
    arrivals: Arrivals,
    /// Each engine's latest load report since the last request sent on a shortlist
    /// ([`Policy::on_load_reports`]), observed when the next one is sent.
    landed: BTreeMap<WorkerId, crate::LoadSample>,
    /// The engines predicted cheapest for a prompt none holds, kept for a pool decided on
    /// shortlists ([`Policy::favoured`]).
    favoured: favoured::Favoured,
}

/// The routing times of the pool's recent requests (the last four load-poll intervals), and
/// whether each followed a request with the same whole prompt routed moments before to the same
/// engine (a sample of a prompt sampled n times at once, S10).
#[derive(Debug, Default)]
struct Arrivals {
    times: std::collections::VecDeque<(u64, bool)>,
}

impl Arrivals {
    fn window_ms(poll_ms: u64) -> u64 {
        poll_ms.saturating_mul(4).max(1)
    }

    fn record(&mut self, now_ms: u64, poll_ms: u64, follower: bool) {
        let window = Self::window_ms(poll_ms);
        while self.times.front().is_some_and(|&(at, _)| at + window < now_ms) {
            self.times.pop_front();
        }
        self.times.push_back((now_ms, follower));
    }

    fn recent(&self, now_ms: u64, poll_ms: u64) -> impl Iterator<Item = bool> + '_ {
        let window = Self::window_ms(poll_ms);
        self.times.iter().filter(move |&&(at, _)| at + window >= now_ms).map(|&(_, follower)| follower)
    }

    /// Requests per second over the window before `now_ms`, and the requests that followed
    /// each leading one to its engine over it (0 when none followed): what a new prompt's
    /// decision is expected to place besides itself. One pass over the window (4,000 requests
    /// at 1,000 a second).
    fn per_sec_and_followers(&self, now_ms: u64, poll_ms: u64) -> (f64, f64) {
        let (mut leaders, mut followers) = (0u64, 0u64);
        for follower in self.recent(now_ms, poll_ms) {
            match follower {
                true => followers += 1,
                false => leaders += 1,
            }
        }
        let per_sec = (leaders + followers) as f64 * 1000.0 / Self::window_ms(poll_ms) as f64;
        (per_sec, followers as f64 / leaders.max(1) as f64)
    }
}

impl KvAwarePolicy {
    pub fn new(config: &PolicyConfig) -> Self {
        Self {
            settings: Settings {
                predict: PredictSettings {
                    kv_pressure_weight: config.kv_aware_kv_pressure_weight,
                    prefill_cost_weight: config.kv_aware_prefill_cost_weight,
                    queue_cost_weight: config.kv_aware_queue_cost_weight,
                    decode_stall_weight: config.kv_aware_decode_stall_weight,
                },
                overload: config.overload_token_usage_threshold,
                wait_margin: config.kv_aware_wait_margin,
                wait_slack_s: config.kv_aware_wait_slack_ms / 1000.0,
                temperature: config.router_temperature,
            },
            state: Mutex::new(State {
                routed: RoutedLog::default(),
                rates: EngineRates::new(RateSettings {
                    prefill_tokens_per_sec: config.kv_aware_prefill_tokens_per_sec,
                    decode_ms_per_request: config.kv_aware_decode_ms_per_request,
                    learn: config.kv_aware_learn_prefill_rate,
                    per_engine: config.kv_aware_per_engine_rates,
                    min_observations: config.kv_aware_rate_min_observations,
                    smoothing: config.kv_aware_rate_smoothing,
                    grid_step: config.kv_aware_rate_grid_step,
                    prior_observations: config.kv_aware_rate_prior_observations,
                    max_ratio: config.kv_aware_rate_max_ratio,
                    saturated_intervals: config.kv_aware_rate_saturated_intervals,
                }),
                arrivals: Arrivals::default(),
                landed: BTreeMap::new(),
                favoured: favoured::Favoured::default(),
            }),
        }
    }
}

/// One candidate's prediction, and whether it may be chosen.
struct Scored {
    predicted: PredictedTtft,
    /// The request's uncached prompt tokens there.
    uncached: f64,
    allowed: bool,
    /// Kept out by the wait margin (its queue alone is too long compared with the best TTFT).
    waits_too_long: bool,
    /// The requests expected to follow this one wherever it goes (see [`Scored::cost`]).
    followers: f64,
    /// The prompt's elements the candidate holds (the match, before tiers are weighed).
    held: usize,
    /// Requests running or in flight there.
    running: u64,
    /// The uncached prompt tokens routed there over the last [`ROUTED_POLLS`] load polls over
    /// what it prefills in that time: at 1 or more its queue grows.
    routed_load: f64,
}

impl Scored {
    /// What the choice minimises: the predicted time to first token once for the request and
    /// once for each request expected to follow it there, plus its costs to the others. The
    /// first sample of a prompt sampled n times at once (S10's rollouts) decides where its
    /// n - 1 siblings go (a prompt routed moments ago is computed there once, so they follow
    /// it), and each of them waits there as long as it does: counted once, its wait was
    /// outweighed by the cost of recomputing a shared prefix elsewhere, and a task family's
    /// new prompts queued on the one engine holding the family's prefix, 25K uncached tokens
    /// (3 s of prefill) in one burst while an engine got none.
    fn cost(&self) -> f64 {
        self.predicted.cost() + self.followers * self.predicted.total()
    }
}

/// Keeps out every allowed candidate whose queued prefill alone exceeds `margin` x the best
/// predicted time to first token among the allowed plus `slack_s`. The best one always stays
/// (its queue is part of its own prediction), so some candidate stays allowed.
fn apply_wait_margin(scored: &mut [Scored], margin: f64, slack_s: f64) {
    let best = scored.iter().filter(|s| s.allowed).map(|s| s.predicted.total()).fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        return;
    }
    for candidate in scored.iter_mut().filter(|s| s.allowed) {
        if candidate.predicted.queue_s > margin * best + slack_s {
            candidate.allowed = false;
            candidate.waits_too_long = true;
        }
    }
}

/// A sample of a prompt routed moments ago goes where the prompt went (`pending`: the engines
/// it was routed to) while one of them may be chosen and its predicted time to first token is
/// within the wait margin of the best allowed one (`margin` x the best + `slack_s`, as
/// [`apply_wait_margin`] bounds a queue): the prompt's decision placed its samples (it counts
/// its wait once per request expected to follow, [`Scored::cost`]), and a sample that leaves
/// computes the prompt again elsewhere. Weighed sample by sample instead, each sample routed
/// to the prompt's engine added what a running request holds to its predicted KV (0.2 s of
/// predicted wait for KV each on S10), so after a few the next went to another engine holding
/// the task family's prefix, a few hundred tokens of prefill cheaper than the growing wait: at
/// full size (S10 seed 1) 223 of 756 prompts' samples were split over engines (8 under
/// cache_aware), the pool computed 3.10M prompt tokens against cache_aware's 2.31M, and the
/// samples that left waited longer than those that stayed (1.03 s against 0.94 s; the wait for
/// KV was predicted 2-3 s where the whole time to first token measured 1-2 s). The margin keeps
/// a flood of one prompt (a client resending the same text) from drowning its engine: once
/// waiting there is predicted to take more than the margin allows, a sample is weighed as any
/// request (and the overload ceiling rules as ever).
fn follow_the_prompt(scored: &mut [Scored], pending: &[bool], margin: f64, slack_s: f64) {
    let best = scored.iter().filter(|s| s.allowed).map(|s| s.predicted.total()).fold(f64::INFINITY, f64::min);
    let within = |s: &Scored| s.allowed && s.predicted.total() <= margin * best + slack_s;
    if !pending.iter().zip(scored.iter()).any(|(&pending, scored)| pending && within(scored)) {
        return;
    }
    for (&pending, candidate) in pending.iter().zip(scored.iter_mut()) {
        candidate.allowed = pending && within(candidate);
    }
}

/// Seconds a request with `uncached` prompt tokens on `candidate` waits there for KV
/// ([`KvView`]): 0 without a usable report. KV is freed at least as fast as the engine decodes
/// a full batch (its decode rate, `1000 / decode_ms_per_request` tokens a second). The requests
/// routed there since the report count at what a running request holds (or their uncached
/// prompt when larger): each takes KV for its answer, even a sample of a prompt held there
/// (S10: counted only when the report showed requests waiting for KV, a burst of samples of
/// one prompt went to its holder, 150 in flight there with its report at 71% KV, and waited
/// 48 s for KV predicted at 0). `freed_share` is [`pool_freed_share`]; `since` what was sent
/// there since the report ([`RoutedLog::sent_since`], taken once by the caller).
fn kv_wait_s(
    load: Option<&crate::LoadSample>,
    since: Sent,
    per_request: f64,
    freed_share: Option<f64>,
    rates: Rates,
    uncached: f64,
) -> f64 {
    let Some(load) = load else { return 0.0 };
    let floor = 1000.0 / rates.decode_ms_per_request.max(1e-3);
    KvView::of(load, since, per_request, freed_share, floor)
        .map_or(0.0, |view| view.wait_s(view.need(uncached)) * rates.kv_wait_scale)
}

/// The share of a full engine's KV freed per second: the share of the pool's running requests
/// finished per second ([`kv_finished_share`]: a finished request frees all it held, its prompt
/// and its answer), or the tokens generated over the KV in use ([`kv_freed_share`], a lower
/// bound: a request holds at least its answer) when larger. Measured decision by decision
/// (each candidate's predicted wait beside the wait the request then got), the lower bound
/// alone predicted the wait for KV 3-12x too long wherever KV ran short (S7: 61 s for 10 s, S2
/// and S3: 118 and 155 s too long on average), so requests left the engine holding their
/// prefix to recompute it elsewhere; the finished share brings the bias within 10-25%.
fn pool_freed_share(generated: Option<f64>, finished: Option<f64>) -> Option<f64> {
    match (generated, finished) {
        (Some(generated), Some(finished)) => Some(generated.max(finished)),
        (generated, finished) => generated.or(finished),
    }
}

/// When every holder of the most of the prompt waits for KV, recomputing the prefix on an
/// engine that admits it now (no wait for KV, no prefill queued ahead) takes no cache another
/// request needs: the copy relieves the holders, which is what the KV they wait for cannot do.
/// Such a candidate is not charged the duplicate's cost (`prefill_cost_weight` x its prefill;
/// the cost of the requests that will queue behind its prefill stays). S11 (contexts of
/// 12K-40K tokens, KV-bound holders beside idle engines) held its questions on the holders
/// only while the wait there was predicted 2-3x too long; predicted right, a 35K-token context
/// elsewhere cost 97 s against 32 s of predicted TTFT at the holder, and the questions waited
/// there 27 s on average. An engine with prefill queued does not admit the request now: relieved
/// too, S2's conversations (every engine backlogged) lost 12% of their cache hits (8.4% of the
/// prompt tokens against 9.5%).
///
/// The same holds when every holder is overloaded ([`Scored::routed_load`] at least 1: more
/// uncached prompt tokens were routed to it over the last four load polls than it prefills in
/// that time, so its queue grows) and an idle engine (nothing running or in flight, no prefill
/// queued, no wait for KV) would give the request its first token sooner, recomputing the whole
/// prompt, than any holder: the holder's queue is fed faster than it drains, and the copy moves
/// work to an engine doing nothing (an agent's later calls follow their context). Charged the
/// duplicate there, agents' sessions of a popular application all started on its holder and
/// stayed with their contexts while 1-4 of 8 engines got no request in a whole run, the calls
/// queued 3-16 s there against 3-8 s of recomputing elsewhere (issue 41's own shape, open loop:
/// TTFT mean up to 2.2x cache_aware's; docs/BENCHMARKS.md). A holder that is not overloaded
/// keeps the charge: its queue is a burst that drains (S8's re-ask behind one long document,
/// S2, S6 and S7's chats), and copying there, relieved whenever the copy was sooner, cost S8 7%
/// of its hits and S6 and S7 5-55% of their TTFT mean or p99.
fn relieve_waiting_holders(
    scored: &mut [Scored],
    matched: impl Iterator<Item = usize>,
    settings: PredictSettings,
) {
    let matched: Vec<usize> = matched.collect();
    let most = matched.iter().copied().max().unwrap_or(0);
    let holders = || (0..scored.len()).filter(|&i| matched[i] == most);
    if most == 0 {
        return;
    }
    let wait_for_kv = holders().all(|i| scored[i].predicted.kv_wait_s > 0.0);
    let overloaded = holders().all(|i| scored[i].routed_load >= 1.0);
    let soonest_holder = holders().map(|i| scored[i].predicted.total()).fold(f64::INFINITY, f64::min);
    if !wait_for_kv && !overloaded {
        return;
    }
    for (held, candidate) in matched.iter().zip(scored.iter_mut()) {
        let idle = candidate.running == 0;
        let p = &mut candidate.predicted;
        let admits_now = *held < most && p.kv_wait_s == 0.0 && p.queue_s <= 0.0;
        if admits_now && (wait_for_kv || (idle && p.total() < soonest_holder)) {
            p.recompute_s = (p.recompute_s - p.prefill_s * settings.prefill_cost_weight).max(0.0);
        }
    }
}

impl KvAwarePolicy {
    /// Scores every candidate for a request of `prompt_tokens` tokens given the overlap `prefix`.
    fn score(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        prefix: &PrefixMatch,
        state: View<'_>,
        now_ms: u64,
        poll_ms: u64,
    ) -> Vec<Scored> {
        let s = &self.settings;
        let routed = state.routed;
        let loads: Vec<_> = candidates.iter().map(|c| fresh_load(c, now_ms, poll_ms)).collect();
        let kv_known = kv_usable(&candidates, now_ms, poll_ms);
        // What was routed to each candidate, looked up once for its queue, what was sent there
        // since its report and whether its prompt was.
        let logs: Vec<WorkerLog<'_>> = candidates.iter().map(|c| routed.of(c.id)).collect();
        // What was sent to each candidate since its usable report (none without one), taken once
        // for its KV usage and its wait for KV.
        let sent: Vec<Sent> = logs
            .iter()
            .zip(&loads)
            .map(|(log, load)| match load.as_ref().filter(|_| kv_known) {
                Some(load) => log.sent_since(load.fetched_at_ms),
                None => Sent::default(),
            })
            .collect();
        let kv: Vec<Option<f64>> = loads
            .iter()
            .zip(&sent)
            .map(|(load, sent)| {
                let load = load.as_ref().filter(|_| kv_known)?;
                let mut usage = load.token_usage;
                if load.max_total_num_tokens > 0 {
                    usage += sent.tokens / load.max_total_num_tokens as f64;
                }
                Some(usage.clamp(0.0, 1.0))
            })
            .collect();
        // The wait for KV, from the same usable snapshot as the KV terms: what a request holds
        // and the share of KV in use freed per second, over the pool's fresh reports.
        // On a shortlist of a large pool, over every engine's latest report (the shortlist's own,
        // chosen for being cold or idle, would say a request holds less and waits less).
        let (per_request, freed_share) = match state.pool_kv {
            Some(pool) => {
                (pool.per_request.unwrap_or(0.0), pool_freed_share(pool.generated_share, pool.finished_share))
            }
            None => {
                let finished = candidates.iter().zip(&loads).filter_map(|(c, load)| {
                    load.as_ref().map(|load| (load, state.rates.finished_per_sec_of(c.id)))
                });
                (
                    kv_per_request(loads.iter().flatten()).unwrap_or(0.0),
                    pool_freed_share(kv_freed_share(loads.iter().flatten()), kv_finished_share(finished)),
                )
            }
        };
        let below_exists = kv.iter().any(|k| k.is_none_or(|k| k <= s.overload));
        let prompt = request.prompt_tokens as f64;
        let whole_prompt = prompt_key(request);
        let recent_ms = now_ms.saturating_sub(poll_ms.saturating_mul(ROUTED_POLLS));
        let window_s = poll_ms.saturating_mul(ROUTED_POLLS).max(1) as f64 / 1000.0;
        let (per_sec, followers_per_leader) = state.arrivals.per_sec_and_followers(now_ms, poll_ms);
        let arrivals_per_sec = per_sec / candidates.pool_size() as f64;
        // A request whose whole prompt no candidate was sent moments ago leads: the samples of
        // its prompt that follow go where it goes.
        let pending: Vec<bool> = logs
            .iter()
            .map(|log| whole_prompt.is_some_and(|hash| log.holds_prompt(hash, recent_ms)))
            .collect();
        let leads = !pending.contains(&true);
        let followers = match leads && whole_prompt.is_some() {
            true => followers_per_leader,
            false => 0.0,
        };
        let mut scored = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| {
                // Tiers weighed: a block held in host memory or on disk is loaded back, which
                // costs part of its prefill (1 - its tier's weight), not nothing.
                let held = prefix.matched(c.id);
                let matched = if prefix.query_len() == 0 {
                    0.0
                } else {
                    prompt * prefix.credited(c.id) as f64 / prefix.query_len() as f64
                };
                let rates = state.rates.rates(c.id);
                let queued = predict::queued_tokens_in(
                    logs[i],
                    loads[i].as_ref(),
                    now_ms,
                    rates.prefill_tokens_per_sec,
                );
                let running = loads[i].map_or(c.in_flight, |l| l.num_running_reqs.max(c.in_flight));
                // A prompt routed there moments ago (a sample of the same prompt) is computed
                // there once, ahead of this one, though the engine has not reported it yet: on
                // the exact index the samples of one prompt looked uncached everywhere and
                // spread over the pool, each computing the prompt (S10).
                let matched = if pending[i] { prompt } else { matched };
                let uncached = (prompt - matched).max(0.0);
                let context = matched.min(prompt);
                let kv_wait_s = kv_wait_s(
                    loads[i].as_ref().filter(|_| kv_known),
                    sent[i],
                    per_request,
                    freed_share,
                    rates,
                    uncached,
                );
                let view = EngineView {
                    rates,
                    queued,
                    uncached,
                    context,
                    running,
                    kv_usage: kv[i],
                    arrivals_per_sec,
                    kv_wait_s,
                };
                let predicted = predict(&s.predict, &view);
                let allowed = !below_exists || kv[i].is_none_or(|k| k <= s.overload);
                let routed_load = logs[i].sent_since(recent_ms).tokens
                    / (rates.prefill_tokens_per_sec * window_s).max(f64::MIN_POSITIVE);
                Scored {
                    predicted,
                    uncached,
                    allowed,
                    waits_too_long: false,
                    followers,
                    held,
                    running,
                    routed_load,
                }
            })
            .collect::<Vec<_>>();
        let held: Vec<usize> = scored.iter().map(|scored| scored.held).collect();
        relieve_waiting_holders(&mut scored, held.into_iter(), s.predict);
        apply_wait_margin(&mut scored, s.wait_margin, s.wait_slack_s);
        follow_the_prompt(&mut scored, &pending, s.wait_margin, s.wait_slack_s);
        scored
    }

    /// The chosen candidate: the lowest prediction among the allowed (ties: fewer in flight, then
    /// at random), or a softmax sample at temperature > 0.
    fn choose(&self, candidates: &[Candidate], scored: &[Scored], rng: &mut dyn rand::RngCore) -> usize {
        let allowed = || (0..candidates.len()).filter(|&i| scored[i].allowed);
        let cost = |i: usize| scored[i].cost();
        let temperature = self.settings.temperature;
        if temperature > 0.0 {
            let best = allowed().map(cost).fold(f64::INFINITY, f64::min);
            // Predictions relative to the best one, so the temperature means the same at any load.
            let scale = temperature * best.max(1e-3);
            let weights: Vec<(usize, f64)> =
                allowed().map(|i| (i, (-(cost(i) - best) / scale).exp())).collect();
            let sum: f64 = weights.iter().map(|(_, w)| w).sum();
            let mut draw = rng.random_range(0.0..sum.max(f64::MIN_POSITIVE));
            for &(i, weight) in &weights {
                if draw < weight {
                    return i;
                }
                draw -= weight;
            }
            return weights.last().map(|&(i, _)| i).expect("an allowed candidate exists");
        }
        pick_min_by(allowed(), |i| ((cost(i) / TIE_SECS) as i64, candidates[i].in_flight), rng)
            .expect("an allowed candidate exists")
    }
}

impl Policy for KvAwarePolicy {
    fn name(&self) -> &'static str {
        "kv_aware"
    }

    fn needs_loads(&self) -> bool {
        true
    }

    fn needs_routing_key(&self) -> bool {
        true
    }

    fn predicts(&self) -> bool {
        true
    }

    /// The cheapest predicted engine is a holder of the prompt or an engine with little queued;
    /// the shortlist keeps both and the pool's size for the arrivals per engine.
    fn shortlists(&self) -> bool {
        true
    }

    /// The candidate with the lowest predicted time to first token plus cost, on the rates as
    /// they will be once every fresh load report is observed (`on_routed` observes them).
    fn decide(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let state = self.lock();
        let (now_ms, poll_ms) = (ctx.now_ms, ctx.load_poll_interval_ms);
        let pending = candidates.iter().any(|c| {
            fresh_load(c, now_ms, poll_ms).is_some_and(|load| state.rates.would_observe(c.id, &load))
        });
        let observed;
        let rates = match pending {
            true => {
                let mut rates = state.rates.clone();
                observe_reports(&mut rates, &candidates, &state.routed, now_ms, poll_ms);
                observed = rates;
                &observed
            }
            false => &state.rates,
        };
        let shortlisted = candidates.pool_size() > candidates.len();
        let pool_kv = state.favoured.pool_kv().filter(|_| shortlisted);
        let view = View { routed: &state.routed, rates, arrivals: &state.arrivals, pool_kv };
        Ok(self.decide_on(request, candidates, ctx, view))
    }

    /// The fresh load reports are observed (the rates learn), then the request's uncached
    /// prompt tokens join its engine's fluid queue and the pool's arrivals.
    fn on_routed(&self, routed: &Routed<'_>) {
        let (now_ms, poll_ms) = (routed.now_ms, routed.load_poll_interval_ms);
        let mut state = self.lock();
        let State { routed: log, rates, arrivals, landed, favoured } = &mut *state;
        // A decision on a shortlist of a large pool: every engine's latest report is observed,
        // not only the shortlist's (whose reports alone would leave the others pending, and
        // every decision learning on a copy of every engine's rates). On a whole pool, as
        // before: the candidates' reports, each engine's latest as the decision saw it.
        let shortlisted = routed.candidates.pool_size() > routed.candidates.len();
        if shortlisted {
            let reports: Vec<Candidate> = std::mem::take(landed)
                .into_iter()
                .map(|(id, load)| Candidate { id, in_flight: 0, load: Some(load) })
                .collect();
            observe_reports(rates, &reports, log, now_ms, poll_ms);
        } else {
            for c in routed.candidates.iter() {
                landed.remove(&c.id);
            }
        }
        observe_reports(rates, &routed.candidates, log, now_ms, poll_ms);
        let worker = routed.decision.worker;
        let prompt = prompt_key(routed.request);
        let recent_ms = now_ms.saturating_sub(poll_ms.saturating_mul(ROUTED_POLLS));
        let follower = prompt.is_some_and(|hash| log.holds_prompt(worker, hash, recent_ms));
        let mut uncached = routed.decision.uncached_tokens.unwrap_or(0.0);
        if let Some(hash) = prompt.filter(|_| follower) {
            let engine = routed.candidates.iter().find(|c| c.id == worker);
            let rate = rates.rates(worker).prefill_tokens_per_sec;
            uncached = uncached.max(first_follower_recompute(log, engine, hash, now_ms, poll_ms, rate));
        }
        let sent = Sent { requests: 1.0, tokens: uncached };
        log.record_prompt(worker, now_ms, sent, prompt, poll_ms.saturating_mul(ROUTED_POLLS));
        arrivals.record(now_ms, poll_ms, follower);
        let inputs = favoured::Inputs { settings: &self.settings.predict, rates, routed: log };
        favoured.routed(routed.decision.worker, shortlisted, &inputs);
    }

    /// The reports as they land. On a pool decided on whole, each engine's latest is kept until
    /// the next request sent, which observes it (the rates learn from the latest report at each
    /// request). On a pool decided on shortlists, each is observed as it lands (requests are
    /// sent between most reports there, so the latest at each request is nearly every one), so
    /// that neither a decision (on a copy of every engine's rates) nor the request sent after a
    /// burst of reports (observing them all: 10,000 at 10,000 engines) learns them, and the
    /// engine is keyed again for [`Policy::favoured`].
    ///
    /// The reports are taken a chunk of [`REPORTS_PER_LOCK`] at a time, the policy's lock let go
    /// between chunks, so that a decision waits for a chunk, not for a tick of 10,000 reports.
    /// When the fleet's rates moved, every engine is keyed again here (`rates_learned`), not by
    /// the next request sent.
    fn on_load_reports(&self, reports: &[(WorkerId, crate::LoadSample)], _now_ms: u64, poll_ms: u64) {
        for chunk in reports.chunks(REPORTS_PER_LOCK) {
            let mut state = self.lock();
            let State { routed, rates, landed, favoured, .. } = &mut *state;
            for &(id, load) in chunk {
                let finished = rates.finished_per_sec_of(id);
                if favoured.kept() {
                    if load.token_usage.is_finite() {
                        rates.observe(id, &load, routed, poll_ms);
                    }
                } else {
                    landed.insert(id, load);
                }
                let inputs = favoured::Inputs { settings: &self.settings.predict, rates, routed };
                favoured.report(id, load, finished, &inputs);
            }
        }
        let mut state = self.lock();
        let State { routed, rates, favoured, .. } = &mut *state;
        favoured.rates_learned(&favoured::Inputs { settings: &self.settings.predict, rates, routed });
    }

    /// The engines predicted cheapest for the uncached tokens asked, over every group asked
    /// (`favoured.rs`), while the pool is decided on shortlists.
    fn favoured(&self, now_ms: u64, asks: &[crate::FavouredAsk<'_>]) -> Vec<WorkerId> {
        self.lock().favoured.cheapest(now_ms, asks, favoured::FAVOURED)
    }

    /// The engine's measured time to first token teaches its rates (`rate.rs`).
    fn on_answered(&self, answered: &crate::Answered) {
        let mut state = self.lock();
        let State { routed, rates, favoured, .. } = &mut *state;
        rates.observe_answer(answered.worker, answered);
        favoured.rates_learned(&favoured::Inputs { settings: &self.settings.predict, rates, routed });
    }

    fn remove_worker(&self, worker: WorkerId) {
        let mut state = self.lock();
        state.routed.forget(worker);
        state.landed.remove(&worker);
        let finished = state.rates.finished_per_sec_of(worker);
        state.favoured.forget(worker, finished);
        state.rates.forget(worker);
    }
}

/// What a decision reads of the policy's state.
#[derive(Clone, Copy)]
struct View<'a> {
    routed: &'a RoutedLog,
    rates: &'a EngineRates,
    arrivals: &'a Arrivals,
    /// The pool's KV terms over every engine's report, on a shortlist of a large pool.
    pool_kv: Option<favoured::PoolKv>,
}

/// The prompt tokens the first sample to follow a prompt (of hash `prompt`, routed once to
/// `engine` over the last four load polls) computes there again: the engine admits it while
/// the prompt's prefill is still running, and it matches only the blocks stored so far, so it
/// computes what is still queued of the prompt (at most the prompt's own uncached tokens). The
/// decision charges it nothing (the prompt is pending there, and the samples go where it went),
/// but the engine's queue holds that work and the requests routed after it wait behind it:
/// uncounted, S10's followers computed 235K tokens (seed 1) the queue never had, against 283K
/// for the prompts' first samples, and a task family's new prompts kept going to the family's
/// holder as if its queue were little more than half as long as it was. Later samples are
/// admitted once the prompt is stored (0).
fn first_follower_recompute(
    log: &RoutedLog,
    engine: Option<&Candidate>,
    prompt: u64,
    now_ms: u64,
    poll_ms: u64,
    prefill_tokens_per_sec: f64,
) -> f64 {
    let recent_ms = now_ms.saturating_sub(poll_ms.saturating_mul(ROUTED_POLLS));
    let Some(engine) = engine else { return 0.0 };
    let (routed_before, leader_tokens) = log.prompt_routed(engine.id, prompt, recent_ms);
    if routed_before != 1.0 {
        return 0.0;
    }
    let load = fresh_load(engine, now_ms, poll_ms);
    leader_tokens.min(queued_tokens(engine, load.as_ref(), log, now_ms, prefill_tokens_per_sec))
}

/// Every candidate's fresh load report, taken into account by the rate learner (once per report).
fn observe_reports(
    rates: &mut EngineRates,
    candidates: &[Candidate],
    routed: &RoutedLog,
    now_ms: u64,
    poll_ms: u64,
) {
    for c in candidates {
        if let Some(load) = fresh_load(c, now_ms, poll_ms) {
            rates.observe(c.id, &load, routed, poll_ms);
        }
    }
}

impl KvAwarePolicy {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn decide_on(
        &self,
        request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
        state: View<'_>,
    ) -> Decision {
        let (now_ms, poll_ms) = (ctx.now_ms, ctx.load_poll_interval_ms);
        let index = ctx.prefix_index;
        let rng = &mut *ctx.rng;
        let mut outcome: Option<(usize, PredictedTtft, f64, Option<MatchInfo>, Reason)> = None;
        let mut decide = |prefix: &PrefixMatch| {
            let scored = self.score(request, candidates, prefix, state, now_ms, poll_ms);
            let chosen = self.choose(&candidates, &scored, rng);
            let query_len = prefix.query_len();
            let matches = (query_len > 0).then(|| {
                let best = scored.iter().map(|scored| scored.held).max().unwrap_or(0);
                MatchInfo {
                    best_match_rate: best as f64 / query_len as f64,
                    chosen_match_rate: scored[chosen].held as f64 / query_len as f64,
                }
            });
            // A holder of more of the prompt was kept out by the wait margin: replicated.
            let held = scored[chosen].held;
            let replicated = scored.iter().any(|scored| scored.waits_too_long && scored.held > held);
            let reason = if replicated { Reason::KvAwareReplicate } else { Reason::KvAware };
            // What the decision gave up: the best of the others it could have chosen.
            let runner_up = (0..scored.len())
                .filter(|&i| i != chosen && scored[i].allowed)
                .min_by(|&a, &b| scored[a].cost().total_cmp(&scored[b].cost()))
                .map(|i| scored[i].predicted.total());
            let predicted = PredictedTtft { runner_up_s: runner_up, ..scored[chosen].predicted };
            outcome = Some((chosen, predicted, scored[chosen].uncached, matches, reason));
            Some(candidates[chosen].id)
        };
        match (index, request.key.prompt()) {
            (Some(index), Some(key)) => {
                index.route(key, now_ms, &mut decide);
            }
            _ => {
                decide(&PrefixMatch::default());
            }
        }
        let (chosen, predicted, uncached, matches, reason) =
            outcome.expect("the index calls the chooser exactly once");
        Decision {
            worker: candidates[chosen].id,
            reason,
            matches,
            index: index.map(|index| index.kind()),
            predicted: Some(predicted),
            uncached_tokens: Some(uncached),
        }
    }
}

#[cfg(test)]
mod tests;
