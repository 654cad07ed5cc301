//! `Sharded`: exact under migration, signals and thread churn (a count inside each shard against
//! the updates made); never two holders of one shard (a flag inside the shard, checked on
//! entry); readers that take every shard while writers run; a panic inside the closure; a
//! nested take; waiting without burning the CPU; the compare-and-swap mode where `membarrier`
//! is refused (`THISCPU_MEMBARRIER=off`, in a child process). `.ci/run` runs this file in
//! every environment and once built with `--cfg thiscpu_inject`.

mod common;

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};
use thiscpu::{ByCpu, Sharded, Spread};

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
            while !stop.load(Ordering::Relaxed) {
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
    eprintln!("{sharded:?}");
    let report = storm(sharded, Duration::from_millis(800));
    assert_exact(&report);
}

/// Built with `--cfg thiscpu_inject`, delay loops inside the sections (between the comparison
/// and the commit) make preemption, migration, signals and the readers' fences land there.
#[test]
fn aborted_takes_are_retried_exactly() {
    let _serial = common::serial();
    #[cfg(thiscpu_inject)]
    for point in 0..thiscpu::ops::inject::POINTS {
        thiscpu::ops::inject::set_delay(point, 20_000);
    }
    let before = thiscpu::ops::aborts();
    let sharded = Sharded::<Tally>::default();
    let rseq = sharded.uses_rseq();
    let report = storm(sharded, Duration::from_millis(800));
    #[cfg(thiscpu_inject)]
    for point in 0..thiscpu::ops::inject::POINTS {
        thiscpu::ops::inject::set_delay(point, 0);
    }
    assert_exact(&report);
    let aborts = thiscpu::ops::aborts() - before;
    eprintln!("aborts: {aborts}, rseq: {rseq}");
    if cfg!(thiscpu_inject) && rseq {
        assert!(aborts > 0, "fault injection on, yet no take aborted");
    }
}

#[test]
fn the_mode_follows_rseq_and_membarrier() {
    let sharded = Sharded::new(|_| 0u8);
    let expected =
        thiscpu::source().registrar != thiscpu::Registrar::None && thiscpu::fence::available();
    assert_eq!(sharded.uses_rseq(), expected, "{sharded:?}");
    if common::rseq_turned_off_by_env() {
        assert!(!sharded.uses_rseq());
    }
    assert_eq!(sharded.len(), common::sys_possible_cpus().len());
    let by_cid = Sharded::by_mm_cid(|_| 0u8);
    assert_eq!(
        by_cid.indexed_by_mm_cid(),
        by_cid.uses_rseq() && thiscpu::source().mm_cid,
        "{by_cid:?}"
    );
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

#[test]
fn a_nested_take_panics_instead_of_waiting_forever() {
    let sharded = Sharded::new(|_| 0u64);
    let nested = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut outer = sharded.lock_current();
        *outer += 1;
        // The same shard, wherever this thread runs now.
        let again = sharded.lock(outer.index());
        drop(again);
    }));
    let message = nested.expect_err("a nested take returned");
    let message = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(message.contains("already holds"), "{message}");
    assert_eq!(sharded.fold(0, |total, n| total + n), 1);
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
fn voluntary_switches() -> i64 {
    // SAFETY: `rusage` is plain integers, for which zero is a valid value.
    let mut usage: libc::rusage = unsafe { core::mem::zeroed() };
    // SAFETY: getrusage writes one rusage through a valid pointer.
    let ret = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    assert_eq!(ret, 0);
    usage.ru_nvcsw
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
    let status = std::process::Command::new(std::env::current_exe().unwrap())
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
