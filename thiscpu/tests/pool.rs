//! `Pool`: spills, refills, distinct objects, drops, drains and the capacity cap (every object
//! in exactly one place under migration, signals, churn and drains is
//! `stress/tests/pool_stress.rs`).
//!
//! Linux only: it compares with `/proc`, `/sys` and Linux's system calls (tests/common).
#![cfg(target_os = "linux")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use thiscpu::{Pool, Pooled};

/// Pins the calling thread to the CPU it runs on, and returns that CPU.
fn pin_to_current_cpu() -> u32 {
    let cpu = thiscpu::current_cpu();
    common::pin(cpu);
    cpu
}

#[test]
fn a_full_cache_spills_half_and_an_empty_one_refills() {
    std::thread::spawn(|| {
        let cpu = pin_to_current_cpu();
        let pool = Pool::with_capacity(4, || 0u32);
        for value in 0..10 {
            pool.put(value);
        }
        assert_eq!(pool.cached() + pool.shared_len(), 10);
        assert!(pool.cached_on(cpu) <= 4, "{pool:?}");
        assert!(pool.shared_len() >= 6, "{pool:?}");
        let mut values: Vec<u32> = (0..10).map(|_| Pooled::into_inner(pool.get())).collect();
        values.sort_unstable();
        assert_eq!(
            values,
            (0..10).collect::<Vec<_>>(),
            "each object exactly once"
        );
        assert_eq!(pool.created(), 0, "nothing made while objects were cached");
        assert_eq!(pool.cached() + pool.shared_len(), 0);
    })
    .join()
    .unwrap();
}

/// Pinned to one CPU: objects cached on another CPU are out of a thread's reach until drained,
/// so a thread that migrated between rounds would rightly create new ones.
#[test]
fn objects_held_at_once_are_distinct() {
    std::thread::spawn(|| {
        pin_to_current_cpu();
        let pool = Pool::with_capacity(8, || [0u8; 32]);
        for _ in 0..3 {
            let held: Vec<_> = (0..50).map(|_| pool.get()).collect();
            let mut addresses: Vec<usize> =
                held.iter().map(|o| &**o as *const _ as usize).collect();
            addresses.sort_unstable();
            addresses.dedup();
            assert_eq!(addresses.len(), 50);
        }
        assert_eq!(pool.created(), 50);
        assert_eq!(pool.cached() + pool.shared_len(), 50);
    })
    .join()
    .unwrap();
}

static DROPPED: AtomicUsize = AtomicUsize::new(0);

#[derive(Default)]
struct Counted(#[allow(dead_code)] u64);

impl Drop for Counted {
    fn drop(&mut self) {
        DROPPED.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn dropping_the_pool_drops_every_cached_and_shared_object() {
    let pool = Pool::<Counted>::with_capacity(4, Counted::default);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for round in 0..2_000 {
                    let held: Vec<_> = (0..1 + round % 7).map(|_| pool.get()).collect();
                    drop(held);
                }
            });
        }
    });
    let _ = pool.drain_all();
    let created = pool.created() as usize;
    assert_eq!(pool.cached() + pool.shared_len(), created);
    let before = DROPPED.load(Ordering::Relaxed);
    drop(pool);
    assert_eq!(DROPPED.load(Ordering::Relaxed) - before, created);
}

#[test]
fn drains_move_a_cpu_cache_to_the_shared_list() {
    std::thread::spawn(|| {
        let cpu = pin_to_current_cpu();
        let pool = Pool::with_capacity(16, || 0u8);
        for _ in 0..10 {
            pool.put(1);
        }
        let cached = pool.cached_on(cpu);
        assert_eq!(cached, 10);
        assert!(pool.touched().contains(cpu));
        match pool.drain_cpu(cpu) {
            Ok(drained) => {
                eprintln!("{drained:?}");
                assert_eq!(drained.objects, cached);
                assert_eq!(pool.cached_on(cpu), 0);
                assert_eq!(pool.shared_len(), 10);
                // The cache works again after the drain.
                drop(pool.get());
                assert_eq!(pool.cached() + pool.shared_len(), 10);
            }
            // Pinned to the CPU, the migrating fallback always reaches it.
            Err(why) => panic!("draining this thread's own CPU failed: {why}"),
        }
        assert!(matches!(
            pool.drain_cpu(u32::MAX),
            Err(thiscpu::pool::DrainError::NoSuchCpu(_))
        ));
    })
    .join()
    .unwrap();
}

#[test]
fn capacity_beyond_the_cap_is_refused_with_a_clear_message() {
    for per_cpu in [thiscpu::pool::MAX_CAPACITY + 1, usize::MAX / 2, usize::MAX] {
        let refused = std::panic::catch_unwind(|| Pool::with_capacity(per_cpu, || 0u8))
            .expect_err("a pool beyond the cap");
        let message = refused
            .downcast_ref::<String>()
            .expect("a formatted panic message");
        assert!(message.contains("at most"), "{message}");
    }
    let pool = Pool::with_capacity(1000, || 7u8);
    assert_eq!(pool.capacity(), 1000);
    assert_eq!(*pool.get(), 7);
}
