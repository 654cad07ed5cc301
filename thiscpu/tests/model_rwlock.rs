//! Model checks of the reader counts under `RwLock` and `EpochCell`, over their interleavings,
//! with loom: the real code runs on the model machine of `thiscpu::model`, where each reader's
//! count is a section that commits or is aborted at every step before its commit, the
//! writer's `membarrier` ends the sections in flight, and a thread asleep on the futex stays
//! asleep until woken (a forgotten wake-up fails as a deadlock).
//!
//! Built only with the model's configuration:
//! `RUSTFLAGS="--cfg thiscpu_model" CARGO_TARGET_DIR=target/model cargo test -p thiscpu
//! --release --test model_rwlock -- --nocapture`. `LOOM_MAX_PREEMPTIONS` bounds the search
//! (default here: 3).

#![cfg(thiscpu_model)]

use loom::cell::UnsafeCell;
use loom::thread;
// `std`'s: loom's, dropped while loom's report of a deadlock (a forgotten wake-up) unwinds,
// panics again and aborts the test executable.
use std::sync::Arc;
use thiscpu::model::{self, explore};
use thiscpu::{EpochCell, RwLock, RwLockUpgradableReadGuard, RwLockWriteGuard};

/// Two words a writer sets one after the other: loom reports a reader's access that is not
/// ordered with a writer's (a reader inside while the writer writes), and the reader checks
/// that both words agree.
struct Pair {
    words: UnsafeCell<[u64; 2]>,
}

// SAFETY: the lock under test is what orders the accesses; loom checks that it does.
unsafe impl Sync for Pair {}

impl Pair {
    fn read(&self) -> [u64; 2] {
        // SAFETY: the caller holds a read lock, which the model checks.
        self.words.with(|words| unsafe { *words })
    }

    fn write(&self, value: u64) {
        self.words.with_mut(|words| {
            // SAFETY: the caller holds the write lock, which the model checks.
            unsafe {
                (*words)[0] = value;
                (*words)[1] = value;
            }
        });
    }
}

/// How a lock's readers count themselves and its writers fence.
#[derive(Clone, Copy)]
enum Mode {
    /// Sections and `membarrier`, which the model machine always has.
    Sections,
    /// `SeqCst` atomic adds and `SeqCst` fences, as without rseq or `membarrier`.
    Atomic,
    /// Sections, with `membarrier` refused once the lock is made (a seccomp filter installed
    /// later): writers fence by visiting every CPU.
    Visiting,
}

fn new_lock() -> Arc<RwLock<Pair>> {
    new_lock_in(Mode::Sections)
}

fn new_lock_in(mode: Mode) -> Arc<RwLock<Pair>> {
    let pair = Pair {
        words: UnsafeCell::new([0, 0]),
    };
    let lock = Arc::new(match mode {
        Mode::Sections | Mode::Visiting => RwLock::new(pair),
        Mode::Atomic => RwLock::new_in_atomic_mode(pair),
    });
    match mode {
        Mode::Sections | Mode::Visiting => assert!(
            lock.uses_rseq(),
            "the model registers every thread and fences"
        ),
        Mode::Atomic => assert!(!lock.uses_rseq()),
    }
    if let Mode::Visiting = mode {
        model::refuse_membarrier();
    }
    lock
}

/// A reader on CPU 0 and a writer on CPU 1: the reader sees the value before or after the
/// write, whole, and never at the same time as the writer writes.
#[test]
fn a_reader_and_a_writer_never_overlap() {
    a_reader_and_a_writer("a reader and a writer", Mode::Sections);
}

/// The same in the atomic mode: the reader's `SeqCst` add and the writer's `SeqCst` fence
/// stand for the sections and `membarrier`.
#[test]
fn a_reader_and_a_writer_never_overlap_in_the_atomic_mode() {
    a_reader_and_a_writer("a reader and a writer, atomic mode", Mode::Atomic);
}

