//! Chooses the backends once, for `arch` and `os` to read as two plain `cfg`s, so that the
//! predicate that decides them is written in this one place.
//!
//! - `thiscpu_linux`: the operating-system services are Linux's (`futex`, `membarrier`,
//!   `sched_getaffinity`, `/sys`, `mmap`, `getcpu`).
//! - `thiscpu_rseq`: besides, the architecture has a restartable-sequence port
//!   (`arch/x86_64.rs`, `arch/aarch64.rs`, `arch/riscv64.rs`), so rseq is registered and used.
//!
//! `RUSTFLAGS="--cfg thiscpu_portable"` turns both off on Linux as well, so that the portable
//! path, which every other system takes, can be built and tested on a Linux machine.
//!
//! - `thiscpu_lsan`: built with AddressSanitizer or LeakSanitizer (nightly's `-Zsanitizer`),
//!   whose leak checker must be told where the allocator's caches keep their pointers
//!   (`allocator/caches.rs`).

use std::env;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(thiscpu_linux)");
    println!("cargo::rustc-check-cfg=cfg(thiscpu_rseq)");
    println!("cargo::rustc-check-cfg=cfg(thiscpu_lsan)");
    println!("cargo::rerun-if-changed=build.rs");
    let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    // Cargo hands the build script every `--cfg` of RUSTFLAGS as `CARGO_CFG_<NAME>`.
    let portable = env::var_os("CARGO_CFG_THISCPU_PORTABLE").is_some();
    // `sanitize="address"` and the like are target cfgs, which cargo hands over too.
    let sanitizers = env::var("CARGO_CFG_SANITIZE").unwrap_or_default();
    if sanitizers.split(',').any(|s| s == "address" || s == "leak") {
        println!("cargo::rustc-cfg=thiscpu_lsan");
    }
    let linux = os == "linux" && !portable;
    if linux {
        println!("cargo::rustc-cfg=thiscpu_linux");
        if matches!(arch.as_str(), "x86_64" | "aarch64" | "riscv64") {
            println!("cargo::rustc-cfg=thiscpu_rseq");
        }
    }
}
