//! Is the index right? The closed loop on the request path: what the exact index predicted
//! cached on the worker a request went to ([`Probe`], taken before the request is sent), and
//! what that worker's engine then reported cached, read from its answer as it passes
//! ([`UsageTap`]: a whole body's `usage` or `meta_info`, a stream's last usage chunk). Each
//! answered request adds to the per model and worker counters and histogram and to the worker's
//! window (`kvgate_index::IndexAccuracy`), which raises one warning naming the likely cause when
//! the two disagree persistently (shown in `/workers` as `index_accuracy`).
//!
//! The same tap teaches kv_aware its engines' speed ([`Learn`]): a stream's time to first byte
//! (the engines send nothing before the first token), the prompt and cached tokens its engine
//! reported, and what the decision predicted, handed to the policy (`Policy::on_answered`).
//!
//! A stream carries its usage only when asked (`stream_options.include_usage`): the gateway
//! asks on the client's behalf ([`ask_for_usage`]) and leaves that chunk out again.

use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};
use kvgate_index::{AccuracyChange, AccuracySample, BlockIndex, Namespace, PrefixMatch, PromptHashes};
use prometheus::{IntCounter, IntCounterVec};

use kvgate_fleet::worker::{ModelAccuracy, Worker};
use kvgate_gateway_core::metrics::Metrics;
use kvgate_protocol::edit::{edit_body, FieldEdit};
use kvgate_protocol::usage::{usage_of_body, EngineUsage, StreamUsage};

/// Whole answers larger than this are not read for their usage (they pass through untouched).
const MAX_READ_BODY: usize = 1 << 20;

/// What the index predicted for one request on the worker it was sent to.
#[derive(Clone, Debug)]
pub struct Probe {
    /// The prompt tokens the prediction covers: the whole prompt, or its first
    /// `--max-tokenize-chars` characters' tokens when `cut`.
    pub prompt_tokens: u32,
    /// The request was routed on the start of a longer prompt (`--max-tokenize-chars`): what
    /// the engine serves cached beyond `prompt_tokens` is out of the index's sight by design,
    /// not an index fault, so the closed loop compares the routed prefix alone.
    pub cut: bool,
    /// Leading prompt tokens the exact index says the worker's engine holds (any tier).
    pub predicted: u32,
    /// The worker's KV events flowed into the exact index the prediction came from.
    pub exact: bool,
    /// The model's window (every worker's answers), once the pool is known.
    pub model_window: Option<Arc<ModelAccuracy>>,
    /// The worker's count of removed KV blocks when the prediction was made: blocks removed
    /// before the answer may be what the engine no longer served.
    pub removed_at: u64,
    /// The request's tenant (its metric label), whose cached tokens are counted.
    pub tenant: Option<String>,
}

impl Probe {
    /// The prediction for `tokens` (in `namespace`; `hashes`: their block hashes, when the
    /// decision computed them) on `worker` from the model's exact index.
    pub fn predict(
        index: &BlockIndex,
        tokens: &[u32],
        namespace: Namespace<'_>,
        hashes: Option<&PromptHashes>,
        worker: u32,
        exact: bool,
    ) -> Probe {
        let mut matched = PrefixMatch::default();
        match hashes {
            // What the engine will serve: never the prompt's last token (`served_overlap`).
            Some(hashes) => index.served_overlap_hashed(hashes, &mut matched),
            None => index.served_overlap(tokens, namespace, &mut matched),
        }
        let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Probe {
            prompt_tokens: clamp(tokens.len()),
            cut: false,
            predicted: clamp(matched.matched(worker)),
            exact,
            model_window: None,
            removed_at: 0,
            tenant: None,
        }
    }
}

/// What kv_aware's decision predicted for a streamed request, to learn from its answer.
#[derive(Clone)]
pub struct Learn {
    pub policy: Arc<dyn kvgate_policy::Policy>,
    pub worker: u32,
    pub predicted: kvgate_policy::PredictedTtft,
    /// The prompt's tokens as the gateway counted them (when the engine does not say).
    pub prompt_tokens: u32,
    /// Seconds from the request's arrival at the gateway to its decision (the tokenizer's
    /// queue, admission): left out of the answer's time to first token, which the policy
    /// compares with a prediction made at the decision (`Answered::ttft_s`).
    pub decided_s: f64,
}

