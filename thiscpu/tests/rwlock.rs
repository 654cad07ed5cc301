//! `RwLock` and `EpochCell`: readers never see a value half written (or freed), a writer gets
//! through a stream of readers, readers that move between CPUs, `fork` with the lock held,
//! signal handlers, a thousand threads, the atomic mode without rseq or `membarrier` (child
//! processes), and a reader without rseq while `membarrier` is refused after construction.
//!
//! Linux only: it compares with `/proc`, `/sys` and Linux's system calls (tests/common).
#![cfg(target_os = "linux")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};
use thiscpu::{EpochCell, RwLock};

/// Words that a writer sets one by one to the same number: a reader that sees two different
/// numbers saw a write half done.
const WORDS: usize = 16;

fn consistent(words: &[u64; WORDS]) -> Result<u64, String> {
    let first = words[0];
    if words.iter().all(|&word| word == first) {
        Ok(first)
    } else {
        Err(format!("a half-written value: {words:?}"))
    }
}

/// Writes `value` into each word, with volatile stores one after the other, so that the
/// compiler neither merges them nor moves them out of the lock.
fn write_all(words: &mut [u64; WORDS], value: u64) {
    for word in words.iter_mut() {
        // SAFETY: `word` is a valid, exclusive reference.
        unsafe { core::ptr::write_volatile(word, value) };
        // Slow enough for a reader that got in to see the write half done.
        for _ in 0..20 {
            core::hint::spin_loop();
        }
    }
}

fn read_all(words: &[u64; WORDS]) -> [u64; WORDS] {
    // SAFETY: each element is a valid reference to a `u64`.
    core::array::from_fn(|i| unsafe { core::ptr::read_volatile(&words[i]) })
}

/// `readers` threads read `lock` until `writes` writes are done (or `limit` passes), checking
/// every read; returns the reads made. The writes start once every reader has read once (or
/// `limit` passed waiting), so that they overlap the reads even where threads start slowly:
/// under qemu-user the 2,000 writes were once over before any reader had started.
fn storm(lock: &RwLock<[u64; WORDS]>, readers: usize, writes: u64, limit: Duration) -> u64 {
    let done = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    let reading = AtomicU64::new(0);
    let written = std::thread::scope(|s| {
        for _ in 0..readers {
            s.spawn(|| {
                let mut last = 0;
                let mut mine = 0;
                while !done.load(Ordering::Relaxed) {
                    let guard = lock.read();
                    let seen = consistent(&read_all(&guard)).unwrap();
                    drop(guard);
                    assert!(seen >= last, "went back from {last} to {seen}");
                    last = seen;
                    if mine == 0 {
                        reading.fetch_add(1, Ordering::Relaxed);
                    }
                    mine += 1;
                    // Moments without readers, which a writer needs when readers ignore it.
                    for _ in 0..200 {
                        core::hint::spin_loop();
                    }
                }
                reads.fetch_add(mine, Ordering::Relaxed);
            });
        }
        let waiting = Instant::now();
        while reading.load(Ordering::Relaxed) < readers as u64 && waiting.elapsed() < limit {
            std::thread::yield_now();
        }
        let start = Instant::now();
        let mut written = 0;
        while written < writes && start.elapsed() < limit {
            written += 1;
            write_all(&mut lock.write(), written);
        }
        done.store(true, Ordering::Relaxed);
        written
    });
    assert_eq!(consistent(&lock.read()).unwrap(), written);
    assert_eq!(lock.readers_inside(), 0);
    reads.load(Ordering::Relaxed)
}

#[test]
fn readers_never_see_a_half_written_value() {
    let lock = RwLock::new([0u64; WORDS]);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
    let reads = storm(&lock, threads, 2000, Duration::from_secs(3));
    eprintln!("{reads} reads checked, mode {lock:?}");
    assert!(reads > 0);
}

/// Readers that each hold the lock for a while, always at least one of them inside: a writer
/// that waited for a moment without readers would never get in.
#[test]
fn a_writer_gets_through_a_stream_of_overlapping_readers() {
    let lock = RwLock::new([0u64; WORDS]);
    let stop = AtomicBool::new(false);
    let gave_up = AtomicBool::new(false);
    let limit = Duration::from_secs(10);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let start = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    if start.elapsed() > limit {
                        gave_up.store(true, Ordering::Relaxed);
                        break;
                    }
                    let guard = lock.read();
                    // Hold on while the next reader comes in.
                    let until = Instant::now() + Duration::from_micros(200);
                    while Instant::now() < until {
                        core::hint::spin_loop();
                    }
                    consistent(&read_all(&guard)).unwrap();
                }
            });
        }
        for value in 1..=20 {
            write_all(&mut lock.write(), value);
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(
        !gave_up.load(Ordering::Relaxed),
        "the writer got through only once the readers stopped"
    );
    assert_eq!(consistent(&lock.read()).unwrap(), 20);
}

#[test]
fn a_reader_may_leave_on_another_cpu_than_it_entered() {
    let _serial = common::serial();
    let cpus = common::allowed_cpus();
    let lock = Arc::new(RwLock::new(0u64));
    std::thread::scope(|s| {
        s.spawn(|| {
            let _restore = common::AffinityGuard::new();
            for round in 0..200 {
                common::pin(cpus[round % cpus.len()]);
                let guard = lock.read();
                common::pin(cpus[(round + 1) % cpus.len()]);
                assert!(lock.try_write().is_none(), "a writer got in past a reader");
                drop(guard);
            }
        });
    });
    assert_eq!(lock.readers_inside(), 0);
    *lock.try_write().expect("every reader left") = 1;
    assert_eq!(*lock.read(), 1);
}

/// A pinned reader keeps the value it loaded alive; the value's drop poisons it.
#[derive(Debug)]
struct Poisoned {
    words: [AtomicU64; WORDS],
}

const POISON: u64 = u64::MAX;

