//! The per-CPU reader counts that [`crate::RwLock`] and [`crate::EpochCell`] are built on: for
//! each CPU (and each phase), how many times readers entered and how many times they left,
//! in two separate words. A reader adds one to its CPU's entry word with a restartable
//! sequence, and one to the exit word of whatever CPU it is on when it leaves; nothing is ever
//! decremented, so a reader that migrates in between is counted right.
//!
//! # The writer's check, and why it is sound
//! A writer first publishes what new readers must see (the lock's writer flag, or the cell's
//! new pointer), then calls [`ReaderCounts::drained`], which
//! 1. sums the exit words,
//! 2. makes a heavy fence (`membarrier` on every CPU that runs a thread of the process; in the
//!    atomic mode a `SeqCst` fence),
//! 3. sums the entry words, and answers whether the two sums are equal.
//!
//! Readers make no fence: the heavy fence stands for one in every reader, at the point where
//! the kernel interrupted it (or at its last context switch). Two consequences:
//! - *No reader is missed.* A reader enters, then reads what the writer published. Either its
//!   entry is counted by step 3, or its fence point came before its entry, and then its read
//!   comes after the writer's publication and sees it: it sees the flag and backs out, or it
//!   sees the new pointer.
//! - *No exit is counted without its entry.* Program order alone does not give this: the
//!   entry and the exit are plain stores to different words, which a weakly ordered CPU (arm64,
//!   riscv64) may make visible in the other order, so seeing the exit says nothing yet about
//!   the entry. The heavy fence does: an exit the writer read in step 1 had been executed by
//!   then, so the full barrier that step 2 runs on the reader's CPU (at the point where it
//!   interrupts the reader, or at the context switch that took the reader off the CPU) comes
//!   after the exit in the reader's program order, hence after its entry, and makes the entry
//!   visible before step 2 returns; a reader that migrated between its entry and its exit went
//!   through a context switch, a full barrier, in between. So step 3 sees the entry of every
//!   exit counted in step 1. (In the atomic mode the adds are `SeqCst` read-modify-writes: the
//!   writer's acquire load that reads an exit synchronizes with it, and the entry, sequenced
//!   before it, happens before step 3's loads.) The counted exits are therefore a subset of
//!   exits whose entries are counted: equal sums mean every counted entry has left. Summing the
//!   entries first would not do: a reader that enters on CPU 0 after the writer read CPU 0's
//!   word and leaves on CPU 1 before the writer reads CPU 1's would count as an exit without an
//!   entry, and hide another reader that holds on.
//!
//! What a reader reads before it leaves is ordered before its exit store, so before the
//! writer's fence: after equal sums, the writer may change or free what those readers read.
//!
//! # Modes
//! - *Sections*: the process uses rseq and `membarrier` works. A thread without rseq of its own
//!   (made by a raw `clone`), or one interrupted at every instruction, adds atomically to a
//!   spare row that no section writes, and fences itself (`SeqCst`).
//! - *Atomic*: no rseq in the process, or `membarrier` refused when the counts were made. Every
//!   add is a `SeqCst` atomic add on the word of the CPU the fallback reports, and the
//!   writer's heavy fence is a `SeqCst` fence. A word is never written both ways.
//!
//! If `membarrier` is refused later (a seccomp filter installed after start-up), the writer
//! fences by running on every CPU ([`crate::fence::visit_all`]), and panics where it cannot.
//!
//! # Memory
//! `2 * PHASES` words per possible CPU plus the spare row, in a slot of the dense per-CPU
//! arena ([`crate::dense`], as [`crate::Counter`]'s): 16 bytes per CPU for a lock, 32 for a
//! cell. A CPU's words sit next to other locks' and counters' words of the same CPU, and
//! never share a cache line with another CPU's; the pages of a CPU that never reads stay
//! unbacked. (Under `--cfg thiscpu_model` the words are loom's atomics in a boxed row per
//! CPU: loom cannot model words in mapped memory.)
//!
//! # Safety
//! The words of a CPU's row are written by restartable sequences positioned on that CPU (in
//! the sections mode) or by atomic adds (the spare row, and every row in the atomic mode);
//! each block says which.