/// The same with `membarrier` refused after the lock was made: the writer's visits to each
/// CPU stand for its fences.
#[test]
fn a_reader_and_a_writer_never_overlap_when_the_writer_visits() {
    a_reader_and_a_writer("a reader and a writer, visiting", Mode::Visiting);
}

fn a_reader_and_a_writer(name: &str, mode: Mode) {
    explore(name, move || {
        let lock = new_lock_in(mode);
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                if let Some(guard) = lock.try_read() {
                    let [a, b] = guard.read();
                    assert_eq!(a, b, "a half-written value");
                }
            })
        };
        model::run_on(1);
        lock.write().write(1);
        reader.join().unwrap();
        assert_eq!(lock.read().read(), [1, 1]);
    });
}

/// A reader that enters on CPU 0 and leaves on CPU 1 while a writer on CPU 1 takes the lock:
/// the writer must count the reader until it has left, even though its exit lands on another
/// CPU's word than its entry.
#[test]
fn a_reader_that_migrates_is_waited_for() {
    explore("a reader that migrates", || {
        let lock = new_lock();
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                if let Some(guard) = lock.try_read() {
                    model::run_on(1);
                    let [a, b] = guard.read();
                    assert_eq!(a, b, "a half-written value");
                }
            })
        };
        model::run_on(1);
        if let Some(guard) = lock.try_write() {
            guard.write(1);
        }
        reader.join().unwrap();
    });
}

/// A blocking reader and a blocking writer: both finish, and the reader sees the value whole.
#[test]
fn a_blocked_reader_and_a_waiting_writer_both_finish() {
    a_blocked_reader_and_a_waiting_writer("a blocked reader and a waiting writer", Mode::Sections);
}

/// The same in the atomic mode.
#[test]
fn a_blocked_reader_and_a_waiting_writer_both_finish_in_the_atomic_mode() {
    a_blocked_reader_and_a_waiting_writer(
        "a blocked reader and a waiting writer, atomic mode",
        Mode::Atomic,
    );
}

/// The same with `membarrier` refused after the lock was made.
#[test]
fn a_blocked_reader_and_a_waiting_writer_both_finish_when_the_writer_visits() {
    a_blocked_reader_and_a_waiting_writer(
        "a blocked reader and a waiting writer, visiting",
        Mode::Visiting,
    );
}

fn a_blocked_reader_and_a_waiting_writer(name: &str, mode: Mode) {
    explore(name, move || {
        let lock = new_lock_in(mode);
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                let [a, b] = lock.read().read();
                assert_eq!(a, b, "a half-written value");
            })
        };
        model::run_on(1);
        lock.write().write(1);
        reader.join().unwrap();
    });
}

/// A value that records its drop in its cell: loom reports a reader's access that is not
/// ordered before the drop (a value dropped under a pinned reader).
struct Tracked {
    value: UnsafeCell<u64>,
}

// SAFETY: as for `Pair`: the cell under test orders the accesses.
unsafe impl Sync for Tracked {}
// SAFETY: as above.
unsafe impl Send for Tracked {}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.value.with_mut(|value| {
            // SAFETY: the value is being dropped, which the model checks no reader overlaps.
            unsafe { *value = u64::MAX };
        });
    }
}

/// A reader pins on CPU 0 (and leaves on CPU 1 or stays) while a writer swaps the value and
/// drops the old one: the reader never reads a dropped value.
#[test]
fn an_epoch_reader_never_sees_its_value_dropped() {
    explore("an epoch reader and a swap", || {
        let cell = Arc::new(EpochCell::new(Tracked {
            value: UnsafeCell::new(1),
        }));
        let reader = {
            let cell = cell.clone();
            thread::spawn(move || {
                model::run_on(0);
                let guard = cell.load();
                model::run_on(1);
                // SAFETY: the reader is pinned, which the model checks.
                let value = guard.value.with(|value| unsafe { *value });
                assert_ne!(value, u64::MAX, "a dropped value");
            })
        };
        model::run_on(1);
        cell.store(Tracked {
            value: UnsafeCell::new(2),
        });
        reader.join().unwrap();
    });
}

