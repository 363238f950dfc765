//! Which prefix index a request is matched against: "exact when the engines' events flow, else
//! the tree", with the modes that force one. One pure rule, called by the gateway for every
//! pool it plans on and by the simulator for every pool it builds.

use serde::{Deserialize, Serialize};

use crate::IndexKind;

/// Which prefix index cache_aware matches requests against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum PrefixIndexMode {
    /// The exact index when every candidate's KV events flow, else the approximate tree.
    Auto,
    /// Always the approximate tree of what was routed where.
    Approximate,
    /// The exact index whenever the model has KV events; workers without flowing events count
    /// as holding nothing.
    Exact,
}

impl PrefixIndexMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixIndexMode::Auto => "auto",
            PrefixIndexMode::Approximate => "approximate",
            PrefixIndexMode::Exact => "exact",
        }
    }
}

/// What the choice of index depends on, for one pool and one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexInputs {
    /// The pool's `prefix_index` option.
    pub mode: PrefixIndexMode,
    /// Some worker of the pool publishes KV events (the exact index can be fed at all).
    pub has_kv_events: bool,
    /// The request's routing key is token ids (the exact index matches nothing else).
    pub key_is_tokens: bool,
    /// Every candidate's events flow, so the exact index is current for all of them.
    pub events_flowing: bool,
}

/// The index to match against: the exact one when the pool has KV events, the key is token ids
/// and the mode allows it (`auto`: every candidate's events flow; `exact`: always), else the
/// approximate tree.
pub fn choose_index(inputs: &IndexInputs) -> IndexKind {
    if !inputs.has_kv_events || !inputs.key_is_tokens {
        return IndexKind::Approximate;
    }
    let exact = match inputs.mode {
        PrefixIndexMode::Auto => inputs.events_flowing,
        PrefixIndexMode::Exact => true,
        PrefixIndexMode::Approximate => false,
    };
    if exact {
        IndexKind::Exact
    } else {
        IndexKind::Approximate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `check(mode, has_kv_events, key_is_tokens, events_flowing, expected)`.
    fn check(mode: PrefixIndexMode, events: bool, tokens: bool, flowing: bool, expected: IndexKind) {
        let inputs =
            IndexInputs { mode, has_kv_events: events, key_is_tokens: tokens, events_flowing: flowing };
        assert_eq!(choose_index(&inputs), expected, "{inputs:?}");
    }

    #[test]
    fn exact_when_events_flow_else_the_tree() {
        use IndexKind::{Approximate as Tree, Exact};
        use PrefixIndexMode::{Approximate, Auto, Exact as Forced};
        check(Auto, true, true, true, Exact);
        check(Auto, true, true, false, Tree);
        check(Forced, true, true, false, Exact);
        check(Approximate, true, true, true, Tree);
        // No events, or a text key: the tree, whatever the mode.
        for mode in [Auto, Forced, Approximate] {
            check(mode, false, true, true, Tree);
            check(mode, true, false, true, Tree);
        }
    }
}
