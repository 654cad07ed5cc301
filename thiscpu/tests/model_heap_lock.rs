//! Model check of the own heap's lock (`src/allocator/heap_lock.rs`, compiled here with
//! loom's atomics and a model of the futex): every interleaving of threads that take it and
//! release it, with the nesting the heap uses (a class's lock, then the pages' lock inside it)
//! and a thread that takes every lock in order as the heap's fork handler does. The data each
//! lock guards is a loom cell, so a holder whose accesses are not ordered after the previous
//! holder's (a lock without acquire and release) fails the check, and a sleeper that no
//! release wakes leaves every thread blocked, which loom reports as a deadlock.
//!
//! Every state change of the heap's spans happens under these locks, in this order, so their
//! exclusion and progress are the heap's protocol; the changes themselves are checked by
//! tests/model_heap.rs, and what the spans hold by the allocator's stress tests
//! (tests/per_cpu_alloc.rs, tests/heap_memory.rs, the C stress).
//!
//! Run with `RUSTFLAGS="--cfg thiscpu_model" cargo test -p thiscpu --release --test
//! model_heap_lock`.
#![cfg(thiscpu_model)]

#[path = "common/heap_lock_word.rs"]
mod lock_word;

#[path = "../src/allocator/heap_lock.rs"]
#[allow(dead_code)]
mod heap_lock;

use heap_lock::Lock;
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::AtomicU32;

/// A lock and the count it guards.
struct Guarded {
    lock: Lock,
    count: UnsafeCell<u32>,
}

impl Guarded {
    fn new() -> Guarded {
        Guarded {
            lock: Lock::over(AtomicU32::new(0)),
            count: UnsafeCell::new(0),
        }
    }

    /// Adds one to the count under the lock, which the caller holds.
    fn add_held(&self) {
        // SAFETY: the caller holds the lock, which is the only way to the count.
        self.count.with_mut(|count| unsafe { *count += 1 });
    }

    fn add(&self) {
        self.lock.lock();
        self.add_held();
        self.lock.unlock();
    }

    fn count(&self) -> u32 {
        self.lock.lock();
        // SAFETY: under the lock.
        let count = self.count.with(|count| unsafe { *count });
        self.lock.unlock();
        count
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(f);
}

#[test]
fn three_takers_of_one_lock_each_add_once() {
    model(|| {
        let guarded = Arc::new(Guarded::new());
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let guarded = guarded.clone();
                loom::thread::spawn(move || guarded.add())
            })
            .collect();
        guarded.add();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(guarded.count(), 3);
    });
}

/// Two threads move batches as a miss and a spill do (a class's lock, then the pages' inside
/// it, each on its own class), while a third takes every lock in the heap's order and releases
/// them all, as the fork handlers do.
#[test]
fn nested_takers_and_a_fork_handler_all_get_through() {
    model(|| {
        let locks: Arc<[Guarded; 3]> = Arc::new([Guarded::new(), Guarded::new(), Guarded::new()]);
        let (first_class, second_class, pages) = (0, 1, 2);
        let batch = |class: usize| {
            let locks = locks.clone();
            loom::thread::spawn(move || {
                locks[class].lock.lock();
                locks[class].add_held();
                locks[pages].add();
                locks[class].lock.unlock();
            })
        };
        let threads = [batch(first_class), batch(second_class)];
        for guarded in locks.iter() {
            guarded.lock.lock();
        }
        for guarded in locks.iter() {
            guarded.add_held();
        }
        for guarded in locks.iter().rev() {
            guarded.lock.unlock();
        }
        for thread in threads {
            thread.join().unwrap();
        }
        let counts: Vec<u32> = locks.iter().map(Guarded::count).collect();
        assert_eq!(counts, [2, 2, 3]);
    });
}
