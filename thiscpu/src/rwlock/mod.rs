//! `RwLock<T>`: a reader-writer lock whose readers count themselves per CPU with restartable
//! sequences, and whose writer waits for the counts to drain.
//!
//! # Safety
//! The data is reached through an `UnsafeCell`: shared by readers while the writer flag is
//! clear and they are counted, exclusive to the writer once it has seen the counts drained.

mod guards;
// The protocol never touches the data: unsafe code stays with the lock and its guards.
#[deny(unsafe_code)]
mod raw;

pub use guards::{
    MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLockReadGuard, RwLockUpgradableReadGuard,
    RwLockWriteGuard,
};

use core::cell::UnsafeCell;
use raw::{Raw, UPGRADABLE, WRITER};
use std::time::{Duration, Instant};

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
/// # Upgradable reads
/// [`upgradable_read`](RwLock::upgradable_read) is one writer-class holder among readers: a
/// bit of `state`, `UPGRADABLE`, that writers and upgradable readers take (with the same
/// compare-exchange, only while neither it nor `WRITER` is set) and readers ignore. The
/// upgradable reader is not counted in the per-CPU counts: its bit alone keeps writers out,
/// and readers come and go beside it at their usual cost. Upgrading flips `UPGRADABLE` to
/// `WRITER` in one atomic step (no writer-class holder can get in between, as `state` never
/// has neither), then fences and waits for the readers to drain exactly as
/// [`write`](RwLock::write) does, with the same ordering argument: the flag is set before the
/// fence, readers that enter after it see the flag, and the drain counts the rest out. A
/// failed [`try_upgrade`](RwLockUpgradableReadGuard::try_upgrade) flips back and wakes the
/// readers it stopped. Downgrading to a reader counts the holder in before its bit is
/// released, as [`RwLockWriteGuard::downgrade`] does, so the next writer waits for it.
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
///   read). Do not lock recursively; take [`try_read`](RwLock::try_read) where unsure, or pass
///   the `&T` of the guard already held down to the code that would lock again. A read taken
///   while holding an upgradable read works (readers ignore its bit), but upgrading while
///   holding that read deadlocks (the upgrade waits for it).
/// - There is no `read_recursive` (`parking_lot`'s read that gets in past a waiting writer
///   while readers hold the lock). The writer learns that the readers are out only from its
///   drain check; a reader let in past the flag after that check would share the data with
///   the writer. Telling such a reader from one that entered before the check would take a
///   fence or a shared atomic read-modify-write in every read, the cost this lock exists to
///   avoid, or a per-thread record of held locks in every read; neither is paid for one use.
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
/// - Read lock + unlock: two restartable sequences and two loads of the flag: 1.95 ns (2.02
///   per thread with two) in the repository's recorded run on a 2-CPU x86_64 VM
///   (`thiscpu bench rwlock`, quoted in docs/results.md).
/// - Write lock + unlock: two `membarrier(PRIVATE_EXPEDITED_RSEQ)` calls (they interrupt every
///   CPU that runs a thread of the process) and a read of every CPU's counts; more while
///   readers hold the lock.
/// - Memory: 16 bytes per possible CPU, plus 16, plus `T` (4 KiB of address space per lock on
///   a 255-CPU machine), in the dense per-CPU arena that [`crate::Counter`] uses: a CPU's
///   words of many locks share its cache lines, never another CPU's, and a CPU that never
///   reads a lock leaves its page unbacked.
///
/// # Statics and const
/// [`RwLock::new`] is not a `const fn`, so a lock cannot initialize a `static` directly: it
/// allocates the lock's per-CPU counts in the dense per-CPU arena and decides the lock's mode
/// (whether the process has rseq and `membarrier`), neither of which can run at compile time.
/// Allocating on first use instead would put a check of the counts (a load and a branch, and a
/// one-time initialization race to settle) in every read. A static lock is a
/// [`std::sync::LazyLock`], which makes it on first use: its own check (a load and a branch
/// per access) is then paid by the locks in statics only, not by every lock:
///
/// ```
/// use std::sync::LazyLock;
/// use thiscpu::RwLock;
///
/// static NAMES: LazyLock<RwLock<Vec<String>>> = LazyLock::new(|| RwLock::new(Vec::new()));
///
/// NAMES.write().push("first".to_owned());
/// assert_eq!(NAMES.read().len(), 1);
/// ```
///
/// For the same reason the lock does not implement `lock_api`'s raw traits (whose `RawRwLock`
/// asks for a `const INIT`); the guards' API (mapping, upgrading, downgrading, timed locks)
/// is written here instead.
///
/// # When not to use it
/// Where writes are more frequent than about one in a hundred reads: in the recorded run (a
/// 2-CPU VM; the break-even table of the repository's docs/results.md) one write per 93 reads
/// cost as much as `std::sync::RwLock`, per 99 as `parking_lot::RwLock` and per 85 as
/// crossbeam's `ShardedLock`, the worst case over one and two threads (with both CPUs reading,
/// the peers' contended reads move the break-even to one write in 13 or 14 reads). Also where
/// the write latency matters (a writer waits for the slowest reader and makes system calls),
/// or for long read sections that writers must wait out. `std::sync::RwLock` or
/// `parking_lot::RwLock` serve those.
pub struct RwLock<T: ?Sized> {
    raw: Raw,
    data: UnsafeCell<T>,
}

