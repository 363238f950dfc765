//! The routing key of a request for a model whose exact index needs token ids: the request
//! tokenized as its engine will tokenize it (chat template included), or, when that is not
//! needed or not possible, the key `request.rs` extracts.
//!
//! Tokenizing runs on a bounded pool of its own threads (`--tokenizer-threads`), so a huge
//! conversation never stalls the I/O threads and the requests they serve; only inputs of at
//! most [`INLINE_BYTES`] are tokenized inline, where the hand-off would cost more than the work.
//! An input longer than `--max-tokenize-chars` is tokenized up to that many characters (the
//! prefix the exact index matches on). A burst of requests waits in the pool's queue for its
//! tokens, so it is routed on the exact index like any other; only when more than
//! `--tokenizer-queue-size` inputs wait, or a request's tokens are not ready within
//! `--tokenizer-queue-timeout-secs`, does it route on its text (the approximate tree) instead
//! (an input whose request stopped waiting is skipped when its turn comes). All three are
//! counted in `kvgate_tokenize_limited_total`. A text key is cut at the same length, so what the
//! tree records of one request is bounded too.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_tokenizer::{Tokenizer, TokenizerError};

use crate::registry::ModelPool;
use kvgate_gateway_core::metrics::Metrics;
use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::request::{estimate_tokens, OwnedKey, RequestFields};

/// Inputs (a chat body or a prompt's text) up to this many bytes are tokenized on the request's
/// own thread: at most a few tens of microseconds (docs/BENCHMARKS.md, "Tokenization in the
/// request path"), less than a hand-off to the pool.
pub const INLINE_BYTES: usize = 2048;

/// The tokenizer and its pool.
pub struct Tokenization {
    tokenizer: Arc<Tokenizer>,
    pool: rayon::ThreadPool,
    /// Inputs handed to the pool and not finished (running or queued).
    pending: Arc<AtomicUsize>,
    /// Most pending inputs: the threads plus the queue.
    capacity: usize,
    /// Longest a request waits for its tokens.
    wait: Duration,
    max_chars: usize,
    metrics: Arc<Metrics>,
}

/// One input to tokenize, owned so that it can cross to the pool.
enum Input {
    /// A raw `/v1/chat/completions` body.
    Chat(Bytes),
    /// A completion prompt (at most `max_chars` characters of it).
    Prompt(String),
}

/// Why a request was not tokenized.
#[derive(Debug)]
enum Skipped {
    /// The pool's queue is full (or the pool is shutting down).
    Busy,
    /// Its tokens were not ready within the wait.
    Late,
    Failed(TokenizerError),
}