impl std::fmt::Debug for Learn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learn")
            .field("worker", &self.worker)
            .field("predicted", &self.predicted)
            .field("decided_s", &self.decided_s)
            .finish()
    }
}

impl Learn {
    /// Hands the answer to the policy: its time to first token from the decision (`ttft_s`,
    /// from the request's arrival, less `decided_s`) and the engine's usage (an answer whose
    /// usage did not say what was cached teaches nothing).
    fn answered(self, usage: Option<EngineUsage>, ttft_s: f64) {
        let Some(usage) = usage else { return };
        let Some(cached_tokens) = usage.cached_tokens else { return };
        let prompt_tokens = engine_prompt_tokens(Some(usage), self.prompt_tokens);
        self.policy.on_answered(&kvgate_policy::Answered {
            worker: self.worker,
            predicted: self.predicted,
            prompt_tokens,
            cached_tokens: cached_tokens.min(prompt_tokens),
            ttft_s: (ttft_s - self.decided_s).max(0.0),
        });
    }
}

/// A streamed OpenAI request's body asking for the final usage chunk (`None`: not a JSON
/// object, left as it is): `stream_options.include_usage` set, by the one body editor (put
/// first, the rest byte for byte, when the client set no `stream_options`).
pub fn ask_for_usage(body: &[u8]) -> Option<Bytes> {
    edit_body(body, &[FieldEdit::SetIn("stream_options", "include_usage", serde_json::Value::Bool(true))])
        .ok()
}

/// How the answer is read.
#[derive(Debug)]
enum Reader {
    Stream(StreamUsage),
    /// A whole JSON body, collected up to [`MAX_READ_BODY`] (`None`: it was larger).
    Whole(Option<BytesMut>),
}

/// Reads one answer's usage as it passes (and leaves the injected usage chunk out of a stream);
/// at its end, records the closed loop's sample.
#[derive(Debug)]
pub struct UsageTap {
    reader: Reader,
    /// The prediction to compare with, and the worker it was made for.
    probe: Option<(Probe, Arc<Worker>)>,
    /// kv_aware's prediction, to learn from (streams only).
    learn: Option<Learn>,
}

impl UsageTap {
    /// Leaves the closed loop's prediction out: the answer is not the predicted worker's.
    pub fn forget_probe(&mut self) {
        self.probe = None;
        self.learn = None;
    }

    /// Whether the answer passes changed (the usage chunk the gateway asked for left out).
    pub fn rewrites(&self) -> bool {
        matches!(&self.reader, Reader::Stream(stream) if stream.strips())
    }

    /// A tap on an answer: `stream` for an event stream, `strip` when the gateway asked for the
    /// usage chunk on the client's behalf.
    pub fn new(probe: Option<(Probe, Arc<Worker>)>, stream: bool, strip: bool) -> Self {
        let reader = if stream {
            Reader::Stream(StreamUsage::new(strip))
        } else {
            Reader::Whole(Some(BytesMut::new()))
        };
        UsageTap { reader, probe, learn: None }
    }

    /// Also hands the answer to kv_aware to learn from (`learn`: a stream's prediction).
    pub fn learning(self, learn: Option<Learn>) -> Self {
        UsageTap { learn, ..self }
    }

    /// One data frame of the answer; returns what to pass on.
    pub fn on_frame(&mut self, data: Bytes) -> Bytes {
        match &mut self.reader {
            Reader::Stream(stream) => stream.on_frame(data),
            Reader::Whole(collected) => {
                if let Some(buffer) = collected {
                    if buffer.len() + data.len() > MAX_READ_BODY {
                        *collected = None;
                    } else {
                        buffer.extend_from_slice(&data);
                    }
                }
                data
            }
        }
    }

