//! The admission queue's order, shared by the gateway and the simulator, as a pure structure:
//! higher priority classes first; within a class, start-time fair queuing on tokens (a virtual
//! token counter per class), optionally bent toward cache locality within a bounded deficit.
//!
//! A request's start tag is the later of the class's virtual time and the tenant's last finish
//! tag, its finish tag the start plus its tokens over the tenant's weight. Strictly
//! ([`FairQueue::pop`]) the smallest start tag goes first and moves the class's virtual time to
//! it. Backlogged tenants so receive tokens in proportion to their weights whatever their
//! arrival rates, and a tenant returning from idle starts at the present (no credit saved up
//! while away).
//!
//! Locality-aware ([`FairQueue::pop_local`]): among the class's waiting entries whose start tag
//! is at most `bound` tokens of virtual time after the smallest one (the first
//! [`LOCALITY_WINDOW`] of them), the one the caller scores highest (its prompt tokens cached on
//! an engine with room, as the routing policy predicts) goes first, ties to the earliest tag.
//! No entry is ever served ahead of one whose tag is more than `bound` earlier, so a tenant's
//! lead over strict fair order stays within `bound`; a bound of 0 is strict order.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

/// A priority class: the admission queue serves every waiting request of a higher class before
/// any of a lower one. Named `high`, `normal` (the default) and `low`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PriorityClass {
    Low,
    #[default]
    Normal,
    High,
}

impl PriorityClass {
    pub const ALL: [PriorityClass; 3] = [PriorityClass::Low, PriorityClass::Normal, PriorityClass::High];

    pub fn as_str(self) -> &'static str {
        match self {
            PriorityClass::Low => "low",
            PriorityClass::Normal => "normal",
            PriorityClass::High => "high",
        }
    }

    /// The class named `text` (case-insensitive; `0`, `1`, `2` name them by rank too).
    pub fn parse(text: &str) -> Option<PriorityClass> {
        let text = text.trim();
        PriorityClass::ALL
            .into_iter()
            .find(|class| class.as_str().eq_ignore_ascii_case(text) || class.rank().to_string() == text)
    }

    /// 0 for `low` up to 2 for `high`.
    pub fn rank(self) -> usize {
        self as usize
    }

    /// The class as an engine's request `priority` where lower values go first (vLLM's
    /// convention, default 0): `high` -1, `normal` 0, `low` 1. Negated, SGLang's default
    /// convention (higher first).
    pub fn lower_first_priority(self) -> i32 {
        1 - self.rank() as i32
    }
}

/// How many of the waiting entries within the bound [`FairQueue::pop_local`] scores at most
/// (the earliest tags first), so a pop costs at most this many scores whatever the backlog.
pub const LOCALITY_WINDOW: usize = 32;

/// Orders a waiting entry within its class: start tag (as ordered bits of a non-negative f64),
/// then arrival.
type Key = (u64, u64);

struct Class<T> {
    virtual_time: f64,
    /// Each tenant's last finish tag (tenants whose tag the virtual time passed are pruned).
    finish: HashMap<String, f64>,
    waiting: BTreeMap<Key, T>,
}

impl<T> Default for Class<T> {
    fn default() -> Self {
        Self { virtual_time: 0.0, finish: HashMap::new(), waiting: BTreeMap::new() }
    }
}

/// Waiting entries of type `T` in the order they are to be served.
pub struct FairQueue<T> {
    classes: [Class<T>; 3],
    /// Where each waiting id is.
    index: HashMap<u64, (usize, Key)>,
    next_id: u64,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self { classes: Default::default(), index: HashMap::new(), next_id: 0 }
    }
}

impl<T> FairQueue<T> {
    /// Adds an entry of `tenant` (its `weight`, > 0) costing `tokens`; returns its id.
    pub fn push(&mut self, class: PriorityClass, tenant: &str, weight: f64, tokens: u64, item: T) -> u64 {
        let queue = &mut self.classes[class.rank()];
        let last = queue.finish.get(tenant).copied().unwrap_or(0.0);
        let start = last.max(queue.virtual_time);
        let finish = start + tokens.max(1) as f64 / weight.max(f64::MIN_POSITIVE);
        match queue.finish.get_mut(tenant) {
            Some(tag) => *tag = finish,
            None => {
                queue.finish.insert(tenant.to_string(), finish);
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let key = (start.to_bits(), id);
        queue.waiting.insert(key, item);
        self.index.insert(id, (class.rank(), key));
        id
    }

    /// The next entry in strict fair order: the highest class's smallest start tag.
    pub fn pop(&mut self) -> Option<T> {
        self.pop_local(0, |_| 0)
    }

    /// The next entry, preferring locality within `bound` tokens of virtual time: of the highest
    /// class's entries whose start tag is within `bound` of its smallest (at most
    /// [`LOCALITY_WINDOW`], earliest first), the one with the highest `score`, ties to the
    /// earliest. `bound` 0 is [`FairQueue::pop`]'s strict order (`score` is not called).
    pub fn pop_local(&mut self, bound: u64, mut score: impl FnMut(&T) -> u64) -> Option<T> {
        let rank = (0..self.classes.len()).rev().find(|&rank| !self.classes[rank].waiting.is_empty())?;
        let queue = &mut self.classes[rank];
        let (&head, _) = queue.waiting.first_key_value()?;
        let head_start = f64::from_bits(head.0);
        let mut chosen = head;
        if bound > 0 {
            let limit = head_start + bound as f64;
            let mut best = None;
            for (&key, item) in queue.waiting.iter().take(LOCALITY_WINDOW) {
                if f64::from_bits(key.0) > limit {
                    break;
                }
                let value = score(item);
                if best.is_none_or(|best| value > best) {
                    best = Some(value);
                    chosen = key;
                }
            }
        }
        let item = queue.waiting.remove(&chosen)?;
        self.index.remove(&chosen.1);
        // The virtual time follows the smallest tag, not the chosen one: an entry served early
        // moves no one else back.
        queue.virtual_time = queue.virtual_time.max(head_start);
        if queue.finish.len() > 64 && queue.finish.len() > 2 * queue.waiting.len() {
            let now = queue.virtual_time;
            queue.finish.retain(|_, finish| *finish > now);
        }
        Some(item)
    }

    /// Takes out the entry `id` (gave up waiting), if it is still waiting.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let (rank, key) = self.index.remove(&id)?;
        self.classes[rank].waiting.remove(&key)
    }

    /// The class of the entry [`FairQueue::pop`] would serve next (the highest class waiting).
    pub fn highest_class(&self) -> Option<PriorityClass> {
        PriorityClass::ALL.into_iter().rev().find(|class| !self.classes[class.rank()].waiting.is_empty())
    }

    /// Whether an entry of `class` or a higher class waits.
    pub fn waits_at_or_above(&self, class: PriorityClass) -> bool {
        self.highest_class().is_some_and(|highest| highest >= class)
    }

    /// How many entries wait.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
}

#[cfg(test)]
mod tests;
