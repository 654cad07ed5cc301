//! Sleeping until a 32-bit word changes: `futex` on Linux; under the model checker, the model
//! machine's futex (loom runs its threads on one OS thread, where a real sleep would never end),
//! which sleeps until woken, so that a wake-up the protocol forgets fails the check.
//!
//! # Safety
//! `futex` reads the word at the address it is given; the word is a live atomic each time.

#[cfg(thiscpu_model)]
pub(crate) use crate::sync::atomic::AtomicU32;
#[cfg(not(thiscpu_model))]
pub(crate) use core::sync::atomic::AtomicU32;

/// Sleeps while `word` holds `expected` (or returns at once if it does not; spurious returns
/// happen: callers check their condition again).
#[cfg(not(thiscpu_model))]
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    // SAFETY: FUTEX_WAIT reads the aligned `u32` at `word`, a live atomic, and compares it;
    // the timeout pointer is null (no timeout); the other arguments are unused.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            core::ptr::null::<libc::timespec>(),
        );
    }
}

/// Wakes up to `count` threads sleeping on `word`.
#[cfg(not(thiscpu_model))]
pub(crate) fn wake(word: &AtomicU32, count: i32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; it reads no memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            count,
        );
    }
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
