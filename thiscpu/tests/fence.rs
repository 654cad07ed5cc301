//! Cross-CPU fences and the pool's drain: exact over millions of operations while another
//! thread keeps draining every CPU's cache; and the drain's fallback where membarrier is
//! refused (`THISCPU_MEMBARRIER=off`, run in a child process).
//!
//! Linux only: it compares with `/proc`, `/sys` and Linux's system calls (tests/common).
#![cfg(target_os = "linux")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use thiscpu::pool::DrainMethod;
use thiscpu::{Pool, Pooled, fence};

#[test]
fn fences_reach_every_cpu_and_ignore_offline_ones() {
    match fence::register() {
        Ok(()) => {
            for cpu in thiscpu::topology::online_cpus() {
                fence::fence_cpu(cpu).unwrap();
            }
            fence::fence_cpu(100_000).expect("an impossible CPU needs no fence");
            fence::fence_all().unwrap();
        }
        Err(why) => {
            eprintln!("fences unavailable: {why}");
            assert!(fence::fence_cpu(0).is_err());
        }
    }
}

fn online_cpus() -> usize {
    thiscpu::topology::online_cpus().len().max(1)
}

/// Stops the drainer when a worker's assertion fails, so that the failure ends the test.
struct StopIfPanicking<'a>(&'a AtomicBool);

impl Drop for StopIfPanicking<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

/// What the drainer of `drain_while_working` did.
#[derive(Debug)]
struct DrainRun {
    /// Successful drains.
    drains: u64,
    /// Objects they moved to the shared list.
    drained: u64,
    /// How the last of them reached its CPU.
    method: Option<DrainMethod>,
    /// Sections the workers saw aborted while a drain was in progress: each was in flight
    /// during a drain (the fence of a drain aborts the sections on its CPU). An upper bound:
    /// a preemption during a drain counts too.
    aborts_during_drains: u64,
}

/// `workers` threads take and return numbered objects for a few million operations while a
/// drainer thread drains every CPU's cache over and over; afterwards each object is in the
/// pool once.
fn drain_while_working(workers: usize, total_ops: u64) -> DrainRun {
    const OBJECTS: usize = 1 << 16;
    let ids = std::sync::Arc::new(AtomicU64::new(0));
    let pool = Pool::with_capacity(16, move || ids.fetch_add(1, Ordering::Relaxed) as usize);
    let held: Vec<AtomicU8> = (0..OBJECTS).map(|_| AtomicU8::new(0)).collect();
    let stop = AtomicBool::new(false);
    let per_worker = total_ops / workers as u64;
    // Bounded in time as well as in operations: an emulated CPU (the aarch64 VM) is far slower.
    let deadline = Instant::now() + Duration::from_secs(5);
    let run = std::thread::scope(|s| {
        let drainer = s.spawn(|| {
            let mut run = DrainRun {
                drains: 0,
                drained: 0,
                method: None,
                aborts_during_drains: 0,
            };
            // One full pass after the workers stopped, however late this thread got to run:
            // their last objects are in the caches then.
            loop {
                let last = stop.load(Ordering::Relaxed);
                for cpu in 0..thiscpu::topology::possible_cpus() as u32 {
                    let aborts = thiscpu::ops::aborts();
                    if let Ok(done) = pool.drain_cpu(cpu) {
                        run.aborts_during_drains += thiscpu::ops::aborts() - aborts;
                        run.drains += 1;
                        run.drained += done.objects as u64;
                        run.method = Some(done.method);
                    }
                }
                if last {
                    break;
                }
                std::thread::yield_now();
            }
            run
        });
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (pool, held) = (&pool, &held);
                let stop = &stop;
                s.spawn(move || {
                    let _stop_the_drainer_on_failure = StopIfPanicking(stop);
                    let mut done = 0;
                    // At least one batch, however late the thread got to run.
                    loop {
                        for _ in 0..256 {
                            let a = pool.get();
                            let b = pool.get();
                            for object in [&a, &b] {
                                assert_eq!(
                                    held[**object].swap(1, Ordering::Relaxed),
                                    0,
                                    "object {} handed out twice",
                                    **object
                                );
                            }
                            for object in [&a, &b] {
                                held[**object].store(0, Ordering::Relaxed);
                            }
                            if w % 2 == 0 {
                                drop(a);
                                drop(b);
                            } else {
                                drop(b);
                                drop(a);
                            }
                        }
                        done += 512;
                        if done >= per_worker || Instant::now() >= deadline {
                            return done;
                        }
                    }
                })
            })
            .collect();
        let done: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        stop.store(true, Ordering::Relaxed);
        let run = drainer.join().unwrap();
        // How many operations fit in the time depends on the machine (an emulated CPU without
        // rseq manages a few thousand a second), so the count is reported, not asserted.
        eprintln!("{done} of {total_ops} operations, {} drains", run.drains);
        run
    });
    let created = pool.created() as usize;
    assert!(created < OBJECTS);
    pool.drain_all()
        .expect("drain every cache once the workers stopped");
    assert_eq!(
        pool.cached(),
        0,
        "a cache kept objects after drain_all: {pool:?}"
    );
    let mut seen = vec![false; created];
    let in_pool = pool.shared_len();
    assert_eq!(in_pool, created, "objects lost or duplicated: {pool:?}");
    // Taken back by one thread pinned to one CPU: a thread that migrated would leave objects
    // refilled into the first CPU's cache behind, and rightly create new ones. A `get` makes
    // a new object while objects are pooled in one case only: its sections aborted
    // `ops::ABORT_LIMIT` times in a row, so it could not pop this CPU's cache (counted by
    // `ops::abort_fallbacks`). Such an object is set aside, and the pooled ones still found.
    let gave_up_before = thiscpu::ops::abort_fallbacks();
    let mut made_anew = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            common::pin(thiscpu::current_cpu());
            let mut found = 0;
            while found < in_pool {
                let id = Pooled::into_inner(pool.get());
                if id >= created {
                    let gave_up = thiscpu::ops::abort_fallbacks() - gave_up_before;
                    assert!(
                        gave_up > 0,
                        "object {id} made anew while {} were pooled, and no call gave up on \
                         its sections",
                        in_pool - found
                    );
                    made_anew += 1;
                    assert!(
                        made_anew <= in_pool,
                        "{made_anew} objects made anew: {pool:?}"
                    );
                    continue;
                }
                assert!(!seen[id], "object {id} twice in the pool");
                seen[id] = true;
                found += 1;
            }
        });
    });
    if made_anew > 0 {
        eprintln!(
            "{made_anew} objects made anew after {} calls gave up on their sections",
            thiscpu::ops::abort_fallbacks() - gave_up_before
        );
    }
    assert_eq!(
        pool.created() as usize,
        created + made_anew,
        "an object went missing"
    );
    run
}

