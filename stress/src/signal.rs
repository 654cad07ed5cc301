//! The signal storm's handler: it increments the counter of the run under way, which the run
//! publishes for it and withdraws only once no handler, on any thread, still uses it.
//!
//! # Safety
//! Installs a process-wide signal handler (restored afterwards) that dereferences a published
//! pointer; each block states why it holds.

use core::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiscpu::Counter;

// The signal handler reaches the counter under test through these; one run at a time.
pub(crate) static RUN: Mutex<()> = Mutex::new(());
static COUNTER: AtomicPtr<Counter> = AtomicPtr::new(core::ptr::null_mut());
pub(crate) static HANDLER_INCREMENTS: AtomicU64 = AtomicU64::new(0);
/// Handlers between their first and last instruction, on any thread. The handler is installed
/// process-wide, so a signal sent to the whole process (`kill`) may run it on a thread that is
/// not a worker, at any time; a run waits for this to fall to zero before its counter can go.
static HANDLERS_RUNNING: AtomicU32 = AtomicU32::new(0);

extern "C" fn increment_in_handler(_: libc::c_int) {
    // Counted as running before the pointer is read: see `HandlerTarget`'s drop.
    HANDLERS_RUNNING.fetch_add(1, Ordering::SeqCst);
    let counter = COUNTER.load(Ordering::SeqCst);
    if !counter.is_null() {
        #[cfg(test)]
        tests::pause_if_asked();
        // SAFETY: the pointer was read while it was published, after this handler counted
        // itself in `HANDLERS_RUNNING`; the `HandlerTarget` that published it holds the counter
        // alive until the pointer is withdrawn and no handler is running any more.
        unsafe { &*counter }.inc();
        HANDLER_INCREMENTS.fetch_add(1, Ordering::Relaxed);
        #[cfg(test)]
        tests::note_handler_end();
    }
    HANDLERS_RUNNING.fetch_sub(1, Ordering::SeqCst);
}

/// The counter the signal handler increments, published for one run. Dropping it withdraws
/// the pointer and then waits until no handler, on any thread, is still between reading the
/// pointer and using it; only then is its reference to the counter released.
pub(crate) struct HandlerTarget {
    _alive: Arc<Counter>,
}

impl HandlerTarget {
    pub(crate) fn publish(counter: &Arc<Counter>) -> Self {
        COUNTER.store(Arc::as_ptr(counter).cast_mut(), Ordering::SeqCst);
        HandlerTarget {
            _alive: counter.clone(),
        }
    }
}

impl Drop for HandlerTarget {
    fn drop(&mut self) {
        COUNTER.store(core::ptr::null_mut(), Ordering::SeqCst);
        // Sequentially consistent on both sides: a handler that read the pointer before the
        // store above had counted itself before that, so the count seen here includes it.
        // Handlers are short; this loop normally runs zero times.
        while HANDLERS_RUNNING.load(Ordering::SeqCst) != 0 {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Restores the previous handler when dropped.
pub(crate) struct HandlerGuard {
    signal: i32,
    previous: libc::sigaction,
}

impl HandlerGuard {
    pub(crate) fn install(signal: i32) -> std::io::Result<Self> {
        // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe (one counter
        // increment and one atomic add); SA_RESTART keeps the workers' syscalls going.
        unsafe {
            let mut action: libc::sigaction = core::mem::zeroed();
            action.sa_sigaction = increment_in_handler as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = core::mem::zeroed();
            if libc::sigaction(signal, &action, &mut previous) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(HandlerGuard { signal, previous })
        }
    }
}

impl Drop for HandlerGuard {
    fn drop(&mut self) {
        // SAFETY: restores the action saved at installation.
        unsafe {
            libc::sigaction(self.signal, &self.previous, core::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::gettid;
    use crate::{StressConfig, run_counter};
    use core::sync::atomic::AtomicI32;
    use std::time::Instant;

    /// The thread whose handler pauses, and for how long.
    static PAUSE_TID: AtomicI32 = AtomicI32::new(0);
    const PAUSE: Duration = Duration::from_millis(800);
    /// `CLOCK_MONOTONIC` nanoseconds when that handler was done with the counter; 0 before.
    static PAUSED_HANDLER_END: AtomicU64 = AtomicU64::new(0);

    fn monotonic_nanos() -> u64 {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec we own; it is async-signal-safe.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
    }

    /// In the handler, after it read the counter's pointer: holds the chosen thread there.
    pub(super) fn pause_if_asked() {
        if gettid() == PAUSE_TID.load(Ordering::SeqCst) {
            std::thread::sleep(PAUSE);
        }
    }

    /// In the handler, after its increment: records when the chosen thread got there.
    pub(super) fn note_handler_end() {
        if gettid() == PAUSE_TID.load(Ordering::SeqCst) {
            PAUSED_HANDLER_END.store(monotonic_nanos(), Ordering::SeqCst);
        }
    }

    /// A signal for the whole process may run the handler on a thread that is not a worker,
    /// and that handler may still hold the counter when the workers are done: the run must not
    /// free the counter (and must not return) before that handler is finished with it.
    #[test]
    fn a_handler_on_another_thread_keeps_the_counter_alive() {
        let config = StressConfig {
            duration: Duration::from_millis(300),
            threads: 2,
            migrate: false,
            churn: false,
            signals: true,
            // Ignored by default: if it ever came after the run, it would do nothing.
            signal: libc::SIGWINCH,
        };
        let bystander = std::thread::spawn(move || {
            PAUSE_TID.store(gettid(), Ordering::SeqCst);
            let waited = Instant::now();
            while COUNTER.load(Ordering::SeqCst).is_null() {
                assert!(
                    waited.elapsed() < Duration::from_secs(20),
                    "the run never started"
                );
                std::thread::sleep(Duration::from_micros(200));
            }
            // SAFETY: tgkill to this thread; the run's handler for the signal is installed.
            let sent = unsafe {
                libc::syscall(libc::SYS_tgkill, libc::getpid(), gettid(), libc::SIGWINCH)
            };
            assert_eq!(sent, 0);
        });
        let report = run_counter(&config).expect("stress run");
        let returned = monotonic_nanos();
        let handler_end = PAUSED_HANDLER_END.load(Ordering::SeqCst);
        bystander.join().expect("bystander");
        assert_ne!(
            handler_end, 0,
            "the run returned while a handler on another thread still held its counter"
        );
        assert!(handler_end <= returned);
        assert!(report.exact(), "{report:?}");
        assert!(report.signal_increments >= 1, "{report:?}");
    }
}
