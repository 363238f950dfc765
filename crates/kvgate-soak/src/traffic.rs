//! The soak's traffic: the request mix (chat requests, streamed or not, with varied prompt
//! lengths and `max_tokens`), and one request sent through the gateway with its outcome
//! classified at the client (succeeded, failed with a clean error, or lost).

use std::time::{Duration, Instant};

use kvgate_config::error_chain;
use kvgate_protocol::SseData;
use kvgate_words::splitmix64;

use crate::engines::Streaming;
use serde_json::{json, Value};

/// Words the prompts are made of.
const WORDS: [&str; 48] = [
    "alpha", "bravo", "cache", "delta", "engine", "fabric", "gamma", "harbor", "index", "jolt", "kernel",
    "lattice", "matrix", "node", "orbit", "prefix", "quorum", "radix", "shard", "token", "union", "vector",
    "window", "xenon", "yield", "zephyr", "amber", "basalt", "cobalt", "dune", "ember", "fjord", "granite",
    "heron", "iris", "juniper", "kelp", "lagoon", "meadow", "nectar", "onyx", "pine", "quartz", "reef",
    "sierra", "tundra", "umber", "valley",
];
/// Distinct system prompts: requests sharing one share a cached prefix.
const TENANTS: u64 = 8;
/// Words of each system prompt.
const SYSTEM_WORDS: usize = 64;
/// Bounds of the user message's length in words (drawn log-uniformly).
const USER_WORDS: (f64, f64) = (16.0, 2048.0);
/// Bounds of `max_tokens` (drawn log-uniformly).
const MAX_TOKENS: (f64, f64) = (8.0, 256.0);
/// Share of requests that ask for exactly `max_tokens` (`ignore_eos`), so long outputs occur.
const IGNORE_EOS_FRACTION: f64 = 0.3;

/// Uniform draws in [0, 1) from a seed and a counter (deterministic, no RNG state shared).
pub(crate) struct Draws {
    state: u64,
}

impl Draws {
    pub(crate) fn new(seed: u64, stream: u64) -> Self {
        Self { state: splitmix64(seed ^ splitmix64(stream.wrapping_add(0x5eed))) }
    }

