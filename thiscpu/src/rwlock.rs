//! `RwLock<T>`: a reader-writer lock whose readers count themselves per CPU with restartable
//! sequences, and whose writer waits for the counts to drain.
//!
//! # Safety
//! The data is reached through an `UnsafeCell`: shared by readers while the writer flag is
//! clear and they are counted, exclusive to the writer once it has seen the counts drained.

use crate::park::{self, AtomicU32};
use crate::reader_counts::ReaderCounts;
use core::cell::UnsafeCell;
use core::sync::atomic::Ordering;

/// `state`: a writer holds the lock or is waiting for the readers to leave.
const WRITER: u32 = 1;
/// `state`: some thread sleeps on `state` until the writer is gone.
const PARKED: u32 = 2;

/// The only reader-writer lock phase: readers are stopped by the flag, not by phases.
const PHASE: usize = 0;

/// A reader-writer lock for data that is read all the time and written rarely (configuration,
/// routing tables, certificate sets): a read lock and unlock are each one restartable
/// sequence adding one to a word of the reader's CPU, plus a load of a flag that only writers
/// write. No atomic read-modify-write, no store to a cache line that another CPU writes.
/// Writes are expensive: two `membarrier` system calls at least (a few microseconds each).
///
/// ```
/// let config = thiscpu::RwLock::new(vec![1, 2, 3]);
/// assert_eq!(config.read().len(), 3);
/// config.write().push(4);
/// assert_eq!(*config.read(), [1, 2, 3, 4]);
/// ```
///
/// # How it works
/// A reader adds one to its CPU's *entry* count, then loads the writer flag: clear, it holds the
/// lock; set, it adds one to an *exit* count, sleeps on a futex until the writer releases, and
/// tries again. Unlocking adds one to the exit count of whatever CPU the reader is on then (a
/// guard may be dropped on another CPU or thread), then loads the flag to wake a writer that
/// waits.
///
/// A writer sets the flag (one writer at a time; others sleep on the futex), makes a
/// `membarrier` fence, then repeats until the readers have drained: sum the exit counts, fence
/// again, sum the entry counts; equal sums mean no reader holds the lock (an unequal check
/// sleeps until a leaving reader wakes it). Readers make no fence; the writer's `membarrier`
/// orders, in each running reader, its count before its load of the flag:
/// - a reader whose entry the writer does not count sees the flag and backs out;
/// - every exit the writer counts has its entry counted too (exits are summed first, with a
///   fence before the entries), so equal sums cannot hide a reader that holds on, even one
///   that entered on one CPU and left on another;
/// - what a reader read before its exit is ordered before the writer's fence, so the writer
///   never changes data under a reader; the release of the flag publishes the writer's data
///   to the readers that load it clear.
///
/// The protocol is checked by a model checker over its interleavings, with every section
/// committing or aborting at each step (tests/model_rwlock.rs).
///
/// # Progress and fairness
/// Writers are not starved by readers: once a writer set the flag, new readers wait (and
/// [`try_read`](RwLock::try_read) fails without touching the counts), and the writer waits
/// only for readers already inside. The lock is not fair otherwise: readers and other writers
/// that wait for a writer are all woken when it releases and race for the lock, and a writer
/// that releases and writes again at once may win that race every time, so a thread that
/// writes in a loop can keep readers and other writers out for as long as it loops. Nothing
/// queues waiters in order; where that matters, `parking_lot::RwLock` (eventually fair) or a
/// queue of writes handled by one thread serve better.
///
/// # Panics and poisoning
/// The lock is never poisoned, as `parking_lot`'s is not: a panic while a write guard is held
/// releases the lock as the guard unwinds, and the next holder sees the data as the panicking
/// writer left it (possibly half-updated). A write that panics before it gets the lock (where
/// no fence can be made: `membarrier` refused and the thread unable to run on every CPU)
/// leaves the lock as it found it: the flag is released and sleepers are woken.
///
/// # Recursion, signals, fork
/// - Taking a read lock while holding one on the same thread works while no writer waits, and
///   deadlocks when one does (the new read waits for the writer, which waits for the first
///   read). Do not lock recursively; take [`try_read`](RwLock::try_read) where unsure.
/// - A signal handler may use [`try_read`](RwLock::try_read): it is async-signal-safe (a load,
///   restartable sequences or atomic adds, no allocation, no lock). [`try_write`] is too
///   while `membarrier` works (system calls and atomics only); where `membarrier` was refused
///   after the lock was made, its fence visits every CPU, which allocates and reads `/proc`,
///   and is then not async-signal-safe. A blocking `read` or `write` in a handler deadlocks if
///   the interrupted code holds the lock for writing (or for reading, for `write`), as with
///   every lock.
/// - After `fork`, the child has the lock as the forking thread held it. Locks held by other
///   threads stay held for ever in the child: its writers then wait for ever ([`try_write`]
///   fails), and if a writer held it, so do its readers. A guard the forking thread held can
///   be dropped in the child as usual.
///
/// [`try_write`]: RwLock::try_write
///
/// # Modes
/// Where the process has no rseq (`THISCPU_RSEQ=off`, valgrind, old kernels) or `membarrier`
/// is refused when the lock is made (a seccomp filter), readers count with `SeqCst` atomic
/// adds on the word of the CPU they are on, and the writer's fences are `SeqCst` fences:
/// correct, about as fast as an uncontended `parking_lot` read on one thread, and still
/// spread over CPUs. A thread without rseq in a process that uses it (made by a raw `clone`)
/// counts atomically in a row of its own. [`uses_rseq`](RwLock::uses_rseq) says which mode a
/// lock took; `thiscpu info` says which a new lock would take.
///
/// # Costs and memory
/// - Read lock + unlock: two restartable sequences and two loads of the flag: 3.7 to 4.0 ns
///   on the 2-CPU x86_64 VM of the README's results (`thiscpu bench rwlock`).
/// - Write lock + unlock: two `membarrier(PRIVATE_EXPEDITED_RSEQ)` calls (they interrupt every
///   CPU that runs a thread of the process) and a read of every CPU's counts; more while
///   readers hold the lock.
/// - Memory: 16 bytes per possible CPU, plus 16, plus `T` (4 KiB of address space per lock on
///   a 255-CPU machine), in the dense per-CPU arena that [`crate::Counter`] uses: a CPU's
///   words of many locks share its cache lines, never another CPU's, and a CPU that never
///   reads a lock leaves its page unbacked.
///
/// # When not to use it
/// Where writes are more than about one in ten thousand reads (see the break-even table in the
/// README), where the write latency matters (a writer waits for the slowest reader and makes
/// system calls), or for long read sections that writers must wait out. `std::sync::RwLock` or
/// `parking_lot::RwLock` serve those.
pub struct RwLock<T: ?Sized> {
    readers: ReaderCounts<1>,
    /// `WRITER | PARKED`; written only by writers and by threads that go to sleep.
    state: AtomicU32,
    /// Bumped by a reader that leaves while a writer waits, to wake it.
    leaves: AtomicU32,
    data: UnsafeCell<T>,
}

