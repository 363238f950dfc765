//! Learning each engine's prefill and decode speed from its load reports.
//!
//! Prefill: between two reports during which an engine was busy (prefill queued at both), it
//! computed what was queued at the first, plus what was routed to it since, minus what is
//! queued at the second. Decode: a report whose engine has no prefill queued and enough
//! requests running gives the time each running request adds to a step, `1000 /
//! gen_throughput` ms. Each engine keeps a running estimate of both.
//!
//! What predictions use (measured on S4, S6 and S7, docs/BENCHMARKS.md):
//! - An engine's estimate is a ratio of sums (the work it did over the time it was busy, both
//!   decayed by `1 - --kv-aware-rate-smoothing` per observation), so one interval mis-measured
//!   (a prompt the engine found cached when the index did not, or the reverse) moves it little.
//! - The fleet's rate: the mean of the measured engines' estimates, on a coarse grid (steps of
//!   `--kv-aware-rate-grid-step` from the configured rate) that moves only when the mean is well
//!   past the middle of a step. It corrects a badly configured rate.
//! - Per engine (`--kv-aware-per-engine-rates true`): the fleet's rate times the grid
//!   step to the power of the engine's deviation from it in whole steps, again with hysteresis,
//!   so equal engines measured with noise are predicted at exactly the same rate (a few percent
//!   of noise steering between equal engines is what made the first per-engine learner
//!   harmful: an engine predicted slow got fewer prompts, was never busy and never corrected),
//!   while an engine twice as fast as another is three steps apart.
//! - Exploration: an engine with fewer than `--kv-aware-rate-min-observations` busy intervals
//!   is predicted at the fleet's rate, never at the configured one: an engine not yet measured
//!   is neither shunned nor preferred, so it is given work, gets busy and is measured. (Starting
//!   each engine at the configured rate, with the rate configured 4x low, the engines measured
//!   first looked 4x faster than the others, took all the work, and the others were never
//!   measured.)
//! - Credibility (`--kv-aware-rate-prior-observations k`, per engine): an engine's estimate is
//!   weighed against the fleet's rate as if the fleet's were k observations, in log space (a
//!   speed ratio): `fleet x (own / fleet)^(n / (n + k))`, n the engine's decayed count of busy
//!   intervals, before the grid. With no samples it is the fleet's rate; it always lies between
//!   the fleet's rate and the engine's own (property test).
//! - Two biases of one interval's reading, each behind an option (off by default, so the
//!   fleet-wide default is unchanged): prompts the engine found cached where the index did not
//!   count as computed (a burst on one hot document reads as a huge rate:
//!   `--kv-aware-rate-max-ratio` bounds one interval's rate to a factor of the fleet's), and an
//!   engine that drained and idled inside an interval reads as slow (idle time counted as
//!   compute: `--kv-aware-rate-saturated-intervals` learns only from intervals whose starting
//!   queue alone keeps the engine busy throughout at the fleet's rate).
//! - Fleet-wide (`--kv-aware-per-engine-rates false`, the default): the fleet's rate for every
//!   engine. Per-engine rates alone, though measured right, made kv_aware worse on S6 (the
//!   unequal fleet) and on S7 (bursts, equal engines); with the credibility prior and both
//!   interval filters they beat the fleet's rate on S6 and stay within 1-2% elsewhere (S5's
//!   p99 +7%), so they stay opt-in: see docs/BENCHMARKS.md.
//!
//! - Measured times to first token ([`EngineRates::observe_answer`], `ttft.rs`): every answer
//!   the host measured teaches a robust least-squares fit of `base + tokens / rate + context x
//!   pairs + running x decode` (pairs: the (new token, context token) pairs of its own
//!   prefill, whose cost grows with the context it attends to). Engines whose load reports never
//!   say what prefill is queued (vLLM's `/metrics`; fleet-wide: no engine's reports, per engine:
//!   that engine's) are predicted at the fit's rates and context cost once it has 8 answers; it
//!   converges within 32-64 (`ttft.rs`'s tests: 10% on the rate with 20% noise on each answer,
//!   15% on each coefficient with 10%). The fit's `base` (what no rate explains: the engine's
//!   server and a forward pass's fixed cost) is every engine's fixed term.
//! - An engine whose reports say what prefill is queued (SGLang's `/v1/loads`: some report
//!   showed prefill queued) is predicted at the reports' rates, the configured ones until busy
//!   intervals teach them, never at the fit's, however few busy intervals were observed. Asking
//!   instead whether a rate had been measured from its reports sent S10's rollouts (a burst a
//!   step, reports observed only when a request is sent: no busy interval in 1,000 requests)
//!   to the fit, meant for vLLM, whose four coefficients, fitted on a few bursts of answers,
//!   changed from run to run over HTTP (the mean predicted decode term 143 ms in one run, 6 ms
//!   in the next) and differed from the simulator's.
//!
//! Only prompts this host routed are counted as arrivals, so with several gateway replicas in
//! front of one fleet the estimate is low (the others' prompts are computed too): leave learning
//! off there, or configure the rate.

