//! `DecodeError`, and the `Path` the decoders keep so an error can say where in the batch it is.

use std::cell::Cell;
use std::fmt;
use std::io;

/// Why frames or a payload could not be decoded. Every case is the publisher's fault (or a
/// transport that mangled frames); decoding the same bytes again gives the same error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A message with the wrong number of ZeroMQ frames.
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: &'static str, got: usize },
    /// A sequence-number frame that is not 8 bytes long.
    #[error("sequence number frame: expected 8 bytes, got {len}")]
    SeqLength { len: usize },
    /// A replay reply whose first frame is neither the empty delimiter nor a topic.
    #[error("replay reply: the first frame must be the empty delimiter, got {len} bytes")]
    Delimiter { len: usize },
    /// A payload that is not a valid `KVEventBatch`. `location` is where in the batch the
    /// problem is (e.g. `event 3 (BlockStored): token_ids[5]`), empty at the top level.
    #[error("payload: {}", PayloadMessage { location, reason })]
    Payload { location: String, reason: String },
}

struct PayloadMessage<'a> {
    location: &'a str,
    reason: &'a str,
}

impl fmt::Display for PayloadMessage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.location.is_empty() {
            f.write_str(self.reason)
        } else {
            write!(f, "{}: {}", self.location, self.reason)
        }
    }
}

/// The event kinds, for locations (`Unknown` tags are not copied into the path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tag {
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
    Unknown,
}

impl Tag {
    pub(crate) fn of(name: &str) -> Tag {
        match name {
            "BlockStored" => Tag::BlockStored,
            "BlockRemoved" => Tag::BlockRemoved,
            "AllBlocksCleared" => Tag::AllBlocksCleared,
            _ => Tag::Unknown,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Tag::BlockStored => "BlockStored",
            Tag::BlockRemoved => "BlockRemoved",
            Tag::AllBlocksCleared => "AllBlocksCleared",
            Tag::Unknown => "unknown type",
        }
    }
}

/// Where the decoder is. Each level sets its part before decoding a child and clears it once the
/// child decoded, so after an error the cells still name the innermost place that failed. Plain
/// cells: the happy path pays a few stores, no allocation.
#[derive(Default)]
pub(crate) struct Path {
    pub(crate) batch_field: Cell<Option<&'static str>>,
    pub(crate) event: Cell<Option<usize>>,
    pub(crate) tag: Cell<Option<Tag>>,
    pub(crate) field: Cell<Option<&'static str>>,
    pub(crate) element: Cell<Option<usize>>,
}

impl Path {
    /// Enters event `idx` (clears what the previous event left).
    pub(crate) fn enter_event(&self, idx: usize) {
        self.event.set(Some(idx));
        self.tag.set(None);
        self.field.set(None);
        self.element.set(None);
    }

    /// Renders the location, e.g. `event 3 (BlockStored): token_ids[5]`.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        let element = |out: &mut String| {
            if let Some(idx) = self.element.get() {
                out.push_str(&format!("[{idx}]"));
            }
        };
        if let Some(event) = self.event.get() {
            out.push_str(&format!("event {event}"));
            if let Some(tag) = self.tag.get() {
                out.push_str(&format!(" ({})", tag.name()));
            }
            if let Some(field) = self.field.get() {
                out.push_str(&format!(": {field}"));
                element(&mut out);
            }
        } else if let Some(field) = self.batch_field.get() {
            out.push_str(field);
            element(&mut out);
        }
        out
    }
}

/// The msgpack nesting limit handed to rmp-serde. A batch needs 4 levels (batch, events, event,
/// list); the rest is room for `extra_keys` and future fields. It bounds the recursion an
/// adversarial payload can cause.
pub(crate) const MAX_DEPTH: usize = 32;

/// The reason text for an error from the msgpack layer (ours travel as `Syntax` messages).
pub(crate) fn reason(err: rmp_serde::decode::Error) -> String {
    use rmp_serde::decode::Error as E;
    match err {
        E::InvalidMarkerRead(e) | E::InvalidDataRead(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            "unexpected end of payload".to_owned()
        }
        E::TypeMismatch(marker) => format!("invalid msgpack marker {:#04x}", marker.to_u8()),
        E::DepthLimitExceeded => format!("nested deeper than {} levels", MAX_DEPTH - 1),
        E::Utf8Error(_) => "a string that is not valid UTF-8".to_owned(),
        E::Syntax(message) => message,
        other => other.to_string(),
    }
}