// SAFETY: the lock owns its `T`; sending the lock sends the `T`.
unsafe impl<T: ?Sized + Send> Send for RwLock<T> {}
// SAFETY: readers on several threads share `&T` (needs `Sync`), a writer gets `&mut T` from
// any thread (needs `Send`), and the protocol keeps them apart.
unsafe impl<T: ?Sized + Send + Sync> Sync for RwLock<T> {}

impl<T> RwLock<T> {
    /// A lock holding `value`. Allocates the per-CPU counts and decides the lock's mode (see
    /// [Modes](RwLock#modes)).
    pub fn new(value: T) -> Self {
        RwLock {
            readers: ReaderCounts::new(),
            state: AtomicU32::new(0),
            leaves: AtomicU32::new(0),
            data: UnsafeCell::new(value),
        }
    }

    /// The value, which the lock owns alone.
    pub fn into_inner(self) -> T {
        self.data.into_inner()
    }
}

#[cfg(thiscpu_model)]
impl<T> RwLock<T> {
    /// A lock in the atomic mode, which the model machine (rseq and `membarrier` everywhere)
    /// would never choose: for the model checks of that mode.
    #[doc(hidden)]
    pub fn new_in_atomic_mode(value: T) -> Self {
        RwLock {
            readers: ReaderCounts::in_mode(false),
            ..RwLock::new(value)
        }
    }
}

