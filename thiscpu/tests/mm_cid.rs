//! `mm_cid`: the concurrency id stays below both the number of threads of the process and the
//! number of possible CPUs.
//!
//! One test in this file on purpose: the kernel's bound follows the most threads the process
//! has had (it keeps a high-water mark), so no other test may start and end threads here.
//!
//! Linux only: it compares with `/proc`, `/sys` and Linux's system calls (tests/common).
#![cfg(target_os = "linux")]

mod common;

use common::*;
use std::sync::{Arc, Barrier};
use thiscpu::topology;

#[test]
fn mm_cid_stays_below_live_threads_and_possible_cpus() {
    let source = thiscpu::source();
    let cpus = allowed_cpus();
    let helpers = 3;
    let start = Arc::new(Barrier::new(helpers + 1));
    let done = Arc::new(Barrier::new(helpers + 1));
    let threads: Vec<_> = (0..helpers)
        .map(|t| {
            let (start, done, cpus) = (Arc::clone(&start), Arc::clone(&done), cpus.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut seen = Vec::new();
                for i in 0..cpus.len() * 20 {
                    pin(cpus[(i + t) % cpus.len()]);
                    seen.push(thiscpu::mm_cid());
                    std::thread::yield_now();
                }
                // Stay alive until every thread has read, so the count below holds throughout.
                done.wait();
                seen
            })
        })
        .collect();
    let _restore = AffinityGuard::new();
    start.wait();
    // Every thread this process has ever had is alive now (this file has no other test).
    let live = live_threads();
    let mut seen = Vec::new();
    for i in 0..cpus.len() * 20 {
        pin(cpus[i % cpus.len()]);
        seen.push(thiscpu::mm_cid());
    }
    done.wait();
    for thread in threads {
        seen.extend(thread.join().expect("helper thread"));
    }

    let bound = live.min(topology::possible_cpus()) as u32;
    eprintln!("{live} threads, bound {bound}; ids seen {:?}", {
        let mut ids: Vec<_> = seen.iter().flatten().collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    });
    for cid in &seen {
        assert_eq!(cid.is_some(), source.mm_cid, "mm_cid() vs {source:?}");
        if let Some(cid) = *cid {
            assert!(
                cid < bound,
                "mm_cid {cid} with {live} threads and {bound} as bound"
            );
        }
    }
}
