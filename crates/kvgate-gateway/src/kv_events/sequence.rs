//! The pure part of a KV-event subscription lives in `kvgate-kv-events` (sequence verdicts, and
//! applying a batch's events one by one to the cache's index writer).

pub(crate) use kvgate_kv_events::{apply_batch, Sequence, Verdict};