// SAFETY: the lock owns its `T`; sending the lock sends the `T`.
unsafe impl<T: ?Sized + Send> Send for RwLock<T> {}
// SAFETY: readers on several threads share `&T` (needs `Sync`), a writer gets `&mut T` from
// any thread (needs `Send`), and the protocol keeps them apart.
unsafe impl<T: ?Sized + Send + Sync> Sync for RwLock<T> {}

impl<T> RwLock<T> {
    /// A lock holding `value`. Allocates the per-CPU counts and decides the lock's mode (see
    /// [Modes](RwLock#modes)); not a `const fn` for that reason (see
    /// [Statics and const](RwLock#statics-and-const) for a `static` lock).
    pub fn new(value: T) -> Self {
        RwLock {
            raw: Raw::new(),
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
        let mut lock = RwLock::new(value);
        lock.raw.use_atomic_mode();
        lock
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
        self.raw.read_until(None);
        RwLockReadGuard { lock: self }
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
        // Lazily: a guard made and dropped on failure would count an exit without its entry.
        self.raw.try_read().then(|| RwLockReadGuard { lock: self })
    }

    /// Locks for writing: waits for other writers, stops new readers, and waits for the
    /// readers inside to leave. Deadlocks if this thread holds the lock.
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.raw.take(WRITER, None);
        // The flag is this writer's: from here a panic (a fence that cannot be made) drops the
        // guard, which releases the flag and wakes the sleepers, so the lock is left as it was
        // found. The guard is handed out only once the readers have drained.
        let writing = RwLockWriteGuard { lock: self };
        self.raw.drain(None);
        writing
    }

