//! `Sharded`: exact under migration, signals and thread churn (a count inside each shard against
//! the updates made); never two holders of one shard (a flag inside the shard, checked on
//! entry); readers that take every shard while writers run; a panic inside the closure; a
//! nested take; waiting without burning the CPU, and without counting the wait as aborts; the
//! compare-and-swap mode where `membarrier` is refused (`THISCPU_MEMBARRIER=off`, in a child
//! process); takes that neither hang nor lose an update where a seccomp filter refuses
//! `membarrier` after construction (in a child process); a shard left held by a thread that
//! exited. `.ci/run` runs this file in every environment and once built with
//! `--cfg thiscpu_inject`, where more tests drive aborts and re-enter the fences' registration
//! from a signal handler.
//!
//! Linux only: it compares with `/proc`, `/sys` and Linux's system calls (tests/common).
#![cfg(target_os = "linux")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};
use thiscpu::{ByCpu, Sharded, Spread};

/// What a `Sharded` must decide in this environment, worked out without thiscpu.
#[derive(Debug)]
struct ExpectedMode {
    /// Sections (rseq and `membarrier`), else compare-and-swap.
    rseq: bool,
    /// Indexed by `mm_cid`, for `Sharded::by_mm_cid`.
    mm_cid: bool,
}

/// `MEMBARRIER_CMD_QUERY`: the commands the kernel offers (and a seccomp filter lets through).
fn kernel_offers_rseq_fences() -> bool {
    // SAFETY: membarrier takes three integers and touches no user memory.
    let commands = unsafe { libc::syscall(libc::SYS_membarrier, 0, 0, 0) };
    commands > 0 && commands & (1 << 7) != 0
}

/// The running kernel's `(major, minor)`, from `uname`.
fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut numbers = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    (numbers.next().unwrap(), numbers.next().unwrap_or(0))
}

/// From `THISCPU_EXPECT_REGISTRAR` when `.ci/run` sets it (as `registration.rs` does, else from
/// glibc's symbols, `THISCPU_RSEQ` and the kernel), `THISCPU_MEMBARRIER`, the kernel's own
/// list of `membarrier` commands, and its version (`mm_cid` since Linux 6.3).
fn expected_mode() -> ExpectedMode {
    let registrar = match common::expected_registrar_from_env() {
        Some(name) => name != "none",
        None => common::registrar_from_environment() != thiscpu::Registrar::None,
    };
    let membarrier_off = matches!(
        std::env::var("THISCPU_MEMBARRIER").as_deref(),
        Ok("off" | "0" | "false" | "no")
    );
    let rseq = registrar && !membarrier_off && kernel_offers_rseq_fences();
    ExpectedMode {
        rseq,
        mm_cid: rseq && kernel_version() >= (6, 3),
    }
}

/// What each shard holds in these tests.
#[derive(Debug, Default)]
struct Tally {
    /// Set while a holder is inside; found set on entry means two holders.
    held: bool,
    /// Updates made in this shard since a reader last harvested it.
    updates: u64,
    /// Scratch work, so that holds last long enough to be preempted and migrated.
    scratch: [u64; 8],
}

/// Entries that found the shard already held, over the whole test binary.
static OVERLAPS: AtomicU64 = AtomicU64::new(0);

/// The work done while holding a shard: check and set the flag, update, clear it. Every
/// `slow`-th entry lingers, so that preemption and migration land inside holds.
fn update(tally: &mut Tally, slow: bool) {
    if tally.held {
        OVERLAPS.fetch_add(1, Ordering::Relaxed);
    }
    tally.held = true;
    let rounds = if slow { 2_000 } else { 4 };
    for i in 0..rounds {
        let slot = &mut tally.scratch[i % 8];
        *slot = std::hint::black_box(slot.wrapping_add(i as u64));
    }
    tally.updates += 1;
    tally.held = false;
}

/// Signals received by the workers (the handler does nothing else: it only interrupts).
static SIGNALS_HANDLED: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_signal(_: libc::c_int) {
    SIGNALS_HANDLED.fetch_add(1, Ordering::Relaxed);
}

