//! `RwLock<T>`: a reader-writer lock whose readers count themselves per CPU with restartable
//! sequences, and whose writer waits for the counts to drain.
//!
//! # Safety
//! The data is reached through an `UnsafeCell`: shared by readers while the writer flag is
//! clear and they are counted, exclusive to the writer once it has seen the counts drained.

use crate::park::{self, AtomicU32};
use crate::reader_counts::ReaderCounts;
use core::cell::UnsafeCell;
use core::marker::PhantomData;
use core::ptr::NonNull;
use core::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// `state`: a writer holds the lock or is waiting for the readers to leave.
const WRITER: u32 = 1;
/// `state`: some thread sleeps on `state` until the writer is gone.
const PARKED: u32 = 2;
/// `state`: an upgradable reader holds the lock. Writers and upgradable readers take this bit
/// or `WRITER` only while both are clear; readers ignore it.
const UPGRADABLE: u32 = 4;

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

/// The lock without its data: what a guard needs to release it, whatever the data's type (a
/// mapped guard no longer names `T`).
struct Raw {
    readers: ReaderCounts<1>,
    /// `WRITER | UPGRADABLE | PARKED`; written only by writer-class holders (writers and
    /// upgradable readers) and by threads that go to sleep.
    state: AtomicU32,
    /// Bumped by a reader that leaves while a writer waits, to wake it.
    leaves: AtomicU32,
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
            raw: Raw {
                readers: ReaderCounts::new(),
                state: AtomicU32::new(0),
                leaves: AtomicU32::new(0),
            },
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
        lock.raw.readers = ReaderCounts::in_mode(false);
        lock
    }
}

impl<T: Default> Default for RwLock<T> {
    fn default() -> Self {
        RwLock::new(T::default())
    }
}

impl Raw {
    /// Counts this thread in as a reader unless a writer holds the lock or waits for it.
    #[inline]
    fn try_read(&self) -> bool {
        // A reader that sees the flag set stays out of the counts: counting in and out while a
        // writer drains would make every drain check of that writer see sums that moved, and
        // a thread polling `try_read` could keep the writer fencing for ever.
        if self.state.load(Ordering::Relaxed) & WRITER != 0 {
            return false;
        }
        self.readers.enter(PHASE);
        // The writer's fence orders this load after the entry (see the type's documentation);
        // acquire: a clear flag stored by a writer's release publishes its data.
        if self.state.load(Ordering::SeqCst) & WRITER == 0 {
            return true;
        }
        self.leave();
        false
    }

