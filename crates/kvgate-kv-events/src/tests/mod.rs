//! Test suite: hand-written fixtures for both encodings, framing, malformed inputs, properties.

mod frames;
mod malformed;
mod maps;
mod positional;
mod prop;
mod writer;

/// Joins fixture parts (hand-written msgpack headers and the bodies of strings) into a payload.
fn concat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}
