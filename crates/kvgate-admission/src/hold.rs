//! What admission holds for a request while its answer streams: the response body keeps the
//! hold and tells it, at the end, the tokens the answer really used.

/// What an answer used, as its engine reported it, bounded by what the request could use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Used {
    pub prompt: u64,
    pub completion: u64,
}

/// What admission holds for a request until its answer ends (a concurrency slot, its tenant's
/// share), dropped with the body; told the tokens the answer really used, when the engine said.
pub trait AdmissionHold: Send + Sync {
    /// Whether the answer's usage is wanted (the hold corrects a charge with it).
    fn wants_usage(&self) -> bool;
    /// The answer's prompt and output tokens.
    fn used(&mut self, used: Used);
}
