//! The optimiser against `abi::usable_size`, in an optimised build (CI runs this file with
//! `--release`, on x86_64 and in the arm64 guest).
//!
//! LLVM 22 (rustc 1.95.0 with LLVM 22.1.2, rustc 1.96.0 with LLVM 22.1.8) compiles
//! `if k > 20 { k.min(32) } else { 20 }` at -O into `umin(k, 32)`: inside the branch it gives
//! `k` the range attribute [21, 2^32), then folds the branch into a select and the select into
//! the `umin`, keeping the attribute, so every k <= 20 returns k instead of 20 (0 for kernels
//! before 6.3, which publish no feature size). `usable_size` was once written that way; its
//! x86_64 code happened to come out right, the aarch64 code from rustc 1.96 did not.

use std::hint::black_box;
use thiscpu::abi::{ORIGINAL_AREA_SIZE, ORIGINAL_FEATURE_SIZE, usable_size};

/// The reproducer: the form LLVM 22 miscompiles.
#[inline(never)]
fn clamp_written_as_branch_and_min(k: u32) -> u32 {
    if k > 20 { k.min(32) } else { 20 }
}

/// What the clamp means, for every feature size a kernel may publish.
fn clamp(k: u32) -> u32 {
    match k {
        0..=20 => 20,
        21..=31 => k,
        _ => 32,
    }
}

#[test]
fn usable_size_survives_the_optimiser_that_miscompiles_the_branch_and_min_form() {
    let miscompiled: Vec<u32> = (0..=64)
        .filter(|&k| clamp_written_as_branch_and_min(black_box(k)) != clamp(k))
        .collect();
    if miscompiled.is_empty() {
        eprintln!("this compiler computes the branch-and-min form correctly");
    } else {
        eprintln!(
            "this compiler miscompiles `if k > 20 {{ k.min(32) }} else {{ 20 }}` for k in \
             {miscompiled:?}"
        );
    }
    for registered in [ORIGINAL_FEATURE_SIZE, ORIGINAL_AREA_SIZE] {
        for k in 0..=64 {
            assert_eq!(
                usable_size(black_box(registered), black_box(k)),
                clamp(k),
                "registered {registered}, feature size {k}"
            );
        }
    }
}