    /// As `try_read`, sleeping while a writer is in the way, until `deadline` if there is one;
    /// false if it passed first.
    #[inline]
    fn read_until(&self, deadline: Option<Instant>) -> bool {
        loop {
            if self.try_read() {
                return true;
            }
            if !self.wait_while(WRITER, deadline) {
                return false;
            }
        }
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

    /// Sleeps until none of `bits` is set in `state`; false if `deadline` passed first (its
    /// `PARKED` may stay set: the next release then wakes nobody, harmlessly).
    #[cold]
    #[inline(never)]
    fn wait_while(&self, bits: u32, deadline: Option<Instant>) -> bool {
        loop {
            let state = self.state.load(Ordering::Relaxed);
            if state & bits == 0 {
                return true;
            }
            if state & PARKED == 0
                && self
                    .state
                    .compare_exchange(state, state | PARKED, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            if !sleep(&self.state, state | PARKED, deadline) {
                return false;
            }
        }
    }

    /// Takes `bit` (`WRITER` or `UPGRADABLE`) if no writer-class holder has the lock: the two
    /// exclude each other, readers only look at `WRITER`.
    fn try_take(&self, bit: u32) -> bool {
        loop {
            let state = self.state.load(Ordering::Relaxed);
            if state & (WRITER | UPGRADABLE) != 0 {
                return false;
            }
            // Acquire: the last writer's release publishes its data to this holder. A failure
            // is a sleeper setting `PARKED`: look again.
            if self
                .state
                .compare_exchange(state, state | bit, Ordering::SeqCst, Ordering::Relaxed)
                .is_ok()
            {
                return true;
            }
        }
    }

    /// As `try_take`, sleeping while another writer-class holder has the lock, until
    /// `deadline` if there is one; false if it passed first.
    fn take(&self, bit: u32, deadline: Option<Instant>) -> bool {
        loop {
            if self.try_take(bit) {
                return true;
            }
            if !self.wait_while(WRITER | UPGRADABLE, deadline) {
                return false;
            }
        }
    }

    /// With `WRITER` set by this thread: fences, then waits for the readers inside to leave,
    /// until `deadline` if there is one; false if it passed first (the flag stays set: the
    /// caller releases it).
    fn drain(&self, deadline: Option<Instant>) -> bool {
        // Readers that leave from now on see the flag and wake this writer (the fence orders
        // the flag before their exits' loads of it).
        self.readers.fence();
        loop {
            let leaves = self.leaves.load(Ordering::SeqCst);
            if self.readers.drained(PHASE) {
                return true;
            }
            if !sleep(&self.leaves, leaves, deadline) {
                return false;
            }
        }
    }

    /// With `WRITER` or `UPGRADABLE` held by this thread: leaves `state` at `keep` and wakes
    /// every sleeper (readers waiting for `WRITER` to clear, writer-class holders waiting for
    /// both bits to clear: one wake serves all, and those still blocked sleep again).
    fn release_to(&self, keep: u32) {
        // Release: readers that load the flag clear, and the next writer, see this writer's
        // data.
        if self.state.swap(keep, Ordering::SeqCst) & PARKED != 0 {
            park::wake(&self.state, i32::MAX);
        }
    }

    /// With `WRITER` (and the readers drained) or `UPGRADABLE` held by this thread: counts
    /// this thread in as a reader, then lets the others in.
    fn downgrade_to_reader(&self) {
        // No other writer can drain while this thread holds its bit, so entering with the flag
        // set is safe; the entry is ordered before the release, which the next writer's
        // acquire of the flag follows, so that writer's sums see this reader.
        self.readers.enter(PHASE);
        self.release_to(0);
    }

    /// With `UPGRADABLE` held by this thread: trades it for `WRITER`, which stops new readers;
    /// the caller then drains them as a writer does. No writer-class holder can take either
    /// bit in between, since the state never has neither.
    fn upgrade(&self) {
        // Sleepers may set `PARKED` meanwhile: flip the two bits in one atomic step.
        let old = self.state.fetch_xor(UPGRADABLE | WRITER, Ordering::SeqCst);
        debug_assert_eq!(old & (UPGRADABLE | WRITER), UPGRADABLE);
    }

    /// `try_write`'s single drain check: fence, then one look at the sums.
    fn fence_and_check(&self) -> bool {
        self.readers.fence();
        self.readers.drained(PHASE)
    }
}

/// Sleeps on `word` while it holds `expected`, until `deadline` if there is one; false if it
/// has passed (spurious returns happen: callers look again).
fn sleep(word: &AtomicU32, expected: u32, deadline: Option<Instant>) -> bool {
    match deadline {
        None => park::wait(word, expected),
        Some(deadline) => {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            park::wait_timeout(word, expected, deadline - now);
        }
    }
    true
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
        self.raw.readers.by_sections()
    }

    /// Bytes of per-CPU reader counts this lock holds (besides itself and `T`).
    pub fn counts_bytes(&self) -> usize {
        self.raw.readers.bytes()
    }

    /// Whether a writer holds the lock or waits for it now.
    pub fn is_write_locked(&self) -> bool {
        self.raw.state.load(Ordering::Relaxed) & WRITER != 0
    }

    /// Readers inside now, from one unfenced look at the counts (a diagnostic; may be off
    /// while readers come and go).
    pub fn readers_inside(&self) -> u64 {
        self.raw.readers.inside(PHASE)
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

impl<'a, T: ?Sized> RwLockReadGuard<'a, T> {
    /// A guard of a part of the data (a field, an element), which keeps the whole lock read
    /// locked until dropped. An associated function, as `parking_lot`'s: `guard.map(..)` would
    /// be a method of `T`.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockReadGuard};
    /// let lock = RwLock::new((String::from("name"), 7));
    /// let name = RwLockReadGuard::map(lock.read(), |pair| pair.0.as_str());
    /// assert_eq!(&*name, "name");
    /// assert!(lock.try_write().is_none(), "still read locked");
    /// drop(name);
    /// assert!(lock.try_write().is_some());
    /// ```
    pub fn map<U: ?Sized, F>(guard: Self, f: F) -> MappedRwLockReadGuard<'a, U>
    where
        F: FnOnce(&T) -> &U,
    {
        // A panic in `f` drops `guard`, which releases the lock.
        let data = NonNull::from(f(&*guard));
        let raw = &guard.lock.raw;
        core::mem::forget(guard);
        MappedRwLockReadGuard {
            raw,
            data,
            _borrow: PhantomData,
        }
    }

    /// As [`map`](Self::map) where `f` may find no part: the original guard comes back then.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockReadGuard};
    /// let lock = RwLock::new(vec![1, 2]);
    /// let guard = RwLockReadGuard::try_map(lock.read(), |v| v.get(5)).unwrap_err();
    /// let second = RwLockReadGuard::try_map(guard, |v| v.get(1)).unwrap();
    /// assert_eq!(*second, 2);
    /// ```
    pub fn try_map<U: ?Sized, F>(guard: Self, f: F) -> Result<MappedRwLockReadGuard<'a, U>, Self>
    where
        F: FnOnce(&T) -> Option<&U>,
    {
        let Some(data) = f(&*guard).map(NonNull::from) else {
            return Err(guard);
        };
        let raw = &guard.lock.raw;
        core::mem::forget(guard);
        Ok(MappedRwLockReadGuard {
            raw,
            data,
            _borrow: PhantomData,
        })
    }
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
        self.lock.raw.leave();
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

impl<'a, T: ?Sized> RwLockWriteGuard<'a, T> {
    /// Turns the write lock into a read lock, atomically: no other writer gets the lock in
    /// between, so the reader sees exactly what this writer left. Readers waiting for this
    /// writer are let in. The writer counts itself as a reader before it releases the flag:
    /// a writer that takes the flag next waits for it as for any reader.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockWriteGuard};
    /// let lock = RwLock::new(1);
    /// let mut writing = lock.write();
    /// *writing = 2;
    /// let reading = RwLockWriteGuard::downgrade(writing);
    /// assert_eq!(*reading, 2);
    /// assert!(lock.try_read().is_some(), "other readers get in");
    /// assert!(lock.try_write().is_none(), "writers wait for the downgraded reader");
    /// drop(reading);
    /// assert!(lock.try_write().is_some());
    /// ```
    pub fn downgrade(guard: Self) -> RwLockReadGuard<'a, T> {
        let lock = guard.lock;
        core::mem::forget(guard);
        lock.raw.downgrade_to_reader();
        RwLockReadGuard { lock }
    }

    /// Turns the write lock into an upgradable read lock, atomically: no writer gets in
    /// between, readers are let in, and the guard may be upgraded again later.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockWriteGuard};
    /// let lock = RwLock::new(1);
    /// let mut writing = lock.write();
    /// *writing = 2;
    /// let reading = RwLockWriteGuard::downgrade_to_upgradable(writing);
    /// assert_eq!(*lock.try_read().unwrap(), 2, "readers get in");
    /// assert!(lock.try_write().is_none(), "writers do not");
    /// drop(reading);
    /// assert!(lock.try_write().is_some());
    /// ```
    pub fn downgrade_to_upgradable(guard: Self) -> RwLockUpgradableReadGuard<'a, T> {
        let lock = guard.lock;
        core::mem::forget(guard);
        // The upgradable reader is not counted: its bit keeps writers out, and readers ignore
        // it. Release: readers that now load the flag clear see this writer's data.
        lock.raw.release_to(UPGRADABLE);
        RwLockUpgradableReadGuard { lock }
    }

    /// A guard of a part of the data, which keeps the whole lock write locked until dropped.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockWriteGuard};
    /// let lock = RwLock::new((String::from("name"), 7));
    /// let mut count = RwLockWriteGuard::map(lock.write(), |pair| &mut pair.1);
    /// *count += 1;
    /// drop(count);
    /// assert_eq!(lock.read().1, 8);
    /// ```
    pub fn map<U: ?Sized, F>(guard: Self, f: F) -> MappedRwLockWriteGuard<'a, U>
    where
        F: FnOnce(&mut T) -> &mut U,
    {
        let mut guard = guard;
        // A panic in `f` drops `guard`, which releases the lock.
        let data = NonNull::from(f(&mut *guard));
        let raw = &guard.lock.raw;
        core::mem::forget(guard);
        MappedRwLockWriteGuard {
            raw,
            data,
            _borrow: PhantomData,
        }
    }

    /// As [`map`](Self::map) where `f` may find no part: the original guard comes back then.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockWriteGuard};
    /// let lock = RwLock::new(vec![1, 2]);
    /// let guard = RwLockWriteGuard::try_map(lock.write(), |v| v.get_mut(5)).unwrap_err();
    /// *RwLockWriteGuard::try_map(guard, |v| v.get_mut(0)).unwrap() = 3;
    /// assert_eq!(*lock.read(), [3, 2]);
    /// ```
    pub fn try_map<U: ?Sized, F>(guard: Self, f: F) -> Result<MappedRwLockWriteGuard<'a, U>, Self>
    where
        F: FnOnce(&mut T) -> Option<&mut U>,
    {
        let mut guard = guard;
        let Some(data) = f(&mut *guard).map(NonNull::from) else {
            return Err(guard);
        };
        let raw = &guard.lock.raw;
        core::mem::forget(guard);
        Ok(MappedRwLockWriteGuard {
            raw,
            data,
            _borrow: PhantomData,
        })
    }
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
        self.lock.raw.release_to(0);
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for RwLockWriteGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// An upgradable read lock on an [`RwLock`], made by [`RwLock::upgradable_read`]: shared
/// access to the data, beside readers, with no writer and no other upgradable reader until it
/// is dropped, upgraded or downgraded. It may be dropped on another CPU or thread than the one
/// that locked.
#[must_use = "the lock is released when the guard is dropped"]
pub struct RwLockUpgradableReadGuard<'a, T: ?Sized> {
    lock: &'a RwLock<T>,
}

impl<'a, T: ?Sized> RwLockUpgradableReadGuard<'a, T> {
    /// Turns the upgradable read lock into a write lock: stops new readers, and waits for the
    /// readers inside to leave, as [`RwLock::write`] does. No writer gets in between, so what
    /// this guard read still holds when the write guard is handed out. Deadlocks if this
    /// thread also holds a read lock of the lock.
    pub fn upgrade(guard: Self) -> RwLockWriteGuard<'a, T> {
        let lock = guard.lock;
        core::mem::forget(guard);
        lock.raw.upgrade();
        // As in `write`: a panic in the fences drops the write guard, which releases the lock.
        let writing = RwLockWriteGuard { lock };
        lock.raw.drain(None);
        writing
    }

    /// As [`upgrade`](Self::upgrade), giving up after `timeout`: the upgradable guard comes
    /// back then, and the readers the attempt stopped are let in again.
    ///
    /// ```
    /// use std::time::Duration;
    /// use thiscpu::{RwLock, RwLockUpgradableReadGuard};
    /// let lock = RwLock::new(1);
    /// let upgradable = lock.upgradable_read();
    /// let reading = lock.read();
    /// let wait = Duration::from_millis(10);
    /// let upgradable = RwLockUpgradableReadGuard::try_upgrade_for(upgradable, wait).unwrap_err();
    /// drop(reading);
    /// *RwLockUpgradableReadGuard::try_upgrade_for(upgradable, wait).unwrap() = 2;
    /// ```
    pub fn try_upgrade_for(
        guard: Self,
        timeout: Duration,
    ) -> Result<RwLockWriteGuard<'a, T>, Self> {
        match Instant::now().checked_add(timeout) {
            Some(deadline) => Self::try_upgrade_until(guard, deadline),
            None => Ok(Self::upgrade(guard)),
        }
    }