impl<T: Default> Default for RwLock<T> {
    fn default() -> Self {
        RwLock::new(T::default())
    }
}

impl<T: ?Sized> RwLock<T> {
    /// Locks for reading, sleeping while a writer holds the lock or waits for it.
    ///
    /// Deadlocks if this thread holds the lock for writing, or for reading while a writer waits
    /// (see [Recursion](RwLock#recursion-signals-fork)).
    #[inline]
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        loop {
            if let Some(guard) = self.try_read() {
                return guard;
            }
            self.wait_for_writer();
        }
    }

    /// Locks for reading unless a writer holds the lock or waits for it.
    ///
    /// ```
    /// let lock = thiscpu::RwLock::new(1);
    /// let writing = lock.write();
    /// assert!(lock.try_read().is_none());
    /// drop(writing);
    /// assert_eq!(*lock.try_read().unwrap(), 1);
    /// ```
    #[inline]
    pub fn try_read(&self) -> Option<RwLockReadGuard<'_, T>> {
        // A reader that sees the flag set stays out of the counts: counting in and out while a
        // writer drains would make every drain check of that writer see sums that moved, and
        // a thread polling `try_read` could keep the writer fencing for ever.
        if self.state.load(Ordering::Relaxed) & WRITER != 0 {
            return None;
        }
        self.readers.enter(PHASE);
        // The writer's fence orders this load after the entry (see the type's documentation);
        // acquire: a clear flag stored by a writer's release publishes its data.
        if self.state.load(Ordering::SeqCst) & WRITER == 0 {
            return Some(RwLockReadGuard { lock: self });
        }
        self.leave();
        None
    }

    /// A reader's exit: counted, then a waiting writer woken.
    #[inline]
    fn leave(&self) {
        self.readers.exit(PHASE);
        if self.state.load(Ordering::SeqCst) & WRITER != 0 {
            self.wake_writer();
        }
    }

    #[cold]
    #[inline(never)]
    fn wake_writer(&self) {
        // The exit is ordered before this bump, which the writer reads before its sums: either
        // the writer counts the exit, or it sees the bump change and does not sleep.
        self.leaves.fetch_add(1, Ordering::SeqCst);
        park::wake(&self.leaves, 1);
    }

    /// Sleeps until no writer holds the lock or waits for it.
    #[cold]
    #[inline(never)]
    fn wait_for_writer(&self) {
        loop {
            let state = self.state.load(Ordering::Relaxed);
            if state & WRITER == 0 {
                return;
            }
            if state & PARKED == 0
                && self
                    .state
                    .compare_exchange(state, state | PARKED, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            park::wait(&self.state, state | PARKED);
        }
    }

    /// Locks for writing: waits for other writers, stops new readers, and waits for the
    /// readers inside to leave. Deadlocks if this thread holds the lock.
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        loop {
            let state = self.state.load(Ordering::Relaxed);
            if state & WRITER == 0 {
                if self
                    .state
                    .compare_exchange(state, state | WRITER, Ordering::SeqCst, Ordering::Relaxed)
                    .is_ok()
                {
                    break;
                }
                continue;
            }
            self.wait_for_writer();
        }
        // The flag is this writer's: from here a panic (a fence that cannot be made) drops the
        // guard, which releases the flag and wakes the sleepers, so the lock is left as it was
        // found. The guard is handed out only once the readers have drained.
        let writing = RwLockWriteGuard { lock: self };
        // Readers that leave from now on see the flag and wake this writer (the fence orders
        // the flag before their exits' loads of it).
        self.readers.fence();
        loop {
            let leaves = self.leaves.load(Ordering::SeqCst);
            if self.readers.drained(PHASE) {
                return writing;
            }
            park::wait(&self.leaves, leaves);
        }
    }

    /// Locks for writing if no other writer holds the lock and no reader is inside; never
    /// sleeps, but fences (two `membarrier` calls with rseq).
    ///
    /// ```
    /// let lock = thiscpu::RwLock::new(1);
    /// let reading = lock.read();
    /// assert!(lock.try_write().is_none());
    /// drop(reading);
    /// *lock.try_write().unwrap() = 2;
    /// assert_eq!(*lock.read(), 2);
    /// ```
    pub fn try_write(&self) -> Option<RwLockWriteGuard<'_, T>> {
        let state = self.state.load(Ordering::Relaxed);
        if state & WRITER != 0
            || self
                .state
                .compare_exchange(state, state | WRITER, Ordering::SeqCst, Ordering::Relaxed)
                .is_err()
        {
            return None;
        }
        // As in `write`: a panic in the fences releases the flag.
        let writing = RwLockWriteGuard { lock: self };
        self.readers.fence();
        if self.readers.drained(PHASE) {
            return Some(writing);
        }
        drop(writing);
        None
    }

    fn release_writer(&self) {
        // Release: readers that load the flag clear see the writer's data.
        if self.state.swap(0, Ordering::SeqCst) & PARKED != 0 {
            park::wake(&self.state, i32::MAX);
        }
    }

    /// The value, through the exclusive borrow (no locking).
    pub fn get_mut(&mut self) -> &mut T {
        self.data.get_mut()
    }

    /// Whether readers count with restartable sequences and writers fence with `membarrier`;
    /// false in the atomic mode (see [Modes](RwLock#modes)).
    ///
    /// ```
    /// let lock = thiscpu::RwLock::new(());
    /// if thiscpu::source().registrar == thiscpu::Registrar::None {
    ///     assert!(!lock.uses_rseq());
    /// }
    /// ```
    pub fn uses_rseq(&self) -> bool {
        self.readers.by_sections()
    }

    /// Bytes of per-CPU reader counts this lock holds (besides itself and `T`).
    pub fn counts_bytes(&self) -> usize {
        self.readers.bytes()
    }

    /// Whether a writer holds the lock or waits for it now.
    pub fn is_write_locked(&self) -> bool {
        self.state.load(Ordering::Relaxed) & WRITER != 0
    }

    /// Readers inside now, from one unfenced look at the counts (a diagnostic; may be off
    /// while readers come and go).
    pub fn readers_inside(&self) -> u64 {
        self.readers.inside(PHASE)
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for RwLock<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let mut out = f.debug_struct("RwLock");
        out.field("mode", &if self.uses_rseq() { "rseq" } else { "atomic" });
        match self.try_read() {
            Some(guard) => out.field("data", &&*guard),
            None => out.field("data", &format_args!("<write-locked>")),
        };
        out.finish()
    }
}

