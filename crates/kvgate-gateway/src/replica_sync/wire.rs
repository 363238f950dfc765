//! What replicas exchange on the Redis channel: a batch of routing records (model, pool role,
//! worker URL, the prompt's chained block hashes) and the sender's in-flight count per worker,
//! MessagePack-encoded with the sender's replica id.

use serde::{Deserialize, Serialize};

use crate::role::WorkerRole;

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
    pub routed: Vec<Routed>,
    /// The sender's requests in flight per worker URL, when this message carries them.
    pub in_flight: Option<Vec<(String, u64)>>,
}

#[derive(Debug, thiserror::Error)]
#[error("undecodable replica-sync message: {0}")]
pub struct DecodeError(#[from] rmp_serde::decode::Error);

impl Message {
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).expect("plain data always encodes")
    }

    pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
        Ok(rmp_serde::from_slice(bytes)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage() {
        let message = Message {
            replica: 7,
            routed: vec![Routed {
                model: "m".into(),
                role: WorkerRole::Regular,
                worker: "http://127.0.0.1:1".into(),
                hashes: vec![1, u64::MAX],
            }],
            in_flight: Some(vec![("http://127.0.0.1:1".into(), 3)]),
        };
        assert_eq!(Message::decode(&message.encode()).unwrap(), message);
        assert!(Message::decode(b"\xc1garbage").is_err());
        assert!(Message::decode(&[]).is_err());
    }
}
