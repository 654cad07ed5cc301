//! `EpochCell<T>`: an `Arc<T>` that readers borrow by pinning with a restartable sequence and
//! that writers swap without waiting; the old value is dropped once its readers have left.
//!
//! # Safety
//! The cell owns one strong count of the `Arc` whose pointer it holds, and one of each value
//! it retired; a pinned reader dereferences the pointer it loaded, and the cell gives up its
//! count of a retired value only after every reader that could have loaded it has left.

use crate::reader_counts::ReaderCounts;
use crate::sync::Mutex;
use crate::sync::atomic::{AtomicUsize, Ordering};
use core::marker::PhantomData;
use std::sync::Arc;

/// A shared value that is read everywhere and replaced rarely, like `arc_swap::ArcSwap`:
/// [`load`](EpochCell::load) pins the reader with one restartable sequence on its CPU (and
/// unpins with another when the guard is dropped), with no atomic read-modify-write and no
/// reference count touched; [`store`](EpochCell::store) swaps in a new value and never waits
/// for readers: the cell keeps the old value until every reader that could still see it has
/// unpinned, and drops it at a later store (or [`reclaim`](EpochCell::reclaim), or the cell's
/// drop).
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
/// time, behind a mutex) swaps the pointer and puts the old value on the cell's list of
/// retired values, which wait for a drain of each phase. A drain check sums the exits, fences
/// every CPU with `membarrier`, and sums the entries: a reader whose entry the check misses
/// loads the pointer after the swap, so it does not hold the retired value; an exit the check
/// counts has its entry counted too. So once a check of each phase that began after a value
/// was retired has found its phase drained, no reader holds that value, and the cell drops it.
///
/// Each store (and [`reclaim`](EpochCell::reclaim)) checks, without waiting: first the phase
/// new readers do not enter, then, after flipping new readers over to it, the phase they
/// entered until then, which from then on holds only readers already inside. A stream of
/// readers therefore cannot keep a value alive: the next store after its readers have left
/// drops it. A check skips its `membarrier` when one unfenced look already sees a reader
/// inside.
///
/// # Recursion, signals, fork
/// - Readers never wait: nested `load`s are fine, also in a signal handler.
/// - Writers never wait for readers either, their own thread's included: the read-modify-write
///   `cell.store(Config { generation: cell.load().generation + 1 })` works, its guard living
///   to the end of the statement. Writers wait only for each other (a mutex): a `store` in a
///   signal handler that interrupted a `store` of the same cell on its thread deadlocks.
/// - After `fork`, guards held by other threads of the parent stay pinned in the child for
///   ever: the values they could see are never dropped in the child (memory, not a hang).
///
/// # Memory
/// Besides the current value, the cell keeps each value replaced while a reader that could see
/// it was still pinned, until a later store (or [`reclaim`](EpochCell::reclaim)) finds its
/// readers gone: one guard kept for long keeps every value replaced meanwhile, because a
/// reader's count says which phase it entered, not which value it holds. A guard that is never
/// dropped (`mem::forget(cell.load())`, or a thread parked inside one) keeps every later
/// value until the cell itself is dropped: after 1,000 stores, all 1,000 replaced values (the
/// test `a_forgotten_epoch_guard_keeps_every_later_value_until_the_cell_drops`). An
/// `arc_swap::ArcSwap` guard pins its one value instead. So keep guards short, and use
/// [`load_full`](EpochCell::load_full) for a value held across a wait;
/// [`retired`](EpochCell::retired) says how many values the cell holds.
///
/// # Modes and costs
/// As for [`crate::RwLock`]: without rseq or `membarrier`, pins are `SeqCst` atomic adds and
/// the writer's fences `SeqCst` fences ([`uses_rseq`](EpochCell::uses_rseq)). A pin and unpin
/// costs two restartable sequences and three loads; a `store` at most two `membarrier` calls
/// (none for a check whose unfenced look sees a reader inside).
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
/// When values are replaced often: each replacement costs microseconds of system calls, and in
/// the recorded run (a 2-CPU VM; the break-even table of the repository's docs/results.md)
/// `arc_swap::ArcSwap` came out ahead once replacements were more frequent than one in 75
/// loads. Or
/// when readers keep guards for long while values are replaced (the cell keeps every value
/// they could see: take [`load_full`](EpochCell::load_full) to keep one value instead).
#[doc(alias = "ArcSwap")]
#[doc(alias = "rcu")]
pub type EpochCell<T> = EpochCellAny<Arc<T>>;

