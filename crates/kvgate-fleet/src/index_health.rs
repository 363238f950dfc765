//! One worker's index health, as the alignment probe (`alignment/`) and the index repair leave
//! it: the last probe's report, the prompt the next probe re-sends to check the index still
//! holds what it claims, whether the worker is quarantined (its pool routed on the approximate
//! tree), and the signal its KV-event subscriptions take to drop and replay its holdings.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use kvgate_index::{FormObservation, ProbeCause, ProbeForm, SentinelObservation, Verdict};
use serde::Serialize;
use tokio::sync::watch;

/// What one probe of a worker concluded.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProbeReport {
    /// When it ended, on the gateway's millisecond clock.
    pub at_ms: u64,
    /// `passed`, `failed` (with the cause) or `inconclusive`.
    #[serde(flatten)]
    pub verdict: Verdict,
    /// Each form sent, with what was seen of it and its own verdict.
    pub forms: Vec<FormReport>,
    /// The previous probe's prompt sent again: does the engine still serve what the index holds?
    pub sentinel: Option<SentinelReport>,
    /// Why the probe could not run to its end (the worker did not answer, ...).
    pub error: Option<String>,
}

impl ProbeReport {
    pub fn cause(&self) -> Option<ProbeCause> {
        self.verdict.cause()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FormReport {
    pub form: ProbeForm,
    #[serde(flatten)]
    pub seen: FormObservation,
    /// The prompt's length is a whole number of the index's blocks (the last-token rule shows).
    pub aligned: bool,
    #[serde(flatten)]
    pub verdict: Verdict,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SentinelReport {
    #[serde(flatten)]
    pub seen: SentinelObservation,
    #[serde(flatten)]
    pub verdict: Verdict,
}

/// The previous probe's completion prompt, re-sent by the next one.
#[derive(Clone, Debug, PartialEq)]
pub struct SentinelPrompt {
    pub text: String,
    pub tokens: Vec<u32>,
}

/// A worker's index health.
#[derive(Debug)]
pub struct IndexHealth {
    report: Mutex<Option<ProbeReport>>,
    sentinel: Mutex<Option<SentinelPrompt>>,
    quarantined: AtomicBool,
    /// A probe is wanted soon (after a repair, a closed-loop disagreement).
    probe_requested: AtomicBool,
    /// Bumped to make the worker's subscriptions drop its holdings and replay them.
    resync: watch::Sender<u64>,
    /// The cause of a disagreement the closed loop raised, for the repair to act on.
    disagreement: Mutex<Option<&'static str>>,
    /// One may be there: the alignment loop's look at every worker four times a second takes
    /// no lock while none is (at 10,000 workers, the locks were a twentieth of an idle
    /// gateway's CPU).
    disagreement_flagged: AtomicBool,
}

impl Default for IndexHealth {
    fn default() -> Self {
        Self {
            report: Mutex::default(),
            sentinel: Mutex::default(),
            quarantined: AtomicBool::new(false),
            probe_requested: AtomicBool::new(false),
            resync: watch::Sender::new(0),
            disagreement: Mutex::default(),
            disagreement_flagged: AtomicBool::new(false),
        }
    }
}

impl IndexHealth {
    pub fn report(&self) -> Option<ProbeReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_report(&self, report: ProbeReport) {
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
    }

    pub fn sentinel(&self) -> Option<SentinelPrompt> {
        self.sentinel.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_sentinel(&self, prompt: Option<SentinelPrompt>) {
        *self.sentinel.lock().unwrap_or_else(|p| p.into_inner()) = prompt;
    }

    /// Whether the worker's exact-index holdings are set aside for routing (quarantine).
    pub fn quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    /// Sets the quarantine; returns whether it changed.
    pub fn set_quarantined(&self, quarantined: bool) -> bool {
        self.quarantined.swap(quarantined, Ordering::Relaxed) != quarantined
    }

    /// Asks the probe loop for a probe of this worker at its next round.
    pub fn request_probe(&self) {
        self.probe_requested.store(true, Ordering::Relaxed);
    }

    /// Takes the request for a probe (true once per request).
    pub fn take_probe_request(&self) -> bool {
        self.probe_requested.swap(false, Ordering::Relaxed)
    }

    /// The closed loop raised a disagreement on this worker (`cause`: its likely cause).
    pub fn flag_disagreement(&self, cause: &'static str) {
        *self.disagreement.lock().unwrap_or_else(|p| p.into_inner()) = Some(cause);
        self.disagreement_flagged.store(true, Ordering::Release);
    }

    /// Takes the disagreement flagged since the last call, if any.
    pub fn take_disagreement(&self) -> Option<&'static str> {
        // A load, not a swap: no write to the worker's cache line while nothing was flagged.
        if !self.disagreement_flagged.load(Ordering::Acquire) {
            return None;
        }
        // Cleared before the take (acquire: the take cannot move before it), so one flagged
        // meanwhile is taken now or seen next time.
        self.disagreement_flagged.swap(false, Ordering::AcqRel);
        self.disagreement.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Makes every KV-event subscription of the worker drop its holdings and replay them.
    pub fn request_resync(&self) {
        self.resync.send_modify(|generation| *generation += 1);
    }

    /// What a subscription watches for [`IndexHealth::request_resync`].
    pub fn resync_requests(&self) -> watch::Receiver<u64> {
        self.resync.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flagged_disagreement_is_taken_once_and_the_last_cause_wins() {
        let health = IndexHealth::default();
        assert_eq!(health.take_disagreement(), None);
        health.flag_disagreement("template");
        health.flag_disagreement("eviction");
        assert_eq!(health.take_disagreement(), Some("eviction"));
        assert_eq!(health.take_disagreement(), None);
        health.flag_disagreement("template");
        assert_eq!(health.take_disagreement(), Some("template"));
    }
}