use crate::fence;
use crate::ops::{self, ByCpu, Outcome};
use crate::registration::{self, Registrar};
use crate::sync::atomic::{AtomicU64, Ordering};

/// The words of every row: `2 * PHASES` zeroed `u64`s per possible CPU and one spare row, the
/// entries of each phase first, then the exits.
#[cfg(not(thiscpu_model))]
struct Words<const PHASES: usize> {
    slot: core::ptr::NonNull<u8>,
    cpus: u32,
}

#[cfg(not(thiscpu_model))]
impl<const PHASES: usize> Words<PHASES> {
    const SIZE: usize = 2 * PHASES * 8;

    fn new() -> Self {
        let slot = crate::dense::alloc(Self::SIZE, 8);
        Words {
            slot,
            cpus: crate::dense::cpu_rows(),
        }
    }

    /// Row `row`'s word `index`.
    ///
    /// # Safety
    /// `row <= self.cpus` and `index < 2 * PHASES`.
    #[inline(always)]
    unsafe fn at(&self, row: u32, index: usize) -> &AtomicU64 {
        // SAFETY: the slot is live while `self` is, holds `2 * PHASES` 8-byte aligned words in
        // each of its `cpus + 1` rows (the caller's bounds), which start zeroed and are only
        // accessed atomically or by sections.
        unsafe { AtomicU64::from_ptr(crate::dense::row(self.slot, row).cast::<u64>().add(index)) }
    }

    /// Bytes of address space the words take, every row included.
    fn bytes(&self) -> usize {
        Self::SIZE * (self.cpus as usize + 1)
    }
}

#[cfg(not(thiscpu_model))]
impl<const PHASES: usize> Drop for Words<PHASES> {
    fn drop(&mut self) {
        // SAFETY: dropping has the words exclusively: every add borrows the counts, so none is
        // running or can be interrupted mid-section; the slot is freed once, with the size and
        // alignment it was allocated with.
        unsafe { crate::dense::free(self.slot, Self::SIZE, 8) };
    }
}

// SAFETY: the slot is an address in the dense arena, owned by this value; its words are
// atomics (or written by sections, which are exclusive per CPU), so sharing them is sound.
#[cfg(not(thiscpu_model))]
unsafe impl<const PHASES: usize> Send for Words<PHASES> {}
// SAFETY: as above.
#[cfg(not(thiscpu_model))]
unsafe impl<const PHASES: usize> Sync for Words<PHASES> {}

#[cfg(thiscpu_model)]
struct Words<const PHASES: usize> {
    rows: Box<[crate::percpu::CachePadded<Box<[AtomicU64]>>]>,
    cpus: u32,
}

#[cfg(thiscpu_model)]
impl<const PHASES: usize> Words<PHASES> {
    fn new() -> Self {
        let cpus = crate::topology::possible_cpus() as u32;
        let rows = (0..=cpus)
            .map(|_| {
                crate::percpu::CachePadded((0..2 * PHASES).map(|_| AtomicU64::new(0)).collect())
            })
            .collect();
        Words { rows, cpus }
    }

    /// Row `row`'s word `index`.
    ///
    /// # Safety
    /// None beyond the indices' bounds, which are checked.
    #[inline(always)]
    unsafe fn at(&self, row: u32, index: usize) -> &AtomicU64 {
        &self.rows[row as usize].0[index]
    }

    fn bytes(&self) -> usize {
        2 * PHASES * 8 * (self.cpus as usize + 1)
    }
}

/// Per-CPU entry and exit counts of readers, in `PHASES` independent sets.
pub(crate) struct ReaderCounts<const PHASES: usize> {
    /// A row per possible CPU, then the spare row.
    words: Words<PHASES>,
    /// The rows sections write: every CPU's (at least one) when readers count with restartable
    /// sequences, none in the atomic mode, so that the reader's one comparison of its CPU
    /// number also sends it to the atomic path; the mode is whether it is 0.
    section_rows: u32,
}

/// Which of a row's words a count goes to.
#[derive(Clone, Copy)]
enum Side {
    Entry,
    Exit,
}

