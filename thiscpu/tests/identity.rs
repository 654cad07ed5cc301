//! CPU identity: `current_cpu`, `getcpu`, `current_node` and `mm_cid` against the kernel's own
//! answers and `/sys`, pinned, unpinned, while being migrated, and inside a signal handler.
//!
//! Linux only: it compares with `/proc`, `/sys` and Linux's system calls (tests/common).
#![cfg(target_os = "linux")]

mod common;

use common::*;
use std::sync::Arc;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::time::Duration;
use thiscpu::{CpuNode, topology};

/// Every check that must hold for a thread pinned to `cpu`.
#[cfg(thiscpu_linux)]
fn check_pinned(cpu: u32, who: &str) {
    let node = topology::node_of_cpu(cpu)
        .unwrap_or_else(|| panic!("{who}: CPU {cpu} is allowed but has no node in /sys"));
    let expected = CpuNode { cpu, node };
    let source = thiscpu::source();
    assert_eq!(
        source.this_thread,
        expected_this_thread(&source),
        "{who}: source {source:?}"
    );
    for round in 0..50 {
        let at = format!("{who}, pinned to CPU {cpu}, round {round}");
        assert_eq!(thiscpu::current_cpu(), cpu, "current_cpu(), {at}");
        assert_eq!(thiscpu::getcpu(), expected, "getcpu(), {at}");
        assert_eq!(thiscpu::current_node(), node, "current_node(), {at}");
        assert_eq!(
            thiscpu::via::syscall(),
            Some(expected),
            "via::syscall(), {at}"
        );
        assert_eq!(kernel_getcpu(), (cpu, node), "getcpu syscall, {at}");
        if let Some(glibc) = thiscpu::via::sched_getcpu() {
            assert_eq!(glibc, cpu, "sched_getcpu(), {at}");
        }
        match thiscpu::mm_cid() {
            Some(cid) => {
                assert!(
                    source.mm_cid,
                    "mm_cid() is Some but source says unusable, {at}"
                );
                let possible = topology::possible_cpus() as u32;
                assert!(
                    cid < possible,
                    "mm_cid {cid} >= {possible} possible CPUs, {at}"
                );
            }
            None => assert!(
                !source.mm_cid,
                "mm_cid() is None but source says usable, {at}"
            ),
        }
    }
}

// Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script); elsewhere
// `pin_to` returns `Unsupported` (tests/portable.rs).
#[cfg(thiscpu_linux)]
#[test]
fn pinned_to_each_allowed_cpu_every_answer_agrees() {
    let _serial = serial();
    let cpus = allowed_cpus();
    assert!(!cpus.is_empty());
    // Several threads go through every allowed CPU at once, each starting at another CPU, so
    // that the kernel has several concurrency ids and CPUs to hand out.
    let threads = 4;
    let start = Arc::new(Barrier::new(threads));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let cpus = cpus.clone();
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                for i in 0..cpus.len() {
                    let cpu = cpus[(i + t) % cpus.len()];
                    pin(cpu);
                    check_pinned(cpu, &format!("thread {t}"));
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("a pinned thread saw a wrong answer");
    }
    // And the test's own thread, restoring its affinity afterwards.
    let _restore = AffinityGuard::new();
    for &cpu in &cpus {
        pin(cpu);
        check_pinned(cpu, "test thread");
    }
}

#[test]
fn each_allowed_cpu_has_the_node_sys_gives_it() {
    let nodes = sys_nodes();
    for cpu in allowed_cpus() {
        let node = topology::node_of_cpu(cpu).expect("allowed CPU without a node");
        if let Some(linked) = sys_node_of_cpu(cpu) {
            assert_eq!(
                node, linked,
                "CPU {cpu}: thiscpu's node vs the cpu{cpu}/node* link"
            );
        }
        if !nodes.is_empty() {
            assert!(
                nodes
                    .iter()
                    .any(|(n, cpus)| *n == node && cpus.contains(&cpu)),
                "CPU {cpu} is not in node{node}/cpulist: {nodes:?}"
            );
        }
    }
}

