//! The engines' KV event replay: the buffer of recently published (seq, payload) batches and the ZMQ ROUTER that answers replay requests from it.
//!
//! A request is `[identity, b"", start_seq]` (as vLLM's DEALER/REQ clients send it) or
//! `[identity, start_seq]` (a DEALER without the delimiter), `start_seq` 8 bytes big-endian.
//! The answer is one message per buffered batch with `seq >= start_seq`, in publish order, then
//! the end marker, framed as the engine version the mock speaks frames them
//! (`WireFormat::replay_reply`): `[identity, b"", topic, seq, payload]` and
//! `[identity, b"", b"", END, b""]` today, `[identity, b"", seq, payload]` and
//! `[identity, b"", END, b""]` up to vLLM 0.25, END being -1 as 8 signed big-endian bytes. The
//! delimiter is echoed only when the request had one. Malformed requests are logged and ignored.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use crate::error::MockError;
use crate::shutdown::stopped;
use bytes::Bytes;
use kvgate_kv_events::WireFormat;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The last `capacity` batches, shared by the publisher (which pushes every batch, published
/// or dropped) and the replay server.
pub(crate) struct ReplayBuffer {
    batches: Mutex<VecDeque<(u64, Bytes)>>,
    capacity: usize,
}

impl ReplayBuffer {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { batches: Mutex::new(VecDeque::new()), capacity: capacity.max(1) }
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<(u64, Bytes)>> {
        self.batches.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps one batch, forgetting the oldest beyond the capacity.
    pub(crate) fn push(&self, seq: u64, payload: Bytes) {
        let mut batches = self.lock();
        if batches.len() == self.capacity {
            batches.pop_front();
        }
        batches.push_back((seq, payload));
    }

    /// Forgets every batch (an engine restarted: its history went with it).
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }

    /// The kept batches with `seq >= start_seq`, in publish order.
    pub(crate) fn since(&self, start_seq: u64) -> Vec<(u64, Bytes)> {
        self.lock().iter().filter(|(seq, _)| *seq >= start_seq).cloned().collect()
    }
}

/// One replay request, as received from the ROUTER (identity frame first).
#[derive(Debug, PartialEq, Eq)]
struct ReplayRequest {
    identity: Bytes,
    /// Whether the request carried the empty delimiter frame (then the answers do too).
    delimited: bool,
    start_seq: u64,
}

impl ReplayRequest {
    fn parse(frames: Vec<Bytes>) -> Result<Self, String> {
        let (identity, delimited, start) = match <[Bytes; 3]>::try_from(frames) {
            Ok([identity, delimiter, start]) if delimiter.is_empty() => (identity, true, start),
            Ok([_, delimiter, _]) => {
                return Err(format!("a non-empty delimiter frame of {} bytes", delimiter.len()))
            }
            Err(frames) => match <[Bytes; 2]>::try_from(frames) {
                Ok([identity, start]) => (identity, false, start),
                Err(frames) => {
                    return Err(format!(
                        "{} frames, expected [b\"\", start_seq] or [start_seq]",
                        frames.len().saturating_sub(1)
                    ))
                }
            },
        };
        let start: [u8; 8] = start[..]
            .try_into()
            .map_err(|_| format!("a start_seq frame of {} bytes, expected 8", start.len()))?;
        Ok(Self { identity, delimited, start_seq: u64::from_be_bytes(start) })
    }

    /// `[identity, (b""), frames...]`.
    fn answer(&self, frames: Vec<Bytes>) -> ZmqMessage {
        let mut message = ZmqMessage::from(self.identity.clone());
        if self.delimited {
            message.push_back(Bytes::new());
        }
        for frame in frames {
            message.push_back(frame);
        }
        message
    }
}

/// A bound ROUTER socket serving replay requests.
pub(crate) struct ReplayServer {
    socket: RouterSocket,
    endpoint: String,
}

/// How replies are framed: the wire format's version and the publisher's topic.
pub(crate) struct Framing {
    pub(crate) format: WireFormat,
    pub(crate) topic: Bytes,
}

impl ReplayServer {
    /// Binds a ROUTER socket on `host:port` (port 0 picks a free one).
    pub(crate) async fn bind(host: &str, port: u16) -> Result<Self, MockError> {
        let mut socket = RouterSocket::new();
        let endpoint = socket
            .bind(&format!("tcp://{host}:{port}"))
            .await
            .map_err(|e| MockError::bind(format!("the KV event replay socket on {host}:{port}"), e))?;
        Ok(Self { socket, endpoint: endpoint.to_string() })
    }

    /// `tcp://host:port` of the bound socket.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Answers requests from `buffer` until `stop` turns true, then closes the socket (the
    /// port is free again when the task ends).
    pub(crate) fn spawn(
        mut self,
        buffer: std::sync::Arc<ReplayBuffer>,
        framing: Framing,
        mut stop: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                let received = tokio::select! {
                    biased;
                    () = stopped(&mut stop) => break,
                    received = self.socket.recv() => received,
                };
                match received {
                    Ok(message) => self.serve(message.into_vec(), &buffer, &framing).await,
                    Err(error) => {
                        tracing::error!(%error, endpoint = %self.endpoint, "KV event replay socket failed");
                        break;
                    }
                }
            }
            for error in self.socket.close().await {
                tracing::warn!(%error, "closing the KV event replay socket");
            }
        })
    }

    async fn serve(&mut self, frames: Vec<Bytes>, buffer: &ReplayBuffer, framing: &Framing) {
        let request = match ReplayRequest::parse(frames) {
            Ok(request) => request,
            Err(problem) => {
                tracing::warn!(endpoint = %self.endpoint, "ignoring a malformed KV event replay request: {problem}");
                return;
            }
        };
        let batches = buffer.since(request.start_seq);
        tracing::debug!(start_seq = request.start_seq, n_batches = batches.len(), "KV event replay");
        let format = framing.format;
        let answers = batches
            .into_iter()
            .map(|(seq, payload)| request.answer(format.replay_reply(&framing.topic, seq, payload)));
        for message in answers.chain([request.answer(format.replay_end())]) {
            if let Err(error) = self.socket.send(message).await {
                tracing::warn!(%error, endpoint = %self.endpoint, "KV event replay answer failed");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&[u8]]) -> Vec<Bytes> {
        parts.iter().map(|part| Bytes::copy_from_slice(part)).collect()
    }

    #[test]
    fn requests_with_and_without_the_delimiter() {
        let start = 7u64.to_be_bytes();
        let delimited = ReplayRequest::parse(frames(&[b"id", b"", &start])).unwrap();
        assert_eq!(
            delimited,
            ReplayRequest { identity: Bytes::from_static(b"id"), delimited: true, start_seq: 7 }
        );
        let bare = ReplayRequest::parse(frames(&[b"id", &start])).unwrap();
        assert_eq!(
            bare,
            ReplayRequest { identity: Bytes::from_static(b"id"), delimited: false, start_seq: 7 }
        );
    }

    #[test]
    fn malformed_requests_are_errors() {
        let start = 7u64.to_be_bytes();
        for parts in [
            &[b"id".as_slice()][..],
            &[b"id", b"", b"short"],
            &[b"id", b"12345678"[..7].as_ref()],
            &[b"id", b"x", &start],
            &[b"id", b"", &start, b""],
        ] {
            assert!(ReplayRequest::parse(frames(parts)).is_err(), "{parts:?}");
        }
    }

    #[test]
    fn answers_echo_the_request_shape_in_the_formats_framing() {
        let delimited = ReplayRequest { identity: Bytes::from_static(b"id"), delimited: true, start_seq: 0 };
        let answer = delimited.answer(WireFormat::Vllm033.replay_end()).into_vec();
        assert_eq!(answer, frames(&[b"id", b"", b"", &[0xff; 8], b""]), "today's end marker: an empty topic");
        let answer = delimited.answer(WireFormat::Vllm025.replay_end()).into_vec();
        assert_eq!(answer, frames(&[b"id", b"", &[0xff; 8], b""]));
        let bare = ReplayRequest { delimited: false, ..delimited };
        let payload = Bytes::from_static(b"payload");
        let answer = bare.answer(WireFormat::Sglang05.replay_reply(b"kv", 3, payload.clone())).into_vec();
        assert_eq!(answer, frames(&[b"id", b"kv", &[0, 0, 0, 0, 0, 0, 0, 3], b"payload"]));
        let answer = bare.answer(WireFormat::Vllm010.replay_reply(b"kv", 3, payload)).into_vec();
        assert_eq!(answer, frames(&[b"id", &[0, 0, 0, 0, 0, 0, 0, 3], b"payload"]));
    }

    #[test]
    fn the_buffer_keeps_the_latest_batches() {
        let buffer = ReplayBuffer::new(2);
        for seq in 0..3 {
            buffer.push(seq, Bytes::from(vec![seq as u8]));
        }
        let seqs = |start| buffer.since(start).into_iter().map(|(seq, _)| seq).collect::<Vec<_>>();
        assert_eq!(seqs(0), [1, 2]);
        assert_eq!(seqs(2), [2]);
        assert_eq!(seqs(3), Vec::<u64>::new());
    }
}
