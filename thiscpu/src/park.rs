//! Sleeping until a 32-bit word changes: `futex` on Linux, a `Mutex` and `Condvar` elsewhere
//! (`os`); under the model checker, a yield (loom runs its threads on one OS thread, where a
//! sleep would never end).

#[cfg(not(thiscpu_model))]
pub(crate) use core::sync::atomic::AtomicU32;
#[cfg(thiscpu_model)]
pub(crate) use loom::sync::atomic::AtomicU32;

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

#[cfg(thiscpu_model)]
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    if word.load(core::sync::atomic::Ordering::Relaxed) == expected {
        loom::thread::yield_now();
    }
}

#[cfg(thiscpu_model)]
pub(crate) fn wake(_word: &AtomicU32, _count: i32) {}
