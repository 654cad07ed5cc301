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

/// As [`wait`], for at most about `timeout` (callers check their deadline again: the sleep
/// may end early or a little late).
#[cfg(not(thiscpu_model))]
pub(crate) fn wait_timeout(word: &AtomicU32, expected: u32, timeout: core::time::Duration) {
    // FUTEX_WAIT takes a relative time; a timeout past what `time_t` holds sleeps as long as
    // it can. `c_long` is `i32` on 32-bit targets, where the nanoseconds' conversion is
    // fallible in type only (they are under 10^9).
    #[allow(clippy::unnecessary_fallible_conversions)]
    let timeout = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::try_from(timeout.subsec_nanos()).unwrap_or(0),
    };
    // SAFETY: FUTEX_WAIT reads the aligned `u32` at `word`, a live atomic, and the timespec,
    // which lives on this stack for the call; the other arguments are unused.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            &timeout as *const libc::timespec,
        );
    }
}

/// The model machine has no clock: a timed wait returns at once, as a timeout would, and lets
/// another thread run so that a caller's loop until its deadline makes progress.
#[cfg(thiscpu_model)]
pub(crate) fn wait_timeout(_word: &AtomicU32, _expected: u32, _timeout: core::time::Duration) {
    crate::sync::yield_now();
}