/// An [`EpochCell`] that may hold no value, as `arc_swap::ArcSwapOption`: the same readers and
/// writers, with `None` for an empty cell.
///
/// ```
/// use std::sync::Arc;
/// let cache = thiscpu::EpochCellOption::<String>::empty();
/// assert!(cache.load().is_none());
/// cache.store(Some(Arc::new(String::from("warm"))));
/// assert_eq!(cache.load().as_deref().map(String::as_str), Some("warm"));
/// let old = cache.swap(None);
/// assert_eq!(old.as_deref().map(String::as_str), Some("warm"));
/// ```
pub type EpochCellOption<T> = EpochCellAny<Option<Arc<T>>>;

/// The one cell behind [`EpochCell`] (`P` is `Arc<T>`) and [`EpochCellOption`] (`P` is
/// `Option<Arc<T>>`), as `arc_swap::ArcSwapAny` is behind its two names. What both do with a
/// `P` is written once, for any `P`; what their signatures do not share (`new`, `load`, the
/// arguments of `store` and `compare_and_swap`) each name has in its own impl.
pub struct EpochCellAny<P: EpochPointer> {
    /// Never holds the null pointer when `P` is `Arc<T>`.
    core: Core<P::Pointee>,
    /// `P` is used only through `P::Pointee`, which does not count as a use of `P`.
    kind: PhantomData<P>,
}

/// What an [`EpochCellAny`] takes and gives back: `Arc<T>` (an [`EpochCell`]) or
/// `Option<Arc<T>>` (an [`EpochCellOption`]), as `arc_swap::RefCnt`. Sealed, so that its
/// methods stay this module's own.
pub trait EpochPointer: sealed::Pointer {}

impl<T> EpochPointer for Arc<T> {}

impl<T> EpochPointer for Option<Arc<T>> {}

/// What [`EpochCell`] and [`EpochCellOption`] share: the reader counts, the phase, the
/// pointer (`Arc::into_raw` of the value, or 0 for none in an [`EpochCellOption`]) and the
/// writers' lock with the values they replaced.
struct Core<T> {
    readers: ReaderCounts<2>,
    /// The phase new readers count themselves in: 0 or 1.
    phase: AtomicUsize,
    /// `Arc::into_raw` of the current value, or 0 for none.
    current: AtomicUsize,
    /// Serializes writers, and holds the values they replaced that readers may still see.
    writers: Mutex<Vec<Retired>>,
    /// The cell owns an `Arc<T>` through `current`.
    owns: PhantomData<Arc<T>>,
    /// `store` writes a `T` through `&self`: like `Cell<T>`, the cell must be invariant in
    /// `T`, or a shared borrow could shorten `T`'s lifetimes and store a value that dies
    /// before the cell's readers load it.
    invariant: PhantomData<fn(T) -> T>,
}

// SAFETY: the cell holds `Arc<T>`s, which are `Send` and `Sync` when `T` is both.
unsafe impl<T: Send + Sync> Send for Core<T> {}
// SAFETY: readers share `&T` across threads and a writer may drop the `T` on any thread.
unsafe impl<T: Send + Sync> Sync for Core<T> {}

/// A value the cell replaced, which pinned readers may still see, and the phases whose drain
/// it still waits for.
struct Retired {
    /// `Arc::into_raw` of the value: the cell's strong count of it.
    value: usize,
    /// Bit `p` set: a drain check of phase `p` that began after the value was retired has not
    /// yet found the phase drained.
    waits_for: u8,
}

