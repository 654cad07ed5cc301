//! A shared library whose global allocator is `thiscpu::PerCpuAlloc`, as a plugin or a Python
//! extension module written in Rust could declare it: this example builds as a `cdylib`
//! (`liballoc_shared_library.so`) exporting C functions, and `tests/shared_library.rs` loads it
//! with `dlopen` into a program that allocates with the system's allocator. The library's
//! Rust code, its standard library's allocations included, allocates through its own copy of
//! thiscpu.

use std::alloc::{GlobalAlloc, Layout};
use thiscpu::PerCpuAlloc;

/// The library's global allocator; with `--cfg thiscpu_global_alloc` thiscpu declares that one
/// itself, and this one serves `alloc_one` only.
#[cfg_attr(not(thiscpu_global_alloc), global_allocator)]
static GLOBAL: PerCpuAlloc = PerCpuAlloc::new();

/// Makes, checks and frees `rounds` rounds of boxes, strings and vectors of many sizes (grown
/// by reallocs, some beyond the cached limit), through the library's global allocator. Returns how many values
/// were found wrong: 0.
#[unsafe(no_mangle)]
pub extern "C" fn alloc_churn(rounds: u64, seed: u64) -> u64 {
    let mut wrong = 0;
    let mut state = seed | 1;
    let mut next = move |below: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % below
    };
    for round in 0..rounds {
        let strings: Vec<String> = (0..16).map(|n| format!("{round}-{n}")).collect();
        // Grown one push at a time: reallocs through the classes and beyond them.
        let vectors: Vec<Vec<u64>> = (0..16)
            .map(|_| {
                let len = 1 + next(1200);
                let mut vector = Vec::new();
                for v in 0..len {
                    vector.push(v ^ round);
                }
                vector
            })
            .collect();
        let boxed: Vec<Box<[u8; 24]>> = (0..16).map(|n| Box::new([n as u8; 24])).collect();
        for (n, string) in strings.iter().enumerate() {
            wrong += u64::from(*string != format!("{round}-{n}"));
        }
        for vector in &vectors {
            wrong += vector
                .iter()
                .enumerate()
                .filter(|&(v, &value)| value != v as u64 ^ round)
                .count() as u64;
        }
        for (n, b) in boxed.iter().enumerate() {
            wrong += u64::from(b.iter().any(|&v| v != n as u8));
        }
    }
    wrong
}

/// Allocates and frees one object of `size` bytes through the library's global allocator, as
/// the C host would with the library's own allocation functions. Returns 1 on success.
#[unsafe(no_mangle)]
pub extern "C" fn alloc_one(size: usize) -> u32 {
    let Ok(layout) = Layout::from_size_align(size.max(1), 8) else {
        return 0;
    };
    // SAFETY: a non-zero layout; the object is freed at once with the same layout.
    unsafe {
        let ptr = GLOBAL.alloc(layout);
        if ptr.is_null() {
            return 0;
        }
        ptr.write_bytes(0xa5, layout.size());
        GLOBAL.dealloc(ptr, layout);
    }
    1
}

/// Whether the library's allocator caches (1) or passes everything through (0).
#[unsafe(no_mangle)]
pub extern "C" fn alloc_caching() -> u32 {
    GLOBAL.stats().caching.into()
}

/// The bytes the library's allocator holds in its CPU caches.
#[unsafe(no_mangle)]
pub extern "C" fn alloc_cached_bytes() -> u64 {
    GLOBAL.stats().cached_bytes()
}

/// Misses of the library's allocator's caches, over every CPU.
#[unsafe(no_mangle)]
pub extern "C" fn alloc_misses() -> u64 {
    GLOBAL.stats().misses()
}

/// Gives every CPU's cache back to the system's allocator; returns the bytes, or `u64::MAX`
/// if the release failed.
#[unsafe(no_mangle)]
pub extern "C" fn alloc_release() -> u64 {
    GLOBAL.release().map_or(u64::MAX, |bytes| bytes as u64)
}
