//! The lock without its data: the reader counts, the writer-class bits of `state`, and the
//! protocol over them (entering and leaving, taking and releasing the flag, the writer's
//! fences and drain checks, sleeping and waking). The lock and its guards call into it to
//! take and release the lock; none of it touches the data.

use crate::park::{self, AtomicU32};
use crate::reader_counts::ReaderCounts;
use core::sync::atomic::Ordering;
use std::time::Instant;

/// `state`: a writer holds the lock or is waiting for the readers to leave.
pub(super) const WRITER: u32 = 1;
/// `state`: some thread sleeps on `state` until the writer is gone.
const PARKED: u32 = 2;
/// `state`: an upgradable reader holds the lock. Writers and upgradable readers take this bit
/// or `WRITER` only while both are clear; readers ignore it.
pub(super) const UPGRADABLE: u32 = 4;

/// The only reader-writer lock phase: readers are stopped by the flag, not by phases.
const PHASE: usize = 0;

/// The lock without its data: what a guard needs to release it, whatever the data's type (a
/// mapped guard no longer names `T`).
pub(super) struct Raw {
    readers: ReaderCounts<1>,
    /// `WRITER | UPGRADABLE | PARKED`; written only by writer-class holders (writers and
    /// upgradable readers) and by threads that go to sleep.
    state: AtomicU32,
    /// Bumped by a reader that leaves while a writer waits, to wake it.
    leaves: AtomicU32,
}

impl Raw {
    /// An unlocked lock's state, with per-CPU counts in the mode the process allows.
    pub(super) fn new() -> Self {
        Raw {
            readers: ReaderCounts::new(),
            state: AtomicU32::new(0),
            leaves: AtomicU32::new(0),
        }
    }

    /// Counts in the atomic mode instead, for `RwLock::new_in_atomic_mode`.
    #[cfg(thiscpu_model)]
    pub(super) fn use_atomic_mode(&mut self) {
        self.readers = ReaderCounts::in_mode(false);
    }

    /// Counts this thread in as a reader unless a writer holds the lock or waits for it.
    #[inline]
    pub(super) fn try_read(&self) -> bool {
        // A reader that sees the flag set stays out of the counts: counting in and out while a
        // writer drains would make every drain check of that writer see sums that moved, and
        // a thread polling `try_read` could keep the writer fencing for ever.
        if self.state.load(Ordering::Relaxed) & WRITER != 0 {
            return false;
        }
        self.readers.enter(PHASE);
        // The writer's fence orders this load after the entry (see `RwLock`'s documentation);
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
    pub(super) fn read_until(&self, deadline: Option<Instant>) -> bool {
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
    pub(super) fn leave(&self) {
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
    pub(super) fn try_take(&self, bit: u32) -> bool {
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
    pub(super) fn take(&self, bit: u32, deadline: Option<Instant>) -> bool {
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
    pub(super) fn drain(&self, deadline: Option<Instant>) -> bool {
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
    pub(super) fn release_to(&self, keep: u32) {
        // Release: readers that load the flag clear, and the next writer, see this writer's
        // data.
        if self.state.swap(keep, Ordering::SeqCst) & PARKED != 0 {
            park::wake(&self.state, i32::MAX);
        }
    }

    /// With `WRITER` (and the readers drained) or `UPGRADABLE` held by this thread: counts
    /// this thread in as a reader, then lets the others in.
    pub(super) fn downgrade_to_reader(&self) {
        // No other writer can drain while this thread holds its bit, so entering with the flag
        // set is safe; the entry is ordered before the release, which the next writer's
        // acquire of the flag follows, so that writer's sums see this reader.
        self.readers.enter(PHASE);
        self.release_to(0);
    }

    /// With `UPGRADABLE` held by this thread: trades it for `WRITER`, which stops new readers;
    /// the caller then drains them as a writer does. No writer-class holder can take either
    /// bit in between, since the state never has neither.
    pub(super) fn upgrade(&self) {
        // Sleepers may set `PARKED` meanwhile: flip the two bits in one atomic step.
        let old = self.state.fetch_xor(UPGRADABLE | WRITER, Ordering::SeqCst);
        debug_assert_eq!(old & (UPGRADABLE | WRITER), UPGRADABLE);
    }

    /// `try_write`'s single drain check: fence, then one look at the sums.
    pub(super) fn fence_and_check(&self) -> bool {
        self.readers.fence();
        self.readers.drained(PHASE)
    }

    /// Whether readers count with restartable sequences and writers fence with `membarrier`.
    pub(super) fn uses_rseq(&self) -> bool {
        self.readers.by_sections()
    }

    /// Bytes of per-CPU reader counts.
    pub(super) fn counts_bytes(&self) -> usize {
        self.readers.bytes()
    }

    /// Whether a writer holds the lock or waits for it now.
    pub(super) fn is_write_locked(&self) -> bool {
        self.state.load(Ordering::Relaxed) & WRITER != 0
    }

    /// Readers inside now, from one unfenced look at the counts.
    pub(super) fn readers_inside(&self) -> u64 {
        self.readers.inside(PHASE)
    }

    /// Entries ever counted.
    #[cfg(test)]
    pub(super) fn entries(&self) -> u64 {
        self.readers.entries(PHASE)
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