/// `Retired::waits_for` of a value just retired: both phases.
const BOTH_PHASES: u8 = 0b11;

/// `Arc::into_raw` of `value` as the cell stores it, 0 for none.
fn into_raw<T>(value: Option<Arc<T>>) -> usize {
    value.map_or(0, |value| Arc::into_raw(value) as usize)
}

/// A pointer the cell stores, with a strong count added for the caller: the `Arc` that owns it.
///
/// # Safety
/// `raw` is 0 or came from `Arc::into_raw`, and a count the caller does not own keeps it alive
/// for the duration of the call (the cell's, or a pinned reader's hold on the cell's).
unsafe fn counted<T>(raw: usize) -> Option<Arc<T>> {
    (raw != 0).then(|| {
        let raw = raw as *const T;
        // SAFETY: the caller's contract; the count added is the one the `Arc` returned owns.
        unsafe {
            Arc::increment_strong_count(raw);
            Arc::from_raw(raw)
        }
    })
}

impl<T> Core<T> {
    fn new(value: Option<Arc<T>>) -> Self {
        Core {
            readers: ReaderCounts::new(),
            phase: AtomicUsize::new(0),
            current: AtomicUsize::new(into_raw(value)),
            writers: Mutex::new(Vec::new()),
            owns: PhantomData,
            invariant: PhantomData,
        }
    }

    /// Pins this reader and loads the pointer: `(phase, pointer)`. The caller unpins with
    /// [`Core::unpin`] in that phase.
    #[inline]
    fn pin(&self) -> (usize, usize) {
        // Relaxed: a stale phase only sends this reader to the phase the writer drains first.
        let phase = self.phase.load(Ordering::Relaxed) & 1;
        self.readers.enter(phase);
        // The writer's fence orders this load after the entry; acquire: the value's contents.
        (phase, self.current.load(Ordering::SeqCst))
    }