fn install_handler() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe (one atomic
        // add); SA_RESTART keeps the workers' system calls going.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = count_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            assert_eq!(
                libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()),
                0
            );
        }
    });
}

#[derive(Debug, Default)]
struct Report {
    performed: u64,
    harvested: u64,
    remaining: u64,
    reads: u64,
    migrations: u64,
    signals: u64,
    threads_created: u64,
}

/// How many reads the storm's reader makes after the stop, at most, while it has found no
/// update yet.
const LATE_READS: u32 = 500;

/// Writers, churn, a migrating and signalling disturber, and a reader that moves every
/// shard's updates into its own total, all at once for `duration`.
fn storm<S: Spread>(sharded: Sharded<Tally, S>, duration: Duration) -> Report {
    install_handler();
    let sharded = Arc::new(sharded);
    let workers = 4;
    let cpus = common::allowed_cpus();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(workers + 2));
    let tids: Arc<Vec<AtomicI32>> = Arc::new((0..workers).map(|_| AtomicI32::new(0)).collect());
    let handles: Vec<_> = (0..workers)
        .map(|index| {
            let (sharded, stop, start, tids) =
                (sharded.clone(), stop.clone(), start.clone(), tids.clone());
            std::thread::spawn(move || {
                tids[index].store(common::gettid(), Ordering::Release);
                start.wait();
                let mut made = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    sharded.with_current(|tally| update(tally, made.is_multiple_of(256)));
                    made += 1;
                }
                made
            })
        })
        .collect();
    let reader = {
        let (sharded, stop, start) = (sharded.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            let (mut harvested, mut reads, mut last_sum) = (0u64, 0u64, 0u64);
            // A reader the scheduler starves (a guest of many CPUs emulated on one host
            // thread: one read in a whole storm, before any update) reads on after the stop
            // until it finds what the writers left, a bounded number of times.
            let mut late_reads = 0;
            loop {
                if stop.load(Ordering::Relaxed) {
                    if harvested > 0 || late_reads == LATE_READS {
                        break;
                    }
                    late_reads += 1;
                }
                let sum = sharded.fold(0, |sum, tally| {
                    if tally.held {
                        OVERLAPS.fetch_add(1, Ordering::Relaxed);
                    }
                    sum + tally.updates
                });
                assert!(sum + harvested >= last_sum, "updates went backwards");
                last_sum = sum + harvested;
                sharded.for_each(|_, tally| {
                    if tally.held {
                        OVERLAPS.fetch_add(1, Ordering::Relaxed);
                    }
                    harvested += std::mem::take(&mut tally.updates);
                });
                reads += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            (harvested, reads)
        })
    };
    start.wait();
    let pid = std::process::id() as i32;
    let mut report = Report::default();
    let mut random = 0x2545_f491_4f6c_dd1du64;
    let mut churn: Vec<std::thread::JoinHandle<u64>> = Vec::new();
    let deadline = Instant::now() + duration;
    while Instant::now() < deadline {
        for _ in 0..4 {
            random ^= random << 13;
            random ^= random >> 7;
            random ^= random << 17;
            let tid = tids[random as usize % workers].load(Ordering::Acquire);
            let cpu = cpus[(random >> 32) as usize % cpus.len()];
            if common::set_affinity(tid, &common::Mask::of(&[cpu])).is_ok() {
                report.migrations += 1;
            }
            // SAFETY: tgkill to a worker of this process, alive until `stop`; its handler is
            // installed.
            if unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGUSR2) } == 0 {
                report.signals += 1;
            }
        }
        let sharded = sharded.clone();
        churn.push(std::thread::spawn(move || {
            for i in 0..500u32 {
                sharded.with_current(|tally| update(tally, i.is_multiple_of(64)));
            }
            500
        }));
        report.threads_created += 1;
        if churn.len() >= 8 {
            for handle in churn.drain(..4) {
                report.performed += handle.join().expect("a short-lived thread panicked");
            }
        }
        std::thread::sleep(Duration::from_micros(300));
    }
    stop.store(true, Ordering::Relaxed);
    for handle in handles.into_iter().chain(churn) {
        report.performed += handle.join().expect("a writer panicked");
    }
    let (harvested, reads) = reader.join().expect("the reader panicked");
    report.harvested = harvested;
    report.reads = reads;
    let sharded = Arc::into_inner(sharded).expect("every thread joined");
    report.remaining = sharded.into_inner().iter().map(|t| t.updates).sum();
    report
}