impl Poisoned {
    fn new(value: u64) -> Self {
        Poisoned {
            words: core::array::from_fn(|_| AtomicU64::new(value)),
        }
    }

    fn check(&self) -> u64 {
        let words: [u64; WORDS] = core::array::from_fn(|i| self.words[i].load(Ordering::Relaxed));
        let value = consistent(&words).unwrap();
        assert_ne!(value, POISON, "a reader saw a value that was dropped");
        value
    }
}

impl Drop for Poisoned {
    fn drop(&mut self) {
        for word in &self.words {
            word.store(POISON, Ordering::Relaxed);
        }
    }
}

#[test]
fn epoch_readers_never_see_a_value_dropped_under_them() {
    let cell = EpochCell::new(Poisoned::new(0));
    let done = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut mine = 0;
                while !done.load(Ordering::Relaxed) {
                    let guard = cell.load();
                    guard.check();
                    // Long enough for a writer to swap and drop meanwhile, if it did not wait.
                    for _ in 0..50 {
                        core::hint::spin_loop();
                    }
                    guard.check();
                    mine += 1;
                }
                reads.fetch_add(mine, Ordering::Relaxed);
            });
        }
        let start = Instant::now();
        let mut value = 0;
        while value < 2000 && start.elapsed() < Duration::from_secs(3) {
            value += 1;
            cell.store(Poisoned::new(value));
        }
        done.store(true, Ordering::Relaxed);
    });
    assert_eq!(cell.readers_inside(), 0);
    eprintln!(
        "{} epoch reads checked, {cell:?}",
        reads.load(Ordering::Relaxed)
    );
    let full = cell.load_full();
    cell.store(Poisoned::new(1));
    assert_ne!(full.check(), 1, "load_full's Arc keeps the old value");
}

/// Runs `child` in a forked child and returns its exit status (0 when it returned normally,
/// 1 if it panicked).
fn in_forked_child(child: impl FnOnce()) -> i32 {
    // SAFETY: the child only runs `child`, which touches the lock and allocates (glibc's
    // allocator is usable after fork), and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).is_ok();
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(i32::from(!ok)) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked, writing its status into a local.
    let waited = unsafe { libc::waitpid(pid, &raw mut status, 0) };
    assert_eq!(waited, pid);
    assert!(libc::WIFEXITED(status), "the child died: {status:#x}");
    libc::WEXITSTATUS(status)
}

#[test]
fn fork_while_this_thread_reads_or_writes() {
    let lock = RwLock::new(1u64);
    let mut reading = Some(lock.read());
    let status = in_forked_child(|| {
        assert_eq!(lock.readers_inside(), 1);
        assert!(
            lock.try_write().is_none(),
            "a writer got in past the forked reader"
        );
        drop(reading.take());
        *lock.try_write().expect("the forked reader left") = 2;
        assert_eq!(*lock.read(), 2);
    });
    assert_eq!(status, 0, "the child with a read lock failed");
    drop(reading);
    assert_eq!(*lock.read(), 1, "the child wrote the parent's copy");
    let mut writing = Some(lock.write());
    let status = in_forked_child(|| {
        assert!(
            lock.try_read().is_none(),
            "a reader got past the forked writer"
        );
        drop(writing.take());
        assert_eq!(*lock.read(), 1);
        *lock.write() = 3;
    });
    assert_eq!(status, 0, "the child with a write lock failed");
    drop(writing);
    assert_eq!(*lock.read(), 1);
}

#[test]
fn fork_while_another_thread_reads() {
    let lock = RwLock::new(1u64);
    let (held, release) = (Barrier::new(2), Barrier::new(2));
    std::thread::scope(|s| {
        s.spawn(|| {
            let _guard = lock.read();
            held.wait();
            release.wait();
        });
        held.wait();
        let status = in_forked_child(|| {
            // The other thread is gone, its read lock held for ever.
            assert_eq!(*lock.read(), 1);
            assert!(
                lock.try_write().is_none(),
                "a writer got in past a vanished reader"
            );
        });
        release.wait();
        assert_eq!(status, 0, "the forked child failed");
    });
    *lock.try_write().unwrap() = 3;
}

static SIGNAL_LOCK: OnceLock<RwLock<[u64; WORDS]>> = OnceLock::new();
static SIGNAL_CELL: OnceLock<EpochCell<Poisoned>> = OnceLock::new();
static HANDLED: AtomicUsize = AtomicUsize::new(0);
static HANDLER_FAILED: AtomicBool = AtomicBool::new(false);

extern "C" fn read_in_handler(_: libc::c_int) {
    let (Some(lock), Some(cell)) = (SIGNAL_LOCK.get(), SIGNAL_CELL.get()) else {
        return;
    };
    // Only `try_read`: the interrupted thread may be the writer.
    if let Some(guard) = lock.try_read() {
        let words = read_all(&guard);
        if words.iter().any(|&word| word != words[0]) {
            HANDLER_FAILED.store(true, Ordering::Relaxed);
        }
    }
    let pinned = cell.load();
    let first = pinned.words[0].load(Ordering::Relaxed);
    if first == POISON
        || pinned
            .words
            .iter()
            .any(|w| w.load(Ordering::Relaxed) != first)
    {
        HANDLER_FAILED.store(true, Ordering::Relaxed);
    }
    drop(pinned);
    HANDLED.fetch_add(1, Ordering::Relaxed);
}