    /// Pins this reader and borrows the current pointer, null for an empty cell: a guard of
    /// the null pointer is only ever dropped, never handed out.
    #[inline]
    fn guard(&self) -> EpochGuard<'_, T> {
        let (phase, value) = self.pin();
        EpochGuard {
            core: self,
            phase,
            value: value as *const T,
        }
    }

    #[inline]
    fn unpin(&self, phase: usize) {
        self.readers.exit(phase);
    }

    /// The current value as an `Arc` of its own (one count added).
    fn load_full(&self) -> Option<Arc<T>> {
        let (phase, raw) = self.pin();
        // SAFETY: the pointer is 0 or came from `Arc::into_raw`, and the cell's count keeps
        // it alive while this reader is pinned.
        let full = unsafe { counted(raw) };
        self.unpin(phase);
        full
    }

    fn lock_writers(&self) -> crate::sync::MutexGuard<'_, Vec<Retired>> {
        self.writers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Stores `new` if the current pointer is `expected` (any pointer for `None`), and returns
    /// the value found, with a count of its own: the old value on success. A `new` not stored
    /// is dropped. Never waits for readers.
    fn replace(&self, expected: Option<usize>, new: Option<Arc<T>>) -> Option<Arc<T>> {
        let mut retired = self.lock_writers();
        // Relaxed: writers are serialized by the lock, and only they store the pointer.
        let found = self.current.load(Ordering::Relaxed);
        if expected.is_some_and(|expected| expected != found) {
            // SAFETY: `found` is the current pointer, alive by the cell's count while the lock
            // keeps it current.
            let previous = unsafe { counted(found) };
            drop(retired);
            return previous;
        }
        self.current.store(into_raw(new), Ordering::SeqCst);
        // SAFETY: `found` was the current pointer; the cell's count, now on the list below,
        // keeps it alive. The count added is the one `previous` owns (given back if a fence
        // panics below).
        let previous = unsafe { counted(found) };
        if found != 0 {
            retired.push(Retired {
                value: found,
                waits_for: BOTH_PHASES,
            });
        }
        let freed = self.advance(&mut retired);
        drop(retired);
        // Outside the lock: a value's drop may use the cell.
        drop(freed);
        previous
    }

    fn reclaim(&self) -> usize {
        let mut retired = self.lock_writers();
        let freed = self.advance(&mut retired);
        let left = retired.len();
        drop(retired);
        drop(freed);
        left
    }

    /// Checks the phases the retired values wait for, without waiting, and takes out those
    /// whose readers are gone (the caller drops them after unlocking). First the phase new
    /// readers do not enter (only readers already inside, or late ones that loaded the phase
    /// before a flip); then, if values still wait for the phase new readers enter, new readers
    /// are sent to the other one and that phase is checked: from the flip on, it holds only
    /// readers already inside, so a stream of readers cannot keep it from draining.
    fn advance(&self, retired: &mut Vec<Retired>) -> Vec<Arc<T>> {
        let waiting = |retired: &[Retired], phase: usize| {
            retired.iter().any(|r| r.waits_for & (1 << phase) != 0)
        };
        for _ in 0..2 {
            let entered = self.phase.load(Ordering::Relaxed) & 1;
            let quiet = entered ^ 1;
            if waiting(retired, quiet) {
                if !self.readers.drained_unless_seen_inside(quiet) {
                    break;
                }
                // The check began after every listed value was retired (the lock is held).
                retired
                    .iter_mut()
                    .for_each(|r| r.waits_for &= !(1 << quiet));
            }
            if !waiting(retired, entered) {
                break;
            }
            self.phase.store(quiet, Ordering::SeqCst);
        }
        let mut freed = Vec::new();
        retired.retain(|r| {
            if r.waits_for != 0 {
                return true;
            }
            // SAFETY: the value came from `Arc::into_raw` and the cell's count of it is given
            // up once, here: a drain of each phase begun after it was retired found no reader
            // left that could have loaded it.
            freed.push(unsafe { Arc::from_raw(r.value as *const T) });
            false
        });
        freed
    }

    fn mode(&self) -> &'static str {
        if self.readers.by_sections() {
            "rseq"
        } else {
            "atomic"
        }
    }
}

impl<T> Drop for Core<T> {
    fn drop(&mut self) {
        let retired = core::mem::take(&mut *self.lock_writers());
        let values = retired
            .iter()
            .map(|r| r.value)
            .chain(Some(self.current.load(Ordering::Relaxed)).filter(|&raw| raw != 0));
        for raw in values {
            // SAFETY: the cell is dropped, so no reader is pinned (guards borrow it); its
            // count of each value it holds, current or retired, is given up once.
            drop(unsafe { Arc::from_raw(raw as *const T) });
        }
    }
}

/// A pointer to compare with a cell's current value in
/// [`compare_and_swap`](EpochCell::compare_and_swap): an `&Arc<T>`, an [`EpochGuard`], or a
/// raw pointer, as `arc_swap::AsRaw`. Sealed.
pub trait AsRawPtr<T>: sealed::Sealed {
    /// The address compared.
    fn as_raw_ptr(&self) -> *const T;
}

mod sealed {
    use std::sync::Arc;

    /// An [`EpochPointer`](super::EpochPointer) as the nullable pointer the core stores.
    pub trait Pointer: Sized {
        /// The `T` of the `Arc<T>`.
        type Pointee;
        /// The cell's name in its `Debug` output.
        const NAME: &'static str;
        /// The value, or `None` for no value.
        fn into_option(self) -> Option<Arc<Self::Pointee>>;
        /// Back from what the core gave: `None` only for a cell that held no value, which an
        /// `EpochCell` never is.
        fn from_option(value: Option<Arc<Self::Pointee>>) -> Self;
        /// The address a compare-and-swap compares, 0 for none.
        fn address(&self) -> usize;
    }