#[test]
fn unpinned_answers_agree_with_the_kernel() {
    let _serial = serial();
    for _ in 0..100 {
        agrees_with_kernel(thiscpu::current_cpu, |(cpu, _)| cpu)
            .unwrap_or_else(|e| panic!("current_cpu(): {e}"));
        agrees_with_kernel(thiscpu::getcpu, |(cpu, node)| CpuNode { cpu, node })
            .unwrap_or_else(|e| panic!("getcpu(): {e}"));
        agrees_with_kernel(thiscpu::current_node, |(_, node)| node)
            .unwrap_or_else(|e| panic!("current_node(): {e}"));
    }
}

/// One migrated thread's view, shared with the thread that moves it. `seq` is odd while its
/// affinity is being changed; `mask` holds the affinity as bits over indexes into the allowed
/// CPUs (the first 64 of them).
#[derive(Debug, Default)]
struct Migrated {
    tid: AtomicU32,
    seq: AtomicU64,
    mask: AtomicU64,
    checked: AtomicU64,
    /// Set when the worker ends (normally or by a failed assertion), so that the mover stops
    /// before its thread id can name another thread.
    ended: AtomicBool,
}

/// Marks a worker as ended when dropped, including while a failed assertion unwinds.
struct EndGuard<'a>(&'a AtomicBool);

