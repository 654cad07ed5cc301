//! `Counter`: an exact per-CPU counter whose increment is one restartable sequence, stored
//! densely (8 bytes per CPU) by the stride allocator.
//!
//! # Safety
//! A counter owns one dense slot (a `u64` in every row); its words are only written by
//! restartable sequences positioned on the row's CPU (or concurrency id), by atomic adds when
//! the process has no rseq at all, or, for the spare row, by atomic adds; each block says how.

use crate::cpu;
use crate::dense;
use crate::ops::{self, ByCpu, ByMmCid, Outcome, Spread};
use crate::registration::{self, Registrar};
use core::marker::PhantomData;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// A counter that many threads increment at once without contention and without atomic
/// read-modify-write instructions: each increment adds to the word of the CPU the thread runs
/// on, inside a restartable sequence, and readers sum the words.
///
/// - `add` is exact under preemption, migration, signals (it may be called from a signal
///   handler) and thread exit: an interrupted increment is retried, never lost or doubled.
/// - Without rseq in the process (old kernel, valgrind, `THISCPU_RSEQ=off`) each `add` is an
///   atomic add on the word of the CPU the fallback reports: still exact, slower.
/// - A thread that cannot use rseq while the rest of the process does (for example a thread
///   made by a raw `clone`) adds atomically to a separate word, so plain and atomic updates
///   never meet on one word.
/// - [`sum`](Counter::sum) reads each word with one atomic load: never a torn value. It is exact
///   once writers have stopped (and happened-before the read, e.g. by `join`); while they run it
///   is, per word, a value that word had during the read.
///
/// Size: the handle is one pointer; the data is 8 bytes per CPU that ever incremented it (plus
/// 8 for threads without rseq), packed with other counters' words by [`crate::dense`].
///
/// ```
/// let requests = thiscpu::Counter::new();
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         s.spawn(|| (0..1000).for_each(|_| requests.inc()));
///     }
/// });
/// assert_eq!(requests.sum(), 4000);
/// ```
///
/// # A global counter
/// [`Counter::new`] is not a `const fn`, so `static REQUESTS: Counter = Counter::new();` does
/// not compile: making a counter allocates its dense slot (a word in every CPU's row, memory
/// that exists only at run time) and fixes, from the process's rseq decision, which spread its
/// adds use for its whole life. A [`LazyLock`](std::sync::LazyLock) makes it on first use;
/// after that each access is one load of the initialized state before the add.
///
/// ```
/// use std::sync::LazyLock;
///
/// static REQUESTS: LazyLock<thiscpu::Counter> = LazyLock::new(thiscpu::Counter::new);
///
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         s.spawn(|| (0..1000).for_each(|_| REQUESTS.inc()));
///     }
/// });
/// assert_eq!(REQUESTS.sum(), 4000);
/// ```
pub struct Counter<S: Spread = ByCpu> {
    /// The slot's address; for a counter spread by `mm_cid`, its lowest bit (free: slots are
    /// 8-byte aligned) says whether it adds by `mm_cid` or, where the process has none, by CPU.
    tagged_slot: NonNull<u64>,
    spread: PhantomData<S>,
}

// SAFETY: the counter's words are only accessed atomically or by restartable sequences, which
// no two threads can run on the same word at once; the handle is a plain address.
unsafe impl<S: Spread> Send for Counter<S> {}
// SAFETY: as above: every method takes `&self` and is safe to call concurrently.
unsafe impl<S: Spread> Sync for Counter<S> {}

const WORD: usize = core::mem::size_of::<u64>();

/// The bit of `tagged_slot` that says "adds by `mm_cid`".
const BY_MM_CID: usize = 1;

/// Per-word values already returned by `take`, for the counters that used it (keyed by slot
/// address): a taker subtracts instead of writing the words that rseq sections write.
static TAKEN: Mutex<Vec<(usize, Box<[u64]>)>> = Mutex::new(Vec::new());
/// Whether any counter was ever taken from: until then readers skip the table (and its lock,
/// which keeps `sum` usable in signal handlers in programs that never take).
static ANY_TAKEN: AtomicBool = AtomicBool::new(false);