    /// As [`upgrade`](Self::upgrade), giving up at `deadline` (see
    /// [`try_upgrade_for`](Self::try_upgrade_for)).
    pub fn try_upgrade_until(
        guard: Self,
        deadline: Instant,
    ) -> Result<RwLockWriteGuard<'a, T>, Self> {
        Self::upgrade_unless(guard, |raw| raw.drain(Some(deadline)))
    }

    /// Upgrades, fences and keeps the write lock if `drained` says the readers left; flips back
    /// to the upgradable read otherwise.
    fn upgrade_unless(
        guard: Self,
        drained: impl FnOnce(&Raw) -> bool,
    ) -> Result<RwLockWriteGuard<'a, T>, Self> {
        let lock = guard.lock;
        core::mem::forget(guard);
        lock.raw.upgrade();
        // As in `try_write`: a panic in the fences drops the write guard, which releases the
        // lock.
        let writing = RwLockWriteGuard { lock };
        if drained(&lock.raw) {
            return Ok(writing);
        }
        core::mem::forget(writing);
        // Back to `UPGRADABLE`, waking the readers that saw `WRITER` and went to sleep.
        lock.raw.release_to(UPGRADABLE);
        Err(RwLockUpgradableReadGuard { lock })
    }

    /// Upgrades if no reader is inside; never sleeps, but fences (two `membarrier` calls with
    /// rseq). The upgradable guard comes back otherwise, and the readers this attempt stopped
    /// are let in again.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockUpgradableReadGuard};
    /// let lock = RwLock::new(1);
    /// let upgradable = lock.upgradable_read();
    /// let reading = lock.read();
    /// let upgradable = RwLockUpgradableReadGuard::try_upgrade(upgradable).unwrap_err();
    /// drop(reading);
    /// *RwLockUpgradableReadGuard::try_upgrade(upgradable).unwrap() = 2;
    /// assert_eq!(*lock.read(), 2);
    /// ```
    pub fn try_upgrade(guard: Self) -> Result<RwLockWriteGuard<'a, T>, Self> {
        Self::upgrade_unless(guard, Raw::fence_and_check)
    }

    /// Turns the upgradable read lock into a read lock, letting writers and upgradable readers
    /// in (once this reader leaves, for writers).
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockUpgradableReadGuard};
    /// let lock = RwLock::new(1);
    /// let reading = RwLockUpgradableReadGuard::downgrade(lock.upgradable_read());
    /// assert!(lock.try_upgradable_read().is_some());
    /// assert!(lock.try_write().is_none(), "a writer waits for the reader");
    /// drop(reading);
    /// assert!(lock.try_write().is_some());
    /// ```
    pub fn downgrade(guard: Self) -> RwLockReadGuard<'a, T> {
        let lock = guard.lock;
        core::mem::forget(guard);
        lock.raw.downgrade_to_reader();
        RwLockReadGuard { lock }
    }
}