/// Two readers, one of which enters on CPU 1 and leaves on CPU 0, and a writer: the exits the
/// writer counts must never stand for the entry of a reader that holds on.
#[test]
fn two_readers_one_migrating_and_a_writer() {
    two_readers_and_a_writer("two readers, one migrating, and a writer", Mode::Sections);
}

/// The same in the atomic mode, whose adds also go to the word of the reader's CPU.
#[test]
fn two_readers_one_migrating_and_a_writer_in_the_atomic_mode() {
    two_readers_and_a_writer(
        "two readers, one migrating, and a writer, atomic mode",
        Mode::Atomic,
    );
}

/// The same with `membarrier` refused after the lock was made: the visits must end the
/// sections in flight on each CPU, and order each CPU's counts before the writer's sums.
#[test]
fn two_readers_one_migrating_and_a_writer_that_visits() {
    two_readers_and_a_writer(
        "two readers, one migrating, and a writer, visiting",
        Mode::Visiting,
    );
}

fn two_readers_and_a_writer(name: &str, mode: Mode) {
    explore(name, move || {
        let lock = new_lock_in(mode);
        let readers: Vec<_> = [(1, Some(0)), (0, None)]
            .into_iter()
            .map(|(enter, leave)| {
                let lock = lock.clone();
                thread::spawn(move || {
                    model::run_on(enter);
                    if let Some(guard) = lock.try_read() {
                        if let Some(cpu) = leave {
                            model::run_on(cpu);
                        }
                        let [a, b] = guard.read();
                        assert_eq!(a, b, "a half-written value");
                    }
                })
            })
            .collect();
        model::run_on(1);
        if let Some(guard) = lock.try_write() {
            guard.write(1);
        }
        for reader in readers {
            reader.join().unwrap();
        }
    });
}

/// A reader that loads the phase, then pins late, across two swaps: the second writer must
/// wait for it in whichever phase it counted itself.
#[test]
fn an_epoch_reader_across_two_swaps() {
    explore("an epoch reader across two swaps", || {
        let cell = Arc::new(EpochCell::new(Tracked {
            value: UnsafeCell::new(1),
        }));
        let reader = {
            let cell = cell.clone();
            thread::spawn(move || {
                model::run_on(0);
                let guard = cell.load();
                // SAFETY: the reader is pinned, which the model checks.
                let value = guard.value.with(|value| unsafe { *value });
                assert_ne!(value, u64::MAX, "a dropped value");
            })
        };
        model::run_on(1);
        for value in [2, 3] {
            cell.store(Tracked {
                value: UnsafeCell::new(value),
            });
        }
        reader.join().unwrap();
    });
}

/// A writer that stores while it holds a guard of the cell itself, and a reader on the other
/// CPU: the store does not wait, no value is dropped under either reader, and once both have
/// left one `reclaim` lets go of every replaced value.
#[test]
fn an_epoch_store_under_its_own_guard_and_a_reader() {
    explore("an epoch store under its own guard", || {
        let cell = Arc::new(EpochCell::new(Tracked {
            value: UnsafeCell::new(1),
        }));
        let reader = {
            let cell = cell.clone();
            thread::spawn(move || {
                model::run_on(0);
                let guard = cell.load();
                // SAFETY: the reader is pinned, which the model checks.
                let value = guard.value.with(|value| unsafe { *value });
                assert_ne!(value, u64::MAX, "a dropped value");
            })
        };
        model::run_on(1);
        let own = cell.load();
        cell.store(Tracked {
            value: UnsafeCell::new(2),
        });
        // SAFETY: this writer's own guard is pinned, which the model checks.
        let value = own.value.with(|value| unsafe { *value });
        assert_eq!(value, 1, "the writer's own value changed under it");
        drop(own);
        reader.join().unwrap();
        assert_eq!(
            cell.reclaim(),
            0,
            "a replaced value kept after its readers left"
        );
    });
}

