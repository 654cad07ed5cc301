//! Compiles the bench's C reference loops (`src/bench/reference.c`) on x86_64 Linux, the one
//! target they are written for, and tells the code so with `cfg(thiscpu_c_reference)`.

use std::env;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(thiscpu_c_reference)");
    println!("cargo::rerun-if-changed=src/bench/reference.c");
    let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    if os != "linux" || arch != "x86_64" {
        return;
    }
    // Loops on 64-byte boundaries, as the workspace's own (see .cargo/config.toml), so that
    // neither side's figure depends on where its loop happens to fall.
    cc::Build::new()
        .file("src/bench/reference.c")
        .opt_level(2)
        .flag("-falign-loops=64")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("thiscpu_c_reference");
    println!("cargo::rustc-cfg=thiscpu_c_reference");
}
