//! The `kvgate` binary and the documents generated from its schema: ARCHITECTURE.md's crate map
//! against the workspace (`architecture`), the demo commands and startup
//! errors (`cli`), docs/CONFIG.md (`docs`), SMG 1.13 command lines and docs/SMG.md (`smg`), a
//! short soak (`soak`). One test binary for the area (see tests/integration/main.rs for why).
//! Regenerate the generated documents with `KVGATE_UPDATE_DOCS=1 cargo test --test commands docs`.

mod architecture;
mod cli;
mod docs;
mod smg;
mod soak;