impl<T: ?Sized> core::ops::Deref for RwLockUpgradableReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this holder's bit keeps every writer out (writers and upgrades take the lock
        // only while neither bit is set), and the acquire that took it saw the last writer's
        // release; readers beside it only read.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T: ?Sized> Drop for RwLockUpgradableReadGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.raw.release_to(0);
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for RwLockUpgradableReadGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// A read lock on an [`RwLock`] that reaches a part of its data, made by
/// [`RwLockReadGuard::map`]: the whole lock stays read locked until it is dropped.
#[must_use = "the lock is released when the guard is dropped"]
pub struct MappedRwLockReadGuard<'a, U: ?Sized> {
    raw: &'a Raw,
    /// Points into the lock's data, which stays read locked while this guard lives.
    data: NonNull<U>,
    /// Shared access to a `U` for `'a`: covariant in `U`, as `&'a U` is (nothing is written
    /// through it).
    _borrow: PhantomData<&'a U>,
}

// SAFETY: the guard hands out `&U` on whichever thread holds it (needs `U: Sync`), and may
// release the lock from another thread than the one that locked (the counts are per CPU, not
// per thread).
unsafe impl<U: ?Sized + Sync> Send for MappedRwLockReadGuard<'_, U> {}
// SAFETY: a shared guard hands out `&U` to every thread that shares it.
unsafe impl<U: ?Sized + Sync> Sync for MappedRwLockReadGuard<'_, U> {}

