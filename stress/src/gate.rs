//! A start gate for worker threads: the stress runs and the benchmark runner hold their
//! workers at it until all have arrived, then release them at once.
//!
//! # Safety
//! Waits and wakes with the `futex` system call on words the gate owns; each block states why
//! it holds.

use core::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Holds worker threads until every one has arrived, then releases them all with one wake-up,
/// or sends them home when the run is called off (a thread could not be created).
///
/// A `std::sync::Barrier` wakes its waiters into a mutex they must take one at a time; with
/// hundreds of threads on a few CPUs, and the released ones spinning, that convoy takes
/// minutes. Here the release is one store and one `futex` wake, and no waiter takes a lock.
/// Each worker learns when the gate opened, so that it can stop on time by its own clock:
/// with many more spinning threads than CPUs, the thread that would tell it to stop may wait
/// a long time for a CPU.
#[derive(Debug)]
pub struct StartGate {
    expected: u32,
    arrived: AtomicU32,
    state: AtomicU32,
    opened: std::sync::OnceLock<Instant>,
}

const GATE_CLOSED: u32 = 0;
const GATE_OPEN: u32 = 1;
const GATE_CANCELLED: u32 = 2;

impl StartGate {
    /// A closed gate for `workers` threads.
    pub fn new(workers: usize) -> Self {
        StartGate {
            expected: u32::try_from(workers).unwrap_or(u32::MAX),
            arrived: AtomicU32::new(0),
            state: AtomicU32::new(GATE_CLOSED),
            opened: std::sync::OnceLock::new(),
        }
    }

    /// Called by a worker: counts it in and waits for the gate to open. The time it opened, or
    /// `None` when the run was called off.
    pub fn arrive(&self) -> Option<Instant> {
        if self.arrived.fetch_add(1, Ordering::AcqRel).wrapping_add(1) == self.expected {
            futex_wake(&self.arrived, 1);
        }
        loop {
            match self.state.load(Ordering::Acquire) {
                GATE_CLOSED => futex_wait(&self.state, GATE_CLOSED),
                GATE_OPEN => return self.opened.get().copied(),
                _ => return None,
            }
        }
    }

    /// Called by the coordinator: waits until every worker has arrived (`true`), or until
    /// `ended_early` reports a worker thread that has ended (`false`; the caller calls the run
    /// off). A worker ends before the gate opens only if it never arrived: std created the
    /// thread but could not start it (its signal stack could not be mapped, say), and waiting
    /// for it would wait forever.
    pub fn wait_for_all(&self, ended_early: impl Fn() -> bool) -> bool {
        loop {
            let arrived = self.arrived.load(Ordering::Acquire);
            if arrived >= self.expected {
                return true;
            }
            if ended_early() {
                return false;
            }
            futex_wait_at_most(&self.arrived, arrived, Duration::from_millis(20));
        }
    }

    /// Lets every waiting (and later arriving) worker go; the time it opened.
    pub fn open(&self) -> Instant {
        let opened = *self.opened.get_or_init(Instant::now);
        self.release(GATE_OPEN);
        opened
    }

    /// Sends every waiting (and later arriving) worker home: `arrive` returns `false`.
    pub fn cancel(&self) {
        self.release(GATE_CANCELLED);
    }

    fn release(&self, state: u32) {
        self.state.store(state, Ordering::Release);
        futex_wake(&self.state, i32::MAX);
    }
}

/// Sleeps while `word` holds `expected`; may return early (a signal, a spurious wake-up), so
/// callers check again in a loop.
fn futex_wait(word: &AtomicU32, expected: u32) {
    futex_wait_until(word, expected, None);
}

/// [`futex_wait`] for at most `limit`.
fn futex_wait_at_most(word: &AtomicU32, expected: u32, limit: Duration) {
    let timeout = libc::timespec {
        tv_sec: limit.as_secs() as libc::time_t,
        tv_nsec: limit.subsec_nanos() as libc::c_long,
    };
    futex_wait_until(word, expected, Some(&timeout));
}

fn futex_wait_until(word: &AtomicU32, expected: u32, timeout: Option<&libc::timespec>) {
    let timeout = timeout.map_or(core::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: FUTEX_WAIT only reads the aligned 32-bit word, which `word` keeps alive for the
    // call, and returns at once when it no longer holds `expected`; the timeout, when given, is
    // a relative time that lives across the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            timeout,
        )
    };
    if ret != 0 {
        let errno = std::io::Error::last_os_error().raw_os_error();
        if !matches!(
            errno,
            Some(libc::EAGAIN) | Some(libc::EINTR) | Some(libc::ETIMEDOUT)
        ) {
            // No futex (a sandbox refusing it): wait politely instead.
            std::thread::yield_now();
        }
    }
}

/// Wakes up to `count` threads sleeping on `word`.
fn futex_wake(word: &AtomicU32, count: i32) {
    // SAFETY: FUTEX_WAKE only uses the word's address as a key; it reads no memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            count,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_coordinator_stops_waiting_when_a_worker_ends_without_arriving() {
        let gate = Arc::new(StartGate::new(3));
        let arriving: Vec<_> = (0..2)
            .map(|_| {
                let gate = gate.clone();
                std::thread::spawn(move || gate.arrive())
            })
            .collect();
        // The third worker ends without arriving, as one that std could not start does.
        let lost = std::thread::spawn(|| None::<Instant>);
        assert!(!gate.wait_for_all(|| lost.is_finished()));
        gate.cancel();
        for worker in arriving {
            assert_eq!(worker.join().unwrap(), None);
        }
    }

    #[test]
    fn the_gate_releases_every_waiter_or_sends_them_home() {
        for open in [true, false] {
            let gate = Arc::new(StartGate::new(64));
            let waiters: Vec<_> = (0..64)
                .map(|_| {
                    let gate = gate.clone();
                    std::thread::spawn(move || gate.arrive())
                })
                .collect();
            assert!(gate.wait_for_all(|| false));
            let opened = if open {
                Some(gate.open())
            } else {
                gate.cancel();
                None
            };
            for waiter in waiters {
                assert_eq!(waiter.join().unwrap(), opened);
            }
        }
    }
}