    /// As [`read`](RwLock::read), giving up after `timeout`. A timeout too large for an
    /// [`Instant`] waits for as long as it takes.
    ///
    /// ```
    /// use std::time::Duration;
    /// let lock = thiscpu::RwLock::new(1);
    /// let writing = lock.write();
    /// assert!(lock.try_read_for(Duration::from_millis(10)).is_none());
    /// drop(writing);
    /// assert_eq!(*lock.try_read_for(Duration::from_millis(10)).unwrap(), 1);
    /// ```
    pub fn try_read_for(&self, timeout: Duration) -> Option<RwLockReadGuard<'_, T>> {
        match Instant::now().checked_add(timeout) {
            Some(deadline) => self.try_read_until(deadline),
            None => Some(self.read()),
        }
    }

    /// As [`read`](RwLock::read), giving up at `deadline`.
    pub fn try_read_until(&self, deadline: Instant) -> Option<RwLockReadGuard<'_, T>> {
        self.raw
            .read_until(Some(deadline))
            .then(|| RwLockReadGuard { lock: self })
    }

    /// As [`write`](RwLock::write), giving up after `timeout`. A write that times out while
    /// the readers drain releases the flag and wakes the readers it stopped: the lock is left
    /// as it was found.
    ///
    /// ```
    /// use std::time::Duration;
    /// let lock = thiscpu::RwLock::new(1);
    /// let reading = lock.read();
    /// assert!(lock.try_write_for(Duration::from_millis(10)).is_none());
    /// assert!(lock.try_read().is_some(), "readers are let in again");
    /// drop(reading);
    /// *lock.try_write_for(Duration::from_millis(10)).unwrap() = 2;
    /// ```
    pub fn try_write_for(&self, timeout: Duration) -> Option<RwLockWriteGuard<'_, T>> {
        match Instant::now().checked_add(timeout) {
            Some(deadline) => self.try_write_until(deadline),
            None => Some(self.write()),
        }
    }

    /// As [`write`](RwLock::write), giving up at `deadline` (see
    /// [`try_write_for`](RwLock::try_write_for)).
    pub fn try_write_until(&self, deadline: Instant) -> Option<RwLockWriteGuard<'_, T>> {
        if !self.raw.take(WRITER, Some(deadline)) {
            return None;
        }
        // As in `write`; and a drain that times out drops the guard the same way.
        let writing = RwLockWriteGuard { lock: self };
        if self.raw.drain(Some(deadline)) {
            return Some(writing);
        }
        drop(writing);
        None
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
        if !self.raw.try_take(WRITER) {
            return None;
        }
        // As in `write`: a panic in the fences releases the flag.
        let writing = RwLockWriteGuard { lock: self };
        if self.raw.fence_and_check() {
            return Some(writing);
        }
        drop(writing);
        None
    }

    /// Locks for an upgradable read: shares the lock with readers, and excludes writers and
    /// other upgradable readers (see [Upgradable reads](RwLock#upgradable-reads)). Sleeps
    /// while a writer or another upgradable reader holds the lock. Deadlocks if this thread
    /// holds it for writing or upgradable reading.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockUpgradableReadGuard};
    /// let cache = RwLock::new(vec![1, 2]);
    /// let reading = cache.upgradable_read();
    /// assert!(cache.try_read().is_some(), "readers share the lock");
    /// assert!(cache.try_upgradable_read().is_none(), "one upgradable reader at a time");
    /// if !reading.contains(&3) {
    ///     // No writer got in since the check: the write is decided on what was read.
    ///     RwLockUpgradableReadGuard::upgrade(reading).push(3);
    /// }
    /// assert_eq!(*cache.read(), [1, 2, 3]);
    /// ```
    pub fn upgradable_read(&self) -> RwLockUpgradableReadGuard<'_, T> {
        self.raw.take(UPGRADABLE, None);
        RwLockUpgradableReadGuard { lock: self }
    }

    /// As [`upgradable_read`](RwLock::upgradable_read), giving up after `timeout`.
    pub fn try_upgradable_read_for(
        &self,
        timeout: Duration,
    ) -> Option<RwLockUpgradableReadGuard<'_, T>> {
        match Instant::now().checked_add(timeout) {
            Some(deadline) => self.try_upgradable_read_until(deadline),
            None => Some(self.upgradable_read()),
        }
    }

    /// As [`upgradable_read`](RwLock::upgradable_read), giving up at `deadline`.
    pub fn try_upgradable_read_until(
        &self,
        deadline: Instant,
    ) -> Option<RwLockUpgradableReadGuard<'_, T>> {
        self.raw
            .take(UPGRADABLE, Some(deadline))
            .then(|| RwLockUpgradableReadGuard { lock: self })
    }

    /// Locks for an upgradable read unless a writer or another upgradable reader holds the
    /// lock; never sleeps, never fences.
    pub fn try_upgradable_read(&self) -> Option<RwLockUpgradableReadGuard<'_, T>> {
        self.raw
            .try_take(UPGRADABLE)
            .then(|| RwLockUpgradableReadGuard { lock: self })
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
        self.raw.uses_rseq()
    }

    /// Bytes of per-CPU reader counts this lock holds (besides itself and `T`).
    pub fn counts_bytes(&self) -> usize {
        self.raw.counts_bytes()
    }

    /// Whether a writer holds the lock or waits for it now.
    pub fn is_write_locked(&self) -> bool {
        self.raw.is_write_locked()
    }

    /// Readers inside now, from one unfenced look at the counts (a diagnostic; may be off
    /// while readers come and go).
    pub fn readers_inside(&self) -> u64 {
        self.raw.readers_inside()
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

#[cfg(test)]
mod tests {
    use super::RwLock;

    #[test]
    fn a_reader_turned_away_by_a_writer_leaves_the_counts_alone() {
        // Counting in and out while a writer drains moves the sums the writer compares: a
        // thread polling `try_read` (or `Debug`) could keep it fencing for ever.
        let lock = RwLock::new(1);
        let writing = lock.write();
        let before = lock.raw.entries();
        for _ in 0..100 {
            assert!(lock.try_read().is_none());
        }
        assert!(format!("{lock:?}").contains("<write-locked>"));
        assert_eq!(lock.raw.entries(), before, "turned-away readers counted");
        drop(writing);
        assert_eq!(*lock.try_read().unwrap(), 1);
        assert_eq!(lock.raw.entries(), before + 1);
    }
}
