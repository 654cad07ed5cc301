//! `Counter::sum` allocates nothing, also for a counter that `take` was used on: a program whose
//! allocator counts its own allocations with thiscpu counters (or that sums from a signal
//! handler) must be able to read them. A test binary of its own, for its global allocator (and
//! so not built with `--cfg thiscpu_global_alloc`, where the library declares one).
#![cfg(not(thiscpu_global_alloc))]
// clippy 1.96 asks for `const` initialisers on Windows although both below have one: std's
// macro expands differently there, and the lint misreads it (as in the library's lib.rs).
#![cfg_attr(windows, allow(clippy::missing_const_for_thread_local))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Counts the allocations the calling thread makes while `COUNTING` is set.
struct CountingAllocator;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the counting touches only
// const-initialised thread-locals, which allocate nothing.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// The allocations `f` makes on this thread.
fn allocations_of(f: impl FnOnce()) -> u64 {
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|on| on.set(true));
    f();
    COUNTING.with(|on| on.set(false));
    ALLOCATIONS.with(Cell::get)
}

#[test]
fn sum_allocates_nothing_before_or_after_a_take() {
    let counter = thiscpu::Counter::new();
    counter.add(5);
    assert_eq!(allocations_of(|| assert_eq!(counter.sum(), 5)), 0);
    assert_eq!(counter.take(), 5);
    counter.add(3);
    let during_sum = allocations_of(|| assert_eq!(counter.sum(), 3));
    assert_eq!(during_sum, 0, "sum allocated after a take");
}
