//! A prefill engine's rooms: one per PD request, from its arrival through its held KV to the decode engine's pull (or a failure), with the long-poll a pull waits on.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::args::PdTiming;
use crate::api_error::ApiError;
use crate::driver::EngineHandle;
use crate::shutdown::stopped;

/// The held KV a pull takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HeldKv {
    /// The request's id in the prefill engine (what `release_held` takes).
    pub(crate) engine_request_id: u64,
    pub(crate) prompt_tokens: u32,
    /// Of the prompt, the tokens the prefill engine found in its own prefix cache (what the
    /// decode engine reports as cached: the KV it receives was computed, not cached, there).
    pub(crate) cached_tokens: u32,
    pub(crate) blocks: u64,
}

/// Why a pull got no KV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PullRefusal {
    /// The room ended without a KV to give (the prefill failed, the hold expired, it was pulled).
    Closed(String),
    /// No request with this room arrived within the hold timeout.
    Unknown(String),
    /// The room's prefill did not finish within the hold timeout.
    StillPrefilling(String),
    ShuttingDown,
}

#[derive(Debug)]
enum Room {
    /// The prefill request arrived; its KV is not ready yet.
    Prefilling,
    Ready(HeldKv),
    /// A pull took the KV and is transferring it.
    Transferring,
    /// Nothing to pull any more; kept (for a hold timeout) so that a late pull fails fast.
    Closed {
        reason: String,
        since: Instant,
    },
}

#[derive(Default)]
struct RoomTable {
    rooms: HashMap<String, Room>,
    /// Closed rooms in closing order, forgotten a hold timeout after closing.
    closed: VecDeque<(Instant, String)>,
}

impl RoomTable {
    fn close(&mut self, key: &str, reason: String, hold_timeout: std::time::Duration) {
        let now = Instant::now();
        while let Some((since, _)) = self.closed.front().filter(|(since, _)| *since + hold_timeout <= now) {
            let since = *since;
            let (_, old) = self.closed.pop_front().expect("peeked above");
            if matches!(self.rooms.get(&old), Some(Room::Closed { since: s, .. }) if *s == since) {
                self.rooms.remove(&old);
            }
        }
        self.rooms.insert(key.to_string(), Room::Closed { reason, since: now });
        self.closed.push_back((now, key.to_string()));
    }
}

/// One prefill engine's rooms, shared by its generation handlers and its bootstrap server.
pub(crate) struct KvRooms {
    engine: EngineHandle,
    pub(crate) timing: PdTiming,
    table: Mutex<RoomTable>,
    /// Woken on every room change; pulls re-check their room.
    changed: Notify,
    /// Turns true when the fleet shuts down.
    pub(crate) stop: watch::Receiver<bool>,
}

impl KvRooms {
    pub(crate) fn new(engine: EngineHandle, timing: PdTiming, stop: watch::Receiver<bool>) -> Self {
        Self { engine, timing, table: Mutex::new(RoomTable::default()), changed: Notify::new(), stop }
    }

    fn lock(&self) -> MutexGuard<'_, RoomTable> {
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Opens room `key` for a PD request arriving at this prefill engine. Fails when a request
    /// with the same room is still in flight or held here.
    pub(crate) fn open(self: &Arc<Self>, key: String) -> Result<RoomTicket, ApiError> {
        let mut table = self.lock();
        if let Some(room) = table.rooms.get(&key) {
            if !matches!(room, Room::Closed { .. }) {
                return Err(ApiError::bad_request(format!(
                    "KV room {key} is already in use on this prefill engine"
                )));
            }
        }
        table.rooms.insert(key.clone(), Room::Prefilling);
        drop(table);
        self.changed.notify_waiters();
        Ok(RoomTicket { rooms: self.clone(), key, settled: false })
    }

    fn close(&self, key: &str, reason: String) {
        self.lock().close(key, reason, self.timing.hold_timeout);
        self.changed.notify_waiters();
    }

    /// Frees the KV of room `key` if it is still held for engine request `engine_request_id`
    /// and nobody pulled it: the hold timeout passed.
    pub(crate) fn expire(&self, key: &str, engine_request_id: u64) {
        let expired = {
            let mut table = self.lock();
            let held = matches!(table.rooms.get(key),
                Some(Room::Ready(held)) if held.engine_request_id == engine_request_id);
            if held {
                let reason = "the prefilled KV expired: nobody pulled it within the hold timeout";
                table.close(key, reason.to_string(), self.timing.hold_timeout);
            }
            held
        };
        if expired {
            self.engine.release_held(engine_request_id);
            self.changed.notify_waiters();
        }
    }

    /// Waits (at most a hold timeout) until room `key` has its KV ready, and takes it: the room
    /// turns `Transferring` and the caller must call `transferred`.
    pub(crate) async fn take(&self, key: &str) -> Result<HeldKv, PullRefusal> {
        let deadline = Instant::now() + self.timing.hold_timeout;
        let mut stop = self.stop.clone();
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let prefilling = {
                let mut table = self.lock();
                match table.rooms.get_mut(key) {
                    Some(room @ Room::Ready(_)) => {
                        let Room::Ready(held) = std::mem::replace(room, Room::Transferring) else {
                            unreachable!("matched as ready above");
                        };
                        return Ok(held);
                    }
                    Some(Room::Transferring) => {
                        return Err(PullRefusal::Closed(format!("KV room {key} is being pulled already")));
                    }
                    Some(Room::Closed { reason, .. }) => return Err(PullRefusal::Closed(reason.clone())),
                    Some(Room::Prefilling) => true,
                    None => false,
                }
            };
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(deadline) => {
                    return Err(if prefilling {
                        PullRefusal::StillPrefilling(format!(
                            "the prefill of KV room {key} did not finish within the hold timeout"
                        ))
                    } else {
                        PullRefusal::Unknown(format!(
                            "KV room {key} is unknown to this prefill engine (waited a hold timeout)"
                        ))
                    });
                }
                () = stopped(&mut stop) => return Err(PullRefusal::ShuttingDown),
            }
        }
    }

    /// The pull of room `key` finished transferring: the engine frees the held KV.
    pub(crate) fn transferred(&self, key: &str, held: HeldKv) {
        self.engine.release_held(held.engine_request_id);
        self.close(key, format!("KV room {key} was pulled already"));
    }
}

/// A PD request's claim on its room at the prefill engine. It must be settled with `ready` or
/// `fail`; dropping it unsettled fails the room (the request was refused or cancelled).
pub(crate) struct RoomTicket {
    rooms: Arc<KvRooms>,
    key: String,
    settled: bool,
}

impl RoomTicket {
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// The prefill finished and its KV is held by the engine: pulls may take it.
    pub(crate) fn ready(mut self, held: HeldKv) -> (Arc<KvRooms>, String) {
        self.settled = true;
        self.rooms.lock().rooms.insert(self.key.clone(), Room::Ready(held));
        self.rooms.changed.notify_waiters();
        (self.rooms.clone(), std::mem::take(&mut self.key))
    }

    /// The prefill produced no KV; pulls of the room fail at once with `reason`.
    pub(crate) fn fail(mut self, reason: String) {
        self.settled = true;
        self.rooms.close(&self.key, reason);
    }
}

impl Drop for RoomTicket {
    fn drop(&mut self) {
        if !self.settled {
            let reason = "the prefill engine did not run the request (refused or cancelled)";
            self.rooms.close(&self.key, reason.to_string());
        }
    }
}