    /// The answer ended: records the sample (and, with its time to first byte `first_byte_s`,
    /// teaches kv_aware); returns what a stream still held (to pass on) and the answer's usage.
    pub fn finish(&mut self, metrics: &Metrics, first_byte_s: Option<f64>) -> (Bytes, Option<EngineUsage>) {
        let (rest, usage) = match &mut self.reader {
            Reader::Stream(stream) => {
                let rest = stream.finish();
                (rest, stream.usage())
            }
            Reader::Whole(collected) => {
                (Bytes::new(), collected.take().and_then(|body| usage_of_body(&body)))
            }
        };
        if let Some((probe, worker)) = self.probe.take() {
            record(metrics, &worker, probe, usage);
        }
        if let (Some(learn), Some(ttft_s)) = (self.learn.take(), first_byte_s) {
            learn.answered(usage, ttft_s);
        }
        (rest, usage)
    }

    /// The body was dropped before its end was polled (a whole body of known length is done
    /// once its bytes are written; a client that went away): records the sample when the
    /// answer's usage was read, never a guess from half an answer. Returns that usage.
    pub fn dropped(&mut self, metrics: &Metrics) -> Option<EngineUsage> {
        let usage = match &mut self.reader {
            Reader::Stream(stream) => stream.usage(),
            Reader::Whole(collected) => collected.take().and_then(|body| usage_of_body(&body)),
        };
        if let (Some(usage), Some((probe, worker))) = (usage, self.probe.take()) {
            record(metrics, &worker, probe, Some(usage));
        }
        usage
    }
}

/// The prompt tokens and the engine's cached tokens the closed loop compares with the
/// prediction: the engine's own prompt length where it says (a wrong template changes the
/// gateway's) and all it served cached; for a request routed on the start of a longer prompt
/// (`cut`), that start alone, and what the engine served cached within it (an agent's 100K-token
/// context past `--max-tokenize-chars` is served from the cache the index cannot see; counting
/// it as missed would call a healthy index wrong).
fn compared(probe: &Probe, usage: Option<EngineUsage>) -> (u32, Option<u32>) {
    let cached = usage.and_then(|usage| usage.cached_tokens);
    if probe.cut {
        return (probe.prompt_tokens, cached.map(|cached| cached.min(probe.prompt_tokens)));
    }
    (engine_prompt_tokens(usage, probe.prompt_tokens), cached)
}

/// The engine's own prompt length where it says one (not 0), else `otherwise`.
fn engine_prompt_tokens(usage: Option<EngineUsage>, otherwise: u32) -> u32 {
    usage.and_then(|usage| usage.prompt_tokens).filter(|&n| n > 0).unwrap_or(otherwise)
}

