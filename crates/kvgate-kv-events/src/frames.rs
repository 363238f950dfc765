//! ZeroMQ framing: the PUB message `[topic, seq, payload]` and the replay request and replies.

use crate::{decode_batch, DecodeError, EventBatch};

/// The sequence number that ends a replay: -1 as an 8-byte big-endian signed integer.
pub const REPLAY_END: u64 = u64::MAX;

/// One reply of the replay endpoint.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplayReply {
    /// A buffered batch, with the sequence number it was published under.
    Batch { seq: u64, batch: EventBatch },
    /// No more buffered batches.
    End,
}

/// A PUB message's frames `[topic, seq, payload]` → (seq, batch). The topic is not checked (the
/// subscription already filtered on it).
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<(u64, EventBatch), DecodeError> {
    let [_topic, seq, payload] = frames else {
        return Err(DecodeError::FrameCount { expected: "3 (topic, seq, payload)", got: frames.len() });
    };
    Ok((seq_number(seq.as_ref())?, decode_batch(payload.as_ref())?))
}

/// One reply of the replay endpoint, `[seq, payload]`, with or without the leading empty
/// delimiter frame a DEALER socket receives. `[END, anything]` is [`ReplayReply::End`] (vLLM
/// sends an empty payload with it).
pub fn decode_replay_reply<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayReply, DecodeError> {
    let (seq, payload) = match frames {
        [seq, payload] => (seq, payload),
        [delimiter, seq, payload] if delimiter.as_ref().is_empty() => (seq, payload),
        [delimiter, _, _] => return Err(DecodeError::Delimiter { len: delimiter.as_ref().len() }),
        _ => {
            return Err(DecodeError::FrameCount {
                expected: "2 (seq, payload) or 3 (empty delimiter, seq, payload)",
                got: frames.len(),
            })
        }
    };
    match seq_number(seq.as_ref())? {
        REPLAY_END => Ok(ReplayReply::End),
        seq => Ok(ReplayReply::Batch { seq, batch: decode_batch(payload.as_ref())? }),
    }
}

/// The frames a DEALER sends to ask for every buffered batch from `start_seq` on:
/// `[b"", start_seq as 8-byte BE]`.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

fn seq_number(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| DecodeError::SeqLength { len: frame.len() })?;
    Ok(u64::from_be_bytes(bytes))
}
