//! `EpochCell<T>`: an `Arc<T>` that readers borrow by pinning with a restartable sequence and
//! that writers swap, then wait for the readers of the old value before dropping it.
//!
//! # Safety
//! The cell owns one strong count of the `Arc` whose pointer it holds; a pinned reader
//! dereferences that pointer, and a writer gives up the count of the pointer it swapped out
//! only after every reader that could have loaded it has left.

use crate::park;
use crate::reader_counts::ReaderCounts;
use crate::sync::Mutex;
use crate::sync::atomic::{AtomicUsize, Ordering};
use core::marker::PhantomData;
use std::sync::Arc;

/// A shared value that is read everywhere and replaced rarely, like `arc_swap::ArcSwap`:
/// [`load`](EpochCell::load) pins the reader with one restartable sequence on its CPU (and
/// unpins with another when the guard is dropped), with no atomic read-modify-write and no
/// reference count touched; [`store`](EpochCell::store) swaps in a new value and waits until
/// every reader that could still see the old one has unpinned, then drops it.
///
/// ```
/// use std::sync::Arc;
/// let routes = thiscpu::EpochCell::new(vec!["/a"]);
/// assert_eq!(routes.load()[0], "/a");
/// let old = routes.swap(Arc::new(vec!["/a", "/b"]));
/// assert_eq!(old.len(), 1);
/// assert_eq!(routes.load().len(), 2);
/// ```
///
/// # How it works
/// Readers count themselves in one of two phases, on per-CPU entry and exit counts (the same
/// counting layer as [`crate::RwLock`]): a reader loads the phase, counts its entry in it,
/// then loads the pointer; its guard counts the exit in the same phase. A writer (one at a
/// time, behind a mutex) swaps the pointer, waits for the readers of the other phase to drain,
/// flips the phase, and waits for the readers of the old phase to drain. Each drain check sums
/// the exits, fences every CPU with `membarrier`, and sums the entries: a reader whose entry
/// the check misses loads the pointer after the swap, so it sees the new value; an exit the
/// check counts has its entry counted too. New readers go to the new phase, so the phase a
/// writer waits for only holds readers already inside: a stream of readers does not starve
/// writers. The other phase's drain catches a reader that loaded the phase long ago, before an
/// earlier writer flipped it, and counted itself late.
///
/// A writer polls the counts (yielding, then sleeping from 20 µs up to 1 ms between checks):
/// readers do not look for writers, so they cannot wake one.
///
/// # Recursion, signals, fork
/// - Readers never wait: nested `load`s are fine, also in a signal handler.
/// - A writer waits for every reader, its own thread's included: `store` or `swap` while the
///   same thread holds a guard of the same cell deadlocks, as does one in a signal handler
///   that interrupted a reader of the cell.
/// - After `fork`, guards held by other threads of the parent stay pinned in the child for
///   ever: a writer in the child waits for ever.
///
/// # Modes and costs
/// As for [`crate::RwLock`]: without rseq or `membarrier`, pins are `SeqCst` atomic adds and
/// the writer's fences `SeqCst` fences ([`uses_rseq`](EpochCell::uses_rseq)). A pin and unpin
/// costs two restartable sequences and three loads; a `store` at least two `membarrier` calls.
/// Memory: 32 bytes per possible CPU, plus 32, besides the value, in the dense per-CPU arena
/// that [`crate::Counter`] uses.
///
/// # Variance
/// `store` writes through a shared borrow, so the cell is invariant in `T`, as `Cell<T>` is:
/// a borrow of an `EpochCell<&'static str>` cannot be shortened to store a string that dies
/// before the cell's readers load it.
///
/// ```compile_fail,E0597
/// let cell = thiscpu::EpochCell::new("static");
/// {
///     let s = String::from("freed before it is read");
///     let short: &thiscpu::EpochCell<&str> = &cell;
///     short.store(s.as_str());
/// }
/// let dangling: &'static str = *cell.load();
/// println!("{dangling}");
/// ```
///
/// # When not to use it
/// When values are replaced often (each replacement costs microseconds and waits for the
/// slowest reader), when a reader keeps a guard for long (writers wait for it: take
/// [`load_full`](EpochCell::load_full) to keep the value), or when writers must not block.
#[doc(alias = "ArcSwap")]
#[doc(alias = "rcu")]
pub struct EpochCell<T> {
    readers: ReaderCounts<2>,
    /// The phase new readers count themselves in: 0 or 1.
    phase: AtomicUsize,
    /// `Arc::into_raw` of the current value.
    current: AtomicUsize,
    writers: Mutex<()>,
    /// The cell owns an `Arc<T>` through `current`, and `store` writes a `T` through `&self`:
    /// like `Cell<T>`, the cell must be invariant in `T`, or a shared borrow could shorten
    /// `T`'s lifetimes and store a value that dies before the cell's readers load it.
    owns: PhantomData<(Arc<T>, Invariant<T>)>,
}

/// Takes and returns a `T`: a marker of it is neither covariant nor contravariant in `T`.
type Invariant<T> = fn(T) -> T;

