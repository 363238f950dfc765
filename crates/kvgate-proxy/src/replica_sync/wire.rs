//! What replicas exchange on the Redis channel: a batch of routing records (model, pool role,
//! worker URL, the prompt's chained block hashes) and the sender's in-flight count per worker,
//! MessagePack-encoded with the sender's replica id, a sequence number and the time it was
//! sent, and sealed with an HMAC-SHA256 of the shared secret (`--replica-sync-secret`): the
//! 32-byte tag, then the encoded message. A message whose tag does not verify is never decoded.

use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use kvgate_protocol::role::WorkerRole;

/// One request routed by a replica on its approximate index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routed {
    pub model: String,
    /// The pool's role.
    pub role: WorkerRole,
    /// The chosen worker's URL (ids are per replica; URLs are shared).
    pub worker: String,
    /// The prompt's chained block hashes (`kvgate_index::prompt_blocks`).
    pub hashes: Vec<u64>,
}

/// One message on the channel.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// The sender (a replica ignores its own messages).
    pub replica: u64,
    /// The sender's message number, from 0 at its start: a message numbered at or below the
    /// last one heard from that replica is a replay and is dropped.
    pub seq: u64,
    /// When it was sent, in milliseconds since the Unix epoch (older than
    /// `--replica-sync-max-age-ms`: dropped).
    pub sent_at_ms: u64,
    pub routed: Vec<Routed>,
    /// The sender's requests in flight per worker URL, when this message carries them.
    pub in_flight: Option<Vec<(String, u64)>>,
}

/// Why a received message was dropped before it was applied.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("larger than {0} bytes")]
    Oversized(usize),
    /// No valid tag: not signed with this deployment's secret (or altered).
    #[error("not signed with the shared secret")]
    Unsigned,
    #[error("undecodable: {0}")]
    Undecodable(#[from] rmp_serde::decode::Error),
}

/// Length of the HMAC-SHA256 tag in front of every message.
const TAG: usize = 32;

/// Seals and opens messages with the deployment's shared secret.
#[derive(Clone)]
pub struct Seal {
    key: Hmac<Sha256>,
}

impl Seal {
    pub fn new(secret: &[u8]) -> Seal {
        Seal { key: Hmac::new_from_slice(secret).expect("HMAC takes a key of any length") }
    }

    /// The tag, then the encoded message.
    pub fn seal(&self, message: &Message) -> Vec<u8> {
        let body = rmp_serde::to_vec(message).expect("plain data always encodes");
        let mut mac = self.key.clone();
        mac.update(&body);
        let mut sealed = Vec::with_capacity(TAG + body.len());
        sealed.extend_from_slice(&mac.finalize().into_bytes());
        sealed.extend_from_slice(&body);
        sealed
    }

    /// The message, if `bytes` is at most `max_bytes` long and its tag verifies (checked in
    /// constant time, before anything is decoded).
    pub fn open(&self, bytes: &[u8], max_bytes: usize) -> Result<Message, OpenError> {
        if bytes.len() > max_bytes {
            return Err(OpenError::Oversized(max_bytes));
        }
        if bytes.len() < TAG {
            return Err(OpenError::Unsigned);
        }
        let (tag, body) = bytes.split_at(TAG);
        let mut mac = self.key.clone();
        mac.update(body);
        mac.verify_slice(tag).map_err(|_| OpenError::Unsigned)?;
        Ok(rmp_serde::from_slice(body)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> Message {
        Message {
            replica: 7,
            seq: 3,
            sent_at_ms: 1_700_000_000_000,
            routed: vec![Routed {
                model: "m".into(),
                role: WorkerRole::Regular,
                worker: "http://127.0.0.1:1".into(),
                hashes: vec![1, u64::MAX],
            }],
            in_flight: Some(vec![("http://127.0.0.1:1".into(), 3)]),
        }
    }

    #[test]
    fn round_trips_and_refuses_garbage() {
        let seal = Seal::new(b"a shared secret");
        let sealed = seal.seal(&message());
        assert_eq!(seal.open(&sealed, 1 << 20).unwrap(), message());
        assert!(matches!(seal.open(b"\xc1garbage", 1 << 20), Err(OpenError::Unsigned)));
        assert!(matches!(seal.open(&[], 1 << 20), Err(OpenError::Unsigned)));
        assert!(matches!(seal.open(&sealed, sealed.len() - 1), Err(OpenError::Oversized(_))));
    }

    #[test]
    fn forged_altered_and_unsigned_messages_are_refused() {
        let seal = Seal::new(b"a shared secret");
        // Signed with another secret (a publisher that does not know it).
        let forged = Seal::new(b"a guessed secret").seal(&message());
        assert!(matches!(seal.open(&forged, 1 << 20), Err(OpenError::Unsigned)));
        // One bit of the body changed.
        let mut altered = seal.seal(&message());
        *altered.last_mut().unwrap() ^= 1;
        assert!(matches!(seal.open(&altered, 1 << 20), Err(OpenError::Unsigned)));
        // The pre-signing wire format: a bare MessagePack message.
        let bare = rmp_serde::to_vec(&message()).unwrap();
        assert!(matches!(seal.open(&bare, 1 << 20), Err(OpenError::Unsigned)));
    }
}
