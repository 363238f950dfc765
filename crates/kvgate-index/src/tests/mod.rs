//! Test suite: invariant checker, unit tests run for both flavours, and proptests against a naive reference.

mod invariants;
mod prop;
mod unit;