/// Signal handlers read the lock and the cell while their threads are inside a read section
/// (or a section's count), write, or swap: every handler's read is whole, and the counts end
/// balanced.
/// In a child process, so that a lost count, which leaves a writer waiting for ever, fails the
/// test within its time limit instead of hanging it.
#[test]
fn signal_handlers_read_in_the_middle_of_everything() {
    let name = "signal_handlers_read_in_the_middle_of_everything";
    if std::env::var_os(CHILD).is_none() {
        common::rerun_alone(name, &[(CHILD, "1")], Duration::from_secs(30));
        return;
    }
    let lock = SIGNAL_LOCK.get_or_init(|| RwLock::new([0; WORDS]));
    let cell = SIGNAL_CELL.get_or_init(|| EpochCell::new(Poisoned::new(0)));
    // SAFETY: an all-zero sigaction is a valid value to fill in.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = read_in_handler as extern "C" fn(libc::c_int) as libc::sighandler_t;
    action.sa_flags = libc::SA_RESTART;
    // SAFETY: installs a handler that only makes async-signal-safe calls (atomics and
    // restartable sequences) on statics initialized above.
    let installed = unsafe { libc::sigaction(libc::SIGUSR2, &action, core::ptr::null_mut()) };
    assert_eq!(installed, 0);
    let done = AtomicBool::new(false);
    let tids: Vec<AtomicU64> = (0..3).map(|_| AtomicU64::new(0)).collect();
    std::thread::scope(|s| {
        let tids = &tids;
        let done = &done;
        s.spawn(move || {
            tids[0].store(common::gettid() as u64, Ordering::Relaxed);
            while !done.load(Ordering::Relaxed) {
                consistent(&read_all(&lock.read())).unwrap();
                cell.load().check();
            }
        });
        s.spawn(move || {
            tids[1].store(common::gettid() as u64, Ordering::Relaxed);
            let mut value = 0;
            while !done.load(Ordering::Relaxed) {
                value += 1;
                write_all(&mut lock.write(), value);
            }
        });
        s.spawn(move || {
            tids[2].store(common::gettid() as u64, Ordering::Relaxed);
            let mut value = 0;
            while !done.load(Ordering::Relaxed) {
                value += 1;
                cell.store(Poisoned::new(value));
            }
        });
        while tids.iter().any(|tid| tid.load(Ordering::Relaxed) == 0) {
            std::thread::yield_now();
        }
        let start = Instant::now();
        let mut sent = 0;
        while sent < 20_000 && start.elapsed() < Duration::from_secs(3) {
            for tid in tids {
                // SAFETY: signals a thread of this process that is still running (the
                // threads run until `done`).
                unsafe {
                    libc::syscall(
                        libc::SYS_tgkill,
                        libc::getpid(),
                        tid.load(Ordering::Relaxed) as libc::pid_t,
                        libc::SIGUSR2,
                    )
                };
            }
            sent += 1;
            std::thread::yield_now();
        }
        done.store(true, Ordering::Relaxed);
    });
    assert!(
        !HANDLER_FAILED.load(Ordering::Relaxed),
        "a handler saw a torn or freed value"
    );
    assert!(HANDLED.load(Ordering::Relaxed) > 0);
    assert_eq!(lock.readers_inside(), 0);
    assert_eq!(cell.readers_inside(), 0);
    assert!(lock.try_write().is_some());
    eprintln!("{} handlers ran", HANDLED.load(Ordering::Relaxed));
}

#[test]
fn a_thousand_threads_read_while_a_writer_writes() {
    let lock = RwLock::new([0u64; WORDS]);
    let cell = EpochCell::new(Poisoned::new(0));
    let start = Barrier::new(1001);
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..1000)
            .map(|_| {
                std::thread::Builder::new()
                    .stack_size(64 * 1024)
                    .spawn_scoped(s, || {
                        start.wait();
                        for _ in 0..50 {
                            consistent(&read_all(&lock.read())).unwrap();
                            cell.load().check();
                        }
                    })
                    .expect("spawn a reader")
            })
            .collect();
        s.spawn(|| {
            let mut value = 0;
            while !done.load(Ordering::Relaxed) {
                value += 1;
                write_all(&mut lock.write(), value);
                cell.store(Poisoned::new(value));
            }
        });
        start.wait();
        for handle in handles {
            handle.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    assert_eq!(lock.readers_inside(), 0);
    assert_eq!(cell.readers_inside(), 0);
}

/// What the lock must decide here, worked out without thiscpu: rseq unless turned off or
/// refused, and `membarrier` unless turned off or refused.
fn expect_rseq() -> bool {
    let rseq = match common::expected_registrar_from_env().as_deref() {
        Some("none") => false,
        Some(_) => true,
        None => thiscpu::source().registrar != thiscpu::Registrar::None,
    };
    rseq && std::env::var("THISCPU_MEMBARRIER").as_deref() != Ok("off")
        && thiscpu::fence::available()
}

#[test]
fn the_mode_follows_rseq_and_membarrier() {
    let lock = RwLock::new([0u64; WORDS]);
    let cell = EpochCell::new(0u8);
    assert_eq!(lock.uses_rseq(), expect_rseq(), "{lock:?}");
    assert_eq!(cell.uses_rseq(), lock.uses_rseq());
    let mode = if lock.uses_rseq() { "rseq" } else { "atomic" };
    assert!(format!("{lock:?}").contains(mode));
    assert!(format!("{cell:?}").contains(mode));
    // An entry and an exit word per possible CPU and in the spare row.
    let rows = thiscpu::topology::possible_cpus() + 1;
    assert_eq!(lock.counts_bytes(), 16 * rows);
    // Two phases' words.
    assert_eq!(cell.counts_bytes(), 32 * rows);
}

const CHILD: &str = "THISCPU_RWLOCK_TEST_CHILD";

