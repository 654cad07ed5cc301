//! Cross-CPU fences and the pool's drain: exact over millions of operations while another
//! thread keeps draining every CPU's cache; and the drain's fallback where membarrier is
//! refused (`THISCPU_MEMBARRIER=off`, run in a child process).

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

/// Stops the drainer when a worker's assertion fails, so that the failure ends the test.
struct StopIfPanicking<'a>(&'a AtomicBool);

impl Drop for StopIfPanicking<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

/// Workers take and return numbered objects for a few million operations while a drainer
/// thread drains every CPU's cache over and over; afterwards each object is in the pool once.
fn drain_while_working(total_ops: u64) -> (u64, u64, Option<DrainMethod>) {
    const OBJECTS: usize = 1 << 16;
    let ids = std::sync::Arc::new(AtomicU64::new(0));
    let pool = Pool::with_capacity(16, move || ids.fetch_add(1, Ordering::Relaxed) as usize);
    let held: Vec<AtomicU8> = (0..OBJECTS).map(|_| AtomicU8::new(0)).collect();
    let stop = AtomicBool::new(false);
    let workers = 2 * thiscpu::topology::online_cpus().len().max(1);
    let per_worker = total_ops / workers as u64;
    // Bounded in time as well as in operations: an emulated CPU (the aarch64 VM) is far slower.
    let deadline = Instant::now() + Duration::from_secs(5);
    let (drains, drained, method) = std::thread::scope(|s| {
        let drainer = s.spawn(|| {
            let (mut drains, mut drained, mut method) = (0u64, 0u64, None);
            // One full pass after the workers stopped, however late this thread got to run:
            // their last objects are in the caches then.
            loop {
                let last = stop.load(Ordering::Relaxed);
                for cpu in 0..thiscpu::topology::possible_cpus() as u32 {
                    if let Ok(done) = pool.drain_cpu(cpu) {
                        drains += 1;
                        drained += done.objects as u64;
                        method = Some(done.method);
                    }
                }
                if last {
                    break;
                }
                std::thread::yield_now();
            }
            (drains, drained, method)
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
        let drained = drainer.join().unwrap();
        // How many operations fit in the time depends on the machine (an emulated CPU without
        // rseq manages a few thousand a second), so the count is reported, not asserted.
        eprintln!("{done} of {total_ops} operations, {} drains", drained.0);
        drained
    });
    let created = pool.created() as usize;
    assert!(created < OBJECTS);
    pool.drain_all()
        .expect("drain every cache once the workers stopped");
    let mut seen = vec![false; created];
    let in_pool = pool.cached() + pool.shared_len();
    assert_eq!(in_pool, created, "objects lost or duplicated: {pool:?}");
    // Taken back by one thread pinned to one CPU: a thread that migrated would leave objects
    // refilled into the first CPU's cache behind, and rightly create new ones.
    std::thread::scope(|s| {
        s.spawn(|| {
            common::pin(thiscpu::current_cpu());
            for _ in 0..in_pool {
                let id = Pooled::into_inner(pool.get());
                assert!(
                    id < created,
                    "object {id} made anew while {in_pool} were pooled"
                );
                assert!(!seen[id], "object {id} twice in the pool");
                seen[id] = true;
            }
        });
    });
    assert_eq!(pool.created() as usize, created, "an object went missing");
    (drains, drained, method)
}

#[test]
fn concurrent_drains_lose_and_duplicate_nothing() {
    let (drains, drained, method) = drain_while_working(4_000_000);
    eprintln!("drains {drains}, objects drained {drained}, method {method:?}");
    if fence::available() || method.is_some() {
        assert!(drains > 0);
        assert!(drained > 0, "the drains never caught an object in a cache");
    }
}

/// Built with `--cfg thiscpu_inject`, a delay between the `stopped` check and the commit of
/// every push and pop keeps sections in flight while the drainer sets the flag: only the fence
/// stops them from committing into a cache the drainer already emptied. Without the cfg this
/// is one more exactness run.
#[test]
fn drains_racing_delayed_sections_lose_and_duplicate_nothing() {
    #[cfg(thiscpu_inject)]
    thiscpu::ops::inject::set_delay(3, 3_000);
    let (drains, drained, method) = drain_while_working(400_000);
    eprintln!("drains {drains}, objects drained {drained}, method {method:?}");
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
        let (drains, _, method) = drain_while_working(1_000_000);
        eprintln!("fallback drains {drains}, method {method:?}");
        let expected = if thiscpu::ops::position().is_some() {
            DrainMethod::Migrate
        } else {
            DrainMethod::Lock
        };
        assert_eq!(method, Some(expected));
        return;
    }
    let status = std::process::Command::new(std::env::current_exe().unwrap())
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