impl Counter<ByCpu> {
    /// A counter at zero, spread by CPU. Not `const`: it allocates the counter's dense slot
    /// and reads the process's rseq decision; a `static` counter goes in a `LazyLock` (see
    /// [A global counter](Counter#a-global-counter)).
    ///
    /// ```
    /// assert_eq!(thiscpu::Counter::new().sum(), 0);
    /// ```
    #[must_use]
    pub fn new() -> Self {
        Counter::allocate()
    }
}

impl Counter<ByMmCid> {
    /// A counter at zero, spread by memory-map concurrency id.
    ///
    /// ```
    /// let c = thiscpu::Counter::by_mm_cid();
    /// c.inc();
    /// assert_eq!(c.sum(), 1);
    /// ```
    #[must_use]
    pub fn by_mm_cid() -> Self {
        Counter::allocate()
    }
}

impl<S: Spread> Counter<S> {
    /// A zeroed slot, and the spread its `add` uses for the counter's whole life: chosen here,
    /// once, from the process's decision, so that no two threads ever add to one word under
    /// different spreads (a CPU's sections and a concurrency id's are not exclusive with each
    /// other). A counter made while nothing is decided (in a signal handler that interrupted
    /// the decision) adds by CPU.
    fn allocate() -> Self {
        let slot = dense::alloc(WORD, WORD).cast::<u64>();
        let by_mm_cid = S::FIELD == ByMmCid::FIELD
            && registration::decided().is_some_and(|process| process.rseq.mm_cid_usable());
        Counter {
            tagged_slot: slot.map_addr(|address| address | usize::from(by_mm_cid)),
            spread: PhantomData,
        }
    }

    /// The slot's address, without the tag.
    #[inline(always)]
    fn slot(&self) -> NonNull<u64> {
        if S::FIELD == ByCpu::FIELD {
            return self.tagged_slot;
        }
        let tagged = self.tagged_slot;
        tagged.map_addr(|address| {
            core::num::NonZeroUsize::new(address.get() & !BY_MM_CID).unwrap_or(address)
        })
    }

    /// Whether `add` adds by `mm_cid` (else by CPU): a counter made by [`Counter::by_mm_cid`]
    /// in a process whose kernel keeps `mm_cid` current (Linux 6.3+, with rseq).
    ///
    /// ```
    /// let c = thiscpu::Counter::by_mm_cid();
    /// assert_eq!(c.indexed_by_mm_cid(), thiscpu::source().mm_cid);
    /// assert!(!thiscpu::Counter::new().indexed_by_mm_cid());
    /// ```
    #[inline]
    #[must_use]
    pub fn indexed_by_mm_cid(&self) -> bool {
        S::FIELD == ByMmCid::FIELD && self.tagged_slot.addr().get() & BY_MM_CID != 0
    }

    #[inline(always)]
    fn word(&self, row: u32) -> &AtomicU64 {
        // SAFETY: callers pass `row <= dense::cpu_rows()`; the slot is a live, zeroed-at-birth,
        // 8-byte aligned `u64` in every row, accessed only atomically or by sections.
        unsafe { AtomicU64::from_ptr(dense::row(self.slot().cast(), row).cast()) }
    }

    /// Address of row `row`'s word (for tests and diagnostics, e.g. checking with `mincore`
    /// which rows are resident). Rows are CPUs below `topology::possible_cpus()`, plus one.
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// assert_eq!(c.word_address(1) - c.word_address(0), thiscpu::dense::STRIDE);
    /// ```
    pub fn word_address(&self, row: u32) -> usize {
        self.word(row.min(dense::cpu_rows())).as_ptr() as usize
    }

    /// Adds 1.
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.inc();
    /// assert_eq!(c.sum(), 1);
    /// ```
    #[inline]
    pub fn inc(&self) {
        self.add(1);
    }

    /// Adds `n` (wrapping at 2^64, like the sum).
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.add(40);
    /// c.add(2);
    /// assert_eq!(c.sum(), 42);
    /// ```
    #[inline]
    pub fn add(&self, n: u64) {
        if !self.indexed_by_mm_cid() {
            self.add_by::<ByCpu>(n);
        } else {
            self.add_by::<ByMmCid>(n);
        }
    }

