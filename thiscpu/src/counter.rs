//! `Counter`: an exact per-CPU counter whose increment is one restartable sequence.

use crate::arch;
use crate::ops::{self, BY_CPU, Outcome};
use crate::percpu::{CachePadded, PerCpu};
use crate::registration::{self, Registrar};
use core::sync::atomic::{AtomicU64, Ordering};

/// A counter that many threads increment at once without contention and without atomic
/// read-modify-write instructions: each increment adds to the slot of the CPU the thread runs
/// on, inside a restartable sequence, and readers sum the slots.
///
/// - `add` is exact under preemption, migration, signals (it may be called from a signal
///   handler) and thread exit: an interrupted increment is retried, never lost or doubled.
/// - Without rseq in the process (old kernel, valgrind, `THISCPU_RSEQ=off`) each `add` is an
///   atomic add on the slot of the CPU the fallback reports: still exact, slower.
/// - A thread that cannot use rseq while the rest of the process does (for example a thread
///   made by a raw `clone`) adds atomically to a separate shared word, so plain and atomic
///   updates never meet on one slot.
/// - [`sum`](Counter::sum) reads each slot with one atomic load: never a torn value. It is
///   exact once writers have stopped (and happened-before the read, e.g. by `join`); while they
///   run it is a value the counter had at some point during the read, per slot.
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
pub struct Counter {
    slots: PerCpu<AtomicU64>,
    unregistered: CachePadded<AtomicU64>,
}

impl Counter {
    /// A counter at zero.
    ///
    /// ```
    /// assert_eq!(thiscpu::Counter::new().sum(), 0);
    /// ```
    pub fn new() -> Self {
        Counter {
            slots: PerCpu::default(),
            unregistered: CachePadded(AtomicU64::new(0)),
        }
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

    /// Adds `n` (wrapping at 2^64, like the slots' sum).
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.add(40);
    /// c.add(2);
    /// assert_eq!(c.sum(), 42);
    /// ```
    #[inline]
    pub fn add(&self, n: u64) {
        let offset = arch::section_offset();
        let cpu = arch::field_at::<BY_CPU>(offset) as u32;
        // One unsigned comparison rejects both an unregistered area (cpu_id -1 or -2) and a
        // CPU beyond the slots.
        if let Some(slot) = self.slots.get(cpu as usize) {
            // SAFETY: `offset` and `cpu` were just read from this thread's area; the slot is
            // CPU `cpu`'s, written only by sections positioned on `cpu` (this one) or by atomic
            // adds when the process has no rseq at all (never both, see `add_slow`).
            let outcome = unsafe { arch::load_add_store::<BY_CPU>(offset, cpu, slot.as_ptr(), n) };
            if outcome == Outcome::Committed(()) {
                return;
            }
            ops::note_abort();
        }
        self.add_slow(n);
    }

    #[cold]
    #[inline(never)]
    fn add_slow(&self, n: u64) {
        while let Some(at) = ops::position() {
            let Some(slot) = self.slots.get(at.index() as usize) else {
                break;
            };
            // SAFETY: as in `add`.
            match unsafe { ops::load_add_store(at, slot.as_ptr(), n) } {
                Outcome::Committed(()) => return,
                Outcome::Mismatch | Outcome::Aborted => ops::note_abort(),
            }
        }
        // No rseq for this thread. When nobody in the process uses rseq, every update of the
        // slots is atomic, so the fallback CPU's slot spreads the load safely; otherwise rseq
        // sections write the slots with plain adds, and this thread must stay off them.
        if registration::process().registrar == Registrar::None {
            let cpu = crate::current_cpu() as usize % self.slots.len();
            self.slots[cpu].fetch_add(n, Ordering::Relaxed);
        } else {
            self.unregistered.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The total: every slot read once with an atomic load, summed (wrapping).
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.add(3);
    /// assert_eq!(c.sum(), 3);
    /// ```
    pub fn sum(&self) -> u64 {
        self.per_cpu()
            .map(|(_, value)| value)
            .fold(self.unattributed(), u64::wrapping_add)
    }

    /// Each CPU's share: `(cpu, value)` for every possible CPU.
    ///
    /// ```
    /// let c = thiscpu::Counter::new();
    /// c.inc();
    /// assert_eq!(c.per_cpu().map(|(_, v)| v).sum::<u64>() + c.unattributed(), 1);
    /// ```
    pub fn per_cpu(&self) -> impl ExactSizeIterator<Item = (u32, u64)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .map(|(cpu, slot)| (cpu as u32, slot.load(Ordering::Relaxed)))
    }

    /// What threads without rseq added while the rest of the process used it (normally 0).
    pub fn unattributed(&self) -> u64 {
        self.unregistered.load(Ordering::Relaxed)
    }
}

impl Default for Counter {
    fn default() -> Self {
        Counter::new()
    }
}

impl core::fmt::Debug for Counter {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Counter").field("sum", &self.sum()).finish()
    }
}