/// The atomic mode, in child processes: without rseq, without `membarrier`, and with
/// `membarrier` refused by a seccomp filter.
// Its seccomp filter is written for the architectures with an rseq port (`thiscpu_rseq`).
#[cfg(thiscpu_rseq)]
#[test]
fn without_rseq_or_membarrier_the_atomic_mode_is_exact() {
    if std::env::var_os(CHILD).is_some() || std::env::var_os(common::SECCOMP_CHILD).is_some() {
        let lock = RwLock::new([0u64; WORDS]);
        assert!(!lock.uses_rseq(), "{lock:?}");
        storm(&lock, 3, 500, Duration::from_secs(2));
        let cell = EpochCell::new(Poisoned::new(0));
        assert!(!cell.uses_rseq(), "{cell:?}");
        std::thread::scope(|s| {
            s.spawn(|| {
                (0..10_000).for_each(|_| {
                    cell.load().check();
                })
            });
            (1..100).for_each(|value| cell.store(Poisoned::new(value)));
        });
        return;
    }
    let name = "without_rseq_or_membarrier_the_atomic_mode_is_exact";
    common::rerun_alone(
        name,
        &[(CHILD, "1"), ("THISCPU_RSEQ", "off")],
        Duration::from_secs(30),
    );
    common::rerun_alone(
        name,
        &[(CHILD, "1"), ("THISCPU_MEMBARRIER", "off")],
        Duration::from_secs(30),
    );
    common::rerun_under_seccomp(
        name,
        common::refuse_syscall_program(libc::SYS_membarrier, libc::EPERM),
    );
}

/// With delays inside every section (`--cfg thiscpu_inject`), so that preemption and
/// migration abort the readers' counts often: still whole values, and counts that balance.
#[cfg(thiscpu_inject)]
#[test]
fn with_delays_inside_the_sections_the_counts_stay_exact() {
    for point in 0..thiscpu::ops::inject::POINTS {
        thiscpu::ops::inject::set_delay(point, 2000);
    }
    let aborts = thiscpu::ops::aborts();
    let lock = RwLock::new([0u64; WORDS]);
    storm(&lock, 3, 300, Duration::from_secs(2));
    let cell = EpochCell::new(Poisoned::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            (0..20_000).for_each(|_| {
                cell.load().check();
            })
        });
        (1..100).for_each(|value| cell.store(Poisoned::new(value)));
    });
    assert_eq!(cell.readers_inside(), 0);
    for point in 0..thiscpu::ops::inject::POINTS {
        thiscpu::ops::inject::set_delay(point, 0);
    }
    eprintln!("{} aborts retried", thiscpu::ops::aborts() - aborts);
}

/// In a child process where glibc registered rseq: a lock made with rseq and `membarrier`, a
/// reader thread whose rseq is then taken away (it counts atomically in the spare row), and a
/// seccomp filter refusing `membarrier` installed afterwards on every thread (writers fence by
/// visiting every CPU): values whole, counts balanced.
// Its seccomp filter is written for the architectures with an rseq port (`thiscpu_rseq`).
#[cfg(thiscpu_rseq)]
#[test]
fn a_reader_without_rseq_and_membarrier_refused_later() {
    let name = "a_reader_without_rseq_and_membarrier_refused_later";
    let glibc = thiscpu::source().registrar == thiscpu::Registrar::Glibc;
    if std::env::var_os(CHILD).is_none() {
        if glibc && thiscpu::fence::available() {
            common::rerun_alone(name, &[(CHILD, "1")], Duration::from_secs(30));
        }
        return;
    }
    let lock = RwLock::new([0u64; WORDS]);
    assert!(lock.uses_rseq(), "{lock:?}");
    let done = AtomicBool::new(false);
    let unregistered = Barrier::new(2);
    std::thread::scope(|s| {
        s.spawn(|| {
            common::unregister_glibcs_area();
            assert!(thiscpu::ops::position().is_none(), "the thread kept rseq");
            unregistered.wait();
            while !done.load(Ordering::Relaxed) {
                consistent(&read_all(&lock.read())).unwrap();
            }
        });
        unregistered.wait();
        common::install_on_every_thread(&common::refuse_syscall_program(
            libc::SYS_membarrier,
            libc::EPERM,
        ));
        assert!(
            thiscpu::fence::fence_all().is_err(),
            "membarrier still allowed"
        );
        for value in 1..=50 {
            write_all(&mut lock.write(), value);
        }
        done.store(true, Ordering::Relaxed);
    });
    assert_eq!(consistent(&lock.read()).unwrap(), 50);
    assert_eq!(lock.readers_inside(), 0);
    assert!(lock.try_write().is_some());
}

/// A value that counts its drops.
struct Counted<'a> {
    generation: u64,
    drops: &'a AtomicUsize,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// The read-modify-write every `ArcSwap` user writes, whose guard lives to the end of the
/// statement: the store does not wait for its own thread's reader, the old value stays alive
/// while that reader may see it, and is dropped once it has left. In a child with a time
/// limit, as a store that waited for its own guard would hang.
#[test]
fn a_store_under_its_own_threads_guard_does_not_wait() {
    let name = "a_store_under_its_own_threads_guard_does_not_wait";
    if std::env::var_os(CHILD).is_none() {
        common::rerun_alone(name, &[(CHILD, "1")], Duration::from_secs(20));
        return;
    }
    let drops = AtomicUsize::new(0);
    let cell = EpochCell::new(Counted {
        generation: 1,
        drops: &drops,
    });
    cell.store(Counted {
        generation: cell.load().generation + 1,
        drops: &drops,
    });
    assert_eq!(cell.load().generation, 2);
    // A guard kept across several stores keeps what it may see, and nothing is dropped early.
    let pinned = cell.load();
    for generation in 3..=10 {
        cell.store(Counted {
            generation,
            drops: &drops,
        });
    }
    assert_eq!(pinned.generation, 2);
    assert!(
        cell.retired() >= 1,
        "a value was let go under a pinned reader"
    );
    drop(pinned);
    assert_eq!(cell.reclaim(), 0, "values kept after their readers left");
    assert_eq!(
        drops.load(Ordering::SeqCst),
        9,
        "replaced values not dropped"
    );
    let old = cell.swap(Arc::new(Counted {
        generation: 11,
        drops: &drops,
    }));
    assert_eq!(old.generation, 10);
    drop(old);
    assert_eq!(cell.retired(), 0);
    assert_eq!(drops.load(Ordering::SeqCst), 10);
    drop(cell);
    assert_eq!(drops.load(Ordering::SeqCst), 11);
}