/// A read lock on an [`RwLock`]: shared access to the data until dropped. It may be dropped on
/// another CPU or thread than the one that locked.
#[must_use = "the lock is released when the guard is dropped"]
pub struct RwLockReadGuard<'a, T: ?Sized> {
    lock: &'a RwLock<T>,
}

impl<T: ?Sized> core::ops::Deref for RwLockReadGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this reader is counted and saw no writer, so no writer gets the data until it
        // leaves (see the type's documentation).
        unsafe { &*self.lock.data.get() }
    }
}

impl<T: ?Sized> Drop for RwLockReadGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.leave();
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for RwLockReadGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// A write lock on an [`RwLock`]: exclusive access to the data until dropped.
#[must_use = "the lock is released when the guard is dropped"]
pub struct RwLockWriteGuard<'a, T: ?Sized> {
    lock: &'a RwLock<T>,
}

impl<T: ?Sized> core::ops::Deref for RwLockWriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the writer saw every reader gone with the flag set: the data is its alone.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T: ?Sized> core::ops::DerefMut for RwLockWriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this borrow the only one.
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T: ?Sized> Drop for RwLockWriteGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.release_writer();
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for RwLockWriteGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::{PHASE, RwLock};

    #[test]
    fn a_reader_turned_away_by_a_writer_leaves_the_counts_alone() {
        // Counting in and out while a writer drains moves the sums the writer compares: a
        // thread polling `try_read` (or `Debug`) could keep it fencing for ever.
        let lock = RwLock::new(1);
        let writing = lock.write();
        let before = lock.readers.entries(PHASE);
        for _ in 0..100 {
            assert!(lock.try_read().is_none());
        }
        assert!(format!("{lock:?}").contains("<write-locked>"));
        assert_eq!(
            lock.readers.entries(PHASE),
            before,
            "turned-away readers counted"
        );
        drop(writing);
        assert_eq!(*lock.try_read().unwrap(), 1);
        assert_eq!(lock.readers.entries(PHASE), before + 1);
    }
}
