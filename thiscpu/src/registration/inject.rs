//! Fault injection for tests, built only with `--cfg thiscpu_inject`. `no_cpu_id` and
//! `defer_decision` act on the rseq registration, which targets without a port never make.
//!
//! # Safety
//! Calls `getenv` and `raise`; each block states why it holds.

/// Whether to act as if the kernel left `cpu_id` negative after accepting a registration:
/// `THISCPU_INJECT_NO_CPU_ID` is set in the environment.
#[cfg(thiscpu_inject)]
pub(crate) fn no_cpu_id() -> bool {
    // SAFETY: `getenv` with a NUL-terminated name; only the result's nullness is used.
    !unsafe { libc::getenv(c"THISCPU_INJECT_NO_CPU_ID".as_ptr()) }.is_null()
}

#[cfg(not(thiscpu_inject))]
#[inline(always)]
pub(crate) fn no_cpu_id() -> bool {
    false
}

/// The signal number in `THISCPU_INJECT_SIGNAL_IN_DECISION`, if set.
#[cfg(thiscpu_inject)]
fn signal() -> Option<i32> {
    // SAFETY: `getenv` with a NUL-terminated name; a non-null result is a NUL-terminated
    // string, read at once.
    let value = unsafe { libc::getenv(c"THISCPU_INJECT_SIGNAL_IN_DECISION".as_ptr()) };
    if value.is_null() {
        return None;
    }
    // SAFETY: as above.
    let value = unsafe { std::ffi::CStr::from_ptr(value) };
    value.to_str().ok()?.parse().ok()
}

/// With `THISCPU_INJECT_SIGNAL_IN_DECISION` set, the decision waits for its first use, so
/// that a test can install its signal handler first; with `THISCPU_INJECT_DEFER_DECISION`
/// set it waits too, so that a test can make a first call before anything is decided.
#[cfg(thiscpu_inject)]
pub(crate) fn defer_decision() -> bool {
    // SAFETY: `getenv` with a NUL-terminated name; only the result's nullness is used.
    let deferred = !unsafe { libc::getenv(c"THISCPU_INJECT_DEFER_DECISION".as_ptr()) }.is_null();
    // SAFETY: as above.
    let panics = !unsafe { libc::getenv(c"THISCPU_INJECT_PANIC_IN_DECISION".as_ptr()) }.is_null();
    deferred || panics || signal().is_some()
}

#[cfg(not(thiscpu_inject))]
#[inline(always)]
pub(crate) fn defer_decision() -> bool {
    false
}

/// Raises the signal in `THISCPU_INJECT_SIGNAL_IN_DECISION` on the deciding thread, in the
/// middle of the decision.
#[cfg(thiscpu_inject)]
pub(crate) fn signal_in_decision() {
    if let Some(signal) = signal() {
        // SAFETY: raises a signal whose handler the test installed.
        unsafe { libc::raise(signal) };
    }
}

#[cfg(not(thiscpu_inject))]
#[inline(always)]
pub(crate) fn signal_in_decision() {}

/// With `THISCPU_INJECT_PANIC_IN_DECISION` set, the decision waits for its first use, and
/// the first decision panics halfway (after registering its thread), once.
#[cfg(thiscpu_inject)]
pub(crate) fn panic_in_decision() {
    use core::sync::atomic::{AtomicBool, Ordering};
    static PANICKED: AtomicBool = AtomicBool::new(false);
    // SAFETY: `getenv` with a NUL-terminated name; only the result's nullness is used.
    let asked = !unsafe { libc::getenv(c"THISCPU_INJECT_PANIC_IN_DECISION".as_ptr()) }.is_null();
    if asked && !PANICKED.swap(true, Ordering::Relaxed) {
        panic!("a decision that fails halfway (THISCPU_INJECT_PANIC_IN_DECISION)");
    }
}

#[cfg(not(thiscpu_inject))]
#[inline(always)]
pub(crate) fn panic_in_decision() {}

/// With `THISCPU_INJECT_DELAY_IN_DECISION` set to a number of milliseconds, the decision
/// sleeps that long halfway, so that other threads race it for that long.
#[cfg(thiscpu_inject)]
pub(crate) fn delay_in_decision() {
    // SAFETY: `getenv` with a NUL-terminated name; a non-null result is a NUL-terminated
    // string, read at once.
    let value = unsafe { libc::getenv(c"THISCPU_INJECT_DELAY_IN_DECISION".as_ptr()) };
    if value.is_null() {
        return;
    }
    // SAFETY: as above.
    let value = unsafe { std::ffi::CStr::from_ptr(value) };
    if let Some(ms) = value.to_str().ok().and_then(|text| text.parse().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

#[cfg(not(thiscpu_inject))]
#[inline(always)]
pub(crate) fn delay_in_decision() {}
