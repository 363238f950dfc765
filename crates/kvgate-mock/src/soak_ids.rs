//! Soak request ids, the counts: each worker counts the `x-soak-id` header values of the
//! generation requests it receives and of those it answers with a 2xx head (`soak_counting.rs`
//! counts them), so a soak run (`kvgate soak`) can tell a request that reached engines twice from
//! one answered twice, and a stream the gateway continued on another engine (the continuation
//! carries `x-kvgate-resumed`) from one answered twice. This file holds the header's name, what
//! was seen of one id, one worker's counts and the fleet's log of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The request header carrying a soak request's unique id.
pub const SOAK_ID_HEADER: &str = "x-soak-id";

/// What the workers saw of one soak request id.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SoakIdSeen {
    /// Generation requests with this id that reached a worker's handler.
    pub received: u32,
    /// Of those, the ones answered with a 2xx status (the answer began; a stream may still have
    /// been cut later).
    pub answered: u32,
    /// Of the answered ones, the continuations of a stream cut on another engine (`x-kvgate-resumed`).
    pub resumed: u32,
}

/// One worker's counts, shared between its handlers and the fleet.
pub(crate) type WorkerSoakIds = Arc<Mutex<HashMap<String, SoakIdSeen>>>;

/// The soak id counts of a fleet's workers. Cloning gives a handle on the same counts, which
/// stays readable after the fleet is shut down (a killed engine's counts still count).
#[derive(Clone, Debug, Default)]
pub struct SoakIdLog {
    workers: Vec<WorkerSoakIds>,
}

impl SoakIdLog {
    pub(crate) fn push(&mut self, worker: WorkerSoakIds) {
        self.workers.push(worker);
    }

    /// The counts summed over the workers, by id.
    pub fn snapshot(&self) -> HashMap<String, SoakIdSeen> {
        let mut total: HashMap<String, SoakIdSeen> = HashMap::new();
        for worker in &self.workers {
            let counts = worker.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            for (id, seen) in counts.iter() {
                let entry = total.entry(id.clone()).or_default();
                entry.received += seen.received;
                entry.answered += seen.answered;
                entry.resumed += seen.resumed;
            }
        }
        total
    }
}
