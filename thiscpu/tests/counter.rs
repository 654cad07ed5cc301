//! Exactness of `Counter`, its `Adder` and the raw operations, under migration and thread churn
//! (the stress with signals is `stress/tests/counter_stress.rs`). `.ci/run` runs this file in
//! every environment (glibc's registration, thiscpu's own, `THISCPU_RSEQ=off`) and once built
//! with `--cfg thiscpu_inject`.

use std::sync::atomic::{AtomicU64, Ordering};
use thiscpu::Counter;
use thiscpu::ops::{self, Outcome};

#[test]
fn counter_sums_per_cpu_shares_and_handles_large_adds() {
    let counter = Counter::new();
    counter.add(u64::MAX);
    counter.add(2);
    assert_eq!(counter.sum(), 1, "sums wrap like u64 arithmetic");
    let counter = Counter::new();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let counter = &counter;
            s.spawn(move || (0..10_000).for_each(|_| counter.add(t)));
        }
    });
    let shares: u64 = counter.per_cpu().map(|(_, v)| v).sum::<u64>() + counter.unattributed();
    assert_eq!(counter.sum(), 10_000 * (0..8).sum::<u64>());
    assert_eq!(shares, counter.sum());
    assert_eq!(counter.per_cpu().len(), thiscpu::topology::possible_cpus());
}

fn slots() -> Vec<AtomicU64> {
    (0..thiscpu::topology::possible_cpus())
        .map(|_| AtomicU64::new(0))
        .collect()
}

#[test]
fn load_cbne_store_stores_only_over_the_expected_value() {
    let words = slots();
    let Some(_) = ops::position() else {
        eprintln!("rseq not in use here: nothing to check");
        return;
    };
    let mut committed = 0;
    let mut mismatched = 0;
    while committed < 1 || mismatched < 1 {
        let at = ops::position().unwrap();
        let word = &words[at.index() as usize];
        let current = word.load(Ordering::Relaxed);
        // SAFETY: each word belongs to its CPU and is written only by sections on it.
        match unsafe { ops::load_cbne_store(at, word.as_ptr(), current + 1, 99) } {
            Outcome::Mismatch => mismatched += 1,
            Outcome::Committed(()) => panic!("stored over {current}, expected {}", current + 1),
            Outcome::Aborted => continue,
        }
        // SAFETY: as above.
        match unsafe { ops::load_cbne_store(at, word.as_ptr(), current, current + 7) } {
            Outcome::Committed(()) => committed += 1,
            Outcome::Mismatch => panic!("{current} was there and did not match"),
            Outcome::Aborted => continue,
        }
    }
    let total: u64 = words.iter().map(|w| w.load(Ordering::Relaxed)).sum();
    assert_eq!(total, 7);
}

#[repr(C)]
struct Node {
    next: *mut Node,
    value: u64,
}

const NEXT: usize = core::mem::offset_of!(Node, next);

/// Threads push and pop nodes on per-CPU lists while being migrated; every node is accounted for
/// at the end, once, with its value.
#[test]
fn per_cpu_lists_never_lose_or_duplicate_a_node() {
    if ops::position().is_none() {
        eprintln!("rseq not in use here: nothing to check");
        return;
    }
    let heads: Vec<AtomicU64> = slots();
    let nodes_per_thread = 2_000u64;
    let threads = 4;
    std::thread::scope(|s| {
        for t in 0..threads {
            let heads = &heads;
            s.spawn(move || {
                let mut owned: Vec<*mut Node> = (0..nodes_per_thread)
                    .map(|i| {
                        Box::into_raw(Box::new(Node {
                            next: core::ptr::null_mut(),
                            value: t * nodes_per_thread + i,
                        }))
                    })
                    .collect();
                for round in 0..20_000usize {
                    if round % 3 != 2 {
                        let Some(node) = owned.pop() else { continue };
                        loop {
                            let at = ops::position().unwrap();
                            let head = heads[at.index() as usize].as_ptr().cast::<*mut Node>();
                            // SAFETY: heads are per-CPU and written only by sections on their
                            // CPU; `node` is ours until the push commits.
                            let outcome =
                                unsafe { ops::list_push(at, head, node, &raw mut (*node).next) };
                            if outcome == Outcome::Committed(()) {
                                break;
                            }
                        }
                    } else {
                        loop {
                            let at = ops::position().unwrap();
                            let head = heads[at.index() as usize].as_ptr().cast::<*mut Node>();
                            // SAFETY: as above; listed nodes are live until popped.
                            match unsafe {
                                ops::load_cbeq_load_store::<Node, ops::ByCpu, NEXT>(at, head)
                            } {
                                Outcome::Committed(node) => {
                                    owned.push(node);
                                    break;
                                }
                                Outcome::Mismatch => break,
                                Outcome::Aborted => continue,
                            }
                        }
                    }
                    if round % 1000 == 0 {
                        std::thread::yield_now();
                    }
                }
                // Hand the nodes still owned back through the lists too.
                for node in owned {
                    loop {
                        let at = ops::position().unwrap();
                        let head = heads[at.index() as usize].as_ptr().cast::<*mut Node>();
                        // SAFETY: as above.
                        if unsafe { ops::list_push(at, head, node, &raw mut (*node).next) }
                            == Outcome::Committed(())
                        {
                            break;
                        }
                    }
                }
            });
        }
    });
    let mut seen = vec![false; (threads * nodes_per_thread) as usize];
    for head in &heads {
        let mut node = head.load(Ordering::Relaxed) as *mut Node;
        while !node.is_null() {
            // SAFETY: every thread has stopped; the lists hold the boxed nodes.
            let boxed = unsafe { Box::from_raw(node) };
            assert!(
                !seen[boxed.value as usize],
                "node {} listed twice",
                boxed.value
            );
            seen[boxed.value as usize] = true;
            node = boxed.next;
        }
    }
    assert!(seen.iter().all(|&s| s), "a node was lost");
}

