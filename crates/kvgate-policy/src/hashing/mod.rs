//! What the hash-based policies share: request keys (a prompt prefix, or the request's session
//! key), and a cached consistent-hash ring over the pool's workers that is rebuilt only when
//! the set of workers changes. Workers not offered as candidates (unhealthy, circuit open) keep
//! their points and are skipped while walking, so their keys return to them when they recover.

mod ring;

use std::collections::HashMap;
use std::sync::Mutex;

use xxhash_rust::xxh3::xxh3_64;

pub use ring::{name_hash, HashRing};

use crate::{Candidate, RouteRequest, RoutingKey, WorkerId};

/// The hash of the first `count` tokens (or characters, for text) of the request's prompt.
pub fn prefix_key(request: &RouteRequest<'_>, count: usize) -> Option<u64> {
    match request.key {
        RoutingKey::Tokens(ids) if !ids.is_empty() => {
            let bytes: Vec<u8> = ids[..ids.len().min(count)].iter().flat_map(|id| id.to_le_bytes()).collect();
            Some(xxh3_64(&bytes))
        }
        RoutingKey::Text(text) if !text.is_empty() => {
            let end = text.char_indices().nth(count).map_or(text.len(), |(at, _)| at);
            Some(xxh3_64(&text.as_bytes()[..end]))
        }
        _ => None,
    }
}

/// The hash of the request's whole prompt: the identity of the samples of one prompt.
pub fn prompt_key(request: &RouteRequest<'_>) -> Option<u64> {
    prefix_key(request, usize::MAX)
}

/// The hash of the request's session key (routing-key header or `user` field), if it has one.
pub fn session_key(request: &RouteRequest<'_>) -> Option<u64> {
    request.session.filter(|key| !key.is_empty()).map(|key| xxh3_64(key.as_bytes()))
}

/// A ring over every worker the policy has seen, with the names the host gave them.
#[derive(Debug, Default)]
pub struct SharedRing {
    inner: Mutex<RingState>,
    virtual_nodes: usize,
}

#[derive(Debug, Default)]
struct RingState {
    names: HashMap<WorkerId, u64>,
    ring: HashRing,
    /// A name changed since the ring was built.
    stale: bool,
}

impl SharedRing {
    pub fn new(virtual_nodes: usize) -> Self {
        Self { inner: Mutex::default(), virtual_nodes: virtual_nodes.max(1) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RingState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the host's stable name of `worker` (its position on the ring).
    pub fn name(&self, worker: WorkerId, name: &str) {
        let mut state = self.lock();
        let hash = name_hash(name);
        if state.names.insert(worker, hash) != Some(hash) {
            state.stale = true;
        }
    }

    pub fn forget(&self, worker: WorkerId) {
        let mut state = self.lock();
        state.names.remove(&worker);
        let members: Vec<WorkerId> = state.ring.members().iter().copied().filter(|&w| w != worker).collect();
        state.ring = HashRing::new(&members, &state.names, self.virtual_nodes);
        state.stale = false;
    }

    /// Offers `accept` the candidates' indices in ring order from `key` (the owner first) until
    /// it takes one; returns that index.
    pub fn find(
        &self,
        key: u64,
        candidates: &[Candidate],
        mut accept: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        let mut state = self.lock();
        if state.stale || candidates.iter().any(|c| state.ring.members().binary_search(&c.id).is_err()) {
            let mut members = state.ring.members().to_vec();
            members.extend(candidates.iter().map(|c| c.id));
            members.sort_unstable();
            members.dedup();
            state.ring = HashRing::new(&members, &state.names, self.virtual_nodes);
            state.stale = false;
        }
        let found = state
            .ring
            .walk(key)
            .filter_map(|worker| candidates.iter().position(|c| c.id == worker))
            .find(|&i| accept(i));
        found
    }
}