    pub(crate) fn unit(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        (splitmix64(self.state) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A draw between `low` and `high`, uniform in the logarithm.
    fn log_uniform(&mut self, (low, high): (f64, f64)) -> f64 {
        (low.ln() + self.unit() * (high.ln() - low.ln())).exp()
    }

    /// An exponential gap of mean `1 / rate` (Poisson arrivals).
    pub(crate) fn exponential(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate
    }
}

fn words(draws: &mut Draws, n: usize, out: &mut String) {
    for _ in 0..n {
        let word = WORDS[(draws.unit() * WORDS.len() as f64) as usize % WORDS.len()];
        out.push(' ');
        out.push_str(word);
    }
}

/// One request of the mix: whether it streams, and its JSON body.
pub(crate) struct PlannedRequest {
    pub stream: bool,
    pub body: Vec<u8>,
    /// Its chat, `max_tokens` and `ignore_eos`: what the mock engines' answer is made of.
    pub messages: [(&'static str, String); 2],
    pub max_tokens: u32,
    pub ignore_eos: bool,
}

impl PlannedRequest {
    /// The whole answer the mock engines give it (`kvgate_mock::chat_answer`).
    pub(crate) fn expected_answer(&self) -> String {
        kvgate_mock::chat_answer(&self.messages, self.max_tokens, self.ignore_eos)
    }
}

/// Request `n` of a run seeded with `seed`.
pub(crate) fn plan_request(seed: u64, n: u64, model: &str, stream_fraction: f64) -> PlannedRequest {
    let mut draws = Draws::new(seed, n);
    let stream = draws.unit() < stream_fraction;
    let tenant = (draws.unit() * TENANTS as f64) as u64 % TENANTS;
    let mut system = format!("You are assistant {tenant}.");
    words(&mut Draws::new(seed, u64::MAX - tenant), SYSTEM_WORDS, &mut system);
    let mut user = format!("Request {n}:");
    let user_words = draws.log_uniform(USER_WORDS) as usize;
    words(&mut draws, user_words, &mut user);
    let max_tokens = draws.log_uniform(MAX_TOKENS) as u32;
    let ignore_eos = draws.unit() < IGNORE_EOS_FRACTION;
    let body = json!({
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    });
    PlannedRequest {
        stream,
        body: serde_json::to_vec(&body).expect("a JSON value always serializes"),
        messages: [("system", system), ("user", user)],
        max_tokens,
        ignore_eos,
    }
}

/// How one request ended, as the client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Cause {
    /// 2xx and a whole answer (a completion body, or a stream through `[DONE]`).
    Answered,
    /// An error status with an OpenAI-style JSON error body.
    ErrorStatus(u16),
    /// A stream that ended with an OpenAI-style error event.
    ErrorEvent,
    /// No response: the connection failed before a response head.
    NoAnswer,
    /// No complete answer within the deadline.
    Hang,
    /// The body broke off (a connection error) with no error event before it.
    BrokenBody,
    /// A stream that ended cleanly without `[DONE]` or an error event.
    Truncated,
    /// A 2xx body that is not a completion (cut short, or not JSON).
    BadBody,
    /// An error status whose body is not an OpenAI-style error.
    BadErrorBody(u16),
}

/// The three outcomes of the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Succeeded,
    FailedClean,
    Lost,
}

impl Cause {
    pub(crate) fn outcome(self) -> Outcome {
        match self {
            Cause::Answered => Outcome::Succeeded,
            Cause::ErrorStatus(_) | Cause::ErrorEvent => Outcome::FailedClean,
            _ => Outcome::Lost,
        }
    }

    pub(crate) fn label(self) -> String {
        match self {
            Cause::Answered => "answered".into(),
            Cause::ErrorStatus(status) => format!("HTTP {status}"),
            Cause::ErrorEvent => "stream error event".into(),
            Cause::NoAnswer => "no answer (connection error)".into(),
            Cause::Hang => "hang past the deadline".into(),
            Cause::BrokenBody => "body broken without an error event".into(),
            Cause::Truncated => "stream ended without [DONE]".into(),
            Cause::BadBody => "2xx body not a completion".into(),
            Cause::BadErrorBody(status) => format!("HTTP {status} without an OpenAI error body"),
        }
    }
}

/// What the client saw of one request.
#[derive(Debug)]
pub(crate) struct Observed {
    pub cause: Cause,
    /// Streams: send to the first token chunk.
    pub ttft: Option<Duration>,
    /// Send to the end of the answer (or of the failure).
    pub latency: Duration,
    /// More than one answer in one response: several `[DONE]`s or several completion ids.
    pub multi_answer: bool,
    /// The worker that answered (`x-kvgate-worker`), if the gateway said.
    pub worker: Option<String>,
    /// For anything but a success: what went wrong, briefly.
    pub detail: Option<String>,
    /// A stream's text as the client read it (its content deltas in order).
    pub text: String,
}

/// Sends one request with its soak id and reads the answer to its end, within `deadline`.
pub(crate) async fn send(
    client: &reqwest::Client,
    url: &str,
    soak_id: &str,
    request: &PlannedRequest,
    deadline: Duration,
    streaming: &Streaming,
) -> Observed {
    let started = Instant::now();
    let mut seen = Seen::default();
    let exchange = exchange(client, url, soak_id, request, started, &mut seen, streaming);
    let (cause, detail) = match tokio::time::timeout(deadline, exchange).await {
        Ok(result) => result,
        Err(_) => (Cause::Hang, Some(format!("no complete answer within {:.0} s", deadline.as_secs_f64()))),
    };
    Observed {
        cause,
        ttft: seen.ttft,
        latency: started.elapsed(),
        multi_answer: seen.done_events > 1 || seen.completion_ids > 1,
        worker: seen.worker,
        detail,
        text: seen.text,
    }
}

/// What has been read of an answer so far (kept when the deadline cuts the read short).
#[derive(Default)]
struct Seen {
    ttft: Option<Duration>,
    worker: Option<String>,
    done_events: u32,
    completion_ids: u32,
    first_id: Option<String>,
    error_event: Option<String>,
    text: String,
}

impl Seen {
    fn completion_id(&mut self, id: &str) {
        if self.first_id.as_deref() != Some(id) {
            self.completion_ids += 1;
            self.first_id.get_or_insert_with(|| id.to_string());
        }
    }

    /// One SSE `data:` payload.
    fn event(&mut self, payload: &str, started: Instant) {
        if payload == "[DONE]" {
            self.done_events += 1;
            return;
        }
        let Ok(value) = serde_json::from_str::<Value>(payload) else { return };
        if let Some(error) = value.get("error") {
            self.error_event = Some(error_message(error));
            return;
        }
        if let Some(id) = value.get("id").and_then(Value::as_str) {
            self.completion_id(id);
        }
        let content = value["choices"][0]["delta"]["content"].as_str();
        if self.ttft.is_none() && content.is_some_and(|text| !text.is_empty()) {
            self.ttft = Some(started.elapsed());
        }
        self.text.push_str(content.unwrap_or_default());
    }
}

fn error_message(error: &Value) -> String {
    let message = error.get("message").and_then(Value::as_str).unwrap_or("");
    message.chars().take(200).collect()
}

/// An OpenAI-style error body: `{"error": {"message": "..."}}`.
fn openai_error(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    value.get("error")?.get("message")?.as_str()?;
    Some(error_message(&value["error"]))
}

async fn exchange(
    client: &reqwest::Client,
    url: &str,
    soak_id: &str,
    request: &PlannedRequest,
    started: Instant,
    seen: &mut Seen,
    streaming: &Streaming,
) -> (Cause, Option<String>) {
    let stream = request.stream;
    let sent = client
        .post(url)
        .header("content-type", "application/json")
        .header(kvgate_mock::SOAK_ID_HEADER, soak_id)
        .body(request.body.clone())
        .send()
        .await;
    let mut response = match sent {
        Ok(response) => response,
        Err(error) => return (Cause::NoAnswer, Some(error_chain(&error))),
    };
    let status = response.status();
    seen.worker = response.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).map(str::to_string);
    if !status.is_success() {
        return match response.bytes().await {
            Ok(body) => match openai_error(&body) {
                Some(message) => (Cause::ErrorStatus(status.as_u16()), Some(message)),
                None => (Cause::BadErrorBody(status.as_u16()), Some(snippet(&body))),
            },
            Err(error) => (Cause::BadErrorBody(status.as_u16()), Some(error_chain(&error))),
        };
    }
    if !stream {
        return match response.bytes().await {
            Ok(body) => match serde_json::from_slice::<Value>(&body) {
                Ok(value) if value["choices"][0]["message"]["content"].is_string() => {
                    if let Some(id) = value["id"].as_str() {
                        seen.completion_id(id);
                    }
                    (Cause::Answered, None)
                }
                _ => (Cause::BadBody, Some(snippet(&body))),
            },
            Err(error) => (Cause::BrokenBody, Some(error_chain(&error))),
        };
    }
    // Open on its engine until it ends (or the deadline drops it).
    let _open = seen.worker.as_deref().and_then(|worker| streaming.begin(worker));
    let mut events = SseData::default();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                events.push(&chunk);
                while let Some(payload) = events.next_data() {
                    seen.event(&payload, started);
                }
            }
            Ok(None) => {
                return match (&seen.error_event, seen.done_events) {
                    (Some(message), _) => (Cause::ErrorEvent, Some(message.clone())),
                    (None, 0) => (Cause::Truncated, Some("the stream ended without [DONE]".into())),
                    (None, _) => (Cause::Answered, None),
                };
            }
            Err(error) => {
                return match &seen.error_event {
                    Some(message) => (Cause::ErrorEvent, Some(message.clone())),
                    None => (Cause::BrokenBody, Some(error_chain(&error))),
                };
            }
        }
    }
}