/// Under a stream of readers on every CPU, stores go on without waiting, and once the readers
/// stop one `reclaim` drops every replaced value: none is kept for ever, none twice.
#[test]
fn replaced_values_are_dropped_once_their_readers_leave() {
    let drops = AtomicUsize::new(0);
    let cell = EpochCell::new(Counted {
        generation: 0,
        drops: &drops,
    });
    let done = AtomicBool::new(false);
    let mut stores = 0;
    std::thread::scope(|s| {
        for _ in 0..std::thread::available_parallelism().map_or(2, |n| n.get()) {
            s.spawn(|| {
                let mut last = 0;
                while !done.load(Ordering::Relaxed) {
                    let generation = cell.load().generation;
                    assert!(generation >= last, "generations went back");
                    last = generation;
                }
            });
        }
        let start = Instant::now();
        while stores < 2000 && start.elapsed() < Duration::from_secs(1) {
            stores += 1;
            cell.store(Counted {
                generation: stores,
                drops: &drops,
            });
        }
        done.store(true, Ordering::Relaxed);
    });
    assert_eq!(cell.reclaim(), 0);
    assert_eq!(drops.load(Ordering::SeqCst) as u64, stores);
}

/// A seccomp filter refusing `membarrier` and `sched_setaffinity`, installed on every thread
/// after the lock was made: a write cannot fence the readers and panics, and leaves the lock
/// as it found it. Readers and later writers get in.
// Its seccomp filter is written for the architectures with an rseq port (`thiscpu_rseq`).
#[cfg(thiscpu_rseq)]
#[test]
fn a_write_that_cannot_fence_leaves_the_lock_as_it_was() {
    let name = "a_write_that_cannot_fence_leaves_the_lock_as_it_was";
    if std::env::var_os(CHILD).is_none() {
        if thiscpu::source().registrar != thiscpu::Registrar::None && thiscpu::fence::available() {
            common::rerun_alone(name, &[(CHILD, "1")], Duration::from_secs(30));
        }
        return;
    }
    let lock = RwLock::new(1u64);
    assert!(lock.uses_rseq(), "{lock:?}");
    common::install_on_every_thread(&common::refuse_syscalls_program(
        &[libc::SYS_membarrier, libc::SYS_sched_setaffinity],
        libc::EPERM,
    ));
    for attempt in ["write", "try_write"] {
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match attempt {
            "write" => drop(lock.write()),
            _ => drop(lock.try_write()),
        }));
        let why = failed.expect_err("a write without any fence went through");
        let why = why
            .downcast_ref::<String>()
            .map_or("", String::as_str)
            .to_owned();
        assert!(why.contains("cannot fence"), "{attempt}: {why}");
        assert!(
            !lock.is_write_locked(),
            "{attempt} left the writer flag set"
        );
        let (sender, answer) = std::sync::mpsc::channel();
        let lock = &lock;
        std::thread::scope(|s| {
            s.spawn(move || sender.send(*lock.read()).unwrap());
            assert_eq!(
                answer.recv_timeout(Duration::from_secs(5)),
                Ok(1),
                "a reader after a failed {attempt} got no answer"
            );
        });
    }
}

/// A reader on a CPU that the writer's own cpuset does not hold (cgroup v1 `tasks` moves one
/// thread), with `membarrier` refused after the lock was made: the writer cannot visit that
/// CPU, a thread of the process may run there, so the write must not go through unfenced.
/// Needs the cgroup v1 cpuset hierarchy at /sys/fs/cgroup/cpuset, writable, and two CPUs.
// Its seccomp filter is written for the architectures with an rseq port (`thiscpu_rseq`).
#[cfg(thiscpu_rseq)]
#[test]
fn a_visiting_fence_does_not_skip_a_cpu_where_a_reader_may_run() {
    let name = "a_visiting_fence_does_not_skip_a_cpu_where_a_reader_may_run";
    let root = std::path::Path::new("/sys/fs/cgroup/cpuset");
    if std::env::var_os(CHILD).is_none() {
        let usable = root.join("tasks").exists()
            && common::allowed_cpus().len() >= 2
            && thiscpu::source().registrar != thiscpu::Registrar::None
            && thiscpu::fence::available();
        if usable {
            common::rerun_alone(name, &[(CHILD, "1")], Duration::from_secs(30));
        } else {
            eprintln!("skipped: no writable cgroup v1 cpuset hierarchy, or fewer than 2 CPUs");
        }
        return;
    }
    let cpus = common::allowed_cpus();
    let (writer_cpu, reader_cpu) = (cpus[0], cpus[1]);
    let group = root.join(format!("thiscpu-test-{}", std::process::id()));
    if std::fs::create_dir(&group).is_err() {
        eprintln!("skipped: cannot make a cpuset group");
        return;
    }
    let mems = std::fs::read_to_string(root.join("cpuset.mems")).unwrap();
    std::fs::write(group.join("cpuset.mems"), mems.trim()).unwrap();
    std::fs::write(group.join("cpuset.cpus"), writer_cpu.to_string()).unwrap();
    let lock = RwLock::new(1u64);
    assert!(lock.uses_rseq(), "{lock:?}");
    let done = AtomicBool::new(false);
    let pinned = Barrier::new(2);
    let outcome = std::thread::scope(|s| {
        s.spawn(|| {
            common::pin(reader_cpu);
            pinned.wait();
            while !done.load(Ordering::Relaxed) {
                assert_eq!(*lock.read(), 1);
            }
        });
        pinned.wait();
        std::fs::write(group.join("tasks"), common::gettid().to_string()).unwrap();
        common::install_on_every_thread(&common::refuse_syscall_program(
            libc::SYS_membarrier,
            libc::EPERM,
        ));
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(lock.try_write())));
        done.store(true, Ordering::Relaxed);
        outcome
    });
    std::fs::write(root.join("tasks"), common::gettid().to_string()).unwrap();
    let _ = std::fs::remove_dir(&group);
    let why = outcome.expect_err("the write went through with a reader's CPU unfenced");
    let why = why.downcast_ref::<String>().map_or("", String::as_str);
    assert!(why.contains(&format!("CPU {reader_cpu}")), "{why}");
    assert!(!lock.is_write_locked());
}