mod kv_wait_scale;
mod ttft;

use crate::inflight::RoutedLog;
use crate::{LoadSample, WorkerId, WorkerMap};
use kv_wait_scale::KvWaitScale;
pub use ttft::attention_pairs;
use ttft::{Answer, Bounds, Fitted, TtftFit};

/// The estimate stays within this factor of the configured rate either way.
const MAX_FACTOR: f64 = 10.0;
/// How far past the middle of a step (in steps) the estimate must go to move the rate used.
const HYSTERESIS: f64 = 0.25;
/// Fewest running requests for a decode observation (below, the fixed cost of a step dominates).
const MIN_DECODE_BATCH: u64 = 8;

/// The learner's options (from `PolicyConfig`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateSettings {
    /// Prefill tokens per second predicted before anything is learned.
    pub prefill_tokens_per_sec: f64,
    /// Milliseconds each running request adds to a decode step, before anything is learned.
    pub decode_ms_per_request: f64,
    pub learn: bool,
    pub per_engine: bool,
    /// Busy intervals before an engine's own estimate is used.
    pub min_observations: u32,
    /// How fast an engine's running estimate forgets: each observation multiplies the work and
    /// time summed so far by `1 - smoothing`, in (0, 1].
    pub smoothing: f64,
    /// Ratio between two rates of the grid, > 1.
    pub grid_step: f64,
    /// Per engine: the fleet's observations an engine's own estimate is weighed against (0:
    /// its own estimate alone).
    pub prior_observations: f64,
    /// One interval's prefill rate counts at most this factor from the fleet's either way, >= 1
    /// (0: unbounded).
    pub max_ratio: f64,
    /// Learn the prefill rate only from intervals the starting queue alone kept busy.
    pub saturated_intervals: bool,
}

/// A running rate: work over time, both decayed by `1 - smoothing` at each observation (a ratio
/// of sums, so one interval mis-measured moves it little).
#[derive(Clone, Copy, Debug, Default)]
struct Running {
    work: f64,
    time: f64,
    observations: u32,
    /// The observations, decayed as the sums are: how much the estimate rests on.
    weight: f64,
}

impl Running {
    fn observe(&mut self, work: f64, time: f64, smoothing: f64) {
        let keep = 1.0 - smoothing;
        self.work = self.work * keep + work;
        self.time = self.time * keep + time;
        self.weight = self.weight * keep + 1.0;
        self.observations = self.observations.saturating_add(1);
    }

    fn rate(&self) -> Option<f64> {
        (self.observations > 0 && self.time > 0.0).then(|| self.work / self.time)
    }
}

/// The grid rate to use given the one in use and the current estimate.
fn snap(used: f64, estimate: f64, configured: f64, step: f64) -> f64 {
    let steps = |rate: f64| (rate / configured).ln() / step.ln();
    let (current, wanted) = (steps(used), steps(estimate));
    if (wanted - current).abs() <= 0.5 + HYSTERESIS {
        return used;
    }
    configured * step.powf(wanted.round())
}

/// An engine's estimate weighed against the fleet's rate by credibility: the fleet's rate times
/// the engine's measured speed ratio to the power `weight / (weight + prior)`. Always between the
/// fleet's rate and the engine's own estimate; the fleet's rate for an engine without samples.
pub fn credible(own: f64, weight: f64, fleet: f64, prior: f64) -> f64 {
    let credibility = if weight + prior > 0.0 { weight / (weight + prior) } else { 0.0 };
    fleet * (own / fleet).powf(credibility)
}

