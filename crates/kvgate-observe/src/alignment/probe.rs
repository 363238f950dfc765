//! One probe of one worker: the previous probe's prompt re-sent (does the engine still serve what
//! the index holds?), then the completion form and, once it agrees, the chat form. Each form is
//! sent twice straight to the worker (no policy, no decision, no closed-loop sample: nothing the
//! gateway counts as traffic), the index is given the time its events take between the two, and
//! the second answer's cached tokens are compared with the closed loop's prediction for them
//! (`accuracy::Probe::predict`, the served overlap on that worker: the same prediction a client
//! request gets). What was seen goes to `kvgate_index::judge_form`, which names the cause.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::Full;
use kvgate_index::{
    judge_form, judge_sentinel, FormObservation, Namespace, PrefixMatch, ProbeCause, ProbeForm,
    SentinelObservation, Verdict,
};
use kvgate_tokenizer::Tokenizer;

use super::canary::{self, COMPLETION_TOKENS};
use crate::accuracy::Probe;
use crate::kv_map::KvMap;
use kvgate_fleet::index_health::{FormReport, ProbeReport, SentinelPrompt, SentinelReport};
use kvgate_fleet::registry::ModelPool;
use kvgate_fleet::tokenize::Tokenization;
use kvgate_fleet::worker::Worker;
use kvgate_gateway_core::metrics::Metrics;
use kvgate_gateway_core::upstream::{read_limited, HttpClient};
use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::request::{OwnedKey, RequestFields};
use kvgate_protocol::usage::{usage_of_body, EngineUsage};

/// Largest answer read (a one-token answer is a few hundred bytes).
const MAX_ANSWER_BYTES: usize = 1 << 20;
/// Between two looks at the index while the first answer's events arrive.
const EVENTS_POLL: Duration = Duration::from_millis(20);

/// What probing needs of the gateway, lent by the probe loop.
pub(super) struct Prober<'a> {
    pub client: &'a HttpClient,
    /// `--api-key`, sent to workers as the proxy sends it.
    pub bearer: Option<&'a str>,
    pub tokenization: &'a Arc<Tokenization>,
    pub metrics: &'a Metrics,
    pub max_chars: usize,
    /// Each request's deadline.
    pub timeout: Duration,
    /// How long the first answer's KV events may take to reach the index.
    pub events_wait: Duration,
    /// Told the probe's own blocks, which the fleet's KV map leaves out.
    pub kv_map: &'a KvMap,
}

/// A probe's outcome: its report and the prompt the next probe re-sends.
pub(super) struct Probed {
    pub report: ProbeReport,
    pub sentinel: Option<SentinelPrompt>,
}

/// The worker's event feed as the subscription counted it.
#[derive(Clone, Copy, Debug, Default)]
struct FeedCounts {
    batches: u64,
    refused_shape: u64,
    refused_parent: u64,
}

