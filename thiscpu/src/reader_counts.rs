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
//! - *No exit is counted without its entry.* An exit counted in step 1 was stored before the
//!   fence of step 2, and its entry before it in the same thread (a migration between the two
//!   is a context switch, a full barrier), so step 3 sees the entry. The counted exits are
//!   therefore a subset of exits whose entries are counted: equal sums mean every counted
//!   entry has left. Summing the entries first would not do: a reader that enters on CPU 0
//!   after the writer read CPU 0's word and leaves on CPU 1 before the writer reads CPU 1's
//!   would count as an exit without an entry, and hide another reader that holds on.
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
//! One row of 128 bytes (two cache lines' worth, see [`crate::CachePadded`]) per possible CPU
//! plus the spare row, for up to eight phases' words: `128 * (possible_cpus + 1)` bytes.
//!
//! # Safety
//! The words of a CPU's row are written by restartable sequences positioned on that CPU (in
//! the sections mode) or by atomic adds (the spare row, and every row in the atomic mode);
//! each block says which.

use crate::fence;
use crate::ops::{self, ByCpu, Outcome};
use crate::percpu::CachePadded;
use crate::registration::{self, Registrar};
use crate::sync::atomic::{AtomicU64, Ordering};

/// One CPU's words: entries and exits for each of `PHASES` phases.
struct Row<const PHASES: usize> {
    entries: [AtomicU64; PHASES],
    exits: [AtomicU64; PHASES],
}

impl<const PHASES: usize> Row<PHASES> {
    fn new() -> Self {
        Row {
            entries: core::array::from_fn(|_| AtomicU64::new(0)),
            exits: core::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// Per-CPU entry and exit counts of readers, in `PHASES` independent sets.
pub(crate) struct ReaderCounts<const PHASES: usize> {
    /// A row per possible CPU, then the spare row.
    rows: Box<[CachePadded<Row<PHASES>>]>,
    /// Whether readers count with restartable sequences (else with atomic adds).
    by_sections: bool,
    /// The rows sections write: every CPU's, or none in the atomic mode, so that the reader's
    /// one comparison of its CPU number also sends it to the atomic path.
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
        const { assert!(PHASES >= 1 && 2 * PHASES * 8 <= 128) };
        let by_sections = registration::decided()
            .is_some_and(|process| process.registrar != Registrar::None)
            && fence::available();
        Self::in_mode(by_sections)
    }

    fn in_mode(by_sections: bool) -> Self {
        let rows: Box<[_]> = (0..=crate::topology::possible_cpus())
            .map(|_| CachePadded(Row::new()))
            .collect();
        let section_rows = if by_sections {
            (rows.len() - 1) as u32
        } else {
            0
        };
        ReaderCounts {
            rows,
            by_sections,
            section_rows,
        }
    }

    /// Whether readers count with restartable sequences and writers fence with `membarrier`.
    pub(crate) fn by_sections(&self) -> bool {
        self.by_sections
    }

    /// Bytes of counts, for the documentation's figure and `Debug`.
    pub(crate) fn bytes(&self) -> usize {
        core::mem::size_of_val(&*self.rows)
    }

    /// The number of CPU rows (the spare row is the next one).
    #[inline(always)]
    fn cpus(&self) -> u32 {
        (self.rows.len() - 1) as u32
    }

    #[inline(always)]
    fn word(&self, row: u32, side: Side, phase: usize) -> &AtomicU64 {
        let row = &self.rows[row as usize].0;
        match side {
            Side::Entry => &row.entries[phase],
            Side::Exit => &row.exits[phase],
        }
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
            // SAFETY: `section_rows` is at most the number of CPU rows, one less than the
            // slice's length.
            let row = unsafe { &self.rows.get_unchecked(at.index() as usize).0 };
            let word = match side {
                Side::Entry => &row.entries[phase],
                Side::Exit => &row.exits[phase],
            };
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
        if !self.by_sections {
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
        if !self.by_sections {
            crate::sync::atomic::fence(Ordering::SeqCst);
            return;
        }
        if let Err(refused) = fence::fence_all() {
            Self::fence_by_visiting(refused);
        }
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

    /// Readers in `phase` now, as far as one unfenced look tells (for `Debug` and tests).
    pub(crate) fn inside(&self, phase: usize) -> u64 {
        let exits = self.sum(Side::Exit, phase);
        self.sum(Side::Entry, phase).wrapping_sub(exits)
    }
}

impl<const PHASES: usize> core::fmt::Debug for ReaderCounts<PHASES> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ReaderCounts")
            .field("mode", &if self.by_sections { "rseq" } else { "atomic" })
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