impl Tokenization {
    /// `threads` tokenizing, up to `queue` inputs waiting for them, a request waiting at most
    /// `wait` for its tokens.
    pub fn new(
        tokenizer: Tokenizer,
        threads: usize,
        (queue, wait): (usize, Duration),
        max_chars: usize,
        metrics: Arc<Metrics>,
    ) -> Result<Tokenization, String> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|index| format!("kvgate-tokenize-{index}"))
            .build()
            .map_err(|e| format!("starting the tokenizer threads: {e}"))?;
        Ok(Tokenization {
            tokenizer: Arc::new(tokenizer),
            pool,
            pending: Arc::default(),
            capacity: threads.saturating_add(queue),
            wait,
            max_chars,
            metrics,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The tokenizer, for work off the I/O threads (`spawn_blocking`).
    pub fn shared_tokenizer(&self) -> Arc<Tokenizer> {
        self.tokenizer.clone()
    }

    /// Token ids of `input` (its first `--max-tokenize-chars` characters), inline when it is
    /// small, else on the pool; returns whether it was cut.
    async fn encode(&self, input: Input) -> Result<(Vec<u32>, bool), Skipped> {
        let size = match &input {
            Input::Chat(body) => body.len(),
            Input::Prompt(text) => text.len(),
        };
        if size <= INLINE_BYTES {
            return encode(&self.tokenizer, input, self.max_chars).map_err(Skipped::Failed);
        }
        if self.pending.fetch_add(1, Ordering::AcqRel) >= self.capacity {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(Skipped::Busy);
        }
        self.metrics.tokenizer_pending.inc();
        let (done, answer) = tokio::sync::oneshot::channel();
        let (tokenizer, pending, metrics) =
            (self.tokenizer.clone(), self.pending.clone(), self.metrics.clone());
        let max_chars = self.max_chars;
        self.pool.spawn(move || {
            // A request that stopped waiting (late, or gone) is not tokenized.
            let result = (!done.is_closed()).then(|| encode(&tokenizer, input, max_chars));
            pending.fetch_sub(1, Ordering::AcqRel);
            metrics.tokenizer_pending.dec();
            if let Some(result) = result {
                let _ = done.send(result); // the request may have gone meanwhile
            }
        });
        match tokio::time::timeout(self.wait, answer).await {
            Ok(Ok(result)) => result.map_err(Skipped::Failed),
            Ok(Err(_)) => Err(Skipped::Busy), // the pool dropped the job (shutting down)
            Err(_) => Err(Skipped::Late),
        }
    }
}

/// The ids of `input`'s first `max_chars` characters, and whether it was cut there.
fn encode(tokenizer: &Tokenizer, input: Input, max_chars: usize) -> Result<(Vec<u32>, bool), TokenizerError> {
    match input {
        Input::Chat(body) if body.len() > max_chars => {
            Ok((tokenizer.encode_chat_request_prefix(&body, max_chars)?, true))
        }
        Input::Chat(body) => Ok((tokenizer.encode_chat_request(&body)?, false)),
        Input::Prompt(text) => Ok((tokenizer.encode_prompt(&text)?, false)),
    }
}

/// `text`'s first `max_chars` characters, and whether that cut it. Every character is at least
/// one byte, so a text no longer than `max_chars` bytes is returned at once; a longer one is
/// counted by the bytes that start a character (decoding each character showed in O1: 3 us for
/// an 8 KB prompt).
fn first_chars(text: &str, max_chars: usize) -> (&str, bool) {
    if text.len() <= max_chars {
        return (text, false);
    }
    let mut starts = text.bytes().enumerate().filter(|(_, byte)| !is_continuation(*byte));
    match starts.nth(max_chars) {
        Some((end, _)) => (&text[..end], true),
        None => (text, false),
    }
}

/// A byte inside a UTF-8 character, after its first.
fn is_continuation(byte: u8) -> bool {
    byte & 0xC0 == 0x80
}

/// A text key cut to its first `max_chars` characters (what the approximate tree records of
/// one request is bounded too).
fn first_chars_of_key(key: OwnedKey<'_>, max_chars: usize) -> OwnedKey<'_> {
    match key {
        OwnedKey::Text(Cow::Borrowed(text)) => OwnedKey::Text(Cow::Borrowed(first_chars(text, max_chars).0)),
        OwnedKey::Text(Cow::Owned(mut text)) => {
            let end = first_chars(&text, max_chars).0.len();
            text.truncate(end);
            OwnedKey::Text(Cow::Owned(text))
        }
        other => other,
    }
}

/// The key a prefix-aware policy matches `fields` on (at most `max_chars` characters of the
/// prompt, `--max-tokenize-chars`), and the prompt's estimated length in tokens. Tokenizes only
/// when the model's workers publish KV events, the policy matches against the exact index, and
/// a tokenizer is configured; a request the tokenizer cannot handle (or the busy pool does not
/// take, or does not finish in time) is routed on its text (never refused).
pub async fn routing_key<'a>(
    tokenization: Option<&Tokenization>,
    metrics: &Metrics,
    max_chars: usize,
    pool: &ModelPool,
    endpoint: Endpoint,
    fields: &'a RequestFields<'a>,
    body: &Bytes,
) -> (OwnedKey<'a>, u64) {
    let text_key = || {
        let key = fields.routing_key();
        let tokens = estimate_tokens(&key);
        (first_chars_of_key(key, max_chars), tokens)
    };
    let tokenization = match tokenization {
        Some(tokenization) if pool.has_kv_events && pool.config.uses_exact_index() => tokenization,
        _ => return text_key(),
    };
    // The input, its size in bytes, and whether it is cut already.
    let (input, size, cut) = match endpoint {
        Endpoint::ChatCompletions if fields.input_ids.is_none() => {
            (Input::Chat(body.clone()), body.len(), false)
        }
        Endpoint::Completions | Endpoint::Generate => match fields.routing_key() {
            OwnedKey::Text(text) => {
                let (prefix, cut) = first_chars(&text, tokenization.max_chars);
                (Input::Prompt(prefix.to_string()), text.len(), cut)
            }
            other => {
                let tokens = estimate_tokens(&other);
                return (other, tokens);
            }
        },
        _ => return text_key(),
    };
    let limited = |reason: &str| {
        metrics.tokenize_limited.with_label_values(&[endpoint.label(), reason]).inc();
    };
    match tokenization.encode(input).await {
        Ok((ids, encoded_cut)) => {
            let cut = cut || encoded_cut;
            let mut tokens = ids.len() as u64;
            if cut {
                limited("prefix");
                // The whole prompt's length, about, for the policies that weigh it.
                tokens = tokens.max((size as u64).div_ceil(4));
            }
            (OwnedKey::Tokens(Cow::Owned(ids)), tokens)
        }
        Err(Skipped::Busy) => {
            limited("queue_full");
            text_key()
        }
        Err(Skipped::Late) => {
            limited("queue_timeout");
            text_key()
        }
        Err(Skipped::Failed(error)) => {
            metrics.tokenize_failures.with_label_values(&[endpoint.label()]).inc();
            tracing::debug!(endpoint = endpoint.label(), %error, "could not tokenize; routing on the text");
            text_key()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use super::{first_chars, Input, Metrics, Skipped, Tokenization, INLINE_BYTES};
    use kvgate_gateway_core::config::GatewayConfig;
    use kvgate_tokenizer::Tokenizer;

    /// One tokenizer thread, `queue` inputs waiting, `wait` for tokens; and a gate holding the
    /// thread busy until it is dropped, so that every input handed to the pool queues.
    fn held_pool(queue: usize, wait: Duration) -> (std::sync::Arc<Tokenization>, mpsc::Sender<()>) {
        let metrics = std::sync::Arc::new(Metrics::new());
        let tokenization = Tokenization::new(Tokenizer::mock(), 1, (queue, wait), 1 << 20, metrics).unwrap();
        let (gate, held) = mpsc::channel::<()>();
        tokenization.pool.spawn(move || {
            let _ = held.recv();
        });
        (std::sync::Arc::new(tokenization), gate)
    }

    /// A prompt of `words` words distinct per `seed`, longer than what is tokenized inline.
    fn prompt(seed: usize, words: usize) -> String {
        let text = (0..words).map(|i| format!("s{seed}w{i}")).collect::<Vec<_>>().join(" ");
        assert!(text.len() > INLINE_BYTES);
        text
    }

    /// Polls until `done`, at most 30 s.
    async fn until(mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "not within 30 s");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// An RL step's samples arrive at once: 400 requests (the default queue took 64, and S10's
    /// bursts are ~336) all wait for the one busy tokenizer thread and each gets its own tokens.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_of_requests_waits_for_its_tokens_in_the_default_queue() {
        let defaults = GatewayConfig::default();
        let burst = 400;
        assert!(defaults.tokenizer_queue_size >= burst);
        let (tokenization, gate) = held_pool(defaults.tokenizer_queue_size, Duration::from_secs(600));
        let tasks: Vec<_> = (0..burst)
            .map(|seed| {
                let tokenization = tokenization.clone();
                tokio::spawn(async move { tokenization.encode(Input::Prompt(prompt(seed, 400))).await })
            })
            .collect();
        until(|| tokenization.metrics.tokenizer_pending.get() == burst as i64).await;
        drop(gate);
        for (seed, task) in tasks.into_iter().enumerate() {
            let (ids, cut) = task.await.unwrap().expect("tokenized, not skipped");
            assert_eq!(
                (ids, cut),
                (tokenization.tokenizer.encode_prompt(&prompt(seed, 400)).unwrap(), false)
            );
        }
        until(|| tokenization.pending.load(std::sync::atomic::Ordering::Acquire) == 0).await;
    }

    /// Past the queue's size a request routes on its text at once, and past its wait it stops
    /// waiting; its input is then skipped, not tokenized, when the thread comes free.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_or_a_late_answer_routes_on_the_text() {
        let (tokenization, gate) = held_pool(2, Duration::from_millis(200));
        let tasks: Vec<_> = (0..3)
            .map(|seed| {
                let tokenization = tokenization.clone();
                tokio::spawn(async move { tokenization.encode(Input::Prompt(prompt(seed, 400))).await })
            })
            .collect();
        until(|| tokenization.metrics.tokenizer_pending.get() == 3).await;
        // One thread and two places, all taken (the gate's job is not counted).
        let full = tokenization.encode(Input::Prompt(prompt(9, 400))).await;
        assert!(matches!(full, Err(Skipped::Busy)), "{full:?}");
        for task in tasks {
            let late = task.await.unwrap();
            assert!(matches!(late, Err(Skipped::Late)), "{late:?}");
        }
        drop(gate);
        until(|| tokenization.metrics.tokenizer_pending.get() == 0).await;
        // The late inputs left the queue: the pool tokenizes again.
        let (ids, _) = tokenization.encode(Input::Prompt(prompt(1, 400))).await.unwrap();
        assert_eq!(ids.len(), 400);
    }

    #[test]
    fn a_text_is_cut_after_its_first_characters_not_bytes() {
        assert_eq!(first_chars("héllo wörld", 11), ("héllo wörld", false));
        assert_eq!(first_chars("héllo wörld", 7), ("héllo w", true));
        assert_eq!(first_chars("héllo wörld", 2), ("hé", true));
        assert_eq!(first_chars("日本語のテキスト", 3), ("日本語", true));
        assert_eq!(first_chars("日本語", 3), ("日本語", false), "9 bytes, 3 characters: not cut");
        assert_eq!(first_chars("abc", 0), ("", true));
        assert_eq!(first_chars("", 0), ("", false));
        // The same as decoding every character, on a mix of widths.
        let text = "a\u{e9}\u{65e5}\u{1f600}b".repeat(50);
        for max in [0, 1, 2, 3, 4, 5, 99, 250, 251, 1000] {
            let decoded = match text.char_indices().nth(max) {
                Some((end, _)) => (&text[..end], true),
                None => (text.as_str(), false),
            };
            assert_eq!(first_chars(&text, max), decoded, "{max}");
        }
    }
}