impl Drop for EndGuard<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn migrated_threads_only_see_cpus_they_may_run_on() {
    let _serial = serial();
    let allowed = allowed_cpus();
    let allowed_mask = Mask::of(&allowed);
    let choices: Vec<u32> = allowed.iter().copied().take(64).collect();
    let possible = topology::possible_cpus() as u32;
    let workers = 3;
    let states: Arc<Vec<Migrated>> = Arc::new((0..workers).map(|_| Migrated::default()).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(Barrier::new(workers + 1));

    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let states = Arc::clone(&states);
            let stop = Arc::clone(&stop);
            let ready = Arc::clone(&ready);
            let choices = choices.clone();
            std::thread::spawn(move || {
                let me = &states[w];
                me.tid.store(gettid() as u32, Ordering::SeqCst);
                let _ended = EndGuard(&me.ended);
                ready.wait();
                let mut reads = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let before = me.seq.load(Ordering::SeqCst);
                    let bits = me.mask.load(Ordering::SeqCst);
                    let cpu = thiscpu::current_cpu();
                    let here = thiscpu::getcpu();
                    let node = thiscpu::current_node();
                    let cid = thiscpu::mm_cid();
                    fence(Ordering::SeqCst);
                    let after = me.seq.load(Ordering::SeqCst);
                    reads += 1;

                    let at = format!("worker {w}, read {reads}");
                    assert!(
                        allowed_mask.contains(cpu),
                        "current_cpu() {cpu} never allowed, {at}"
                    );
                    assert!(
                        allowed_mask.contains(here.cpu),
                        "getcpu() {here:?} never allowed, {at}"
                    );
                    assert!(
                        here.cpu < possible && cpu < possible,
                        "{cpu} / {here:?}, {at}"
                    );
                    assert_eq!(
                        topology::node_of_cpu(here.cpu),
                        Some(here.node),
                        "getcpu() returned a pair /sys says cannot exist, {at}"
                    );
                    assert!(
                        topology::possible_cpus() > 0
                            && (0..possible).any(|c| topology::node_of_cpu(c) == Some(node)),
                        "current_node() {node} has no CPU, {at}"
                    );
                    if let Some(cid) = cid {
                        assert!(cid < possible, "mm_cid {cid} >= {possible}, {at}");
                    }
                    // The affinity did not change while we read: the answers must be inside it.
                    if before == after && before.is_multiple_of(2) && before > 0 {
                        let inside = |c: u32| {
                            choices
                                .iter()
                                .position(|&x| x == c)
                                .is_some_and(|i| bits & (1 << i) != 0)
                        };
                        assert!(
                            inside(cpu),
                            "current_cpu() {cpu} outside mask {bits:#x} of {choices:?}, {at}"
                        );
                        assert!(
                            inside(here.cpu),
                            "getcpu() {here:?} outside mask {bits:#x} of {choices:?}, {at}"
                        );
                        me.checked.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();

    ready.wait();
    let mut rng = Rng::seeded();
    eprintln!("migration seed {:#x}", rng.0);
    let full = if choices.len() == 64 {
        u64::MAX
    } else {
        (1u64 << choices.len()) - 1
    };
    let moves = bounded(4000, Duration::from_secs(3), |_| {
        if states.iter().any(|s| s.ended.load(Ordering::SeqCst)) {
            return false; // a worker failed; its join below reports why
        }
        let w = (rng.next() % workers as u64) as usize;
        let me = &states[w];
        let mut bits = rng.next() & full;
        if bits == 0 || rng.next().is_multiple_of(2) {
            // Half of the moves pin to a single CPU, the strongest constraint.
            bits = 1 << (rng.next() % choices.len() as u64);
        }
        let cpus: Vec<u32> = (0..choices.len())
            .filter(|i| bits & (1 << i) != 0)
            .map(|i| choices[i])
            .collect();
        me.seq.fetch_add(1, Ordering::SeqCst);
        me.mask.store(bits, Ordering::SeqCst);
        let tid = me.tid.load(Ordering::SeqCst) as libc::pid_t;
        if let Err(e) = set_affinity(tid, &Mask::of(&cpus)) {
            assert!(
                me.ended.load(Ordering::SeqCst),
                "moving worker {w} to {cpus:?}: {e}"
            );
            return false;
        }
        me.seq.fetch_add(1, Ordering::SeqCst);
        std::thread::yield_now();
        true
    });
    stop.store(true, Ordering::Relaxed);
    for handle in handles {
        handle
            .join()
            .expect("a migrated thread saw an impossible answer");
    }
    let checked: Vec<u64> = states
        .iter()
        .map(|s| s.checked.load(Ordering::Relaxed))
        .collect();
    eprintln!("{moves} moves; reads checked against a stable mask per worker: {checked:?}");
    assert!(moves > 0, "the migrating thread never moved anyone");
    assert!(
        checked.iter().sum::<u64>() > 0,
        "no read happened under a stable mask"
    );
}

/// xorshift64*, seeded from the clock; the seed is printed so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn seeded() -> Rng {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Rng(nanos | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

static IN_HANDLER_CPU: AtomicU32 = AtomicU32::new(u32::MAX);
static IN_HANDLER_NODE: AtomicU32 = AtomicU32::new(u32::MAX);
static IN_HANDLER_KERNEL: AtomicU32 = AtomicU32::new(u32::MAX);

extern "C" fn record_cpu(_signal: libc::c_int) {
    IN_HANDLER_CPU.store(thiscpu::current_cpu(), Ordering::SeqCst);
    IN_HANDLER_NODE.store(thiscpu::getcpu().node, Ordering::SeqCst);
    IN_HANDLER_KERNEL.store(kernel_getcpu().0, Ordering::SeqCst);
}

#[test]
fn answers_inside_a_signal_handler() {
    let _serial = serial();
    // SAFETY: an all-zero sigaction is a valid value to fill in.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = record_cpu as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: a zeroed sigaction is a valid sigaction; the old one is kept to restore it.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: installs a handler that only calls async-signal-safe code and stores atomics.
    let installed = unsafe { libc::sigaction(libc::SIGUSR1, &action, &mut old) };
    assert_eq!(
        installed,
        0,
        "sigaction: {}",
        std::io::Error::last_os_error()
    );

    // A fresh thread whose first call into thiscpu happens inside the handler: with thiscpu's
    // own registration, that is where it registers.
    let cpus = allowed_cpus();
    std::thread::spawn(move || {
        for &cpu in &cpus {
            pin(cpu);
            // SAFETY: raises the signal in this thread; the handler is installed.
            assert_eq!(unsafe { libc::raise(libc::SIGUSR1) }, 0);
            let node = topology::node_of_cpu(cpu).unwrap();
            assert_eq!(
                IN_HANDLER_KERNEL.load(Ordering::SeqCst),
                cpu,
                "kernel, in handler"
            );
            assert_eq!(
                IN_HANDLER_CPU.load(Ordering::SeqCst),
                cpu,
                "current_cpu() in handler"
            );
            assert_eq!(
                IN_HANDLER_NODE.load(Ordering::SeqCst),
                node,
                "getcpu().node in handler"
            );
            assert_eq!(
                thiscpu::current_cpu(),
                cpu,
                "current_cpu() after the handler"
            );
        }
    })
    .join()
    .expect("wrong answer in or after a signal handler");

    // SAFETY: restores the disposition saved above.
    let restored = unsafe { libc::sigaction(libc::SIGUSR1, &old, std::ptr::null_mut()) };
    assert_eq!(
        restored,
        0,
        "sigaction: {}",
        std::io::Error::last_os_error()
    );
}