/// Adds one answered request to the worker's series and window, and logs a disagreement raised
/// or cleared by it.
pub fn record(metrics: &Metrics, worker: &Worker, probe: Probe, usage: Option<EngineUsage>) {
    let model = worker.model().unwrap_or("");
    let cached = usage.and_then(|usage| usage.cached_tokens);
    // Evicted after routing: the engine served less than predicted and its caches lost blocks
    // between the decision and the answer (KV pressure, the engine making room while the request
    // queued). Counted apart, and the window compares what the engine could still serve, so only
    // a wrong configuration or lost removal events raise a disagreement.
    let evicted = match cached {
        Some(cached) if cached < probe.predicted && worker.kv_removed_blocks() > probe.removed_at => {
            probe.predicted - cached
        }
        _ => 0,
    };
    let (prompt_tokens, compared) = compared(&probe, usage);
    // Written through the worker's series, each resolved once: none is made again once the
    // worker is removed.
    let series = &worker.series;
    let own = &series.closed_loop;
    let add = |slot: &OnceLock<IntCounter>, family: &IntCounterVec, by: u32| {
        if let Some(counter) = series.resolved(slot, |url| family.with_label_values(&[model, url])) {
            counter.inc_by(u64::from(by));
        }
    };
    add(&own.predicted_tokens, &metrics.prefix_predicted_tokens, probe.predicted);
    add(&own.evicted_after_routing_tokens, &metrics.prefix_evicted_after_routing_tokens, evicted);
    if evicted > 0 {
        add(&own.evicted_after_routing_requests, &metrics.prefix_evicted_after_routing_requests, 1);
    }
    // The counters keep the engine's own figures (the whole prompt, all it served cached).
    add(&own.prompt_tokens, &metrics.prefix_prompt_tokens, engine_prompt_tokens(usage, prompt_tokens));
    if let Some(cached) = cached {
        add(&own.engine_cached_tokens, &metrics.prefix_engine_cached_tokens, cached);
    }
    if let Some(cached) = compared {
        add(
            &own.missed_cached_tokens,
            &metrics.prefix_missed_cached_tokens,
            cached.saturating_sub(probe.predicted),
        );
        if prompt_tokens > 0 {
            let difference = (f64::from(cached) - f64::from(probe.predicted)) / f64::from(prompt_tokens);
            let family = &metrics.prefix_cached_difference;
            if let Some(histogram) =
                series.resolved(&own.cached_difference, |url| family.with_label_values(&[model, url]))
            {
                histogram.observe(difference);
            }
        }
    }
    if let (Some(tenant), Some(cached)) = (&probe.tenant, cached) {
        metrics.admission.tenant_cached_tokens.with_label_values(&[tenant]).inc_by(u64::from(cached));
    }
    let sample = AccuracySample {
        prompt_tokens,
        predicted: probe.predicted - evicted,
        engine_cached: compared,
        exact: probe.exact,
    };
    match worker.record_accuracy(sample) {
        Some(AccuracyChange::Raised(disagreement)) => {
            worker
                .series
                .write(|url| metrics.prefix_index_disagreement.with_label_values(&[model, url]).set(1));
            // The index repair acts on it (`--index-repair`), off the request path.
            worker.index_health.flag_disagreement(disagreement.cause.as_str());
            tracing::warn!(
                model,
                worker = %worker.url,
                cause = disagreement.cause.as_str(),
                error_share = disagreement.error_share,
                wrong_share = disagreement.wrong_share,
                missed_share = disagreement.missed_share,
                requests = disagreement.requests,
                "the prefix index disagrees with the engine's cached tokens: {}",
                disagreement.cause.advice()
            );
        }
        Some(AccuracyChange::Cleared) => {
            worker
                .series
                .write(|url| metrics.prefix_index_disagreement.with_label_values(&[model, url]).set(0));
            tracing::info!(model, worker = %worker.url, "the prefix index agrees with the engine again");
        }
        None => {}
    }
    let Some(window) = probe.model_window else { return };
    let change = window.record(sample);
    match change {
        Some(AccuracyChange::Raised(disagreement)) => {
            metrics.prefix_model_index_disagreement.with_label_values(&[model]).set(1);
            tracing::warn!(
                model,
                cause = disagreement.cause.as_str(),
                error_share = disagreement.error_share,
                wrong_share = disagreement.wrong_share,
                missed_share = disagreement.missed_share,
                requests = disagreement.requests,
                "the prefix index disagrees with the engines' cached tokens over the model's last {} answers: {}",
                disagreement.requests,
                disagreement.cause.advice()
            );
        }
        Some(AccuracyChange::Cleared) => {
            metrics.prefix_model_index_disagreement.with_label_values(&[model]).set(0);
            tracing::info!(model, "the prefix index agrees with the engines again (the model's window)");
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_index::{AccuracySettings, IndexAccuracy, LikelyCause};

    fn probe(prompt_tokens: u32, predicted: u32, cut: bool) -> Probe {
        Probe { prompt_tokens, cut, predicted, exact: true, model_window: None, removed_at: 0, tenant: None }
    }

    fn usage(prompt_tokens: u32, cached_tokens: u32) -> Option<EngineUsage> {
        Some(EngineUsage {
            prompt_tokens: Some(prompt_tokens),
            cached_tokens: Some(cached_tokens),
            completion_tokens: Some(1),
        })
    }

    /// A policy that keeps the answers it is told of.
    #[derive(Default)]
    struct Told(std::sync::Mutex<Vec<kvgate_policy::Answered>>);

    impl kvgate_policy::Policy for Told {
        fn name(&self) -> &'static str {
            "told"
        }

        fn decide(
            &self,
            _request: &kvgate_policy::RouteRequest<'_>,
            _candidates: kvgate_policy::Candidates<'_>,
            _ctx: &mut kvgate_policy::SelectContext<'_>,
        ) -> Result<kvgate_policy::Decision, kvgate_policy::NoRoute> {
            Err(kvgate_policy::NoRoute::NoCandidates)
        }

        fn on_answered(&self, answered: &kvgate_policy::Answered) {
            self.0.lock().unwrap().push(*answered);
        }
    }

    /// A request that waited 300 ms before its decision (a burst of samples in the tokenizer's
    /// queue) and got its first byte 500 ms after it arrived teaches 200 ms: what the decision's
    /// prediction predicted. Timed from the arrival, the queue read as the engine's fixed cost.
    #[test]
    fn an_answer_is_timed_from_its_decision_not_from_the_arrival() {
        let told = Arc::new(Told::default());
        let learn = |decided_s: f64| Learn {
            policy: told.clone(),
            worker: 3,
            predicted: kvgate_policy::PredictedTtft { base_s: 0.05, ..Default::default() },
            prompt_tokens: 1_000,
            decided_s,
        };
        learn(0.3).answered(usage(1_000, 900), 0.5);
        learn(0.0).answered(usage(1_000, 900), 0.5);
        // A clock read out of order never teaches a negative time.
        learn(0.6).answered(usage(1_000, 900), 0.5);
        let answers = told.0.lock().unwrap();
        let ttfts: Vec<f64> = answers.iter().map(|answer| answer.ttft_s).collect();
        assert_eq!(ttfts.len(), 3);
        assert!((ttfts[0] - 0.2).abs() < 1e-9, "{ttfts:?}");
        assert_eq!(&ttfts[1..], &[0.5, 0.0]);
        assert_eq!((answers[0].worker, answers[0].prompt_tokens, answers[0].cached_tokens), (3, 1_000, 900));
    }

    /// An agent's turn: a 100K-token context routed on its first 26K tokens (what
    /// `--max-tokenize-chars` 262,144 leaves of the trace words), the index predicting all of
    /// them cached and the engine serving 99K. The window compares the routed start (no
    /// disagreement); the same answers on a prompt that was not cut are the engine serving what
    /// the index misses, and raise one.
    #[test]
    fn a_cut_prompt_is_compared_on_its_routed_start() {
        assert_eq!(compared(&probe(26_000, 25_984, true), usage(100_000, 99_000)), (26_000, Some(26_000)));
        assert_eq!(compared(&probe(26_000, 25_984, true), usage(100_000, 10_000)), (26_000, Some(10_000)));
        assert_eq!(compared(&probe(1_000, 990, false), usage(1_003, 1_000)), (1_003, Some(1_000)));
        assert_eq!(compared(&probe(1_000, 990, true), None), (1_000, None));
        for (cut, raised) in [(true, None), (false, Some(LikelyCause::IndexUnderclaims))] {
            let mut accuracy = IndexAccuracy::new(AccuracySettings::default());
            let mut cause = None;
            for _ in 0..AccuracySettings::default().window {
                let (prompt_tokens, engine_cached) =
                    compared(&probe(26_000, 25_984, cut), usage(100_000, 99_000));
                let sample = AccuracySample { prompt_tokens, predicted: 25_984, engine_cached, exact: true };
                if let Some(AccuracyChange::Raised(disagreement)) = accuracy.record(sample) {
                    cause = Some(disagreement.cause);
                }
            }
            assert_eq!(cause, raised, "cut: {cut}");
        }
    }

    #[test]
    fn the_usage_chunk_is_asked_for_first_and_the_rest_kept_byte_for_byte() {
        let body = br#" {"model": "m", "stream": true, "messages": []}"#;
        let expected =
            r#"{"stream_options":{"include_usage":true},"model": "m", "stream": true, "messages": []}"#;
        assert_eq!(std::str::from_utf8(&ask_for_usage(body).unwrap()).unwrap(), expected);
        assert_eq!(ask_for_usage(b"[1]"), None);
    }
}
