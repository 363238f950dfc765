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
    let (seq, payload) = message_parts(frames)?;
    Ok((seq, decode_batch(payload)?))
}

/// A PUB message's sequence number and (undecoded) payload.
pub(crate) fn message_parts<F: AsRef<[u8]>>(frames: &[F]) -> Result<(u64, &[u8]), DecodeError> {
    let [_topic, seq, payload] = frames else {
        return Err(DecodeError::FrameCount { expected: "3 (topic, seq, payload)", got: frames.len() });
    };
    Ok((seq_number(seq.as_ref())?, payload.as_ref()))
}

/// A replay reply's parts: a batch's sequence number and (undecoded) payload, or the end.
pub(crate) enum ReplayParts<'a> {
    Batch { seq: u64, payload: &'a [u8] },
    End,
}

/// One reply of the replay endpoint, in any form an engine sends, as a DEALER receives it:
///
/// * `[b"", topic, seq, payload]` (vLLM 0.26 on, SGLang 0.5), ended by `[b"", b"", END, b""]`;
/// * `[b"", seq, payload]` (vLLM up to 0.25), ended by `[b"", END, b""]`;
/// * either without the leading empty delimiter (a socket that strips it): `[topic, seq,
///   payload]` with a non-empty topic, or `[seq, payload]`.
///
/// A reply whose sequence number is [`REPLAY_END`] is [`ReplayReply::End`], whatever follows.
pub fn decode_replay_reply<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayReply, DecodeError> {
    match replay_parts(frames)? {
        ReplayParts::End => Ok(ReplayReply::End),
        ReplayParts::Batch { seq, payload } => Ok(ReplayReply::Batch { seq, batch: decode_batch(payload)? }),
    }
}

pub(crate) fn replay_parts<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayParts<'_>, DecodeError> {
    let (seq, payload) = match frames {
        [seq, payload] => (seq, payload),
        [delimiter, _topic, seq, payload] if delimiter.as_ref().is_empty() => (seq, payload),
        [delimiter, _, _, _] => return Err(DecodeError::Delimiter { len: delimiter.as_ref().len() }),
        // An empty first frame: the delimiter (or an empty topic, which reads the same).
        [first, seq, payload] if first.as_ref().is_empty() || seq.as_ref().len() == 8 => (seq, payload),
        [first, _, _] => return Err(DecodeError::Delimiter { len: first.as_ref().len() }),
        _ => {
            return Err(DecodeError::FrameCount {
                expected: "2 to 4 ([delimiter,] [topic,] seq, payload)",
                got: frames.len(),
            })
        }
    };
    Ok(match seq_number(seq.as_ref())? {
        REPLAY_END => ReplayParts::End,
        seq => ReplayParts::Batch { seq, payload: payload.as_ref() },
    })
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