impl<const PHASES: usize> ReaderCounts<PHASES> {
    pub(crate) fn new() -> Self {
        const { assert!(PHASES >= 1 && PHASES <= 8) };
        let by_sections = registration::decided()
            .is_some_and(|process| process.rseq.registrar != Registrar::None)
            && fence::available();
        Self::in_mode(by_sections)
    }

    pub(crate) fn in_mode(by_sections: bool) -> Self {
        let words = Words::new();
        let section_rows = if by_sections { words.cpus } else { 0 };
        ReaderCounts {
            words,
            section_rows,
        }
    }

    /// Whether readers count with restartable sequences and writers fence with `membarrier`.
    pub(crate) fn by_sections(&self) -> bool {
        self.section_rows != 0
    }

    /// Bytes of address space the counts take (every CPU's row and the spare row), for the
    /// documentation's figure and `Debug`.
    pub(crate) fn bytes(&self) -> usize {
        self.words.bytes()
    }

    /// The number of CPU rows (the spare row is the next one).
    #[inline(always)]
    fn cpus(&self) -> u32 {
        self.words.cpus
    }

    /// The word of `side` in phase `phase` (taken modulo `PHASES`) of row `row`.
    ///
    /// # Safety
    /// `row <= self.cpus()`.
    #[inline(always)]
    unsafe fn word_unchecked(&self, row: u32, side: Side, phase: usize) -> &AtomicU64 {
        let index = match side {
            Side::Entry => phase % PHASES,
            Side::Exit => PHASES + phase % PHASES,
        };
        // SAFETY: the caller's bound on `row`; `index < 2 * PHASES`.
        unsafe { self.words.at(row, index) }
    }

    /// As [`word_unchecked`](Self::word_unchecked), with the row checked.
    #[inline(always)]
    fn word(&self, row: u32, side: Side, phase: usize) -> &AtomicU64 {
        assert!(row <= self.cpus(), "row {row} beyond the reader counts");
        // SAFETY: checked above.
        unsafe { self.word_unchecked(row, side, phase) }
    }

    /// Counts a reader's entry in `phase`. The caller reads what writers publish afterwards.
    #[inline]
    pub(crate) fn enter(&self, phase: usize) {
        self.add(Side::Entry, phase);
    }

    /// Counts a reader's exit from `phase`, after everything it read in there.
    #[inline]
    pub(crate) fn exit(&self, phase: usize) {
        self.add(Side::Exit, phase);
    }

    #[inline(always)]
    fn add(&self, side: Side, phase: usize) {
        let at = ops::position_as_is::<ByCpu>();
        // One unsigned comparison rejects the atomic mode (no section rows), an unregistered
        // area (an index of 2^31 or more) and an index beyond the rows.
        if at.index() < self.section_rows {
            // SAFETY: `section_rows` is at most the number of CPU rows.
            let word = unsafe { self.word_unchecked(at.index(), side, phase) };
            // SAFETY: `at` was just read by this thread; the word is row `at.index()`'s,
            // which only sections positioned on that CPU write in this mode (threads without
            // sections use the spare row), and it lives as long as `self`.
            let outcome = unsafe { ops::load_add_store(at, word.as_ptr(), 1) };
            if outcome == Outcome::Committed(()) {
                return;
            }
        }
        self.add_slow(side, phase);
    }

    /// After an abort, in a thread not registered yet or without rseq, or in the atomic mode.
    #[cold]
    #[inline(never)]
    fn add_slow(&self, side: Side, phase: usize) {
        if !self.by_sections() {
            let row = crate::cpu::current_cpu() % self.cpus();
            self.word(row, side, phase).fetch_add(1, Ordering::SeqCst);
            return;
        }
        let mut aborts = ops::AbortRun::new();
        while let Some(at) = ops::position() {
            if at.index() >= self.cpus() {
                break;
            }
            let word = self.word(at.index(), side, phase);
            // SAFETY: as in `add`; a migration since the read aborts the section, which
            // compares the CPU again.
            match unsafe { ops::load_add_store(at, word.as_ptr(), 1) } {
                Outcome::Committed(()) => return,
                Outcome::Mismatch | Outcome::Aborted => {
                    ops::note_abort();
                    if aborts.gives_up() {
                        break;
                    }
                }
            }
        }
        // No section for this thread: the spare row, which no section writes. The add is
        // `SeqCst`, so this reader does not depend on the writer's fence for its ordering.
        self.word(self.cpus(), side, phase)
            .fetch_add(1, Ordering::SeqCst);
    }