fn assert_exact(report: &Report) {
    eprintln!(
        "{report:?}, signals handled {}",
        SIGNALS_HANDLED.load(Ordering::Relaxed)
    );
    assert_eq!(
        OVERLAPS.load(Ordering::Relaxed),
        0,
        "two holders met in a shard"
    );
    assert_eq!(
        report.harvested + report.remaining,
        report.performed,
        "updates lost or counted twice: {report:?}"
    );
    assert!(report.performed > 0 && report.reads > 0, "{report:?}");
    assert!(
        report.harvested > 0,
        "the reader never found an update: {report:?}"
    );
    assert!(report.migrations > 0 || common::allowed_cpus().len() == 1);
    assert!(report.signals > 0 && report.threads_created > 0);
}

#[test]
fn exact_by_cpu_under_migration_signals_churn_and_readers() {
    let _serial = common::serial();
    let report = storm(
        Sharded::<Tally, ByCpu>::default(),
        Duration::from_millis(1500),
    );
    assert_exact(&report);
}

#[test]
fn exact_by_mm_cid_under_migration_signals_churn_and_readers() {
    let _serial = common::serial();
    let sharded = Sharded::by_mm_cid(|_| Tally::default());
    let expected = expected_mode();
    eprintln!("{sharded:?}, expected {expected:?}");
    assert_eq!(sharded.indexed_by_mm_cid(), expected.mm_cid, "{sharded:?}");
    let report = storm(sharded, Duration::from_millis(800));
    assert_exact(&report);
}

/// Built with `--cfg thiscpu_inject`, delay loops inside the sections (between the comparison
/// and the commit) make preemption, migration, signals and the readers' fences land there:
/// takes abort, and are retried exactly.
#[cfg(thiscpu_inject)]
#[test]
fn injected_delays_abort_takes_and_they_are_retried_exactly() {
    let _serial = common::serial();
    let sharded = Sharded::<Tally>::default();
    if !sharded.uses_rseq() {
        eprintln!("skipped: no sections to abort here: {sharded:?}");
        return;
    }
    for point in 0..thiscpu::ops::inject::POINTS {
        thiscpu::ops::inject::set_delay(point, 20_000);
    }
    let before = thiscpu::ops::aborts();
    let report = storm(sharded, Duration::from_millis(800));
    for point in 0..thiscpu::ops::inject::POINTS {
        thiscpu::ops::inject::set_delay(point, 0);
    }
    let aborts = thiscpu::ops::aborts() - before;
    eprintln!("aborts: {aborts}");
    assert_exact(&report);
    assert!(aborts > 0, "fault injection on, yet no take aborted");
}

#[test]
fn the_mode_follows_rseq_and_membarrier() {
    let expected = expected_mode();
    let sharded = Sharded::new(|_| 0u8);
    eprintln!("{sharded:?}, expected {expected:?}");
    assert_eq!(sharded.uses_rseq(), expected.rseq, "{sharded:?}");
    assert_eq!(sharded.len(), common::sys_possible_cpus().len());
    let by_cid = Sharded::by_mm_cid(|_| 0u8);
    assert_eq!(by_cid.uses_rseq(), expected.rseq, "{by_cid:?}");
    assert_eq!(by_cid.indexed_by_mm_cid(), expected.mm_cid, "{by_cid:?}");
}

