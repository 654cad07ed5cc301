//! `CpuMask`: a set of CPUs that many threads update at once, whose `set` and `clear` avoid the
//! atomic read-modify-write when the bit already holds the wanted value.
//!
//! # Why `set` does not always write
//! A CPU mask that every CPU updates for itself (the kernel's `mm_cpumask`, a pool's "touched"
//! mask) packs 64 CPUs into one word, so one cache line is shared by all of them. An atomic
//! `fetch_or` takes that line exclusive even when the bit is already set, and the line then
//! bounces between cores: the x86 `switch_mm` patch (Rik van Riel, "x86,switch_mm: skip atomic
//! operations for init_mm") measured `cpumask_set_cpu`/`cpumask_clear_cpu` at half of
//! `switch_mm_irqs_off` for exactly this reason. Reading first and skipping the write when the
//! bit is already right keeps the line shared in every cache: a hit costs one load.
//!
//! Reading first has a price when the bit *does* change: the load brings the line in shared,
//! and the read-modify-write that follows must then upgrade it, a second coherence transaction
//! (measured with two threads flipping their bits: 12.2 ns against 8.8 ns for a bare
//! `fetch_or`). So a mask has two modes, written only when the mode changes. A call reads the
//! mode as the number of words it may read first, kept next to the word pointer: all of them in
//! read-first mode, none otherwise, so one comparison of the word's index checks both the mode
//! and the bounds:
//! - **read first** (the start, and the steady state of "the bit is usually right"): one load;
//!   a read-modify-write only when the bit must change. Each thread counts, in its own TLS and
//!   only on that rare path, the changes it made; after [`STREAK`] of them it switches the mask
//!   to the other mode.
//! - **read-modify-write**: a bare `fetch_or`/`fetch_and`, whose returned old value says whether
//!   the call was needed. Two calls that changed nothing, with no change between them, switch
//!   the mask back.
//!
//! In the steady states nothing but the bits is written: "always right" stays in read-first,
//! "changes every call" stays in read-modify-write. A pattern that changes the bit once in a
//! while (one call in 16, say) visits read-modify-write once every `STREAK` changes (of each
//! thread) and pays two wasted read-modify-writes and a few writes of the mode there. The hot
//! path never touches TLS: on some machines (AMD EPYC virtual machines among them) an
//! `fs`-relative load costs as much as the read-first fast path itself.
//!
//! # Memory ordering
//! Every operation is `Relaxed`: a mask says *which* CPUs, it does not publish data. A thread
//! that set a bit before writing data elsewhere is seen with its bit by any reader that
//! happens-after the write (by `join`, a lock, or an acquire/release pair of the caller's), by
//! the coherence of the word; order the data itself with that same synchronization.
//!
//! # Safety
//! One unchecked index, on the read-first path: the count of words that path may read is only
//! ever 0 or the number of words.

use crate::topology;
use core::cell::Cell;
use core::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};

/// Bits per word.
const BITS: usize = 64;

/// Read-modify-write mode, fresh: the number of wasted calls it takes to go back to reading
/// first.
const RMW_FRESH: u8 = 2;

/// Changes made through read-first calls, per thread and mask, before a mask switches to
/// read-modify-write mode.
pub const STREAK: u8 = 64;

/// Change counters per thread; masks are spread over them by creation number (two masks that
/// share a counter only share a count, never a bit).
const COUNTERS: usize = 16;