/// One run of `drain_while_working` at a time in this process: the delays that
/// `drains_racing_delayed_sections_lose_and_duplicate_nothing` sets apply to every section of
/// the process, and its drainer's fences abort every section in flight, so beside it another
/// run's sections would abort far more often than they ever do outside this test.
static ONE_DRAIN_RUN_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_drain_run_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_DRAIN_RUN_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn concurrent_drains_lose_and_duplicate_nothing() {
    let _alone = one_drain_run_at_a_time();
    let run = drain_while_working(2 * online_cpus(), 4_000_000);
    eprintln!("{run:?}");
    if fence::available() || run.method.is_some() {
        assert!(run.drains > 0);
        assert!(
            run.drained > 0,
            "the drains never caught an object in a cache"
        );
    }
}

/// Built with `--cfg thiscpu_inject` only: a delay between the `stopped` check and the commit
/// of every push and pop keeps sections in flight while the drainer sets the flag: only the
/// fence stops them from committing into a cache the drainer already emptied. Sections
/// aborted while a drain ran are the witness that sections and drains did race.
#[cfg(thiscpu_inject)]
#[test]
fn drains_racing_delayed_sections_lose_and_duplicate_nothing() {
    if thiscpu::ops::position().is_none() {
        // Only where the environment says so (`THISCPU_EXPECT_REGISTRAR=none`): anywhere else
        // this would pass with no section run at all.
        assert_eq!(
            common::expected_registrar_from_env().as_deref(),
            Some("none"),
            "no rseq here, so no section to race a drain"
        );
        eprintln!("rseq not in use here: no section to race a drain");
        return;
    }
    // Long delays, so that a worker spends most of its time between the check and the commit,
    // and one CPU fewer workers than CPUs, so that the drainer runs while they are there.
    let _alone = one_drain_run_at_a_time();
    struct NoDelayAfter;
    impl Drop for NoDelayAfter {
        fn drop(&mut self) {
            thiscpu::ops::inject::set_delay(3, 0);
        }
    }
    let _no_delay_after = NoDelayAfter;
    thiscpu::ops::inject::set_delay(3, 200_000);
    let run = drain_while_working((online_cpus() - 1).max(1), 400_000);
    eprintln!("{run:?}");
    assert!(run.drains > 0, "no drain succeeded: {run:?}");
    assert!(
        run.aborts_during_drains > 0,
        "no section was aborted while a drain ran: nothing raced the drains: {run:?}"
    );
}

/// The fallback, in a child process where membarrier is turned off: drains migrate the drainer
/// to the CPU (or use the locks when rseq is off) and stay exact.
#[test]
fn drains_fall_back_when_membarrier_is_refused() {
    const CHILD: &str = "THISCPU_TEST_FENCE_FALLBACK_CHILD";
    if std::env::var_os(CHILD).is_some() {
        assert_eq!(
            fence::register().map_err(|why| why.errno()),
            Err(libc::EPERM)
        );
        let run = drain_while_working(2 * online_cpus(), 1_000_000);
        eprintln!("fallback {run:?}");
        let expected = if thiscpu::ops::position().is_some() {
            DrainMethod::Migrate
        } else {
            DrainMethod::Lock
        };
        assert_eq!(run.method, Some(expected));
        return;
    }
    let status = common::this_executable()
        .args([
            "--exact",
            "drains_fall_back_when_membarrier_is_refused",
            "--nocapture",
        ])
        .env("THISCPU_MEMBARRIER", "off")
        .env(CHILD, "1")
        .status()
        .expect("run the test binary again");
    assert!(status.success(), "the fallback run failed: {status}");
}
