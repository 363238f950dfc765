//! One replayed request: the OpenAI-compatible streaming body for a trace line, and reading its SSE response for TTFT, end-to-end time and usage.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvgate_protocol::usage::usage_of_body;
use kvgate_protocol::SseData;
use kvgate_trace::{prompt_text, TraceRequest};
use serde_json::{json, Value};

pub use kvgate_trace::Endpoint;

/// The JSON body of a trace line: streaming, exactly `output_length` tokens, usage in the stream.
pub fn request_body(request: &TraceRequest, model: &str, endpoint: Endpoint) -> Value {
    let text = prompt_text(request);
    let mut body = json!({
        "model": model,
        "stream": true,
        "max_tokens": request.output_length,
        "ignore_eos": true,
        "temperature": 0,
        "stream_options": {"include_usage": true},
    });
    endpoint.put_prompt(&mut body, text);
    body
}

/// What the client saw of one request that succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observed {
    /// Send to the first SSE `data:` event.
    pub ttft: Duration,
    /// Send to the end of the stream.
    pub e2e: Duration,
    /// From the final usage chunk (0 when the server sent none).
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// Why one request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("connecting or sending: {0}")]
    Send(String),
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
    #[error("reading the stream: {0}")]
    Stream(String),
    #[error("the stream ended without `data: [DONE]`")]
    Truncated,
    #[error("the server sent an error event: {0}")]
    ErrorEvent(String),
}

/// Sends `body` to `url` and reads the SSE stream to its end.
pub async fn send(client: &reqwest::Client, url: &str, body: &Value) -> Result<Observed, RequestError> {
    send_with_headers(client, url, body, &[]).await
}

/// [`send`] with extra request headers (the tenant and priority headers of a trace line).
pub async fn send_with_headers(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &[(String, String)],
) -> Result<Observed, RequestError> {
    let payload = serde_json::to_vec(body).expect("a JSON value always serializes");
    send_payload(client, url, payload, headers).await
}

/// [`send_with_headers`] with the body already serialized (`kvgate replay` builds it ahead of
/// the request's due time): the time to first token counts from here.
pub async fn send_payload(
    client: &reqwest::Client,
    url: &str,
    payload: Vec<u8>,
    headers: &[(String, String)],
) -> Result<Observed, RequestError> {
    let started = Instant::now();
    let mut builder =
        client.post(url).header("content-type", "application/json").header("accept", "text/event-stream");
    for (name, value) in headers {
        builder = builder.header(name.as_str(), value.as_str());
    }
    let response = builder.body(payload).send().await.map_err(|e| RequestError::Send(e.to_string()))?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        let body: String = text.chars().take(300).collect();
        return Err(RequestError::Status { status: status.as_u16(), body });
    }
    let mut reader = SseReader::default();
    let mut stream = response.bytes_stream();
    let mut ttft = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| RequestError::Stream(e.to_string()))?;
        reader.push(&chunk)?;
        if ttft.is_none() && reader.data_events > 0 {
            ttft = Some(started.elapsed());
        }
        if reader.done {
            break;
        }
    }
    if !reader.done {
        return Err(RequestError::Truncated);
    }
    let e2e = started.elapsed();
    Ok(Observed {
        ttft: ttft.unwrap_or(e2e),
        e2e,
        prompt_tokens: reader.usage.0,
        cached_tokens: reader.usage.1,
        completion_tokens: reader.usage.2,
    })
}

/// What a replayed request's stream says: its `data:` events (`kvgate_protocol::SseData` reads
/// them), `[DONE]`, the last usage object, or an error event.
#[derive(Debug, Default)]
pub struct SseReader {
    events: SseData,
    /// `data:` events seen, `[DONE]` included.
    pub data_events: u64,
    pub done: bool,
    /// (prompt, cached, completion) tokens of the last usage object seen.
    pub usage: (u64, u64, u64),
}

impl SseReader {
    /// Consumes bytes; complete events are interpreted at once.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), RequestError> {
        self.events.push(bytes);
        while let Some(data) = self.events.next_data() {
            self.data(&data)?;
        }
        Ok(())
    }

    fn data(&mut self, data: &str) -> Result<(), RequestError> {
        self.data_events += 1;
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        if data.contains("\"error\"") {
            if let Some(error) = serde_json::from_str::<Value>(data)
                .ok()
                .and_then(|mut value| value.get_mut("error").map(Value::take))
            {
                return Err(RequestError::ErrorEvent(error.to_string()));
            }
        }
        if let Some(usage) = usage_of_body(data.as_bytes()) {
            let number = |count: Option<u32>| u64::from(count.unwrap_or(0));
            self.usage =
                (number(usage.prompt_tokens), number(usage.cached_tokens), number(usage.completion_tokens));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_usage_and_done_across_chunk_boundaries() {
        let stream = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[],\"usage\":\
            {\"prompt_tokens\":10,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\r\n\r\n\
            data: [DONE]\n\n";
        let mut reader = SseReader::default();
        for piece in stream.as_bytes().chunks(7) {
            reader.push(piece).unwrap();
        }
        assert!(reader.done);
        assert_eq!(reader.data_events, 3);
        assert_eq!(reader.usage, (10, 4, 2));
    }

    #[test]
    fn an_error_event_fails_the_request() {
        let mut reader = SseReader::default();
        let error = reader.push(b"data: {\"error\": {\"message\": \"boom\"}}\n").unwrap_err();
        assert!(matches!(error, RequestError::ErrorEvent(message) if message.contains("boom")));
    }

    #[test]
    fn bodies_stream_exactly_the_trace_lengths() {
        let request = TraceRequest {
            timestamp_ms: 0.0,
            input_length: 600,
            output_length: 9,
            hash_ids: vec![3, 4],
            ..Default::default()
        };
        let body = request_body(&request, "m", Endpoint::Completions);
        assert_eq!(body["max_tokens"], 9);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["prompt"].as_str().unwrap().split(' ').count(), 600);
        let chat = request_body(&request, "m", Endpoint::Chat);
        assert_eq!(chat["messages"][0]["role"], "user");
    }
}