/// A writer holds the lock while a reader on the other CPU blocks: the reader goes to sleep on
/// the futex, and the writer's release must wake it (loom reports a reader left asleep as a
/// deadlock). The reader then sees the writer's value whole.
#[test]
fn a_reader_asleep_behind_a_writer_is_woken() {
    explore("a reader asleep behind a writer", || {
        let lock = new_lock();
        model::run_on(1);
        let guard = lock.write();
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                let [a, b] = lock.read().read();
                assert_eq!(a, b, "a half-written value");
            })
        };
        guard.write(1);
        drop(guard);
        reader.join().unwrap();
    });
}

/// Two writers on two CPUs and a reader: the writers never hold the lock together nor with the
/// reader (loom reports overlapping accesses to the value), a writer asleep behind the other is
/// woken, and both writes land. The reader only tries: a blocking one takes the count of
/// interleavings from about 60 000 to 400 000 (the blocking reader has checks of its own).
#[test]
fn two_writers_and_a_reader() {
    two_writers_and_a_reader_in("two writers and a reader", Mode::Sections);
}

/// The same in the atomic mode.
#[test]
fn two_writers_and_a_reader_in_the_atomic_mode() {
    two_writers_and_a_reader_in("two writers and a reader, atomic mode", Mode::Atomic);
}

/// The same with `membarrier` refused after the lock was made.
#[test]
fn two_writers_that_visit_and_a_reader() {
    two_writers_and_a_reader_in("two writers and a reader, visiting", Mode::Visiting);
}

fn two_writers_and_a_reader_in(name: &str, mode: Mode) {
    explore(name, move || {
        let lock = new_lock_in(mode);
        let writer = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                let guard = lock.write();
                let [a, _] = guard.read();
                guard.write(a + 1);
            })
        };
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                if let Some(guard) = lock.try_read() {
                    let [a, b] = guard.read();
                    assert_eq!(a, b, "a half-written value");
                }
            })
        };
        model::run_on(1);
        {
            let guard = lock.write();
            let [a, _] = guard.read();
            guard.write(a + 1);
        }
        writer.join().unwrap();
        reader.join().unwrap();
        assert_eq!(lock.read().read(), [2, 2], "a write lost");
    });
}

/// A reader holds the lock on CPU 0 while a `try_write` on CPU 1 sets the flag, finds the
/// reader inside and gives up, and a second reader on CPU 1 blocks behind that flag: the
/// failed `try_write` must wake the second reader when it clears the flag.
#[test]
fn a_failed_try_write_wakes_the_readers_it_stopped() {
    explore("a failed try_write and a reader asleep behind it", || {
        let lock = new_lock();
        // Not dropped while loom's report of a deadlock unwinds: its exit would be a loom step
        // with no thread to run it, a second panic that aborts the test executable.
        let holder = core::mem::ManuallyDrop::new(lock.read());
        let writer = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(1);
                assert!(lock.try_write().is_none(), "a writer with a reader inside");
            })
        };
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(1);
                let [a, b] = lock.read().read();
                assert_eq!(a, b, "a half-written value");
            })
        };
        writer.join().unwrap();
        reader.join().unwrap();
        drop(core::mem::ManuallyDrop::into_inner(holder));
    });
}

/// A writer on CPU 1 downgrades its lock while a second writer on CPU 0 races for it: the
/// second writer must not get in between (loom reports its write overlapping the downgraded
/// reader's read), the downgraded reader sees its own write, and both writers finish (the
/// downgraded reader's exit wakes the second writer if it waits).
#[test]
fn a_downgrade_lets_no_writer_in_between() {
    explore("a downgrade and a racing writer", || {
        let lock = new_lock();
        let writer = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                lock.write().write(2);
            })
        };
        model::run_on(1);
        let guard = lock.write();
        guard.write(1);
        let guard = RwLockWriteGuard::downgrade(guard);
        assert_eq!(guard.read(), [1, 1], "a writer got in between");
        drop(guard);
        writer.join().unwrap();
        let [a, b] = lock.read().read();
        assert_eq!(a, b, "a half-written value");
    });
}

