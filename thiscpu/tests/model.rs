//! Model checks of the concurrent protocols, over their interleavings, with loom: `Sharded`'s
//! shard taking (restartable sections, fenced take-overs, releases) and the pool's draining
//! of a CPU's cache while a thread on that CPU pops and pushes.
//!
//! The real code runs on the model machine of `thiscpu::model` (see its documentation): each
//! section can be preempted, migrated away from or fenced, and so aborted, at every step
//! before its commit, and loom runs the other threads between any two steps.
//!
//! Built only with the model's configuration:
//! `RUSTFLAGS="--cfg thiscpu_model" CARGO_TARGET_DIR=target/model cargo test -p thiscpu
//! --release --test model -- --nocapture`. `LOOM_MAX_PREEMPTIONS` bounds the search
//! (default here: 3); each test prints how many interleavings loom explored.

#![cfg(thiscpu_model)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use thiscpu::model::{self, explore};
use thiscpu::pool::DrainMethod;
use thiscpu::{Pool, Pooled, Sharded};

/// Runs `body` in every interleaving loom explores (two model CPUs), then prints how many.
/// A shard's value: loom reports two accesses that are not ordered one after the other (two
/// holders at once, or a holder that does not see its predecessor's update).
type Cell = UnsafeCell<u64>;

fn add_one(cell: &Cell) {
    cell.with_mut(|value| {
        // SAFETY: the caller holds the shard, which is what the model checks.
        unsafe { *value += 1 }
    });
}

fn value(cell: &Cell) -> u64 {
    // SAFETY: every other thread was joined.
    cell.with(|value| unsafe { *value })
}

fn sharded() -> Arc<Sharded<Cell>> {
    let shards = Arc::new(Sharded::new(|_| UnsafeCell::new(0)));
    assert!(
        shards.uses_rseq(),
        "the model registers every thread and fences"
    );
    assert_eq!(shards.len(), 2);
    shards
}

fn on_cpu_0(shards: &Arc<Sharded<Cell>>) -> thread::JoinHandle<()> {
    let shards = shards.clone();
    thread::spawn(move || {
        model::run_on(0);
        shards.with_current(|cell| add_one(cell));
    })
}

// Each test has one thread that may wait for a shard at a time: loom also explores schedules
// in which two waiters that yield take turns for ever and the holder never runs again.

/// Two threads take CPU 0's shard with sections: one holder at a time, no update lost, both
/// takes end.
#[test]
fn two_sections_on_one_cpu_take_turns() {
    explore("two sections on one CPU", || {
        let shards = sharded();
        let (first, second) = (on_cpu_0(&shards), on_cpu_0(&shards));
        first.join().unwrap();
        second.join().unwrap();
        assert_eq!(value(&shards.lock(0).unwrap()), 2);
        assert_eq!(value(&shards.lock(1).unwrap()), 0);
    });
}

/// A thread takes CPU 0's shard with a section while a thread on CPU 1 takes it over with a
/// fence: one holder at a time, no update lost, both takes end.
#[test]
fn a_section_and_a_take_over_never_hold_one_shard_together() {
    explore("a section and a take-over", || {
        let shards = sharded();
        let section = on_cpu_0(&shards);
        let reader = {
            let shards = shards.clone();
            thread::spawn(move || {
                model::run_on(1);
                add_one(&shards.lock(0).expect("shard 0 exists"));
            })
        };
        section.join().unwrap();
        reader.join().unwrap();
        assert_eq!(value(&shards.lock(0).unwrap()), 2);
    });
}

/// A holder takes CPU 0's shard, moves to CPU 1 and releases it there, while another thread on
/// CPU 0 takes the same shard with a section: the section's take must see the update made
/// under the released guard.
#[test]
fn a_holder_that_migrates_releases_to_the_next_section() {
    explore("a holder that migrates", || {
        let shards = sharded();
        let mover = {
            let shards = shards.clone();
            thread::spawn(move || {
                model::run_on(0);
                let guard = shards.lock_current();
                assert_eq!(guard.index(), 0);
                add_one(&guard);
                model::run_on(1);
                drop(guard);
            })
        };
        let stayer = {
            let shards = shards.clone();
            thread::spawn(move || {
                model::run_on(0);
                shards.with_current(|cell| add_one(cell));
            })
        };
        mover.join().unwrap();
        stayer.join().unwrap();
        assert_eq!(value(&shards.lock(0).unwrap()), 2);
    });
}

/// A pool whose objects are numbered as they are made.
fn numbered_pool() -> Arc<Pool<u64>> {
    let next = AtomicU64::new(0);
    Arc::new(Pool::with_capacity(2, move || {
        next.fetch_add(1, Ordering::Relaxed)
    }))
}

/// Takes every object out of the pool (every thread joined) and checks that it holds each
/// object it made exactly once: none lost (a `get` would make a new one), none twice (two
/// boxes of one address). On a failure the objects are leaked, so that a duplicate is not
/// freed twice.
fn census(pool: &Pool<u64>) {
    let made = pool.created();
    let objects: Vec<*mut u64> = (0..made)
        .map(|_| Box::into_raw(Pooled::into_box(pool.get())))
        .collect();
    let distinct: HashSet<_> = objects.iter().collect();
    let left = pool.cached() + pool.shared_len();
    if distinct.len() != objects.len() || pool.created() != made || left != 0 {
        panic!(
            "the pool made {made} objects, gave back {} of {} distinct addresses, made {} more \
             to do it, and holds {left} besides",
            objects.len(),
            distinct.len(),
            pool.created() - made,
        );
    }
    for object in objects {
        // SAFETY: each came from `Box::into_raw` above, once (checked).
        drop(unsafe { Box::from_raw(object) });
    }
}

/// A thread on CPU 0 pops and pushes its cache while a thread on CPU 1 drains that cache:
/// no object lost or duplicated.
#[test]
fn a_drain_and_a_section_never_lose_or_duplicate_an_object() {
    explore("a drain while CPU 0 pops and pushes", || {
        let pool = numbered_pool();
        model::run_on(0);
        let (a, b) = (pool.get(), pool.get());
        drop((a, b));
        assert_eq!(pool.cached_on(0), 2);
        let user = {
            let pool = pool.clone();
            thread::spawn(move || {
                model::run_on(0);
                let object = pool.get();
                drop(object);
            })
        };
        let drainer = {
            let pool = pool.clone();
            thread::spawn(move || {
                model::run_on(1);
                let drained = pool.drain_cpu(0).expect("the model fences");
                assert_eq!(drained.method, DrainMethod::Fence);
            })
        };
        user.join().unwrap();
        drainer.join().unwrap();
        census(&pool);
    });
}

/// A thread on CPU 0 empties its cache, makes an object, and fills the cache until it spills
/// to the shared list, while a thread on CPU 1 drains that cache: no object lost or
/// duplicated.
#[test]
fn a_drain_while_a_cache_refills_and_spills_never_loses_or_duplicates_an_object() {
    explore("a drain while CPU 0 refills and spills", || {
        let pool = numbered_pool();
        model::run_on(0);
        let (a, b) = (pool.get(), pool.get());
        drop((a, b));
        let user = {
            let pool = pool.clone();
            thread::spawn(move || {
                model::run_on(0);
                let objects = [pool.get(), pool.get(), pool.get()];
                drop(objects);
            })
        };
        let drainer = {
            let pool = pool.clone();
            thread::spawn(move || {
                model::run_on(1);
                pool.drain_cpu(0).expect("the model fences");
            })
        };
        user.join().unwrap();
        drainer.join().unwrap();
        census(&pool);
    });
}
