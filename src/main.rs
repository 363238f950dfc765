//! The `kvgate` binary: the command line of `src/lib.rs` with mimalloc as the allocator.

use std::process::ExitCode;

/// The proxy allocates and frees small buffers per request; mimalloc keeps that cheap.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    kvgate::main_with_args(std::env::args_os())
}
