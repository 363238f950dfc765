//! The decode side of a KV transfer: pulling a room's KV from the prefill engine's bootstrap server before any response byte.

use std::fmt::Write;
use std::time::Duration;

use kvgate_config::error_chain;
use tokio::sync::watch;

use kvgate_protocol::transfer::KvSource;

use super::args::PdTiming;
use super::bootstrap::PulledKv;
use crate::api_error::ApiError;
use crate::shutdown::stopped;

/// Added to the decode side's wait, so that a prefill engine's own verdict at the end of the
/// same hold timeout (an unknown room, a prefill still running) arrives first.
const PULL_GRACE: Duration = Duration::from_millis(100);

/// The bootstrap server's URL of a decode request's KV.
fn url(source: &KvSource) -> String {
    let host = if source.host.contains(':') && !source.host.starts_with('[') {
        format!("[{}]", source.host)
    } else {
        source.host.clone()
    };
    format!("http://{host}:{}/kv/{}", source.port, percent_encode(&source.room))
}

/// `text` with every byte outside `A-Z a-z 0-9 - . _ ~` percent-encoded (a path segment).
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// Pulls the KV of `source` for a prompt of `prompt_tokens` tokens: waits until the prefill
/// engine has it ready and transferred, at most a hold timeout plus the transfer time (and a
/// grace of 100 ms). Every
/// failure (refused connection, unknown or failed room, timeout, a KV of another prompt
/// length) is a 502 `kv_transfer_error`. Returns the prompt tokens the prefill engine found
/// cached.
pub(crate) async fn pull(
    client: &reqwest::Client,
    timing: &PdTiming,
    stop: &watch::Receiver<bool>,
    source: &KvSource,
    prompt_tokens: usize,
) -> Result<u32, ApiError> {
    let url = url(source);
    let fetch = async {
        let response = client.get(&url).send().await.map_err(|error| error_chain(&error))?;
        let status = response.status();
        let body = response.bytes().await.map_err(|error| error_chain(&error))?;
        if !status.is_success() {
            let message = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|value| value["error"]["message"].as_str().map(str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
            return Err(format!("HTTP {}: {message}", status.as_u16()));
        }
        serde_json::from_slice::<PulledKv>(&body).map_err(|error| format!("malformed answer: {error}"))
    };
    let wait = timing.hold_timeout + timing.transfer_time(prompt_tokens as u64) + PULL_GRACE;
    let mut stop = stop.clone();
    let result = tokio::select! {
        result = tokio::time::timeout(wait, fetch) => result,
        () = stopped(&mut stop) => return Err(ApiError::unavailable("the engine is shutting down")),
    };
    let from = format!("KV room {} from {}:{}", source.room, source.host, source.port);
    match result {
        Err(_) => Err(ApiError::kv_transfer(format!("gave up waiting for {from} after the hold timeout"))),
        Ok(Err(problem)) => Err(ApiError::kv_transfer(format!("pulling {from} failed: {problem}"))),
        Ok(Ok(pulled)) if pulled.prompt_tokens as usize != prompt_tokens => {
            Err(ApiError::kv_transfer(format!(
                "{from} holds the KV of {} prompt tokens but this request's prompt has {prompt_tokens}",
                pulled.prompt_tokens
            )))
        }
        Ok(Ok(pulled)) => Ok(pulled.cached_tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_escape_the_room_and_bracket_ipv6_hosts() {
        let source = KvSource { host: "127.0.0.1".into(), port: 9, room: "vllm-0-1".into() };
        assert_eq!(url(&source), "http://127.0.0.1:9/kv/vllm-0-1");
        let odd = KvSource { host: "::1".into(), port: 9, room: "a/b c".into() };
        assert_eq!(url(&odd), "http://[::1]:9/kv/a%2Fb%20c");
    }
}