/// A thread waiting on the current CPU for a shard held there is contention, not aborts: it
/// must not count toward the abort limit and its fallback.
#[test]
fn waiting_for_a_held_shard_is_not_counted_as_aborts() {
    let _serial = common::serial();
    let sharded = Sharded::new(|_| 0u64);
    if !sharded.uses_rseq() {
        eprintln!("skipped: without sections a held shard is a failed compare-and-swap");
        return;
    }
    let cpu = *common::allowed_cpus().last().unwrap();
    let holding = Barrier::new(2);
    let before = (thiscpu::ops::abort_fallbacks(), thiscpu::ops::aborts());
    std::thread::scope(|s| {
        s.spawn(|| {
            common::pin(cpu);
            let mut guard = sharded.lock_current();
            holding.wait();
            std::thread::sleep(Duration::from_millis(200));
            *guard += 1;
        });
        s.spawn(|| {
            common::pin(cpu);
            holding.wait();
            sharded.with_current(|n| *n += 1);
        });
    });
    let fallbacks = thiscpu::ops::abort_fallbacks() - before.0;
    eprintln!(
        "aborts meanwhile: {}, fallbacks: {fallbacks}",
        thiscpu::ops::aborts() - before.1
    );
    assert_eq!(fallbacks, 0, "waiting for a held shard counted as aborts");
    assert_eq!(sharded.fold(0, |total, n| total + n), 2);
}

#[test]
fn a_panic_inside_the_closure_releases_the_shard() {
    let sharded = Sharded::new(|_| 0u64);
    let index = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sharded.with_current(|n| {
            *n += 1;
            panic!("inside the closure");
        })
    }));
    assert!(index.is_err());
    // Another thread can take every shard, in bounded time; the update made before the panic
    // stays (no poisoning, no rollback).
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| done.send(sharded.fold(0, |total, n| total + n)).unwrap());
        let total = wait
            .recv_timeout(Duration::from_secs(10))
            .expect("a shard stayed held after the panic");
        assert_eq!(total, 1);
    });
    sharded.with_current(|n| *n += 1);
    assert_eq!(sharded.into_inner().iter().sum::<u64>(), 2);
}

/// Runs `nested` on a thread pinned to one CPU (so that both takes name the same shard) and
/// returns its panic message; fails if it returns, or hangs.
fn nested_take_message(nested: impl FnOnce() + Send + 'static) -> String {
    let cpu = *common::allowed_cpus().last().unwrap();
    let (done, answer) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        common::pin(cpu);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(nested));
        let message = outcome.err().map(|payload| {
            payload
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default()
        });
        done.send(message).unwrap();
    });
    answer
        .recv_timeout(Duration::from_secs(10))
        .expect("a nested take waited (no answer within 10 s)")
        .expect("a nested take returned")
}

#[test]
fn a_nested_take_panics_instead_of_waiting_forever() {
    let sharded: &'static Sharded<u64> = Box::leak(Box::new(Sharded::new(|_| 0)));
    let nested_lock = nested_take_message(|| {
        let mut outer = sharded.lock_current();
        *outer += 1;
        drop(sharded.lock(outer.index()));
    });
    let nested_lock_current = nested_take_message(|| {
        let mut outer = sharded.lock_current();
        *outer += 1;
        drop(sharded.lock_current());
    });
    let nested_with_current = nested_take_message(|| {
        sharded.with_current(|outer| {
            *outer += 1;
            sharded.with_current(|inner| *inner += 1);
        });
    });
    for message in [nested_lock, nested_lock_current, nested_with_current] {
        assert!(message.contains("already holds"), "{message}");
    }
    // Each outer take's update stays, and the unwinding released every shard.
    assert_eq!(sharded.fold(0, |total, n| total + n), 3);
}

/// A thread that exits holding a shard (its guard leaked) keeps it held for good; a later
/// thread, even one given the same thread-local memory, waits for it like any other thread
/// rather than taking it for its own and panicking as at a nested take. Run in a child process,
/// which ends with the waiters still waiting.
#[test]
fn a_shard_left_held_by_an_exited_thread_is_waited_for() {
    const CHILD: &str = "THISCPU_SHARDED_LEFT_HELD_CHILD";
    if std::env::var_os(CHILD).is_none() {
        common::rerun_alone(
            "a_shard_left_held_by_an_exited_thread_is_waited_for",
            &[(CHILD, "1")],
            Duration::from_secs(30),
        );
        return;
    }
    let sharded: &'static Sharded<u64> = Box::leak(Box::new(Sharded::new(|_| 0)));
    let index = std::thread::spawn(|| {
        let guard = sharded.lock_current();
        let index = guard.index();
        std::mem::forget(guard);
        index
    })
    .join()
    .unwrap();
    for _ in 0..4 {
        let (done, answer) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let taken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                drop(sharded.lock(index))
            }));
            done.send(taken.is_ok()).unwrap();
        });
        match answer.recv_timeout(Duration::from_millis(200)) {
            Err(_) => {} // waiting, as it must
            Ok(true) => panic!("shard {index} was taken while its holder's guard is leaked"),
            Ok(false) => panic!("a later thread took shard {index} for its own (see above)"),
        }
    }
}