    #[inline(always)]
    fn add_by<By: Spread>(&self, n: u64) {
        let at = ops::position_as_is::<By>();
        // SAFETY: `at` was just read by this thread, and `dense::cpu_rows()` never exceeds the
        // rows of the counter's range.
        unsafe { self.add_at(at, dense::cpu_rows(), n) }
    }

    /// The fast path at `at`, or the slow path when `at` is unregistered or its index is not
    /// below `rows`.
    ///
    /// # Safety
    /// `at` was read by the calling thread, `rows` is at most `dense::cpu_rows()`, and `By` is
    /// the counter's spread (`indexed_by_mm_cid`).
    #[inline(always)]
    unsafe fn add_at<By: Spread>(&self, at: ops::Position<By>, rows: u32, n: u64) {
        let index = at.index();
        // One unsigned comparison rejects both an unregistered area and an index beyond the
        // rows.
        if index < rows {
            // SAFETY: `at` was read from this thread's area, by `By`; the word is row `index`'s
            // (below the rows, the caller's contract), written only by sections positioned on
            // that index with the same spread (process-wide: `mm_cid` usable never changes once
            // true) or, when the process has no rseq, by atomic adds (never both, see
            // `add_slow_by`).
            let outcome = unsafe { ops::load_add_store(at, self.word(index).as_ptr(), n) };
            if outcome == Outcome::Committed(()) {
                return;
            }
            return self.add_after_abort::<By>(n);
        }
        self.add_slow_by::<By>(n);
    }