    impl<T> Pointer for Arc<T> {
        type Pointee = T;
        const NAME: &'static str = "EpochCell";
        fn into_option(self) -> Option<Arc<T>> {
            Some(self)
        }
        fn from_option(value: Option<Arc<T>>) -> Self {
            value.expect("an EpochCell always holds a value")
        }
        fn address(&self) -> usize {
            Arc::as_ptr(self) as usize
        }
    }

    impl<T> Pointer for Option<Arc<T>> {
        type Pointee = T;
        const NAME: &'static str = "EpochCellOption";
        fn into_option(self) -> Option<Arc<T>> {
            self
        }
        fn from_option(value: Option<Arc<T>>) -> Self {
            value
        }
        fn address(&self) -> usize {
            self.as_ref().map_or(0, Pointer::address)
        }
    }

    pub trait Sealed {}
    impl<T> Sealed for &std::sync::Arc<T> {}
    impl<T> Sealed for &super::EpochGuard<'_, T> {}
    impl<T> Sealed for *const T {}
    impl<T> Sealed for *mut T {}
}

impl<T> AsRawPtr<T> for &Arc<T> {
    fn as_raw_ptr(&self) -> *const T {
        Arc::as_ptr(self)
    }
}

impl<T> AsRawPtr<T> for &EpochGuard<'_, T> {
    fn as_raw_ptr(&self) -> *const T {
        self.value
    }
}

impl<T> AsRawPtr<T> for *const T {
    fn as_raw_ptr(&self) -> *const T {
        *self
    }
}

impl<T> AsRawPtr<T> for *mut T {
    fn as_raw_ptr(&self) -> *const T {
        self.cast_const()
    }
}

impl<P: EpochPointer> EpochCellAny<P> {
    fn with(value: P) -> Self {
        EpochCellAny {
            core: Core::new(value.into_option()),
            kind: PhantomData,
        }
    }

    /// The current value, as an `Arc` of its own (one reference count added): an `Arc<T>`
    /// from an [`EpochCell`], an `Option<Arc<T>>` from an [`EpochCellOption`].
    pub fn load_full(&self) -> P {
        P::from_option(self.core.load_full())
    }

    /// Replaces the value and returns the old one, without waiting for its readers: the cell
    /// keeps a count of the old value until they have unpinned, so `Arc::try_unwrap` on it
    /// may fail until then (as with `arc_swap`). Works while this thread holds a guard of
    /// this cell. An [`EpochCellOption`] swaps an `Option<Arc<T>>`, `None` for no value.
    ///
    /// ```
    /// use std::sync::Arc;
    /// let cell = thiscpu::EpochCell::new(1);
    /// let pinned = cell.load();
    /// let old = cell.swap(Arc::new(2));
    /// assert_eq!((*old, *pinned, *cell.load()), (1, 1, 2));
    /// ```
    pub fn swap(&self, value: P) -> P {
        self.replace(None, value)
    }

    /// Stores `new` if the current pointer is `expected` (any pointer for `None`), and returns
    /// the value found: the old one on success. Never waits for readers.
    fn replace(&self, expected: Option<usize>, new: P) -> P {
        P::from_option(self.core.replace(expected, new.into_option()))
    }

    /// `rcu` with an `update` that gives a `P` already: retries while another writer got in
    /// between, and returns the value replaced.
    fn rcu_with(&self, mut update: impl FnMut(&P) -> P) -> P {
        let mut current = self.load_full();
        loop {
            let expected = current.address();
            let previous = self.replace(Some(expected), update(&current));
            if previous.address() == expected {
                return previous;
            }
            current = previous;
        }
    }