// SAFETY: the cell holds an `Arc<T>`, which is `Send` and `Sync` when `T` is both.
unsafe impl<T: Send + Sync> Send for EpochCell<T> {}
// SAFETY: readers share `&T` across threads and a writer may drop the `T` on any thread.
unsafe impl<T: Send + Sync> Sync for EpochCell<T> {}

impl<T> EpochCell<T> {
    /// A cell holding `value`.
    pub fn new(value: T) -> Self {
        EpochCell::from_arc(Arc::new(value))
    }

    /// A cell holding `value`.
    pub fn from_arc(value: Arc<T>) -> Self {
        EpochCell {
            readers: ReaderCounts::new(),
            phase: AtomicUsize::new(0),
            current: AtomicUsize::new(Arc::into_raw(value) as usize),
            writers: Mutex::new(()),
            owns: PhantomData,
        }
    }

    /// Pins this reader and borrows the current value until the guard is dropped. Never
    /// waits.
    #[inline]
    pub fn load(&self) -> EpochGuard<'_, T> {
        // Relaxed: a stale phase only sends this reader to the phase the writer drains first.
        let phase = self.phase.load(Ordering::Relaxed) & 1;
        self.readers.enter(phase);
        // The writer's fence orders this load after the entry; acquire: the value's contents.
        let value = self.current.load(Ordering::SeqCst) as *const T;
        EpochGuard {
            cell: self,
            phase,
            value,
        }
    }

    /// The current value, as an `Arc` of its own (one reference count added).
    pub fn load_full(&self) -> Arc<T> {
        let guard = self.load();
        // SAFETY: the pointer came from `Arc::into_raw`, and the cell's count keeps it alive
        // while this reader is pinned.
        unsafe { Arc::increment_strong_count(guard.value) };
        // SAFETY: the count added above is the one this `Arc` owns.
        unsafe { Arc::from_raw(guard.value) }
    }

    /// Replaces the value, waits for every reader of the old one to unpin, and returns it.
    /// Deadlocks if this thread holds a guard of this cell.
    pub fn swap(&self, value: Arc<T>) -> Arc<T> {
        let _writer = self
            .writers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let old = self
            .current
            .swap(Arc::into_raw(value) as usize, Ordering::SeqCst) as *const T;
        let phase = self.phase.load(Ordering::Relaxed);
        self.wait_drained(phase ^ 1);
        self.phase.store(phase ^ 1, Ordering::SeqCst);
        self.wait_drained(phase);
        // SAFETY: `old` came from `Arc::into_raw` and the cell's count of it is handed over;
        // no reader that could have loaded it is pinned any more.
        unsafe { Arc::from_raw(old) }
    }

    /// Replaces the value and drops the old one once its readers have unpinned.
    pub fn store(&self, value: impl Into<Arc<T>>) {
        drop(self.swap(value.into()));
    }

    fn wait_drained(&self, phase: usize) {
        let mut round = 0;
        while !self.readers.drained(phase) {
            park::back_off(round);
            round += 1;
        }
    }

    /// Whether readers pin with restartable sequences and writers fence with `membarrier`
    /// (else with `SeqCst` atomics and fences).
    pub fn uses_rseq(&self) -> bool {
        self.readers.by_sections()
    }

    /// Bytes of per-CPU reader counts this cell holds (besides itself and the value).
    pub fn counts_bytes(&self) -> usize {
        self.readers.bytes()
    }

    /// Readers pinned now, from one unfenced look at the counts (a diagnostic).
    pub fn readers_inside(&self) -> u64 {
        self.readers.inside(0).wrapping_add(self.readers.inside(1))
    }
}

impl<T> Drop for EpochCell<T> {
    fn drop(&mut self) {
        let value = self.current.load(Ordering::Relaxed) as *const T;
        // SAFETY: the cell is dropped, so no reader is pinned (guards borrow it); its count of
        // the value is given up once.
        drop(unsafe { Arc::from_raw(value) });
    }
}

impl<T: Default> Default for EpochCell<T> {
    fn default() -> Self {
        EpochCell::new(T::default())
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for EpochCell<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("EpochCell")
            .field("mode", &if self.uses_rseq() { "rseq" } else { "atomic" })
            .field("value", &&*self.load())
            .finish()
    }
}

/// A pinned reader's borrow of an [`EpochCell`]'s value; unpins when dropped (on any CPU or
/// thread).
#[must_use = "the reader is unpinned when the guard is dropped"]
pub struct EpochGuard<'a, T> {
    cell: &'a EpochCell<T>,
    phase: usize,
    value: *const T,
}

// SAFETY: the guard is a shared borrow of a `T` (needs `Sync`) whose exit may be counted on
// any thread; the cell is `Sync` under the same bounds.
unsafe impl<T: Send + Sync> Send for EpochGuard<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for EpochGuard<'_, T> {}

impl<T> core::ops::Deref for EpochGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this reader is pinned in `phase`, and writers drop a value only after the
        // readers that could have loaded it have unpinned.
        unsafe { &*self.value }
    }
}

impl<T> Drop for EpochGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.cell.readers.exit(self.phase);
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for EpochGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}