    /// An [`Adder`] for this counter, for loops that add many times: it holds what each
    /// [`add`](Counter::add) would otherwise load from memory (where the rseq area is, where the
    /// counter's words are, how many rows there are, the spread), so that in a loop the
    /// compiler keeps them in registers. Its adds are exact, like the counter's own.
    ///
    /// Made on a thread without rseq, or before the process has decided how it uses rseq, an
    /// adder passes every add to [`Counter::add`].
    ///
    /// ```
    /// let requests = thiscpu::Counter::new();
    /// let adder = requests.adder();
    /// for _ in 0..1000 {
    ///     adder.inc();
    /// }
    /// assert_eq!(requests.sum(), 1000);
    /// ```
    #[must_use]
    pub fn adder(&self) -> Adder<'_, S> {
        // Once this thread has a position, the process has decided: the area offset no longer
        // changes (the counter's spread never does).
        let decided = ops::position().is_some();
        Adder {
            counter: self,
            area: ops::area_offset(),
            rows: if decided { dense::cpu_rows() } else { 0 },
            by_mm_cid: self.indexed_by_mm_cid(),
        }
    }

    /// The fast path's abort: counted, then retried on the slow path. One call that the fast
    /// path jumps to, so the fast path keeps nothing across a call and saves no register.
    #[cold]
    #[inline(never)]
    fn add_after_abort<By: Spread>(&self, n: u64) {
        ops::note_abort();
        self.add_slow_by::<By>(n);
    }

    /// The slow path: registers this thread if it can, retries, and gives up to an atomic add
    /// where sections cannot run.
    #[cold]
    #[inline(never)]
    fn add_slow_by<By: Spread>(&self, n: u64) {
        let mut aborts = ops::AbortRun::new();
        while let Some(at) = ops::position_by::<By>() {
            let index = at.index();
            if index >= dense::cpu_rows() {
                break;
            }
            // SAFETY: as in `add_by`; a migration since the read makes the section abort,
            // since it compares the spread's field again.
            match unsafe { ops::load_add_store(at, self.word(index).as_ptr(), n) } {
                Outcome::Committed(()) => return,
                Outcome::Mismatch | Outcome::Aborted => {
                    ops::note_abort();
                    if aborts.gives_up() {
                        // Interrupted at every instruction: the spare row, atomically.
                        self.word(dense::cpu_rows()).fetch_add(n, Ordering::Relaxed);
                        return;
                    }
                }
            }
        }
        // No rseq for this thread. When nobody in the process uses rseq, every update of the
        // words is atomic, so the fallback CPU's word spreads the load safely; otherwise (or
        // while the decision is not known, in a signal handler that interrupted it) sections
        // may write the words with plain adds, and this thread must stay off them.
        if registration::decided().is_some_and(|process| process.rseq.registrar == Registrar::None)
        {
            let cpu = cpu::current_cpu() % dense::cpu_rows();
            self.word(cpu).fetch_add(n, Ordering::Relaxed);
        } else {
            self.word(dense::cpu_rows()).fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The total: every word read once with an atomic load, summed (wrapping), minus what
    /// [`take`](Counter::take) already returned.
    ///
    /// Async-signal-safe while no counter of the process has been taken from; after the first
    /// `take`, `sum`, [`per_cpu`](Counter::per_cpu) and [`unattributed`](Counter::unattributed)
    /// read the taken values under a lock (do not call them from a handler that may interrupt a
    /// `take` in the same thread).
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.add(3);
    /// assert_eq!(c.sum(), 3);
    /// ```
    pub fn sum(&self) -> u64 {
        // What was taken is read before the words: every word only grows, so each is then at
        // least the value a take recorded for it, and a take racing this read cannot make the
        // difference wrap below zero.
        let taken = self.taken_total();
        let raw = (0..=dense::cpu_rows())
            .map(|row| self.word(row).load(Ordering::Relaxed))
            .fold(0u64, u64::wrapping_add);
        raw.wrapping_sub(taken)
    }

    /// Each CPU's (or concurrency id's) share since the last take: `(index, value)` for every
    /// possible CPU.
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.inc();
    /// assert_eq!(c.per_cpu().map(|(_, v)| v).sum::<u64>() + c.unattributed(), 1);
    /// ```
    pub fn per_cpu(&self) -> impl ExactSizeIterator<Item = (u32, u64)> + '_ {
        let taken = self.taken_words();
        (0..dense::cpu_rows()).map(move |row| {
            let base = taken.as_ref().map_or(0, |taken| taken[row as usize]);
            (
                row,
                self.word(row).load(Ordering::Relaxed).wrapping_sub(base),
            )
        })
    }

    /// What threads without rseq added while the rest of the process used it (normally 0),
    /// since the last take.
    pub fn unattributed(&self) -> u64 {
        let row = dense::cpu_rows();
        let base = self.taken_words().map_or(0, |taken| taken[row as usize]);
        self.word(row).load(Ordering::Relaxed).wrapping_sub(base)
    }

    /// Returns what was added since the previous `take` (or since creation) and starts counting
    /// from zero again, while other threads keep adding: every increment is returned by exactly
    /// one `take` (or still counted by [`sum`](Counter::sum)), none is lost or returned twice.
    ///
    /// Each word only grows (modulo 2^64) and is read once with an atomic load, so the taker
    /// remembers what it has read per word and subtracts, instead of writing words that
    /// restartable sequences on other CPUs write: no fence, no pause for the writers.
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.add(5);
    /// assert_eq!(c.take(), 5);
    /// c.add(2);
    /// assert_eq!((c.sum(), c.take(), c.sum()), (2, 2, 0));
    /// ```
    pub fn take(&self) -> u64 {
        let rows = dense::cpu_rows() as usize + 1;
        let mut taken = TAKEN
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        ANY_TAKEN.store(true, Ordering::Relaxed);
        let key = self.slot().as_ptr() as usize;
        let position = match taken.iter().position(|(slot, _)| *slot == key) {
            Some(position) => position,
            None => {
                taken.push((key, vec![0; rows].into_boxed_slice()));
                taken.len() - 1
            }
        };
        let bases = &mut taken[position].1;
        let mut total = 0u64;
        for (row, base) in bases.iter_mut().enumerate() {
            let now = self.word(row as u32).load(Ordering::Relaxed);
            total = total.wrapping_add(now.wrapping_sub(*base));
            *base = now;
        }
        total
    }

    /// Sets the counter back to zero, concurrently with writers: what `take` would return is
    /// discarded.
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.add(7);
    /// c.reset();
    /// assert_eq!(c.sum(), 0);
    /// ```
    pub fn reset(&self) {
        let _ = self.take();
    }

    /// `f` of what `take` returned so far per word, read under the table's lock; `None` when
    /// nothing was ever taken from this counter.
    fn with_taken<R>(&self, f: impl FnOnce(&[u64]) -> R) -> Option<R> {
        if !ANY_TAKEN.load(Ordering::Relaxed) {
            return None;
        }
        let taken = TAKEN
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let key = self.slot().as_ptr() as usize;
        taken
            .iter()
            .find(|(slot, _)| *slot == key)
            .map(|(_, bases)| f(bases))
    }

    fn taken_words(&self) -> Option<Box<[u64]>> {
        self.with_taken(|bases| Box::from(bases))
    }

    /// The sum of what `take` returned so far, without allocating (so that `sum` allocates
    /// nothing, whatever a program's allocator counts with).
    fn taken_total(&self) -> u64 {
        self.with_taken(|bases| bases.iter().fold(0u64, |sum, &base| sum.wrapping_add(base)))
            .unwrap_or(0)
    }
}