    fn sum(&self, side: Side, phase: usize) -> u64 {
        (0..=self.cpus())
            .map(|row| self.word(row, side, phase).load(Ordering::Acquire))
            .fold(0, u64::wrapping_add)
    }

    /// The writer's heavy fence: `membarrier` on every CPU running this process (or visits to
    /// every CPU where it is refused now), or a `SeqCst` fence in the atomic mode.
    pub(crate) fn fence(&self) {
        if !self.by_sections() {
            crate::sync::atomic::fence(Ordering::SeqCst);
            return;
        }
        // The `SeqCst` fences around the system call state, in the language's memory model,
        // what `membarrier` does in the hardware's: the writer's accesses before it are
        // ordered before those after it. The CPU needs nothing more (the system call is a
        // full barrier), but the compiler and the model are only bound by what they can see.
        crate::sync::atomic::fence(Ordering::SeqCst);
        if let Err(refused) = fence::fence_all() {
            Self::fence_by_visiting(refused);
        }
        crate::sync::atomic::fence(Ordering::SeqCst);
    }

    #[cold]
    #[inline(never)]
    fn fence_by_visiting(refused: fence::FenceUnavailable) {
        if let Err(visit) = fence::visit_all() {
            panic!(
                "thiscpu: cannot fence the readers: {refused}, and this thread cannot fence \
                 by running on every CPU instead: {visit}"
            );
        }
    }

    /// Whether every reader counted in `phase` has left: exits summed, heavy fence, entries
    /// summed, equal (see the module's documentation). Call after publishing what new readers
    /// must see.
    pub(crate) fn drained(&self, phase: usize) -> bool {
        let exits = self.sum(Side::Exit, phase);
        self.fence();
        let entries = self.sum(Side::Entry, phase);
        entries == exits
    }

    /// [`drained`](Self::drained), but answers `false` without fencing when one unfenced look
    /// already sees a reader inside: for a caller that will look again later anyway, and would
    /// otherwise interrupt every CPU for an answer it can already guess. The look may also see
    /// a reader that has just left (an exit it read too early): only `false` is ever guessed.
    pub(crate) fn drained_unless_seen_inside(&self, phase: usize) -> bool {
        self.inside(phase) == 0 && self.drained(phase)
    }

    /// Entries ever counted in `phase` (for tests).
    #[cfg(test)]
    pub(crate) fn entries(&self, phase: usize) -> u64 {
        self.sum(Side::Entry, phase)
    }

    /// Readers in `phase` now, as far as one unfenced look tells (for `Debug` and tests).
    pub(crate) fn inside(&self, phase: usize) -> u64 {
        let exits = self.sum(Side::Exit, phase);
        self.sum(Side::Entry, phase).wrapping_sub(exits)
    }
}

impl<const PHASES: usize> core::fmt::Debug for ReaderCounts<PHASES> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ReaderCounts")
            .field("mode", &if self.by_sections() { "rseq" } else { "atomic" })
            .field("bytes", &self.bytes())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::ReaderCounts;

    #[test]
    fn only_the_sections_mode_lets_readers_into_sections() {
        // In the atomic mode every add must take the atomic path: a plain store of a section
        // next to the writer's SeqCst fence (no membarrier) would let a reader go unseen.
        let atomic = ReaderCounts::<2>::in_mode(false);
        assert_eq!(atomic.section_rows, 0);
        let sections = ReaderCounts::<2>::in_mode(true);
        assert_eq!(
            sections.section_rows,
            crate::topology::possible_cpus() as u32
        );
        assert_eq!(sections.section_rows, sections.cpus());
        // Either way the counts add up.
        for counts in [&atomic, &sections] {
            counts.enter(1);
            counts.enter(1);
            counts.exit(1);
            assert_eq!(counts.inside(1), 1);
            assert_eq!(counts.inside(0), 0);
        }
    }
}