/// An engine's deviation from the fleet's grid rate in grid steps, moved only past the
/// hysteresis: equal engines measured with noise all stay at 0 steps.
fn deviation(previous: i32, estimate: f64, fleet: f64, step: f64) -> i32 {
    let wanted = (estimate / fleet).ln() / step.ln();
    if (wanted - f64::from(previous)).abs() <= 0.5 + HYSTERESIS {
        previous
    } else {
        wanted.round() as i32
    }
}

/// One learned quantity (prefill or decode speed) of one engine.
#[derive(Clone, Copy, Debug, Default)]
struct Speed {
    running: Running,
    /// Grid steps from the fleet's rate.
    steps: i32,
}

#[derive(Clone, Copy, Debug)]
struct Learned {
    /// The last report seen: when its poll was sent, the prefill it said was queued, and
    /// whether its waiting requests waited for KV ([`crate::kv_wait::waits_for_kv`]).
    at_ms: u64,
    queued: f64,
    kv_bound: bool,
    /// Requests running or waiting at the last report.
    in_system: f64,
    /// Whether some report said prefill was queued: its reports say what is queued (SGLang's
    /// `num_waiting_uncached_tokens`; vLLM's reports never do).
    shows_queue: bool,
    /// Requests finished per second: those routed there between two reports less the growth
    /// of its running and waiting requests.
    finished: Running,
    prefill: Speed,
    /// Decode speed as a rate, 1000 / (ms each running request adds to a step), so the grid and
    /// the fleet mean treat it as the prefill rate.
    decode: Speed,
}

#[derive(Clone, Copy, Debug)]
enum Quantity {
    Prefill,
    Decode,
}

/// The fleet's grid rate of one quantity, and the engines measured enough to count in its mean.
#[derive(Clone, Copy, Debug)]
struct Fleet {
    configured: f64,
    used: f64,
    /// The measured engines' rates summed, and how many: kept as each engine's speed changes,
    /// so a refresh does not walk every engine (at 10,000 engines, each report learned walked
    /// them all).
    measured_sum: f64,
    measured: usize,
}

impl Fleet {
    fn new(rate: f64) -> Self {
        Fleet { configured: rate, used: rate, measured_sum: 0.0, measured: 0 }
    }

    /// `speed`'s part of the measured engines' mean (none before `min` observations).
    fn part(speed: &Speed, min: u32) -> Option<f64> {
        speed.running.rate().filter(|_| speed.running.observations >= min)
    }

    /// One engine's speed changed from `old` to `new` (`None`: it had none, or has none now).
    fn replace(&mut self, old: Option<f64>, new: Option<f64>) {
        if let Some(old) = old {
            self.measured_sum -= old;
            self.measured -= 1;
        }
        if let Some(new) = new {
            self.measured_sum += new;
            self.measured += 1;
        }
        if self.measured == 0 {
            self.measured_sum = 0.0;
        }
    }
}

/// The rates to predict with: the configured ones until reports teach otherwise.
#[derive(Clone, Debug)]
pub struct EngineRates {
    settings: RateSettings,
    engines: WorkerMap<Learned>,
    prefill: Fleet,
    decode: Fleet,
    /// Each engine's answers, and the fleet's (`ttft.rs`).
    answers: WorkerMap<TtftFit>,
    pooled: TtftFit,
    /// Engines whose reports say what prefill is queued (`Learned::shows_queue`).
    showing_queue: usize,
    /// The fleet's measured waits for KV over the predicted ones.
    kv_wait: KvWaitScale,
}

/// What the prediction uses for one engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    pub prefill_tokens_per_sec: f64,
    pub decode_ms_per_request: f64,
    /// The engine's fixed cost of any request, in seconds (learned from measured times to first
    /// token; 0 until then).
    pub base_s: f64,
    /// Nanoseconds each (new token, context token) pair of a prefill adds ([`attention_pairs`];
    /// learned from measured times to first token, 0 until then).
    pub context_ns_per_pair: f64,
    /// What the wait for KV the model predicts ([`crate::kv_wait::KvView::wait_s`]) is
    /// multiplied by: the waits measured over those predicted ([`KvWaitScale`]; 1 until learned).
    pub kv_wait_scale: f64,
}

impl Default for Rates {
    fn default() -> Self {
        Self {
            prefill_tokens_per_sec: 0.0,
            decode_ms_per_request: 0.0,
            base_s: 0.0,
            context_ns_per_pair: 0.0,
            kv_wait_scale: 1.0,
        }
    }
}

