//! The own heap keeps the pages of up to 64 MiB of free spans for its next spans, gives back
//! those of spans freed beyond at once, and those of spans that stayed free past
//! `idle_return()` at its next change, without a release; it keeps them while the policy is
//! off.
//! A process of its own (one test), whose global allocator is the system's, so that the heap
//! changes only when the test's allocator asks it to.
//!
//! Not built under the model checker (no heap there), nor with `--cfg thiscpu_global_alloc`,
//! where the library's global allocator shares the heap.
#![cfg(all(not(thiscpu_model), not(thiscpu_global_alloc)))]

use std::alloc::{GlobalAlloc, Layout};
use std::time::Duration;
use thiscpu::PerCpuAlloc;
use thiscpu::allocator::{idle_return, set_idle_return};

/// Makes `count` objects of `size` bytes and frees them.
fn round(allocator: &PerCpuAlloc, size: usize, count: usize) {
    let layout = Layout::from_size_align(size, 8).unwrap();
    let objects: Vec<*mut u8> = (0..count)
        // SAFETY: a non-zero layout; each object is freed once below, with it.
        .map(|_| unsafe { allocator.alloc(layout) })
        .collect();
    assert!(objects.iter().all(|object| !object.is_null()));
    for object in objects {
        // SAFETY: made above with `layout`, freed once.
        unsafe { allocator.dealloc(object, layout) };
    }
}

/// The most free spans that keep their pages (64 MiB of 64 KiB spans).
const RETAINED_SPANS: u64 = 1024;
const SPAN_BYTES: u64 = 64 << 10;

#[test]
fn spans_free_past_the_setting_go_back_at_the_heaps_next_change() {
    assert_eq!(idle_return(), Some(Duration::from_secs(1)), "the default");
    set_idle_return(None);
    let allocator = PerCpuAlloc::new();
    round(&allocator, 256, 10);
    if !allocator.stats().caching || allocator.stats().heap.mapped_bytes == 0 {
        println!("skipped: the own heap is not in use here (no rseq)");
        return;
    }
    // A burst of about 1,330 spans of 4 KiB objects (15 a span), freed: the free spans keep
    // their pages up to 64 MiB, and those freed beyond give theirs back at once.
    let first = allocator.stats().heap;
    round(&allocator, 4096, 20_000);
    let burst = allocator.stats().heap;
    eprintln!("after the burst: {burst:?}");
    assert!(
        burst.free_resident_bytes <= RETAINED_SPANS * SPAN_BYTES
            && burst.free_resident_bytes >= (RETAINED_SPANS - 8) * SPAN_BYTES,
        "{burst:?}"
    );
    assert!(
        burst.returned_total_bytes - first.returned_total_bytes >= 200 * SPAN_BYTES,
        "{first:?} then {burst:?}"
    );
    // A smaller burst again takes the kept spans, pages and all, and gives them back to the
    // free spans, with room for them: no page goes back to the system.
    round(&allocator, 4096, 10_000);
    let again = allocator.stats().heap;
    assert_eq!(
        again.returned_total_bytes, burst.returned_total_bytes,
        "{burst:?} then {again:?}"
    );
    assert_eq!(again.mapped_bytes, burst.mapped_bytes, "{again:?}");
    // About 80 spans of 256-byte objects, freed: the caches keep their capacity's worth, the
    // rest goes back to the spans, and the free spans keep their pages.
    round(&allocator, 256, 20_000);
    let before = allocator.stats().heap;
    eprintln!("after the round: {before:?}");
    assert!(before.free_resident_bytes >= 16 * 65536, "{before:?}");
    // Off: time alone changes nothing, and neither does a change of the heap.
    std::thread::sleep(Duration::from_millis(150));
    round(&allocator, 2056, 40);
    let off = allocator.stats().heap;
    assert_eq!(
        off.returned_total_bytes, before.returned_total_bytes,
        "{off:?}"
    );
    // On: the next change (a class that has no span yet takes one) gives back every span
    // free for longer than 50 ms, all of them by now but the one it takes.
    set_idle_return(Some(Duration::from_millis(50)));
    std::thread::sleep(Duration::from_millis(150));
    round(&allocator, 3080, 40);
    let on = allocator.stats().heap;
    eprintln!("after the next change: {on:?}");
    assert!(
        on.returned_total_bytes - off.returned_total_bytes + 65536 >= off.free_resident_bytes,
        "the idle spans' pages went back: {off:?} then {on:?}"
    );
    assert!(on.free_resident_bytes < off.free_resident_bytes, "{on:?}");
}