/// An increment by `mm_cid` made before the process decided how it uses rseq spreads by
/// `mm_cid` too. The fast path cannot know yet whether the kernel provides `mm_cid`; the call
/// that makes the decision must then use it, or its section would write a CPU's word that other
/// threads write by concurrency id, on other CPUs. The decision normally runs before `main`; the
/// instrumented build (`--cfg thiscpu_inject`) defers it to the first call here. Run in a fresh
/// process, pinned to the last allowed CPU, whose number differs from the lone thread's
/// concurrency id (0) on any machine with two CPUs or more.
// Pins with `sched_setaffinity`: Linux only.
#[cfg(target_os = "linux")]
#[test]
fn a_first_increment_by_mm_cid_lands_on_the_concurrency_id() {
    const CHILD: &str = "THISCPU_COUNTER_TEST_FIRST_INCREMENT";
    if std::env::var_os(CHILD).is_none() {
        // Through the emulator where the tests run under one (see tests/common).
        let executable = std::env::current_exe().unwrap();
        let mut command = match std::env::var_os("THISCPU_TEST_RUNNER") {
            Some(runner) => {
                let mut command = std::process::Command::new(runner);
                command.arg(executable);
                command
            }
            None => std::process::Command::new(executable),
        };
        let status = command
            .args([
                "--exact",
                "a_first_increment_by_mm_cid_lands_on_the_concurrency_id",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("THISCPU_INJECT_DEFER_DECISION", "1")
            .status()
            .expect("run the test binary again");
        assert!(status.success(), "the fresh process failed: {status}");
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls only read and write it.
    let last = unsafe {
        let mut set: libc::cpu_set_t = core::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, core::mem::size_of_val(&set), &mut set),
            0
        );
        let last = (0..libc::CPU_SETSIZE as usize)
            .rev()
            .find(|&cpu| libc::CPU_ISSET(cpu, &set))
            .expect("an allowed CPU");
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(last, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, core::mem::size_of_val(&set), &set),
            0
        );
        last as u32
    };
    let counter = Counter::by_mm_cid();
    counter.inc();
    let Some(mm_cid) = thiscpu::mm_cid() else {
        eprintln!("no mm_cid here (kernel before 6.3, or no rseq): the counter spreads by CPU");
        return;
    };
    let rows: Vec<(u32, u64)> = counter.per_cpu().filter(|&(_, v)| v != 0).collect();
    assert_eq!(
        rows,
        vec![(mm_cid, 1)],
        "pinned to CPU {last}, concurrency id {mm_cid}: the increment must be in the id's row"
    );
}

/// An adder made on one thread and sent to fresh ones (whose first add registers them), by CPU
/// and by concurrency id, while the threads are moved between CPUs: every add is counted, and
/// the adder and the counter's own adds share the words.
// Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script); elsewhere
// `pin_to` returns `Unsupported` (tests/portable.rs).
#[cfg(thiscpu_linux)]
#[test]
fn an_adder_sent_to_fresh_threads_counts_exactly_while_they_migrate() {
    fn run<S: thiscpu::Spread>(counter: &Counter<S>) {
        let cpus = thiscpu::topology::allowed_cpus().expect("the allowed CPUs");
        let adder = counter.adder();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let cpus = &cpus;
                s.spawn(move || {
                    for round in 0..200usize {
                        let cpu = cpus[(round + t as usize) % cpus.len()];
                        // A CPU taken away meanwhile is no reason to stop counting.
                        let _pinned = thiscpu::topology::pin_to(cpu).ok();
                        for _ in 0..100 {
                            adder.add(t + 1);
                        }
                        counter.inc();
                    }
                });
            }
        });
        assert_eq!(counter.sum(), 200 * 100 * (1 + 2 + 3 + 4) + 4 * 200);
    }
    run(&Counter::new());
    run(&Counter::by_mm_cid());
}
