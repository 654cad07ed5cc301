//! Sleeping until a 32-bit word changes: `futex` on Linux; under the model checker, a yield
//! (loom runs its threads on one OS thread, where a sleep would never end).
//!
//! # Safety
//! `futex` reads the word at the address it is given; the word is a live atomic each time.

#[cfg(not(thiscpu_model))]
pub(crate) use core::sync::atomic::AtomicU32;
#[cfg(thiscpu_model)]
pub(crate) use loom::sync::atomic::AtomicU32;

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

#[cfg(thiscpu_model)]
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    if word.load(core::sync::atomic::Ordering::Relaxed) == expected {
        loom::thread::yield_now();
    }
}

#[cfg(thiscpu_model)]
pub(crate) fn wake(_word: &AtomicU32, _count: i32) {}
