//! The heap's lock: a word that is 0 when free, 1 when held, 2 when held with sleepers. A
//! taker spins briefly and then sleeps on the word (a futex on Linux); the releaser wakes one
//! sleeper only when the word says there may be one. Not a guard type: the heap's fork
//! handlers take every lock in one call and release them in another.
//!
//! Written against `super::lock_word`, so that tests/model_heap_lock.rs compiles this very
//! file with loom's atomics and a model of the futex.

use super::lock_word::{AtomicU32, Ordering, wait, wake};

/// Tries of a contended lock before the taker sleeps: a holder keeps it for one batch, at most
/// 64 objects. The model checker, for which each try is a step to interleave, tries once.
const SPINS: usize = if cfg!(thiscpu_model) { 1 } else { 100 };

#[derive(Debug)]
pub(crate) struct Lock(AtomicU32);

impl Lock {
    /// A lock over `word`, which must be 0 (free).
    pub(crate) const fn over(word: AtomicU32) -> Lock {
        Lock(word)
    }

    pub(crate) fn lock(&self) {
        if self
            .0
            .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
    }

    #[cold]
    fn lock_contended(&self) {
        for _ in 0..SPINS {
            core::hint::spin_loop();
            if self.0.load(Ordering::Relaxed) == 0
                && self
                    .0
                    .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
        }
        // From here the word says 2 while this thread waits or holds the lock, so that its
        // releaser wakes the next sleeper.
        while self.0.swap(2, Ordering::Acquire) != 0 {
            wait(&self.0, 2);
        }
    }

    /// Releases the lock, which the caller holds (or took for a fork).
    pub(crate) fn unlock(&self) {
        if self.0.swap(0, Ordering::Release) == 2 {
            wake(&self.0, 1);
        }
    }
}