/// Thread CPU time of the calling thread.
fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let ret = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    assert_eq!(ret, 0);
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// The calling thread's voluntary context switches so far: one per sleep that blocked.
// `ru_nvcsw` is a C `long`: 32 bits on 32-bit targets, where the conversion is not useless.
#[allow(clippy::useless_conversion)]
fn voluntary_switches() -> i64 {
    // SAFETY: `rusage` is plain integers, for which zero is a valid value.
    let mut usage: libc::rusage = unsafe { core::mem::zeroed() };
    // SAFETY: getrusage writes one rusage through a valid pointer.
    let ret = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    assert_eq!(ret, 0);
    i64::from(usage.ru_nvcsw)
}

/// A holder keeps the shard of CPU `c` while another thread on `c` wants it: the waiter gets
/// it only after the release, and meanwhile sleeps rather than spins.
#[test]
fn a_waiter_gets_the_shard_after_the_release_without_burning_its_cpu() {
    let _serial = common::serial();
    let cpu = *common::allowed_cpus().last().unwrap();
    let sharded = Sharded::new(|_| Tally::default());
    let released = AtomicBool::new(false);
    let holding = Barrier::new(2);
    let hold = Duration::from_millis(300);
    let (waited, cpu_used, sleeps) = std::thread::scope(|s| {
        s.spawn(|| {
            common::pin(cpu);
            let mut guard = sharded.lock_current();
            guard.held = true;
            holding.wait();
            // Moves away while holding: the release comes from another CPU where possible.
            if let Some(&other) = common::allowed_cpus().iter().find(|&&c| c != cpu) {
                common::pin(other);
            }
            std::thread::sleep(hold);
            guard.held = false;
            released.store(true, Ordering::SeqCst);
        });
        let waiter = s.spawn(|| {
            common::pin(cpu);
            holding.wait();
            let (began, cpu_before) = (Instant::now(), thread_cpu_time());
            let switches_before = voluntary_switches();
            sharded.with_current(|tally| {
                assert!(released.load(Ordering::SeqCst), "taken before the release");
                update(tally, false);
            });
            let sleeps = voluntary_switches() - switches_before;
            (began.elapsed(), thread_cpu_time() - cpu_before, sleeps)
        });
        waiter.join().unwrap()
    });
    eprintln!("waited {waited:?}, of which on the CPU {cpu_used:?}, in {sleeps} sleeps");
    assert!(waited >= hold / 2, "{waited:?}");
    // A waiter that spins or only yields never blocks; one that backs off sleeps about once a
    // millisecond: natively, 259-265 sleeps and 4.7-5.3 ms of CPU in 301 ms (three runs with
    // `--nocapture` on an x86_64 VM). The sleeps are counted rather than timed: under emulation
    // the tick charges a sleeper for much of its wait (168 ms of CPU in 316 ms once, in a 4-CPU
    // guest emulated on one host thread).
    assert!(sleeps >= 10, "{sleeps} sleeps in {waited:?}");
    // Spinning all along would be charged about all of `waited`.
    assert!(
        cpu_used < waited * 9 / 10,
        "{cpu_used:?} of CPU in {waited:?}"
    );
    assert_eq!(sharded.fold(0, |n, t| n + t.updates), 1);
}