impl<S: Spread> Drop for Counter<S> {
    fn drop(&mut self) {
        if ANY_TAKEN.load(Ordering::Relaxed) {
            let key = self.slot().as_ptr() as usize;
            let mut taken = TAKEN
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            taken.retain(|(slot, _)| *slot != key);
        }
        // SAFETY: `drop` has the counter exclusively: no `add` (which borrows it) is running or
        // can be interrupted mid-section, so no late increment can reach the slot; it is freed
        // once, with the size and alignment it was allocated with.
        unsafe { dense::free(self.slot().cast(), WORD, WORD) };
    }
}

impl Default for Counter<ByCpu> {
    fn default() -> Self {
        Counter::new()
    }
}

impl<S: Spread> core::fmt::Debug for Counter<S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Counter").field("sum", &self.sum()).finish()
    }
}
/// A [`Counter`]'s adds with the counter's address, its rows, the rseq area's offset and the
/// spread read once, by [`Counter::adder`]: a loop of `adder.inc()` keeps them in registers,
/// where a loop of `counter.inc()` loads them again on every call (each add is a restartable
/// sequence, an `asm!` block the compiler must assume writes memory).
///
/// It may be sent to and used by any thread: what it holds is the same in every thread. A
/// thread that is not registered yet takes the counter's slow path, which registers it.
///
/// By `mm_cid` an adder saves less: each add still reads `cpu_id` before `mm_cid`, since an
/// unregistered area shows `mm_cid` 0 rather than a negative id.
///
/// ```
/// let hits = thiscpu::Counter::by_mm_cid();
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         let adder = hits.adder();
///         s.spawn(move || (0..1000).for_each(|_| adder.add(2)));
///     }
/// });
/// assert_eq!(hits.sum(), 8000);
/// ```
pub struct Adder<'a, S: Spread = ByCpu> {
    counter: &'a Counter<S>,
    area: ops::AreaOffset,
    /// `dense::cpu_rows()` once the process had decided, 0 (every add takes the slow path)
    /// before.
    rows: u32,
    /// Whether `Counter::add` spreads by `mm_cid`; read after the decision, so final.
    by_mm_cid: bool,
}

impl<S: Spread> Clone for Adder<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S: Spread> Copy for Adder<'_, S> {}

impl<S: Spread> core::fmt::Debug for Adder<'_, S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Adder")
            .field("rows", &self.rows)
            .field("by_mm_cid", &self.by_mm_cid)
            .finish_non_exhaustive()
    }
}

impl<S: Spread> Adder<'_, S> {
    /// Adds 1 to the counter.
    #[inline]
    pub fn inc(&self) {
        self.add(1);
    }

    /// Adds `n` to the counter (wrapping at 2^64), as [`Counter::add`] does.
    #[inline]
    pub fn add(&self, n: u64) {
        if self.by_mm_cid {
            let at = ops::position_in::<ByMmCid>(self.area);
            // SAFETY: `at` was just read by this thread; `rows` is `dense::cpu_rows()` read
            // after the process decided, when `by_mm_cid` is the spread `add` chooses and stays
            // so, or 0 when the adder was made before that.
            unsafe { self.counter.add_at(at, self.rows, n) }
        } else {
            let at = ops::position_in::<ByCpu>(self.area);
            // SAFETY: as above, by CPU.
            unsafe { self.counter.add_at(at, self.rows, n) }
        }
    }
}