/// A reader holds the lock while an upgradable reader tries to upgrade, finds the reader inside
/// and gives up, and a second reader on CPU 1 blocks behind the flag the attempt set: the
/// failed `try_upgrade` must wake it when it flips back to an upgradable read, while the
/// upgradable guard is still held (its release would wake the sleeper too, and hide the bug).
#[test]
fn a_failed_try_upgrade_wakes_the_readers_it_stopped() {
    explore("a failed try_upgrade and a reader asleep behind it", || {
        let lock = new_lock();
        // Neither guard is dropped while loom's report of a deadlock unwinds (see the failed
        // `try_write`).
        let holder = core::mem::ManuallyDrop::new(lock.read());
        model::run_on(0);
        let upgradable = lock.upgradable_read();
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(1);
                let [a, b] = lock.read().read();
                assert_eq!(a, b, "a half-written value");
            })
        };
        let Err(upgradable) = RwLockUpgradableReadGuard::try_upgrade(upgradable) else {
            panic!("an upgrade with a reader inside");
        };
        let upgradable = core::mem::ManuallyDrop::new(upgradable);
        reader.join().unwrap();
        drop(core::mem::ManuallyDrop::into_inner(upgradable));
        drop(core::mem::ManuallyDrop::into_inner(holder));
    });
}

/// An upgradable reader on CPU 0 reads, upgrades and writes what it read plus one, while a
/// writer on CPU 1 does the same with a write lock: the writer never gets in between the
/// upgradable read and its upgrade (loom reports overlapping accesses; a lost update fails the
/// final check), and whichever waits for the other is woken.
#[test]
fn an_upgrader_racing_a_writer_loses_no_update() {
    explore("an upgrader racing a writer", || {
        let lock = new_lock();
        let upgrader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                let upgradable = lock.upgradable_read();
                let [a, _] = upgradable.read();
                RwLockUpgradableReadGuard::upgrade(upgradable).write(a + 1);
            })
        };
        model::run_on(1);
        {
            let guard = lock.write();
            let [a, _] = guard.read();
            guard.write(a + 1);
        }
        upgrader.join().unwrap();
        assert_eq!(lock.read().read(), [2, 2], "an update lost");
    });
}

/// A reader on CPU 0 holds the lock (it may migrate to CPU 1 before it leaves) while an
/// upgradable reader on CPU 1 upgrades: the upgrade must wait for the reader to leave (loom
/// reports the write overlapping its read) and be woken by its exit.
#[test]
fn an_upgrade_while_a_reader_holds_waits_for_it() {
    explore("an upgrade while a reader holds", || {
        let lock = new_lock();
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(0);
                let guard = lock.read();
                model::run_on(1);
                let [a, b] = guard.read();
                assert_eq!(a, b, "a half-written value");
            })
        };
        model::run_on(1);
        let upgradable = lock.upgradable_read();
        RwLockUpgradableReadGuard::upgrade(upgradable).write(1);
        reader.join().unwrap();
    });
}

/// A reader holds the lock while a timed write on CPU 1 sets the flag and times out waiting for
/// it (the model machine has no clock: a zero timeout), and a second reader on CPU 1 blocks
/// behind that flag: the timed-out write must release the flag and wake the second reader.
#[test]
fn a_timed_out_write_wakes_the_readers_it_stopped() {
    explore("a timed-out write and a reader asleep behind it", || {
        let lock = new_lock();
        // Not dropped while loom's report of a deadlock unwinds (see the failed `try_write`).
        let holder = core::mem::ManuallyDrop::new(lock.read());
        let writer = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(1);
                let writing = lock.try_write_for(std::time::Duration::ZERO);
                assert!(writing.is_none(), "a writer with a reader inside");
            })
        };
        let reader = {
            let lock = lock.clone();
            thread::spawn(move || {
                model::run_on(1);
                let [a, b] = lock.read().read();
                assert_eq!(a, b, "a half-written value");
            })
        };
        writer.join().unwrap();
        reader.join().unwrap();
        drop(core::mem::ManuallyDrop::into_inner(holder));
    });
}