thread_local! {
    /// The calling thread's change counters. Constant-initialised and without a destructor, so
    /// valid for the thread's whole life (a signal handler interrupting an update only blurs a
    /// count). Touched only when a read-first call must change a bit.
    static CHANGES: [Cell<u8>; COUNTERS] = const { [const { Cell::new(0) }; COUNTERS] };
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

/// A set of CPU ids, shared between threads, sized for every possible CPU.
///
/// - [`set`](CpuMask::set) and [`clear`](CpuMask::clear) are lock-free and, when the bit
///   already holds the wanted value, usually cost one load and no write; a mask whose bits
///   change on most calls switches to plain read-modify-writes (see the module documentation).
/// - [`contains`](CpuMask::contains), [`iter`](CpuMask::iter), [`count`](CpuMask::count) and
///   [`first`](CpuMask::first) read each word once; while other threads update the mask they
///   see every bit as it was at some moment during the call.
/// - Every operation is `Relaxed` (see "Memory ordering" in the module documentation).
///
/// Size: one `u64` per 64 CPUs and four words (plus 16 bytes of static TLS per thread, shared
/// by all masks).
///
/// ```
/// let running = thiscpu::CpuMask::new();
/// let cpu = running.set_current();
/// assert!(running.contains(cpu));
/// assert_eq!(running.iter().collect::<Vec<_>>(), vec![cpu]);
/// assert!(running.clear(cpu));
/// assert!(running.is_empty());
/// ```
pub struct CpuMask {
    words: Box<[AtomicU64]>,
    /// The words a call may read first: `words.len()` in read-first mode, 0 in
    /// read-modify-write mode, never anything else. One comparison of a word's index with it
    /// checks the bounds and the mode at once.
    read_first_words: AtomicUsize,
    /// In read-modify-write mode, the wasted calls left before reading first again
    /// (1..=`RMW_FRESH`). Neither read nor written in read-first mode, where it is stale.
    wasted_left: AtomicU8,
    /// This mask's change counter in every thread, below `COUNTERS`.
    counter: u8,
}

impl CpuMask {
    /// An empty mask for every possible CPU ([`topology::possible_cpus`]).
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::new();
    /// assert!(mask.capacity() >= thiscpu::topology::possible_cpus());
    /// assert_eq!(mask.count(), 0);
    /// ```
    pub fn new() -> Self {
        CpuMask::with_capacity(topology::possible_cpus())
    }

    /// An empty mask for CPUs `0..cpus` at least (any count; the capacity is rounded up to a
    /// multiple of 64).
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::with_capacity(300);
    /// mask.set(299);
    /// assert_eq!(mask.first(), Some(299));
    /// ```
    pub fn with_capacity(cpus: usize) -> Self {
        let words: Box<[AtomicU64]> = (0..cpus.max(1).div_ceil(BITS))
            .map(|_| AtomicU64::new(0))
            .collect();
        CpuMask {
            read_first_words: AtomicUsize::new(words.len()),
            words,
            wasted_left: AtomicU8::new(RMW_FRESH),
            counter: (NEXT_ID.fetch_add(1, Ordering::Relaxed) % COUNTERS) as u8,
        }
    }

    /// How many CPUs the mask can hold: valid ids are `0..capacity()`, a multiple of 64.
    ///
    /// ```
    /// assert_eq!(thiscpu::CpuMask::with_capacity(3).capacity(), 64);
    /// assert_eq!(thiscpu::CpuMask::with_capacity(65).capacity(), 128);
    /// ```
    #[inline]
    pub fn capacity(&self) -> usize {
        self.words.len() * BITS
    }

    /// Adds `cpu`; returns whether it was absent (whether this call changed the mask).
    /// Panics if `cpu >= capacity()`, with a message naming the CPU and the capacity.
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::new();
    /// assert!(mask.set(0));
    /// assert!(!mask.set(0), "already there: nothing written");
    /// ```
    ///
    /// ```should_panic
    /// thiscpu::CpuMask::with_capacity(64).set(64); // "CPU 64 is beyond the mask's capacity of 64 CPUs"
    /// ```
    #[inline]
    #[track_caller]
    pub fn set(&self, cpu: u32) -> bool {
        self.update(cpu, true)
    }

    /// Removes `cpu`; returns whether it was present (whether this call changed the mask).
    /// Panics if `cpu >= capacity()`.
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::new();
    /// mask.set(0);
    /// assert!(mask.clear(0));
    /// assert!(!mask.clear(0));
    /// ```
    #[inline]
    #[track_caller]
    pub fn clear(&self, cpu: u32) -> bool {
        self.update(cpu, false)
    }

    /// Adds the CPU the calling thread runs on now, and returns it. The thread may migrate
    /// right after: the bit says "this CPU was used", not "this thread is there".
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::new();
    /// let cpu = mask.set_current();
    /// assert!(mask.contains(cpu));
    /// ```
    #[inline]
    pub fn set_current(&self) -> u32 {
        let cpu = self.current();
        self.set(cpu);
        cpu
    }

    /// Removes the CPU the calling thread runs on now, and returns it.
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::new();
    /// let cpu = mask.set_current();
    /// mask.clear(cpu);
    /// assert!(!mask.contains(cpu));
    /// ```
    #[inline]
    pub fn clear_current(&self) -> u32 {
        let cpu = self.current();
        self.clear(cpu);
        cpu
    }

    #[inline]
    fn current(&self) -> u32 {
        let cpu = crate::cpu::current_cpu();
        // Below the possible CPUs by the kernel's guarantee; a mask made smaller by
        // `with_capacity` folds larger ids rather than panicking.
        let capacity = self.capacity();
        if (cpu as usize) < capacity {
            cpu
        } else {
            (cpu as usize % capacity) as u32
        }
    }

    /// Whether `cpu` is in the mask (false for ids beyond the capacity).
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::new();
    /// mask.set(0);
    /// assert!(mask.contains(0));
    /// assert!(!mask.contains(100_000));
    /// ```
    #[inline]
    pub fn contains(&self, cpu: u32) -> bool {
        let index = cpu as usize;
        self.words
            .get(index / BITS)
            .is_some_and(|word| word.load(Ordering::Relaxed) & (1 << (index % BITS)) != 0)
    }

    /// The CPUs in the mask, in increasing order; each word is read once, when the iterator
    /// reaches it.
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::with_capacity(130);
    /// for cpu in [1, 64, 129] {
    ///     mask.set(cpu);
    /// }
    /// assert_eq!(mask.iter().collect::<Vec<_>>(), vec![1, 64, 129]);
    /// ```
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            words: &self.words,
            index: 0,
            current: 0,
        }
    }

    /// Number of CPUs in the mask.
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::new();
    /// mask.set(0);
    /// assert_eq!(mask.count(), 1);
    /// ```
    pub fn count(&self) -> usize {
        self.words
            .iter()
            .map(|word| word.load(Ordering::Relaxed).count_ones() as usize)
            .sum()
    }

    /// Whether no CPU is in the mask.
    ///
    /// ```
    /// assert!(thiscpu::CpuMask::new().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.words
            .iter()
            .all(|word| word.load(Ordering::Relaxed) == 0)
    }

    /// The lowest CPU in the mask.
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::with_capacity(200);
    /// assert_eq!(mask.first(), None);
    /// mask.set(150);
    /// mask.set(70);
    /// assert_eq!(mask.first(), Some(70));
    /// ```
    pub fn first(&self) -> Option<u32> {
        self.iter().next()
    }

    /// Removes every CPU (one atomic swap per non-empty word).
    ///
    /// ```
    /// let mask = thiscpu::CpuMask::new();
    /// mask.set(0);
    /// mask.clear_all();
    /// assert!(mask.is_empty());
    /// ```
    pub fn clear_all(&self) {
        for word in self.words.iter() {
            if word.load(Ordering::Relaxed) != 0 {
                word.swap(0, Ordering::Relaxed);
            }
        }
    }
}