/// `rcu` from several threads at once, each adding one many times: no update is lost, and
/// every replaced value is dropped once its readers have left.
#[test]
fn rcu_from_several_threads_loses_no_update() {
    let drops = AtomicUsize::new(0);
    let cell = EpochCell::from_pointee(Counted {
        generation: 0,
        drops: &drops,
    });
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
    const EACH: u64 = 300;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..EACH {
                    cell.rcu(|current| Counted {
                        generation: current.generation + 1,
                        drops: &drops,
                    });
                }
            });
        }
    });
    let total = EACH * threads as u64;
    assert_eq!(cell.load().generation, total, "an update was lost");
    // Another writer in the middle of an update, every time: `rcu` tries again on its value.
    let cell = EpochCell::new(0u64);
    let mut calls = 0;
    cell.rcu(|current| {
        calls += 1;
        if calls == 1 {
            cell.store(**current + 10);
        }
        **current + 1
    });
    assert_eq!(
        (*cell.load(), calls),
        (11, 2),
        "the other writer's update was lost"
    );
    let cell = EpochCell::from_pointee(Counted {
        generation: total,
        drops: &drops,
    });
    assert_eq!(cell.reclaim(), 0);
    // Every value `rcu` built was stored or dropped: `total` stored, each replacing one, and
    // those built for a lost race dropped at once.
    assert!(drops.load(Ordering::SeqCst) as u64 >= total);
}

/// `compare_and_swap` compares by address: a stale `Arc` does not match, the value that
/// stands is returned, and nothing is stored.
#[test]
fn compare_and_swap_stores_only_over_the_value_compared() {
    let cell = EpochCell::from(Arc::new(1));
    let first = cell.load_full();
    let same_number = Arc::new(1);
    let previous = cell.compare_and_swap(&same_number, Arc::new(9));
    assert!(
        Arc::ptr_eq(&previous, &first),
        "an equal value at another address matched"
    );
    assert_eq!(*cell.load(), 1);
    let guard = cell.load();
    let previous = cell.compare_and_swap(&guard, 2);
    assert!(Arc::ptr_eq(&previous, &first));
    drop(guard);
    assert_eq!(*cell.load(), 2);
    let previous = cell.compare_and_swap(Arc::as_ptr(&first), 3);
    assert_eq!(*previous, 2, "a stale pointer matched");
    assert_eq!(*cell.load(), 2);
}

/// `EpochCellOption`: empty and full, swaps between them, readers of a value that is taken
/// away keep it until they leave.
#[test]
fn an_optional_cell_holds_nothing_or_a_value() {
    let drops = AtomicUsize::new(0);
    let cell = thiscpu::EpochCellOption::<Counted>::default();
    assert!(cell.load().is_none() && cell.load_full().is_none());
    cell.store(Some(Arc::new(Counted {
        generation: 1,
        drops: &drops,
    })));
    let pinned = cell.load().expect("a value");
    assert!(cell.swap(None).is_some());
    assert!(cell.load().is_none());
    assert_eq!(
        pinned.generation, 1,
        "a value taken away changed under its reader"
    );
    assert_eq!(drops.load(Ordering::SeqCst), 0, "dropped under its reader");
    drop(pinned);
    assert_eq!(cell.reclaim(), 0);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    let previous = cell.compare_and_swap(
        None,
        Some(Arc::new(Counted {
            generation: 2,
            drops: &drops,
        })),
    );
    assert!(previous.is_none());
    let old = cell.rcu(|current| {
        Some(Arc::new(Counted {
            generation: current.as_ref().map_or(0, |c| c.generation) + 1,
            drops: &drops,
        }))
    });
    assert_eq!(old.map(|old| old.generation), Some(2));
    assert_eq!(cell.load().map(|c| c.generation), Some(3));
    drop(cell);
    assert_eq!(drops.load(Ordering::SeqCst), 3);
}

/// How long a test leaves a thread to reach its blocking call before checking that it blocks.
const SETTLE: Duration = Duration::from_millis(100);

#[test]
fn a_downgraded_writer_keeps_other_writers_out_and_lets_readers_in() {
    use std::sync::mpsc;
    use thiscpu::RwLockWriteGuard;
    let lock = Arc::new(RwLock::new(0u64));
    let mut writing = lock.write();
    *writing = 1;
    let writer = {
        let lock = lock.clone();
        std::thread::spawn(move || *lock.write() = 2)
    };
    let (read_tx, read_rx) = mpsc::channel();
    let reader = {
        let lock = lock.clone();
        std::thread::spawn(move || read_tx.send(*lock.read()).unwrap())
    };
    std::thread::sleep(SETTLE);
    let reading = RwLockWriteGuard::downgrade(writing);
    // The waiting writer wakes with the downgrade and takes the flag, and must then wait for
    // this reader; the waiting reader may get in before it does.
    std::thread::sleep(SETTLE);
    assert_eq!(
        *reading, 1,
        "a writer got in while the downgraded reader held on"
    );
    assert!(lock.try_write().is_none());
    drop(reading);
    writer.join().unwrap();
    assert!(
        [1, 2].contains(&read_rx.recv().unwrap()),
        "the reader saw neither value"
    );
    reader.join().unwrap();
    assert_eq!(*lock.read(), 2);
    assert_eq!(
        lock.readers_inside(),
        0,
        "the downgraded reader left twice or never"
    );
}

