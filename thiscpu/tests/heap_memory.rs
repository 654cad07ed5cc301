//! The own heap gives memory back: after a burst of small objects is freed and the caches
//! released, the resident memory of a process holding a working set is within 10% of what it
//! was before the burst.
//! A process of its own (one test), so that no other test's objects move the figure.
//!
//! Linux only (`/proc/self/statm`). Not built under the model checker, nor with
//! `--cfg thiscpu_global_alloc`, where the library declares the global allocator itself.
#![cfg(all(target_os = "linux", not(thiscpu_model), not(thiscpu_global_alloc)))]

use thiscpu::PerCpuAlloc;

#[global_allocator]
static GLOBAL: PerCpuAlloc = PerCpuAlloc::new();

/// Resident bytes of this process.
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .expect("the resident field of statm");
    // SAFETY: sysconf reads a constant of the system.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// Makes as many objects as `held` has room for, of sizes from 24 to 1,000 bytes, writes
/// every byte, and frees them in an order unlike the one they were made in. `held` is the
/// caller's, made beforehand, so that the burst asks the inner allocator for nothing (under
/// AddressSanitizer, whose allocator keeps what is freed in a quarantine, a list made here
/// stayed resident).
fn burst(held: &mut Vec<Vec<u8>>) {
    for n in 0..held.capacity() {
        held.push(vec![n as u8; 24 + n * 37 % 977]);
    }
    let mut n = 0usize;
    while !held.is_empty() {
        n = (n * 31 + 17) % held.len();
        drop(held.swap_remove(n));
    }
}

#[test]
fn a_burst_freed_and_released_gives_its_memory_back() {
    // A program's working set, held throughout: 100,000 objects, about 50 MB.
    let working_set: Vec<Vec<u8>> = (0..100_000).map(|n| vec![1; 24 + n * 37 % 977]).collect();
    // The burst's list, its pages written once (an empty `Vec` allocates nothing).
    let mut held: Vec<Vec<u8>> = Vec::with_capacity(400_000);
    held.resize_with(held.capacity(), Vec::new);
    held.clear();
    let _ = GLOBAL.release();
    let before = resident();
    burst(&mut held);
    let peak_heap = GLOBAL.stats().heap;
    let released = GLOBAL.release();
    let after = resident();
    let stats = GLOBAL.stats();
    eprintln!(
        "resident before {before} bytes, after {after}; release: {released:?}; heap at the \
         end of the burst {peak_heap:?}, now {:?}",
        stats.heap
    );
    if !stats.caching || released.is_err() {
        // No rseq here (or a CPU the release could not reach): the inner allocator holds
        // everything, and what it keeps is its own affair.
        return;
    }
    assert!(
        stats.heap.returned_total_bytes >= 100 << 20,
        "the burst's spans did not go back: {:?}",
        stats.heap
    );
    assert!(
        after <= before + before / 10,
        "resident {after} bytes after the burst, {before} before"
    );
    drop(working_set);
}