#[test]
fn without_membarrier_shards_are_taken_by_compare_and_swap() {
    const CHILD: &str = "THISCPU_SHARDED_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let sharded = Sharded::<Tally>::default();
        assert!(!sharded.uses_rseq(), "{sharded:?}");
        assert_exact(&storm(sharded, Duration::from_millis(500)));
        return;
    }
    let status = common::this_executable()
        .args([
            "--exact",
            "without_membarrier_shards_are_taken_by_compare_and_swap",
            "--nocapture",
        ])
        .env("THISCPU_MEMBARRIER", "off")
        .env(CHILD, "1")
        .status()
        .expect("run the test binary again");
    assert!(
        status.success(),
        "the run without membarrier failed: {status}"
    );
}

/// Writers with rseq running before the filter and others started after it (without rseq:
/// their registration is refused), while this thread reads with `fold`, `lock(0)`,
/// `lock(len - 1)` and `for_each`. Exact, and every take returns.
// Its seccomp filter is written for the architectures with an rseq port (`thiscpu_rseq`).
#[cfg(thiscpu_rseq)]
fn refused_after_construction<S: Spread>(sharded: Sharded<Tally, S>) {
    let sharded = Arc::new(sharded);
    let expected = expected_mode();
    eprintln!("{sharded:?}, expected before the filter {expected:?}");
    assert_eq!(sharded.uses_rseq(), expected.rseq);
    sharded.with_current(|tally| update(tally, false));
    let stop = Arc::new(AtomicBool::new(false));
    let registrar = thiscpu::source().registrar;
    // The writers with rseq register (thiscpu registers a thread on its first use) before the
    // filter comes.
    let registered = Arc::new(Barrier::new(3));
    let writer = |with_rseq: bool| {
        let (sharded, stop, ready) = (
            Arc::clone(&sharded),
            Arc::clone(&stop),
            Arc::clone(&registered),
        );
        std::thread::spawn(move || {
            if with_rseq {
                let with_registrar = registrar != thiscpu::Registrar::None;
                let position = thiscpu::ops::position();
                ready.wait();
                assert_eq!(position.is_some(), with_registrar, "{position:?}");
            } else {
                if registrar == thiscpu::Registrar::Glibc {
                    common::unregister_glibcs_area();
                }
                assert!(thiscpu::ops::position().is_none(), "a writer kept rseq");
            }
            let mut made = 0u64;
            while !stop.load(Ordering::Relaxed) {
                sharded.with_current(|tally| update(tally, made.is_multiple_of(64)));
                made += 1;
                // Waiting is not fair: writers that never pause would starve the readers,
                // whose takes now last two migrations per CPU.
                if made.is_multiple_of(16) {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            made
        })
    };
    // Built with `--cfg thiscpu_inject`, sections linger between their comparison and their
    // commit, so that a take without a working fence would meet them there.
    #[cfg(thiscpu_inject)]
    for point in 0..thiscpu::ops::inject::POINTS {
        thiscpu::ops::inject::set_delay(point, 20_000);
    }
    let mut writers: Vec<_> = (0..2).map(|_| writer(true)).collect();
    registered.wait();
    // glibc ends a process whose new thread it cannot register; where thiscpu registers, the
    // filter refuses rseq too, so that later threads have none.
    if registrar == thiscpu::Registrar::Thiscpu {
        common::install_on_every_thread(&common::refuse_syscalls_program(
            &[libc::SYS_membarrier, libc::SYS_rseq],
            libc::EPERM,
        ));
    } else {
        common::install_on_every_thread(&common::refuse_syscalls_program(
            &[libc::SYS_membarrier],
            libc::EPERM,
        ));
    }
    assert!(
        !kernel_offers_rseq_fences() && thiscpu::fence::fence_all().is_err(),
        "membarrier still allowed under the filter"
    );
    writers.extend((0..2).map(|_| writer(false)));
    let last = sharded.len() as u32 - 1;
    let (mut harvested, mut reads) = (0u64, 0u64);
    let first = sharded.fold(0, |sum, tally| sum + tally.updates);
    assert!(first >= 1, "the update made before the filter is gone");
    let deadline = Instant::now() + Duration::from_millis(500);
    while Instant::now() < deadline {
        for index in [0, last] {
            let mut guard = sharded.lock(index).expect("a shard in range");
            assert_eq!(guard.index(), index);
            if guard.held {
                OVERLAPS.fetch_add(1, Ordering::Relaxed);
            }
            harvested += std::mem::take(&mut guard.updates);
        }
        sharded.for_each(|_, tally| {
            if tally.held {
                OVERLAPS.fetch_add(1, Ordering::Relaxed);
            }
            harvested += std::mem::take(&mut tally.updates);
        });
        reads += 1;
    }
    stop.store(true, Ordering::Relaxed);
    // The writers' updates and this thread's first one.
    let performed: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum::<u64>() + 1;
    let sharded = Arc::into_inner(sharded).unwrap();
    let remaining: u64 = sharded.into_inner().iter().map(|t| t.updates).sum();
    eprintln!("performed {performed}, harvested {harvested}, remaining {remaining}, {reads} reads");
    assert_eq!(
        OVERLAPS.load(Ordering::Relaxed),
        0,
        "two holders met in a shard"
    );
    assert_eq!(
        harvested + remaining,
        performed,
        "updates lost or counted twice"
    );
    assert!(reads > 0 && harvested > 0);
}

/// A sandbox refuses `membarrier` (and `rseq`) on every thread after the shards began to be
/// taken by sections: reads fence by visiting the CPUs, threads without rseq take their shard
/// the same way, nothing hangs and nothing is lost. In a child process, by CPU and by
/// `mm_cid`.
// Its seccomp filter is written for the architectures with an rseq port (`thiscpu_rseq`).
#[cfg(thiscpu_rseq)]
#[test]
fn membarrier_refused_after_construction_neither_hangs_nor_loses_a_take() {
    const CHILD: &str = "THISCPU_SHARDED_SECCOMP_AFTER_START";
    const NAME: &str = "membarrier_refused_after_construction_neither_hangs_nor_loses_a_take";
    match std::env::var(CHILD).as_deref() {
        Ok("by-cpu") => refused_after_construction(Sharded::<Tally, ByCpu>::default()),
        Ok("by-mm-cid") => {
            refused_after_construction(Sharded::<Tally, thiscpu::ByMmCid>::by_mm_cid(|_| {
                Tally::default()
            }))
        }
        _ => {
            for spread in ["by-cpu", "by-mm-cid"] {
                let stderr = common::rerun_alone(NAME, &[(CHILD, spread)], Duration::from_secs(30));
                eprintln!("{spread}:\n{stderr}");
            }
        }
    }
}

#[cfg(thiscpu_inject)]
static HANDLER_REGISTRATION: AtomicI32 = AtomicI32::new(i32::MIN);

#[cfg(thiscpu_inject)]
extern "C" fn register_in_handler(_: libc::c_int) {
    let answer = match thiscpu::fence::register() {
        Ok(()) => thiscpu::fence::fence_all().map_or_else(|e| e.errno(), |()| 0),
        Err(refused) => refused.errno(),
    };
    HANDLER_REGISTRATION.store(answer, Ordering::SeqCst);
}

/// A signal handler that interrupts the fences' registration on its own thread and registers
/// (then fences) itself gets an answer instead of waiting for the registration it interrupted.
/// In a child process, where the registration has not happened yet.
#[cfg(thiscpu_inject)]
#[test]
fn the_fence_registration_answers_a_signal_handler_that_interrupts_it() {
    const INJECT: &str = "THISCPU_INJECT_SIGNAL_IN_FENCE_REGISTRATION";
    if std::env::var_os(INJECT).is_none() {
        common::rerun_alone(
            "the_fence_registration_answers_a_signal_handler_that_interrupts_it",
            &[(INJECT, &libc::SIGUSR1.to_string())],
            Duration::from_secs(30),
        );
        return;
    }
    // SAFETY: a zeroed sigaction is valid; the handler only registers, fences and stores.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = register_in_handler as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut action.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()),
            0
        );
    }
    let outer = thiscpu::fence::register();
    let inner = HANDLER_REGISTRATION.load(Ordering::SeqCst);
    eprintln!("outer {outer:?}, the handler's errno {inner}");
    assert_ne!(
        inner,
        i32::MIN,
        "the handler did not run inside the registration"
    );
    assert_eq!(outer.err().map_or(0, |e| e.errno()), inner);
    assert_eq!(thiscpu::fence::register(), outer);
}
