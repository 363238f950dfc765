//! Link options for the `kvgate` binary in optimised builds (docs/BENCHMARKS.md, release build).
//!
//! Where the linker is LLVM's lld (rustc's default on x86_64 Linux since 1.90):
//! - `--icf=all` folds functions whose machine code is identical (the same drop glue and generic
//!   code instantiated in many crates), about 0.9 MB of the stripped binary;
//! - `-z pack-relative-relocs` stores the position-independent executable's relative relocations
//!   packed (DT_RELR) instead of 24 bytes each, about 1.2 MB; glibc loads them from 2.36 on, so it
//!   is passed only when the glibc the binary is linked against is 2.36 or newer.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    if var("OPT_LEVEL") == "0" || var("TARGET") != "x86_64-unknown-linux-gnu" || !rustc_links_with_lld() {
        return;
    }
    println!("cargo:rustc-link-arg-bins=-Wl,--icf=all");
    if glibc_at_least(2, 36) {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// rustc 1.90 and newer link x86_64 Linux through its own lld unless a linker was chosen.
fn rustc_links_with_lld() -> bool {
    let linker_chosen = std::env::vars().any(|(name, value)| {
        name == "RUSTC_LINKER"
            || name == "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER"
            || (name == "CARGO_ENCODED_RUSTFLAGS" && (value.contains("linker") || value.contains("fuse-ld")))
    });
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc).arg("--version").output().ok();
    let minor = version
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.split_whitespace().nth(1).map(str::to_owned))
        .and_then(|version| version.split('.').nth(1).and_then(|minor| minor.parse::<u32>().ok()));
    !linker_chosen && minor.is_some_and(|minor| minor >= 90)
}

/// The build host's glibc (`getconf GNU_LIBC_VERSION`: "glibc 2.36").
fn glibc_at_least(major: u32, minor: u32) -> bool {
    let Ok(out) = Command::new("getconf").arg("GNU_LIBC_VERSION").output() else { return false };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(version) = text.split_whitespace().nth(1) else { return false };
    let mut parts = version.split('.').map(|part| part.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (major, minor)
}