impl Prober<'_> {
    /// Probes `worker` of `pool`; `now_ms` stamps the report.
    pub(super) async fn probe(&self, worker: &Worker, pool: &ModelPool, now_ms: impl Fn() -> u64) -> Probed {
        let mut report = ProbeReport {
            at_ms: 0,
            verdict: Verdict::Inconclusive,
            forms: Vec::new(),
            sentinel: None,
            error: None,
        };
        let mut next_sentinel = worker.index_health.sentinel();
        if !worker.kv_events_flowing() {
            // Nothing the index could learn: no request is sent.
            report.verdict = Verdict::Failed(ProbeCause::EventsNotFlowing);
            report.error = Some("the worker's KV event subscription is not connected".into());
            report.at_ms = now_ms();
            return Probed { report, sentinel: next_sentinel };
        }
        let outcome = async {
            if let Some(prompt) = &next_sentinel {
                report.sentinel = Some(self.sentinel(worker, pool, prompt).await?);
            }
            let (completion, prompt) = self.completion(worker, pool).await?;
            let passed = completion.verdict == Verdict::Passed;
            report.forms.push(completion);
            next_sentinel = Some(prompt);
            if passed {
                report.forms.push(self.chat(worker, pool).await?);
            }
            Ok::<(), String>(())
        };
        if let Err(error) = outcome.await {
            report.error = Some(error);
        }
        let verdicts =
            report.forms.iter().map(|form| form.verdict).chain(report.sentinel.as_ref().map(|s| s.verdict));
        report.verdict = kvgate_index::overall_verdict(verdicts);
        if report.error.is_some() && report.verdict == Verdict::Passed {
            report.verdict = Verdict::Inconclusive;
        }
        report.at_ms = now_ms();
        Probed { report, sentinel: next_sentinel }
    }

    /// The previous probe's prompt, sent once more: served as the index predicts?
    async fn sentinel(
        &self,
        worker: &Worker,
        pool: &ModelPool,
        prompt: &SentinelPrompt,
    ) -> Result<SentinelReport, String> {
        let index = &pool.prefix.exact;
        let predicted =
            Probe::predict(index, &prompt.tokens, Namespace::BASE, None, worker.id, true).predicted;
        let (removed_before, restarts_before) = (worker.kv_removed_blocks(), self.restarts(worker));
        let body = canary::completion_body(&pool.model, &prompt.text, worker.dp_rank);
        let usage = self.send(worker, Endpoint::Completions, &body).await?;
        let seen = SentinelObservation {
            predicted,
            cached: usage.cached_tokens,
            removed: worker.kv_removed_blocks().saturating_sub(removed_before),
            restarted: self.restarts(worker) > restarts_before,
        };
        Ok(SentinelReport { seen, verdict: judge_sentinel(&seen) })
    }

    /// The completion form: a prompt of [`COMPLETION_TOKENS`] tokens when the tokenizer allows.
    async fn completion(
        &self,
        worker: &Worker,
        pool: &ModelPool,
    ) -> Result<(FormReport, SentinelPrompt), String> {
        let salt = canary::salt(rand::random());
        let tokenizer: Arc<Tokenizer> = self.tokenization.shared_tokenizer();
        let filled = tokio::task::spawn_blocking(move || {
            canary::fill(&salt, COMPLETION_TOKENS, |text| {
                tokenizer.encode_prompt(text).ok().map(|ids| ids.len())
            })
        })
        .await
        .map_err(|error| format!("building the canary prompt: {error}"))?;
        let (text, _) = filled.ok_or("the tokenizer cannot encode the canary prompt")?;
        let body = canary::completion_body(&pool.model, &text, worker.dp_rank);
        let (report, tokens) = self.form(worker, pool, ProbeForm::Completion, &body).await?;
        Ok((report, SentinelPrompt { text, tokens }))
    }

    /// The chat form: a salted system message and a question.
    async fn chat(&self, worker: &Worker, pool: &ModelPool) -> Result<FormReport, String> {
        let body = canary::chat_body(&pool.model, &canary::salt(rand::random()), worker.dp_rank);
        Ok(self.form(worker, pool, ProbeForm::Chat, &body).await?.0)
    }

    /// One form: tokenized as a client request of its endpoint is, sent, given the time its
    /// events take, predicted, sent again, judged. Returns the report and the prompt's ids.
    async fn form(
        &self,
        worker: &Worker,
        pool: &ModelPool,
        form: ProbeForm,
        body: &serde_json::Value,
    ) -> Result<(FormReport, Vec<u32>), String> {
        let endpoint = match form {
            ProbeForm::Completion => Endpoint::Completions,
            ProbeForm::Chat => Endpoint::ChatCompletions,
        };
        let tokens = self.tokens(pool, endpoint, body).await?;
        let index = &pool.prefix.exact;
        self.exclude_own_blocks(pool, &tokens);
        let before = self.feed_counts(worker);
        let first = self.send(worker, endpoint, body).await?;
        let (held, after) = self.wait_held(worker, pool, &tokens, before).await;
        let removed_before = worker.kv_removed_blocks();
        let predicted = Probe::predict(index, &tokens, Namespace::BASE, None, worker.id, true).predicted;
        let second = self.send(worker, endpoint, body).await?;
        let block_size = u32::try_from(index.block_size()).unwrap_or(u32::MAX);
        let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
        let seen = FormObservation {
            prompt_tokens,
            engine_prompt_tokens: first.prompt_tokens,
            batches: after.batches.saturating_sub(before.batches),
            refused_shape: after.refused_shape.saturating_sub(before.refused_shape),
            refused_parent: after.refused_parent.saturating_sub(before.refused_parent),
            held,
            predicted,
            cached: second.cached_tokens,
            removed: worker.kv_removed_blocks().saturating_sub(removed_before),
            block_size,
        };
        let aligned = block_size > 0 && prompt_tokens.is_multiple_of(block_size);
        Ok((FormReport { form, seen, aligned, verdict: judge_form(form, &seen) }, tokens))
    }

    /// Leaves the prompt's own blocks (those after what the index already holds of it anywhere:
    /// a chat template's shared start is the workload's too) out of the fleet's KV map.
    fn exclude_own_blocks(&self, pool: &ModelPool, tokens: &[u32]) {
        let index = &pool.prefix.exact;
        let mut matched = PrefixMatch::default();
        index.overlap(tokens, Namespace::BASE, &mut matched);
        let hashes = index.prompt_hashes(tokens, Namespace::BASE);
        for layout in index.layouts() {
            let shared = matched.best() / (layout.block_size.max(1) as usize);
            self.kv_map.exclude(hashes.hashes(layout).iter().skip(shared).copied());
        }
    }

    /// The prompt's token ids, on the path a client request of `endpoint` takes.
    async fn tokens(
        &self,
        pool: &ModelPool,
        endpoint: Endpoint,
        body: &serde_json::Value,
    ) -> Result<Vec<u32>, String> {
        let bytes = Bytes::from(serde_json::to_vec(body).map_err(|e| e.to_string())?);
        let fields = RequestFields::parse(&bytes)?;
        let tokenization = Some(&**self.tokenization);
        let (key, _) = kvgate_fleet::tokenize::routing_key(
            tokenization,
            self.metrics,
            self.max_chars,
            pool,
            endpoint,
            &fields,
            &bytes,
        )
        .await;
        match key {
            OwnedKey::Tokens(ids) => Ok(ids.into_owned()),
            _ => Err(format!(
                "the {} canary was not tokenized (the tokenizer failed or was busy)",
                endpoint.label()
            )),
        }
    }

    /// Waits (at most `events_wait`) until the index holds every whole block of the prompt on the
    /// worker, or the worker's stores were refused; returns what it holds and the feed's counts.
    async fn wait_held(
        &self,
        worker: &Worker,
        pool: &ModelPool,
        tokens: &[u32],
        before: FeedCounts,
    ) -> (u32, FeedCounts) {
        let deadline = Instant::now() + self.events_wait;
        let index = &pool.prefix.exact;
        loop {
            let mut matched = PrefixMatch::default();
            index.overlap(tokens, Namespace::BASE, &mut matched);
            let held = matched.matched(worker.id);
            let counts = self.feed_counts(worker);
            let size = index.block_size();
            let whole = held > 0 && size > 0 && held >= tokens.len() / size * size;
            let refused =
                counts.refused_shape + counts.refused_parent > before.refused_shape + before.refused_parent;
            if whole || refused || Instant::now() >= deadline {
                return (u32::try_from(held).unwrap_or(u32::MAX), counts);
            }
            tokio::time::sleep(EVENTS_POLL).await;
        }
    }

    /// Event-sequence restarts the worker's subscriptions saw so far.
    fn restarts(&self, worker: &Worker) -> u64 {
        let mut restarts = 0;
        worker.series.write(|url| restarts = self.metrics.kv_events.restarts.with_label_values(&[url]).get());
        restarts
    }

    /// The worker's subscription counters now.
    fn feed_counts(&self, worker: &Worker) -> FeedCounts {
        let kv = &self.metrics.kv_events;
        let mut counts = FeedCounts::default();
        worker.series.write(|url| {
            let refused = |reason: &str| kv.refused.with_label_values(&[url, reason]).get();
            counts = FeedCounts {
                batches: kv.batches.with_label_values(&[url]).get(),
                refused_shape: refused("inconsistent") + refused("too_many_layouts"),
                refused_parent: refused("unknown_parent"),
            };
        });
        counts
    }

    /// Posts `body` to the worker's `endpoint` and reads the answer's usage.
    async fn send(
        &self,
        worker: &Worker,
        endpoint: Endpoint,
        body: &serde_json::Value,
    ) -> Result<EngineUsage, String> {
        let url = format!("{}{}", worker.address, endpoint.path());
        let bytes = Bytes::from(serde_json::to_vec(body).map_err(|e| e.to_string())?);
        let mut request = Request::post(&url).header(header::CONTENT_TYPE, "application/json");
        if let Some(token) = self.bearer {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request.body(Full::new(bytes)).map_err(|e| e.to_string())?;
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| format!("{url}: {e}"))?;
            let status = response.status();
            let answer = read_limited(response.into_body(), MAX_ANSWER_BYTES)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            if status != StatusCode::OK {
                let text = String::from_utf8_lossy(&answer[..answer.len().min(200)]).into_owned();
                return Err(format!("{url} answered {status}: {text}"));
            }
            usage_of_body(&answer).ok_or_else(|| format!("{url}: the answer carries no usage"))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| format!("{url}: no answer within {:.0} s", self.timeout.as_secs_f64()))?
    }
}
