//! Sleeping until a 32-bit word changes: `futex` on Linux, a `Mutex` and `Condvar` elsewhere
//! (`os`); under the model checker, the model machine's futex (loom runs its threads on one OS
//! thread, where a real sleep would never end), which sleeps until woken, so that a wake-up the
//! protocol forgets fails the check.

#[cfg(thiscpu_model)]
pub(crate) use crate::sync::atomic::AtomicU32;
#[cfg(not(thiscpu_model))]
pub(crate) use core::sync::atomic::AtomicU32;

/// Sleeps while `word` holds `expected` (or returns at once if it does not; spurious returns
/// happen: callers check their condition again).
#[cfg(not(thiscpu_model))]
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    crate::os::wait(word, expected);
}

/// Wakes up to `count` threads sleeping on `word`.
#[cfg(not(thiscpu_model))]
pub(crate) fn wake(word: &AtomicU32, count: i32) {
    crate::os::wake(word, count);
}

/// The model kernel's futex, which keeps a waiter asleep until a wake of its word.
#[cfg(thiscpu_model)]
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    crate::arch::model::futex_wait(word, expected);
}

#[cfg(thiscpu_model)]
pub(crate) fn wake(word: &AtomicU32, count: i32) {
    crate::arch::model::futex_wake(word, count);
}

/// As [`wait`], for at most about `timeout` (callers check their deadline again: the sleep
/// may end early or a little late).
#[cfg(not(thiscpu_model))]
pub(crate) fn wait_timeout(word: &AtomicU32, expected: u32, timeout: core::time::Duration) {
    crate::os::wait_timeout(word, expected, timeout);
}

/// The model machine has no clock: a timed wait returns at once, as a timeout would, and lets
/// another thread run so that a caller's loop until its deadline makes progress.
#[cfg(thiscpu_model)]
pub(crate) fn wait_timeout(_word: &AtomicU32, _expected: u32, _timeout: core::time::Duration) {
    crate::sync::yield_now();
}