impl EngineRates {
    pub fn new(settings: RateSettings) -> Self {
        let prefill = settings.prefill_tokens_per_sec;
        let decode = 1000.0 / settings.decode_ms_per_request.max(1e-9);
        Self {
            settings,
            engines: WorkerMap::default(),
            prefill: Fleet::new(prefill),
            decode: Fleet::new(decode),
            answers: WorkerMap::default(),
            pooled: TtftFit::default(),
            showing_queue: 0,
            kv_wait: KvWaitScale::default(),
        }
    }

    /// After `worker`'s speed changed: the fleet's grid rate (the mean of the measured engines,
    /// with hysteresis) and the engines' deviations from it (every engine's when the fleet's
    /// rate moved, else `worker`'s).
    fn refresh(&mut self, worker: WorkerId, pick: fn(&mut Learned) -> &mut Speed, quantity: Quantity) {
        let min = self.settings.min_observations;
        let step = self.settings.grid_step;
        let prior = self.settings.prior_observations;
        let fleet = *self.fleet(quantity);
        if fleet.measured == 0 {
            return;
        }
        let clamp = |rate: f64| rate.clamp(fleet.configured / MAX_FACTOR, fleet.configured * MAX_FACTOR);
        let mean = clamp(fleet.measured_sum / fleet.measured as f64);
        let used = snap(fleet.used, mean, fleet.configured, step);
        self.fleet(quantity).used = used;
        let deviate = |speed: &mut Speed| {
            if let Some(rate) = speed.running.rate().filter(|_| speed.running.observations >= min) {
                let estimate = credible(clamp(rate), speed.running.weight, used, prior);
                speed.steps = deviation(speed.steps, estimate, used, step);
            }
        };
        if used != fleet.used {
            self.engines.values_mut().for_each(|learned| deviate(pick(learned)));
        } else if let Some(learned) = self.engines.get_mut(&worker) {
            deviate(pick(learned));
        }
    }

    /// The fleet's prefill and decode rates in use (the grid's; they move rarely).
    pub fn fleet_rates(&self) -> (f64, f64) {
        (self.prefill.used, self.decode.used)
    }

    fn fleet(&mut self, quantity: Quantity) -> &mut Fleet {
        match quantity {
            Quantity::Prefill => &mut self.prefill,
            Quantity::Decode => &mut self.decode,
        }
    }

    /// One quantity's rate on `worker`: the fleet's grid rate, times the engine's own deviation
    /// in grid steps when per-engine and measured enough.
    fn rate(&self, worker: WorkerId, fleet: &Fleet, pick: fn(&Learned) -> &Speed) -> f64 {
        if !self.settings.learn {
            return fleet.configured;
        }
        let steps = match self.engines.get(&worker).map(pick) {
            Some(speed)
                if self.settings.per_engine
                    && speed.running.observations >= self.settings.min_observations =>
            {
                speed.steps
            }
            _ => 0,
        };
        fleet.used * self.settings.grid_step.powi(steps)
    }

    /// The rates to predict `worker` with: from the load reports where they say what prefill is
    /// queued, else from the measured times to first token once there are enough (module doc).
    pub fn rates(&self, worker: WorkerId) -> Rates {
        let mut reported = Rates {
            prefill_tokens_per_sec: self.rate(worker, &self.prefill, |l| &l.prefill),
            decode_ms_per_request: 1000.0 / self.rate(worker, &self.decode, |l| &l.decode),
            base_s: 0.0,
            context_ns_per_pair: 0.0,
            kv_wait_scale: 1.0,
        };
        if !self.settings.learn {
            return reported;
        }
        reported.kv_wait_scale = self.kv_wait.scale();
        let Some(fit) = self.answers_of(worker) else { return reported };
        if self.reports_show_queue(worker) {
            let rates = Fitted {
                base_s: 0.0,
                prefill_tokens_per_sec: reported.prefill_tokens_per_sec,
                context_s_per_pair: 0.0,
                decode_s_per_request: reported.decode_ms_per_request / 1000.0,
            };
            return Rates { base_s: fit.base_given(rates).unwrap_or(0.0), ..reported };
        }
        match fit.fitted() {
            Some(fitted) => Rates {
                prefill_tokens_per_sec: fitted.prefill_tokens_per_sec,
                decode_ms_per_request: fitted.decode_s_per_request * 1000.0,
                base_s: fitted.base_s,
                context_ns_per_pair: fitted.context_s_per_pair * 1e9,
                kv_wait_scale: reported.kv_wait_scale,
            },
            None => reported,
        }
    }