fn snippet(body: &[u8]) -> String {
    String::from_utf8_lossy(body).chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_is_deterministic_and_varied() {
        let a = plan_request(7, 3, "m", 0.5);
        assert_eq!(a.body, plan_request(7, 3, "m", 0.5).body);
        let bodies: Vec<Value> =
            (0..200).map(|n| serde_json::from_slice(&plan_request(7, n, "m", 0.5).body).unwrap()).collect();
        let streamed = bodies.iter().filter(|b| b["stream"] == true).count();
        assert!((60..140).contains(&streamed), "{streamed}");
        let lengths: Vec<usize> =
            bodies.iter().map(|b| b["messages"][1]["content"].as_str().unwrap().split(' ').count()).collect();
        assert!(lengths.iter().any(|&n| n < 40) && lengths.iter().any(|&n| n > 1000), "{lengths:?}");
        let caps: Vec<u64> = bodies.iter().map(|b| b["max_tokens"].as_u64().unwrap()).collect();
        assert!(caps.iter().all(|&c| (8..=256).contains(&c)));
    }

    #[test]
    fn stream_events_are_read_for_ttft_ids_and_errors() {
        let started = Instant::now();
        let mut seen = Seen::default();
        seen.event(r#"{"id": "a", "choices": [{"delta": {"content": "hi"}}]}"#, started);
        seen.event(r#"{"id": "a", "choices": [{"delta": {"content": " there"}}]}"#, started);
        seen.event("[DONE]", started);
        assert!(seen.ttft.is_some());
        assert_eq!((seen.completion_ids, seen.done_events), (1, 1));
        seen.event(r#"{"id": "b", "choices": []}"#, started);
        assert_eq!(seen.completion_ids, 2, "a second answer spliced in");
        seen.event(r#"{"error": {"message": "broke", "type": "upstream_error"}}"#, started);
        assert_eq!(seen.error_event.as_deref(), Some("broke"));
        assert_eq!(openai_error(br#"{"error": {"message": "full", "code": 429}}"#).as_deref(), Some("full"));
        assert_eq!(openai_error(b"Too Many Requests"), None);
    }
}