impl CpuMask {
    /// The update of one bit, by the mask's mode.
    #[inline(always)]
    #[track_caller]
    fn update(&self, cpu: u32, set: bool) -> bool {
        let index = cpu as usize / BITS;
        let bit = 1 << (cpu as usize % BITS);
        if index < self.read_first_words.load(Ordering::Relaxed) {
            // SAFETY: `read_first_words` is 0 or `words.len()` (see its definition), so the index
            // is in bounds.
            let word = unsafe { self.words.get_unchecked(index) };
            // Read first: the usual case finds the bit right and writes nothing.
            if (word.load(Ordering::Relaxed) & bit != 0) == set {
                return false;
            }
            return self.change_after_read(word, bit, set);
        }
        // Read-modify-write mode (or an index beyond the capacity, which panics here): learn
        // from the old value. In the steady "every call changes it" state nothing else is
        // written; a wasted call counts towards reading first.
        let Some(word) = self.words.get(index) else {
            beyond_capacity(cpu, self.capacity())
        };
        let left = self.wasted_left.load(Ordering::Relaxed);
        let changed = read_modify_write(word, bit, set);
        if !changed {
            if left <= 1 {
                self.read_first_words
                    .store(self.words.len(), Ordering::Relaxed);
            } else {
                self.wasted_left.store(left - 1, Ordering::Relaxed);
            }
        } else if left != RMW_FRESH {
            self.wasted_left.store(RMW_FRESH, Ordering::Relaxed);
        }
        changed
    }