    /// The answers `worker` is predicted from: its own per engine once it has enough, else the
    /// fleet's.
    fn answers_of(&self, worker: WorkerId) -> Option<&TtftFit> {
        let own = self.answers.get(&worker).filter(|fit| fit.samples >= ttft::MIN_SAMPLES);
        match own {
            Some(fit) if self.settings.per_engine => Some(fit),
            _ => (self.pooled.samples >= ttft::MIN_SAMPLES).then_some(&self.pooled),
        }
    }

    /// Whether the load reports say what prefill `worker` has queued, so that they teach its
    /// prefill rate (the configured one until they do): per engine, some report of its own
    /// showed prefill queued; fleet-wide, some engine's did (a count kept as reports come, not
    /// a walk over every engine for every candidate of every decision).
    fn reports_show_queue(&self, worker: WorkerId) -> bool {
        match self.settings.per_engine {
            true => self.engines.get(&worker).is_some_and(|learned| learned.shows_queue),
            false => self.showing_queue > 0,
        }
    }

    /// The configured rates, what the fit of measured times to first token is pulled toward
    /// (no context cost), and the prefill rates it may give.
    fn bounds(&self) -> Bounds {
        let prior = Fitted {
            base_s: 0.0,
            prefill_tokens_per_sec: self.settings.prefill_tokens_per_sec,
            context_s_per_pair: 0.0,
            decode_s_per_request: self.settings.decode_ms_per_request / 1000.0,
        };
        let configured = self.prefill.configured;
        Bounds { prior, min_rate: configured / MAX_FACTOR, max_rate: configured * MAX_FACTOR }
    }

    /// One answer `worker` gave: the prediction its decision was made on, the prompt and what
    /// the engine reported cached, and its time to first token as the host measured it, less
    /// the wait for KV the decision predicted (`PredictedTtft::kv_wait_s`). Teaches the fit of
    /// `worker` and the fleet's (`ttft.rs`).
    pub fn observe_answer(&mut self, worker: WorkerId, answer: &crate::Answered) {
        if !self.settings.learn {
            return;
        }
        let used = answer.predicted.rates;
        if used.prefill_tokens_per_sec.is_nan() || used.prefill_tokens_per_sec <= 0.0 {
            return;
        }
        let ahead = answer.predicted.queue_s * used.prefill_tokens_per_sec;
        let own = f64::from(answer.prompt_tokens.saturating_sub(answer.cached_tokens));
        let pairs = attention_pairs(own, f64::from(answer.cached_tokens.min(answer.prompt_tokens)));
        let running = match used.decode_ms_per_request > 0.0 {
            true => (answer.predicted.decode_s * 1000.0 / used.decode_ms_per_request).round(),
            false => 0.0,
        };
        // The wait for KV the decision predicted is no prefill: left in, the fit would read an
        // engine whose requests queue for KV as a slow one (an answer the prediction says was
        // all wait teaches nothing).
        let ttft_s = answer.ttft_s - answer.predicted.kv_wait_s.max(0.0);
        // The wait for KV the model predicted, against what the answer took beyond the rest of
        // its prediction: only where the wait is most of the prediction, so that the other
        // terms' error (a queue drained sooner, the hop to the engine) is not read as a wait.
        let p = &answer.predicted;
        let rest = p.queue_s + p.prefill_s + p.decode_s + p.base_s;
        let model_wait = p.kv_wait_s / used.kv_wait_scale.max(1.0);
        if model_wait > 0.0 && model_wait >= rest {
            self.kv_wait.observe(answer.ttft_s - rest, model_wait);
        }
        let sample = Answer { tokens: ahead + own, pairs, running, ttft_s };
        let bounds = self.bounds();
        self.answers.entry(worker).or_default().observe(sample, &bounds);
        self.pooled.observe(sample, &bounds);
    }

    /// Whether [`EngineRates::observe`] would learn from `report` (a report of `worker` newer
    /// than the last one taken into account): a decision made before it is then made on a copy
    /// that has observed it, so that deciding records nothing.
    pub fn would_observe(&self, worker: WorkerId, report: &LoadSample) -> bool {
        self.settings.learn && self.engines.get(&worker).is_some_and(|seen| report.fetched_at_ms > seen.at_ms)
    }