#[test]
fn a_downgraded_writer_lets_a_waiting_reader_in_while_it_reads() {
    use std::sync::mpsc;
    use thiscpu::RwLockWriteGuard;
    let lock = Arc::new(RwLock::new(0u64));
    let mut writing = lock.write();
    *writing = 1;
    let (read_tx, read_rx) = mpsc::channel();
    let reader = {
        let lock = lock.clone();
        std::thread::spawn(move || read_tx.send(*lock.read()).unwrap())
    };
    std::thread::sleep(SETTLE);
    assert!(
        read_rx.try_recv().is_err(),
        "a reader got in under the writer"
    );
    let reading = RwLockWriteGuard::downgrade(writing);
    assert_eq!(
        read_rx.recv_timeout(Duration::from_secs(10)),
        Ok(1),
        "the waiting reader was not let in beside the downgraded one"
    );
    drop(reading);
    reader.join().unwrap();
    assert!(lock.try_write().is_some());
}

#[test]
fn mapped_guards_hold_the_lock_until_dropped_and_release_it_once() {
    use thiscpu::{
        MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLockReadGuard, RwLockWriteGuard,
    };
    let lock = RwLock::new((String::from("name"), vec![1u64, 2, 3]));

    let name = RwLockReadGuard::map(lock.read(), |(name, _)| name.as_str());
    let first = MappedRwLockReadGuard::map(name, |name| &name[..1]);
    assert_eq!(&*first, "n");
    assert!(
        lock.try_write().is_none(),
        "a mapped read guard let a writer in"
    );
    assert!(
        lock.try_read().is_some(),
        "a mapped read guard kept readers out"
    );
    drop(first);
    assert_eq!(lock.readers_inside(), 0);
    assert!(
        lock.try_write().is_some(),
        "a mapped read guard not released"
    );

    let missing = RwLockReadGuard::try_map(lock.read(), |(_, values)| values.get(9));
    let guard = missing.unwrap_err();
    assert!(
        lock.try_write().is_none(),
        "try_map's failure released the lock"
    );
    let found = RwLockReadGuard::try_map(guard, |(_, values)| values.get(1)).unwrap();
    let found = MappedRwLockReadGuard::try_map(found, |_| None::<&u64>).unwrap_err();
    assert_eq!(*found, 2);
    drop(found);
    assert_eq!(lock.readers_inside(), 0);

    let mut values = RwLockWriteGuard::map(lock.write(), |(_, values)| values);
    values.push(4);
    assert!(
        lock.try_read().is_none(),
        "a mapped write guard let a reader in"
    );
    let mut last = MappedRwLockWriteGuard::try_map(values, |values| values.last_mut()).unwrap();
    *last = 5;
    drop(last);
    assert_eq!(lock.read().1, [1, 2, 3, 5]);
    let guard = RwLockWriteGuard::try_map(lock.write(), |(_, values)| values.get_mut(9));
    let guard = guard.unwrap_err();
    assert!(
        lock.try_read().is_none(),
        "try_map's failure released the lock"
    );
    drop(guard);
    assert!(
        lock.try_write().is_some(),
        "a mapped write guard not released"
    );
    assert!(lock.try_read().is_some());
}

#[test]
fn a_panic_while_mapping_releases_the_lock() {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use thiscpu::{RwLockReadGuard, RwLockWriteGuard};
    let lock = RwLock::new(1u64);
    let mapping = catch_unwind(AssertUnwindSafe(|| {
        RwLockWriteGuard::map(lock.write(), |_| -> &mut u64 { panic!("mapping") })
    }));
    assert!(mapping.is_err());
    assert!(lock.try_read().is_some(), "the write lock stayed held");
    let mapping = catch_unwind(AssertUnwindSafe(|| {
        RwLockReadGuard::map(lock.read(), |_| -> &u64 { panic!("mapping") })
    }));
    assert!(mapping.is_err());
    assert_eq!(lock.readers_inside(), 0);
    assert!(lock.try_write().is_some(), "the read lock stayed held");
}

#[test]
fn mapped_guards_may_be_dropped_on_another_thread() {
    use thiscpu::{RwLockReadGuard, RwLockWriteGuard};
    let lock = RwLock::new([7u64, 8]);
    std::thread::scope(|scope| {
        let second = RwLockReadGuard::map(lock.read(), |pair| &pair[1]);
        scope.spawn(move || assert_eq!(*second, 8)).join().unwrap();
        assert!(lock.try_write().is_some());
        let mut first = RwLockWriteGuard::map(lock.write(), |pair| &mut pair[0]);
        scope
            .spawn(move || {
                *first = 9;
            })
            .join()
            .unwrap();
    });
    assert_eq!(*lock.read(), [9, 8]);
}

#[test]
fn an_upgradable_read_shares_with_readers_and_excludes_writers() {
    use thiscpu::RwLockUpgradableReadGuard;
    let lock = Arc::new(RwLock::new(1u64));
    let upgradable = lock.upgradable_read();
    assert_eq!(*lock.try_read().unwrap(), 1, "a reader kept out");
    assert!(
        lock.try_upgradable_read().is_none(),
        "two upgradable readers"
    );
    assert!(
        lock.try_write().is_none(),
        "a writer beside an upgradable reader"
    );
    let writer = {
        let lock = lock.clone();
        std::thread::spawn(move || *lock.write() = 3)
    };
    std::thread::sleep(SETTLE);
    assert_eq!(
        *upgradable, 1,
        "a writer got in beside the upgradable reader"
    );
    let mut writing = RwLockUpgradableReadGuard::upgrade(upgradable);
    *writing = 2;
    drop(writing);
    writer.join().unwrap();
    assert_eq!(*lock.read(), 3);
    assert_eq!(lock.readers_inside(), 0);
    assert!(!lock.is_write_locked());
}

