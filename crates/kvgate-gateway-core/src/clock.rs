//! The gateway's millisecond clock: the time handed to policies, stamped on load samples and
//! compared with them, counted from the gateway's start.

use std::time::Instant;

/// Milliseconds since one start instant; copies share the epoch.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    started: Instant,
}

impl Clock {
    /// A clock starting now.
    pub fn start() -> Self {
        Self { started: Instant::now() }
    }

    /// Milliseconds since the clock started.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
}