    /// Takes `worker`'s report into account (once per report). Reports closer than half the
    /// poll interval `poll_ms` are too noisy to learn a prefill rate from.
    pub fn observe(&mut self, worker: WorkerId, report: &LoadSample, routed: &RoutedLog, poll_ms: u64) {
        if !self.settings.learn {
            return;
        }
        let smoothing = self.settings.smoothing;
        let min = self.settings.min_observations;
        let fleet_prefill = self.prefill.used;
        let RateSettings { max_ratio, saturated_intervals, .. } = self.settings;
        let queued = report.num_waiting_uncached_tokens as f64;
        let kv_bound = crate::kv_wait::waits_for_kv(report);
        let in_system = (report.num_running_reqs + report.num_waiting_reqs) as f64;
        let entry = self.engines.entry(worker).or_insert_with(|| Learned {
            at_ms: report.fetched_at_ms,
            queued,
            kv_bound,
            in_system,
            shows_queue: false,
            finished: Running::default(),
            prefill: Speed::default(),
            decode: Speed::default(),
        });
        if queued > 0.0 && !entry.shows_queue {
            entry.shows_queue = true;
            self.showing_queue += 1;
        }
        if report.fetched_at_ms <= entry.at_ms {
            return;
        }
        let interval_ms = report.fetched_at_ms - entry.at_ms;
        let mut prefill_learned = false;
        let secs = interval_ms as f64 / 1000.0;
        let saturated = !saturated_intervals || entry.queued >= fleet_prefill * secs;
        // Prefill queued behind requests waiting for KV drains as running requests finish, not
        // at the prefill rate: such an interval says nothing of the rate.
        let prefill_bound = !entry.kv_bound && !kv_bound;
        if interval_ms >= poll_ms / 2 && entry.queued > 0.0 && queued > 0.0 && saturated && prefill_bound {
            let arrived: f64 = routed
                .entries(worker)
                .filter(|&(at, _)| at >= entry.at_ms && at < report.fetched_at_ms)
                .map(|(_, tokens)| tokens)
                .sum();
            let computed = entry.queued + arrived - queued;
            if computed > 0.0 {
                let mut rate = computed / secs;
                if max_ratio >= 1.0 {
                    rate = rate.clamp(fleet_prefill / max_ratio, fleet_prefill * max_ratio);
                }
                let old = Fleet::part(&entry.prefill, min);
                entry.prefill.running.observe(rate * secs, secs, smoothing);
                self.prefill.replace(old, Fleet::part(&entry.prefill, min));
                prefill_learned = true;
            }
        }
        if interval_ms >= poll_ms / 2 {
            let routed_between = routed.sent_since(worker, entry.at_ms).requests
                - routed.sent_since(worker, report.fetched_at_ms).requests;
            let finished = (routed_between + entry.in_system - in_system).max(0.0);
            entry.finished.observe(finished, secs, smoothing);
        }
        let mut decode_learned = false;
        if queued == 0.0 && report.num_running_reqs >= MIN_DECODE_BATCH && report.gen_throughput > 0.0 {
            // A step of b running requests produces b tokens, so each request adds 1000 /
            // gen_throughput ms to it: the decode "rate" learned is gen_throughput itself.
            let old = Fleet::part(&entry.decode, min);
            entry.decode.running.observe(report.gen_throughput, 1.0, smoothing);
            self.decode.replace(old, Fleet::part(&entry.decode, min));
            decode_learned = true;
        }
        entry.at_ms = report.fetched_at_ms;
        entry.queued = queued;
        entry.kv_bound = kv_bound;
        entry.in_system = in_system;
        if prefill_learned {
            self.refresh(worker, |l| &mut l.prefill, Quantity::Prefill);
        }
        if decode_learned {
            self.refresh(worker, |l| &mut l.decode, Quantity::Decode);
        }
    }

    /// Requests `worker` finishes per second, from its reports.
    pub fn finished_per_sec_of(&self, worker: WorkerId) -> Option<f64> {
        self.engines.get(&worker).and_then(|learned| learned.finished.rate())
    }

    pub fn forget(&mut self, worker: WorkerId) {
        let min = self.settings.min_observations;
        if let Some(learned) = self.engines.remove(&worker) {
            self.showing_queue -= usize::from(learned.shows_queue);
            self.prefill.replace(Fleet::part(&learned.prefill, min), None);
            self.decode.replace(Fleet::part(&learned.decode, min), None);
        }
        self.answers.remove(&worker);
    }
}

#[cfg(test)]
mod tests;