    /// Two stores, so a racing call can see the new mode with the old count; then the count is
    /// only an early or a late switch back, never a wrong bit.
    fn switch_to_read_modify_write(&self) {
        self.wasted_left.store(RMW_FRESH, Ordering::Relaxed);
        self.read_first_words.store(0, Ordering::Relaxed);
    }

    /// A read-first call found the bit wrong: change it, and count the change.
    #[cold]
    #[inline(never)]
    fn change_after_read(&self, word: &AtomicU64, bit: u64, set: bool) -> bool {
        let changed = read_modify_write(word, bit, set);
        let streak = CHANGES
            .try_with(|counters| {
                let counter = &counters[usize::from(self.counter) % COUNTERS];
                let streak = counter.get().saturating_add(1);
                counter.set(if streak >= STREAK { 0 } else { streak });
                streak
            })
            .unwrap_or(0);
        if streak >= STREAK {
            self.switch_to_read_modify_write();
        }
        changed
    }
}

/// The panic of `set` and `clear` on a CPU the mask has no bit for, naming both numbers (an
/// index error would name only a word).
#[cold]
#[inline(never)]
#[track_caller]
fn beyond_capacity(cpu: u32, capacity: usize) -> ! {
    panic!(
        "thiscpu::CpuMask: CPU {cpu} is beyond the mask's capacity of {capacity} CPUs \
         (ids 0..{capacity}); make it with CpuMask::with_capacity({})",
        cpu as usize + 1
    )
}

/// `fetch_or` or `fetch_and`; returns whether the bit changed.
#[inline(always)]
fn read_modify_write(word: &AtomicU64, bit: u64, set: bool) -> bool {
    let old = if set {
        word.fetch_or(bit, Ordering::Relaxed)
    } else {
        word.fetch_and(!bit, Ordering::Relaxed)
    };
    (old & bit != 0) != set
}

impl Default for CpuMask {
    fn default() -> Self {
        CpuMask::new()
    }
}

/// A copy of the mask's bits at the moment of the call (word by word), with a fresh predictor.
impl Clone for CpuMask {
    fn clone(&self) -> Self {
        let copy = CpuMask::with_capacity(self.capacity());
        for (to, from) in copy.words.iter().zip(self.words.iter()) {
            to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        copy
    }
}

/// A mask for every possible CPU holding the given CPUs. Panics on a CPU beyond them.
///
/// ```
/// let mask: thiscpu::CpuMask = [0].into_iter().collect();
/// assert_eq!(mask.count(), 1);
/// ```
impl FromIterator<u32> for CpuMask {
    fn from_iter<I: IntoIterator<Item = u32>>(cpus: I) -> Self {
        let mask = CpuMask::new();
        for cpu in cpus {
            mask.set(cpu);
        }
        mask
    }
}

/// The kernel's cpulist format: `0-3,8,10-11` (empty for no CPU).
///
/// ```
/// let mask = thiscpu::CpuMask::with_capacity(16);
/// for cpu in [0, 1, 2, 3, 8, 10, 11] {
///     mask.set(cpu);
/// }
/// assert_eq!(mask.to_string(), "0-3,8,10-11");
/// assert_eq!(thiscpu::topology::parse_cpu_list(&mask.to_string()).unwrap(), mask.iter().collect::<Vec<_>>());
/// ```
impl core::fmt::Display for CpuMask {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        topology::write_cpu_list(f, self.iter())
    }
}