#[test]
fn an_upgrade_waits_for_the_readers_inside() {
    use std::sync::mpsc;
    use thiscpu::RwLockUpgradableReadGuard;
    let lock = Arc::new(RwLock::new(1u64));
    let (entered_tx, entered_rx) = mpsc::channel();
    let leaving = Arc::new(AtomicBool::new(false));
    let reader = {
        let lock = lock.clone();
        let leaving = leaving.clone();
        std::thread::spawn(move || {
            let reading = lock.read();
            entered_tx.send(()).unwrap();
            std::thread::sleep(SETTLE);
            let seen = *reading;
            leaving.store(true, Ordering::SeqCst);
            drop(reading);
            seen
        })
    };
    entered_rx.recv().unwrap();
    let upgradable = lock.upgradable_read();
    let upgradable = RwLockUpgradableReadGuard::try_upgrade(upgradable).unwrap_err();
    assert!(
        lock.try_read().is_some(),
        "a failed try_upgrade left readers out"
    );
    let mut writing = RwLockUpgradableReadGuard::upgrade(upgradable);
    assert!(
        leaving.load(Ordering::SeqCst),
        "an upgrade got in beside a reader"
    );
    *writing = 2;
    assert_eq!(
        reader.join().unwrap(),
        1,
        "the reader saw the upgraded write"
    );
}

#[test]
fn upgradable_readers_lose_no_update_among_writers() {
    use thiscpu::RwLockUpgradableReadGuard;
    const THREADS: u64 = 4;
    const ROUNDS: u64 = 300;
    let lock = RwLock::new(0u64);
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let lock = &lock;
            scope.spawn(move || {
                for _ in 0..ROUNDS {
                    if thread % 2 == 0 {
                        let reading = lock.upgradable_read();
                        let seen = *reading;
                        std::thread::yield_now();
                        *RwLockUpgradableReadGuard::upgrade(reading) = seen + 1;
                    } else {
                        *lock.write() += 1;
                    }
                }
            });
        }
    });
    assert_eq!(*lock.read(), THREADS * ROUNDS, "an update lost");
}

#[test]
fn downgrades_of_an_upgradable_read_and_to_one() {
    use thiscpu::{RwLockUpgradableReadGuard, RwLockWriteGuard};
    let lock = RwLock::new(1u64);
    let mut writing = lock.write();
    *writing = 2;
    let upgradable = RwLockWriteGuard::downgrade_to_upgradable(writing);
    assert_eq!(*lock.try_read().unwrap(), 2);
    assert!(lock.try_write().is_none());
    assert!(lock.try_upgradable_read().is_none());
    let reading = RwLockUpgradableReadGuard::downgrade(upgradable);
    assert!(lock.try_upgradable_read().is_some());
    assert!(
        lock.try_write().is_none(),
        "a writer beside the downgraded reader"
    );
    drop(reading);
    assert_eq!(lock.readers_inside(), 0);
    assert_eq!(*lock.try_write().unwrap(), 2);
}

#[test]
fn timed_locks_give_up_at_their_deadline_and_leave_the_lock_as_found() {
    use std::sync::mpsc;
    let lock = Arc::new(RwLock::new(1u64));
    let wait = Duration::from_millis(50);

    let writing = lock.write();
    let start = Instant::now();
    assert!(lock.try_read_for(wait).is_none(), "a read beside a writer");
    assert!(start.elapsed() >= wait, "gave up early");
    assert!(lock.try_write_for(wait).is_none(), "two writers");
    assert!(lock.try_upgradable_read_for(wait).is_none());
    assert!(lock.try_read_until(Instant::now()).is_none());
    drop(writing);

    // A write that times out while a reader stays inside: readers that slept behind its flag
    // are woken, and the lock is as before.
    let reading = lock.read();
    let (read_tx, read_rx) = mpsc::channel();
    let sleeper = {
        let lock = lock.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                // Sleeps behind the timed write's flag if it comes while the flag is set.
                if read_tx.send(*lock.read()).is_err() {
                    break;
                }
            }
        })
    };
    read_rx.recv().unwrap();
    let start = Instant::now();
    assert!(
        lock.try_write_for(wait).is_none(),
        "a write beside a reader"
    );
    assert!(start.elapsed() >= wait, "gave up early");
    assert!(!lock.is_write_locked(), "a timed-out write kept its flag");
    for _ in 0..3 {
        assert_eq!(
            read_rx.recv_timeout(Duration::from_secs(10)),
            Ok(1),
            "a reader left asleep behind a timed-out write"
        );
    }
    drop(reading);
    drop(read_rx);
    sleeper.join().unwrap();

    // A reader that leaves in time lets the timed write in, and wakes it.
    let reading = lock.read();
    let writer = {
        let lock = lock.clone();
        std::thread::spawn(move || {
            lock.try_write_for(Duration::from_secs(10))
                .map(|mut writing| *writing = 2)
                .is_some()
        })
    };
    std::thread::sleep(SETTLE);
    drop(reading);
    assert!(writer.join().unwrap(), "a timed write not let in");
    assert_eq!(*lock.read(), 2);
    assert_eq!(*lock.try_read_for(Duration::MAX).unwrap(), 2);
}

/// The documented cost of a reader that never leaves (`EpochCell`'s "Memory"): a guard that is
/// forgotten keeps the value it could see and every value stored after it, until the cell is
/// dropped, which drops them all. Checked with the values' own drops, not only the count.
#[test]
fn a_forgotten_epoch_guard_keeps_every_later_value_until_the_cell_drops() {
    static DROPPED: AtomicUsize = AtomicUsize::new(0);
    struct Counted;
    impl Drop for Counted {
        fn drop(&mut self) {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
    const STORES: usize = 1000;
    let cell = EpochCell::new(Counted);
    std::mem::forget(cell.load());
    for _ in 0..STORES {
        cell.store(Counted);
    }
    cell.reclaim();
    assert_eq!(
        cell.retired(),
        STORES,
        "values kept while the guard stays pinned"
    );
    assert_eq!(
        DROPPED.load(Ordering::Relaxed),
        0,
        "a value dropped under a pinned guard"
    );
    drop(cell);
    assert_eq!(DROPPED.load(Ordering::Relaxed), STORES + 1);
}