impl<'a, U: ?Sized> MappedRwLockReadGuard<'a, U> {
    /// A guard of a part of this part.
    pub fn map<V: ?Sized, F>(guard: Self, f: F) -> MappedRwLockReadGuard<'a, V>
    where
        F: FnOnce(&U) -> &V,
    {
        let data = NonNull::from(f(&*guard));
        let raw = guard.raw;
        core::mem::forget(guard);
        MappedRwLockReadGuard {
            raw,
            data,
            _borrow: PhantomData,
        }
    }

    /// As [`map`](Self::map) where `f` may find no part: the original guard comes back then.
    pub fn try_map<V: ?Sized, F>(guard: Self, f: F) -> Result<MappedRwLockReadGuard<'a, V>, Self>
    where
        F: FnOnce(&U) -> Option<&V>,
    {
        let Some(data) = f(&*guard).map(NonNull::from) else {
            return Err(guard);
        };
        let raw = guard.raw;
        core::mem::forget(guard);
        Ok(MappedRwLockReadGuard {
            raw,
            data,
            _borrow: PhantomData,
        })
    }
}

impl<U: ?Sized> core::ops::Deref for MappedRwLockReadGuard<'_, U> {
    type Target = U;
    #[inline]
    fn deref(&self) -> &U {
        // SAFETY: `data` came from a `&U` into the lock's data under a read lock that this
        // guard still holds (it releases only when dropped), so no writer changes it.
        unsafe { self.data.as_ref() }
    }
}