/// The members as a quoted cpulist (as [`Display`](core::fmt::Display) writes them), and the
/// capacity.
///
/// ```
/// let mask = thiscpu::CpuMask::with_capacity(64);
/// assert_eq!(format!("{mask:?}"), r#"CpuMask { cpus: "", capacity: 64 }"#);
/// mask.set(1);
/// mask.set(2);
/// assert_eq!(format!("{mask:?}"), r#"CpuMask { cpus: "1-2", capacity: 64 }"#);
/// ```
impl core::fmt::Debug for CpuMask {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CpuMask")
            .field("cpus", &self.to_string())
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// Masks are equal when they hold the same CPUs; their capacities do not count (a mask of
/// 64 and one of 128 holding the same CPUs are equal), nor does their update mode. Each word
/// of each mask is read once: while other threads update them, the answer compares values
/// each word had during the call.
///
/// ```
/// let small = thiscpu::CpuMask::with_capacity(64);
/// let large = thiscpu::CpuMask::with_capacity(128);
/// small.set(3);
/// large.set(3);
/// assert_eq!(small, large);
/// large.set(100);
/// assert_ne!(small, large);
/// ```
impl PartialEq for CpuMask {
    fn eq(&self, other: &CpuMask) -> bool {
        let word_of = |words: &[AtomicU64], index: usize| {
            words
                .get(index)
                .map_or(0, |word| word.load(Ordering::Relaxed))
        };
        let words = self.words.len().max(other.words.len());
        (0..words).all(|index| word_of(&self.words, index) == word_of(&other.words, index))
    }
}

impl Eq for CpuMask {}

/// The CPUs of a [`CpuMask`], in increasing order (see [`CpuMask::iter`]).
#[derive(Debug)]
pub struct Iter<'a> {
    words: &'a [AtomicU64],
    index: usize,
    current: u64,
}

impl Iterator for Iter<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        loop {
            if self.current != 0 {
                let bit = self.current.trailing_zeros();
                self.current &= self.current - 1;
                return Some(((self.index - 1) * BITS) as u32 + bit);
            }
            let word = self.words.get(self.index)?;
            self.current = word.load(Ordering::Relaxed);
            self.index += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "CPU 64 is beyond the mask's capacity of 64 CPUs")]
    fn setting_a_cpu_beyond_the_capacity_names_both() {
        CpuMask::with_capacity(64).set(64);
    }

    #[test]
    #[should_panic(expected = "CPU 200 is beyond the mask's capacity of 128 CPUs")]
    fn clearing_a_cpu_beyond_the_capacity_in_read_modify_write_mode_names_both() {
        let mask = CpuMask::with_capacity(128);
        mask.switch_to_read_modify_write();
        mask.clear(200);
    }

    #[test]
    fn the_mode_switches_to_rmw_and_back() {
        let mask = CpuMask::with_capacity(2);
        for change in 0..STREAK {
            assert_eq!(
                mask.read_first_words.load(Ordering::Relaxed),
                1,
                "reads first"
            );
            if change % 2 == 0 {
                assert!(mask.set(1));
            } else {
                assert!(mask.clear(1));
            }
        }
        assert_eq!(
            mask.read_first_words.load(Ordering::Relaxed),
            0,
            "alternating calls"
        );
        assert_eq!(mask.wasted_left.load(Ordering::Relaxed), RMW_FRESH);
        for _ in 0..10 {
            assert!(mask.set(1));
            assert!(mask.clear(1));
        }
        assert_eq!(mask.read_first_words.load(Ordering::Relaxed), 0);
        assert_eq!(mask.wasted_left.load(Ordering::Relaxed), RMW_FRESH);
        // Idle calls on bit 0: the first sets it (a change, so the count stays fresh), and the
        // `RMW_FRESH`-th wasted one after it switches back to reading first.
        assert!(mask.set(0));
        for wasted in 1..=RMW_FRESH {
            assert!(!mask.set(0));
            let expected = if wasted < RMW_FRESH { 0 } else { 1 };
            assert_eq!(
                mask.read_first_words.load(Ordering::Relaxed),
                expected,
                "after {wasted} wasted calls"
            );
        }
        assert!(mask.contains(0) && !mask.contains(1));
    }
}
