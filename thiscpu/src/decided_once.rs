//! `DecidedOnce<T>`: a value that the first caller computes and then publishes whole, for a
//! process-wide decision that signal handlers, forks and panics may interrupt.
//!
//! `std::sync::OnceLock` is not enough for the rseq decision: a signal handler that asks for
//! the value while its own thread is computing it would wait for itself for ever, and a child
//! forked at that moment (from the handler) inherits a lock that no thread of the child will
//! ever release. Here the claim on the decision is the claimant's thread id in one word:
//!
//! - `UNDECIDED`: nobody decides; the next caller claims the word with a compare-and-swap.
//! - a thread id: that thread computes the value. A caller on the same thread (a signal
//!   handler that interrupted it) gets `None` at once; another thread waits, and takes the
//!   claim over when the claimant no longer exists in this process (the claimant was in the
//!   parent of a `fork`, or vanished some other way), which it asks the kernel.
//! - `DECIDED`: the value is written and never changes again; readers load the word with
//!   acquire ordering and read the value.
//!
//! A computation that unwinds hands the claim back, so that a later caller decides again
//! rather than waiting for a thread that gave up. Only the claimant writes the value, and only
//! while the word holds its id; nothing reads it before the word says `DECIDED`.
//!
//! # Safety
//! The value lives in an `UnsafeCell` written by the claimant alone and read only after the
//! release store of `DECIDED`; each block states why it holds.

use crate::sync::atomic::{AtomicI32, Ordering};
use crate::sync::cell::UnsafeCell;
use core::mem::MaybeUninit;

/// The word's value while nobody decides: the claim a new `DecidedOnce` starts with.
pub(crate) const UNDECIDED: i32 = 0;
/// The word's value once the value is published.
const DECIDED: i32 = -1;

/// Who a caller is, and whether a claimant still exists: `os::Threads` in the library, plain
/// numbers in the model checks.
pub(crate) trait Claimants {
    /// The calling thread's id: positive, unique among the process's live threads.
    fn me(&self) -> i32;
    /// Whether the thread `id` no longer exists in this process.
    fn is_gone(&self, id: i32) -> bool;
    /// Lets the claimant run while the caller waits for it.
    fn pause(&self);
}

/// A value decided once per process: see the module documentation.
pub(crate) struct DecidedOnce<T> {
    claim: AtomicI32,
    value: UnsafeCell<MaybeUninit<T>>,
}

// SAFETY: the value is written by one thread at a time (the claimant, while the claim word
// holds its id) and read by any thread only after the word says `DECIDED`, after which nothing
// writes it; `T: Send + Sync` makes handing it between threads and sharing `&T` sound.
unsafe impl<T: Send + Sync> Sync for DecidedOnce<T> {}

impl<T: Copy> DecidedOnce<T> {
    /// An undecided value, from its parts, so that a `static` can be made of the standard
    /// primitives and a model check can make one of loom's:
    /// `DecidedOnce::new(AtomicI32::new(0), UnsafeCell::new(MaybeUninit::uninit()))`.
    pub(crate) const fn new(claim: AtomicI32, value: UnsafeCell<MaybeUninit<T>>) -> Self {
        DecidedOnce { claim, value }
    }

    /// The published value, if the decision was made.
    #[inline]
    pub(crate) fn get(&self) -> Option<&T> {
        if self.claim.load(Ordering::Acquire) != DECIDED {
            return None;
        }
        // SAFETY: `DECIDED` was stored with release ordering after the value was written, and
        // the acquire load above saw it; nothing writes the value after that.
        Some(unsafe { self.value.with(|value| (*value).assume_init_ref()) })
    }

    /// The published value, deciding it with `decide` if nobody has; `None` only to a caller
    /// on the thread that is deciding (a signal handler that interrupted the decision).
    ///
    /// `decide` must not ask for this value itself (it would get `None`).
    pub(crate) fn get_or_decide(
        &self,
        who: &impl Claimants,
        decide: impl FnOnce() -> T,
    ) -> Option<&T> {
        if let Some(value) = self.get() {
            return Some(value);
        }
        self.decide_or_wait(who, decide)
    }

    #[cold]
    #[inline(never)]
    fn decide_or_wait(&self, who: &impl Claimants, decide: impl FnOnce() -> T) -> Option<&T> {
        let me = who.me();
        let mut expected = UNDECIDED;
        loop {
            match self
                .claim
                .compare_exchange(expected, me, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => {
                    let hand_back = HandBackOnUnwind(&self.claim, me);
                    let value = decide();
                    // SAFETY: the claim word holds this thread's id, so no other thread
                    // writes the value, and none reads it before `DECIDED` is published
                    // below. A signal handler on this thread that asks meanwhile gets `None`
                    // and does not read it either.
                    unsafe { self.value.with_mut(|slot| (*slot).write(value)) };
                    core::mem::forget(hand_back);
                    self.claim.store(DECIDED, Ordering::Release);
                    return self.get();
                }
                Err(DECIDED) => return self.get(),
                Err(claimant) if claimant == me => return None,
                Err(UNDECIDED) => expected = UNDECIDED,
                Err(claimant) => {
                    // A claimant that no longer exists (in the parent of a fork) never
                    // publishes: take its claim over.
                    expected = if who.is_gone(claimant) {
                        claimant
                    } else {
                        who.pause();
                        UNDECIDED
                    };
                }
            }
        }
    }
}

/// Gives the claim back when dropped, which happens only while a decision unwinds.
struct HandBackOnUnwind<'a>(&'a AtomicI32, i32);

impl Drop for HandBackOnUnwind<'_> {
    fn drop(&mut self) {
        let _ = self
            .0
            .compare_exchange(self.1, UNDECIDED, Ordering::Release, Ordering::Relaxed);
    }
}
