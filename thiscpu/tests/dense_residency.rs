//! Slots of a CPU that never ran the program are not backed by memory. Alone in its own test
//! binary, so that no other test's counters share (and touch) its pages.
//!
//! Linux only: it compares with `/proc`, `/sys` and Linux's system calls (tests/common).
#![cfg(target_os = "linux")]

mod common;

use thiscpu::{Counter, dense};

/// Slots of a CPU that never ran the program are not backed by memory: write from one CPU only
/// and ask the kernel (mincore) which pages of the other rows are resident.
#[test]
fn rows_of_cpus_that_never_ran_stay_unbacked() {
    let cpus = thiscpu::topology::possible_cpus();
    if cpus < 2 {
        return;
    }
    let here = thiscpu::current_cpu() as usize;
    let other = (here + 1) % cpus;
    // A fresh range, so no other test's counters share its pages.
    let counters: Vec<Counter> = (0..dense::STRIDE / 8 * 2).map(|_| Counter::new()).collect();
    let page = 4096usize;
    let resident = |counter: &Counter, cpu: usize| -> bool {
        let address = counter.word_address(cpu as u32) & !(page - 1);
        let mut vec = 0u8;
        // SAFETY: `address` is page-aligned inside a live mapping; mincore writes one byte.
        let ret = unsafe { libc::mincore(address as *mut libc::c_void, page, &mut vec) };
        assert_eq!(ret, 0);
        vec & 1 == 1
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            common::pin(here as u32);
            counters.iter().for_each(Counter::inc);
        });
    });
    let last = counters.last().unwrap();
    assert!(resident(last, here), "the written row is resident");
    assert!(
        !resident(last, other),
        "CPU {other} never ran the writer, yet its row page is resident"
    );
    let total: u64 = counters.iter().map(Counter::sum).sum();
    assert_eq!(total, counters.len() as u64);
}