impl<U: ?Sized> Drop for MappedRwLockReadGuard<'_, U> {
    #[inline]
    fn drop(&mut self) {
        self.raw.leave();
    }
}

impl<U: ?Sized + core::fmt::Debug> core::fmt::Debug for MappedRwLockReadGuard<'_, U> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// A write lock on an [`RwLock`] that reaches a part of its data, made by
/// [`RwLockWriteGuard::map`]: the whole lock stays write locked until it is dropped.
#[must_use = "the lock is released when the guard is dropped"]
pub struct MappedRwLockWriteGuard<'a, U: ?Sized> {
    raw: &'a Raw,
    /// Points into the lock's data, which this guard holds exclusively.
    data: NonNull<U>,
    /// Exclusive access to a `U` for `'a`: invariant in `U`, as `&'a mut U` is, since a `U`
    /// is written through it (see `variance_checks`).
    _borrow: PhantomData<&'a mut U>,
}

// SAFETY: the guard hands out `&mut U` on whichever thread holds it (needs `U: Send`), and
// may release the lock from another thread than the one that locked.
unsafe impl<U: ?Sized + Send> Send for MappedRwLockWriteGuard<'_, U> {}
// SAFETY: a shared guard hands out only `&U`, to every thread that shares it.
unsafe impl<U: ?Sized + Sync> Sync for MappedRwLockWriteGuard<'_, U> {}

impl<'a, U: ?Sized> MappedRwLockWriteGuard<'a, U> {
    /// A guard of a part of this part.
    pub fn map<V: ?Sized, F>(guard: Self, f: F) -> MappedRwLockWriteGuard<'a, V>
    where
        F: FnOnce(&mut U) -> &mut V,
    {
        let mut guard = guard;
        let data = NonNull::from(f(&mut *guard));
        let raw = guard.raw;
        core::mem::forget(guard);
        MappedRwLockWriteGuard {
            raw,
            data,
            _borrow: PhantomData,
        }
    }

    /// As [`map`](Self::map) where `f` may find no part: the original guard comes back then.
    pub fn try_map<V: ?Sized, F>(guard: Self, f: F) -> Result<MappedRwLockWriteGuard<'a, V>, Self>
    where
        F: FnOnce(&mut U) -> Option<&mut V>,
    {
        let mut guard = guard;
        let Some(data) = f(&mut *guard).map(NonNull::from) else {
            return Err(guard);
        };
        let raw = guard.raw;
        core::mem::forget(guard);
        Ok(MappedRwLockWriteGuard {
            raw,
            data,
            _borrow: PhantomData,
        })
    }
}

impl<U: ?Sized> core::ops::Deref for MappedRwLockWriteGuard<'_, U> {
    type Target = U;
    fn deref(&self) -> &U {
        // SAFETY: `data` came from a `&mut U` into the lock's data under the write lock that
        // this guard still holds, and `&self` borrows the guard, so nothing writes meanwhile.
        unsafe { self.data.as_ref() }
    }
}

impl<U: ?Sized> core::ops::DerefMut for MappedRwLockWriteGuard<'_, U> {
    fn deref_mut(&mut self) -> &mut U {
        // SAFETY: as in `deref`; `&mut self` makes this borrow the only one.
        unsafe { self.data.as_mut() }
    }
}

impl<U: ?Sized> Drop for MappedRwLockWriteGuard<'_, U> {
    fn drop(&mut self) {
        self.raw.release_to(0);
    }
}

impl<U: ?Sized + core::fmt::Debug> core::fmt::Debug for MappedRwLockWriteGuard<'_, U> {
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
        let before = lock.raw.readers.entries(PHASE);
        for _ in 0..100 {
            assert!(lock.try_read().is_none());
        }
        assert!(format!("{lock:?}").contains("<write-locked>"));
        assert_eq!(
            lock.raw.readers.entries(PHASE),
            before,
            "turned-away readers counted"
        );
        drop(writing);
        assert_eq!(*lock.try_read().unwrap(), 1);
        assert_eq!(lock.raw.readers.entries(PHASE), before + 1);
    }
}