    /// Drops the replaced values whose readers have all unpinned, without waiting for any
    /// (at most two `membarrier` calls), and returns how many the cell still keeps. Stores
    /// do this themselves; call it to let go of old values sooner where stores are rare.
    ///
    /// ```
    /// let cell = thiscpu::EpochCell::new(String::from("old"));
    /// let pinned = cell.load();
    /// cell.store(String::from("new"));
    /// assert_eq!(cell.retired(), 1); // `pinned` may still read "old"
    /// drop(pinned);
    /// assert_eq!(cell.reclaim(), 0);
    /// ```
    pub fn reclaim(&self) -> usize {
        self.core.reclaim()
    }

    /// Replaced values the cell still keeps for readers that may see them.
    pub fn retired(&self) -> usize {
        self.core.lock_writers().len()
    }

    /// Whether readers pin with restartable sequences and writers fence with `membarrier`
    /// (else with `SeqCst` atomics and fences).
    pub fn uses_rseq(&self) -> bool {
        self.core.readers.by_sections()
    }
}

impl<T> EpochCell<T> {
    /// A cell holding `value`.
    pub fn new(value: T) -> Self {
        EpochCell::from_arc(Arc::new(value))
    }

    /// A cell holding `value`, as `arc_swap::ArcSwap::from_pointee`.
    pub fn from_pointee(value: T) -> Self {
        EpochCell::new(value)
    }

    /// A cell holding `value`.
    pub fn from_arc(value: Arc<T>) -> Self {
        EpochCell::with(value)
    }

    /// Pins this reader and borrows the current value until the guard is dropped. Never
    /// waits.
    #[inline]
    pub fn load(&self) -> EpochGuard<'_, T> {
        self.core.guard()
    }

    /// Replaces the value; the old one is dropped once its readers have unpinned (by this
    /// call, or a later one). Never waits for readers, its own thread's included:
    ///
    /// ```
    /// let cell = thiscpu::EpochCell::new(1u64);
    /// cell.store(*cell.load() + 1); // the guard lives to the end of the statement
    /// assert_eq!(*cell.load(), 2);
    /// ```
    pub fn store(&self, value: impl Into<Arc<T>>) {
        drop(self.swap(value.into()));
    }

    /// Stores `new` if the current value is `current` (compared by address, as
    /// `arc_swap::ArcSwap::compare_and_swap`), and returns the value found: the old one when
    /// it was swapped (`Arc::ptr_eq` with `current`), else the one that stands. Never waits
    /// for readers. Passing an `&Arc<T>` or an [`EpochGuard`] keeps the compared value alive,
    /// so its address cannot have been reused by another value (no ABA); a raw pointer does
    /// not.
    ///
    /// ```
    /// use std::sync::Arc;
    /// let cell = thiscpu::EpochCell::new(1);
    /// let seen = cell.load_full();
    /// let previous = cell.compare_and_swap(&seen, Arc::new(2));
    /// assert!(Arc::ptr_eq(&previous, &seen)); // swapped
    /// let previous = cell.compare_and_swap(&seen, Arc::new(3));
    /// assert_eq!(*previous, 2); // not swapped: the value that stands
    /// assert_eq!(*cell.load(), 2);
    /// ```
    pub fn compare_and_swap<C, N>(&self, current: C, new: N) -> Arc<T>
    where
        C: AsRawPtr<T>,
        N: Into<Arc<T>>,
    {
        self.replace(Some(current.as_raw_ptr() as usize), new.into())
    }

    /// Read, copy, update: calls `update` with the current value and stores what it returns,
    /// again with the newer value while another writer got in between (so `update` may run
    /// more than once: keep it free of side effects), as `arc_swap::ArcSwap::rcu`. Returns
    /// the value replaced.
    ///
    /// ```
    /// let routes = thiscpu::EpochCell::new(vec!["/a"]);
    /// let old = routes.rcu(|routes| {
    ///     let mut routes = Vec::clone(routes);
    ///     routes.push("/b");
    ///     routes
    /// });
    /// assert_eq!((old.len(), routes.load().len()), (1, 2));
    /// ```
    pub fn rcu<R, F>(&self, mut update: F) -> Arc<T>
    where
        F: FnMut(&Arc<T>) -> R,
        R: Into<Arc<T>>,
    {
        self.rcu_with(|current| update(current).into())
    }

    /// Bytes of per-CPU reader counts this cell holds (besides itself and the value).
    pub fn counts_bytes(&self) -> usize {
        self.core.readers.bytes()
    }

    /// Readers pinned now, from one unfenced look at the counts (a diagnostic).
    pub fn readers_inside(&self) -> u64 {
        let readers = &self.core.readers;
        readers.inside(0).wrapping_add(readers.inside(1))
    }
}

impl<T> EpochCellOption<T> {
    /// A cell holding `value`, or nothing.
    pub fn new(value: Option<Arc<T>>) -> Self {
        EpochCellOption::with(value)
    }

    /// A cell holding nothing.
    pub fn empty() -> Self {
        EpochCellOption::new(None)
    }

    /// A cell holding `value`, as `arc_swap::ArcSwapOption::from_pointee`.
    pub fn from_pointee(value: impl Into<Option<T>>) -> Self {
        EpochCellOption::new(value.into().map(Arc::new))
    }

    /// Pins this reader and borrows the current value until the guard is dropped, or `None`
    /// (unpinned at once) when the cell is empty. Never waits.
    #[inline]
    pub fn load(&self) -> Option<EpochGuard<'_, T>> {
        // Dropping the guard of an empty cell unpins it.
        Some(self.core.guard()).filter(|guard| !guard.value.is_null())
    }

    /// Replaces the value (or its absence), as [`EpochCell::store`].
    pub fn store(&self, value: Option<Arc<T>>) {
        drop(self.swap(value));
    }

    /// Stores `new` if the current value is `current` (by address; `None` matches an empty
    /// cell), and returns what was found, as [`EpochCell::compare_and_swap`].
    pub fn compare_and_swap(
        &self,
        current: Option<&Arc<T>>,
        new: Option<Arc<T>>,
    ) -> Option<Arc<T>> {
        self.replace(Some(current.map_or(0, sealed::Pointer::address)), new)
    }

    /// Read, copy, update, as [`EpochCell::rcu`]; returns the value replaced.
    pub fn rcu<F>(&self, update: F) -> Option<Arc<T>>
    where
        F: FnMut(&Option<Arc<T>>) -> Option<Arc<T>>,
    {
        self.rcu_with(update)
    }
}

/// `T::default()` in an [`EpochCell`]; an [`EpochCellOption`] starts empty.
impl<P: EpochPointer + Default> Default for EpochCellAny<P> {
    fn default() -> Self {
        EpochCellAny::with(P::default())
    }
}

impl<P: EpochPointer> From<P> for EpochCellAny<P> {
    fn from(value: P) -> Self {
        EpochCellAny::with(value)
    }
}

impl<T> From<T> for EpochCell<T> {
    fn from(value: T) -> Self {
        EpochCell::new(value)
    }
}

impl<T> From<Arc<T>> for EpochCellOption<T> {
    fn from(value: Arc<T>) -> Self {
        EpochCellOption::new(Some(value))
    }
}

impl<P: EpochPointer + core::fmt::Debug> core::fmt::Debug for EpochCellAny<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct(P::NAME)
            .field("mode", &self.core.mode())
            .field("value", &self.load_full())
            .finish()
    }
}

/// A pinned reader's borrow of an [`EpochCell`]'s (or [`EpochCellOption`]'s) value; unpins
/// when dropped (on any CPU or thread).
#[must_use = "the reader is unpinned when the guard is dropped"]
pub struct EpochGuard<'a, T> {
    core: &'a Core<T>,
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
        // readers that could have loaded it have unpinned; the pointer is never null here.
        unsafe { &*self.value }
    }
}

impl<T> Drop for EpochGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.core.unpin(self.phase);
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for EpochGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}
