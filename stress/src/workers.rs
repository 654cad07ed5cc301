//! The long-lived workers of a run: their start behind the gate, under `SCHED_IDLE`, and the
//! errors when the system refuses a thread.
//!
//! # Safety
//! Changes the calling worker's scheduling policy or priority; each block states why it holds.

use crate::gate::StartGate;
use core::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Starts `count` workers that wait at `gate` first. When the system refuses a thread, the
/// gate is cancelled, the workers already started are joined, and the error says which thread
/// of how many could not be created.
pub(crate) fn spawn_workers<T: Send + 'static, F: FnOnce() -> T + Send + 'static>(
    count: usize,
    gate: &StartGate,
    mut make: impl FnMut(usize) -> F,
) -> std::io::Result<Vec<std::thread::JoinHandle<T>>> {
    let mut handles = Vec::with_capacity(count);
    for index in 0..count {
        match std::thread::Builder::new().spawn(make(index)) {
            Ok(handle) => handles.push(handle),
            Err(error) => {
                gate.cancel();
                for handle in handles {
                    let _ = handle.join();
                }
                return Err(thread_refused(
                    &format!("worker thread {} of {count}", index + 1),
                    &error,
                ));
            }
        }
    }
    Ok(handles)
}

/// A worker's start: publishes its thread id for the disturber, lets the coordinator run, and
/// waits at the gate. The worker's deadline, or `None` when the run was called off.
pub(crate) fn start_worker(
    tids: &[AtomicI32],
    index: usize,
    gate: &StartGate,
    duration: Duration,
) -> Option<Instant> {
    tids[index].store(gettid(), Ordering::Release);
    yield_to_the_coordinator();
    Some(gate.arrive()? + duration)
}

/// Sends the workers home after one of them ended without reaching the gate, waits for them,
/// and says what happened.
pub(crate) fn call_off<T>(
    gate: &StartGate,
    workers: Vec<std::thread::JoinHandle<T>>,
) -> std::io::Error {
    gate.cancel();
    for handle in workers {
        let _ = handle.join();
    }
    std::io::Error::other(
        "a worker thread ended before it could start (the system may be short of memory or \
         threads)",
    )
}
/// The error for a thread the system would not create.
pub(crate) fn thread_refused(what: &str, error: &std::io::Error) -> std::io::Error {
    let reason = match error.raw_os_error() {
        Some(errno) => os_reason(errno),
        None => error.to_string(),
    };
    std::io::Error::new(
        error.kind(),
        format!("the system refused to create {what}: {reason}"),
    )
}

/// `strerror`'s text, without std's ` (os error N)` suffix.
fn os_reason(errno: i32) -> String {
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    match text.find(" (os error") {
        Some(cut) => text[..cut].to_owned(),
        None => text,
    }
}

/// Puts the calling worker under `SCHED_IDLE` (or, where that is refused, at nice 19), which
/// needs no privilege: any thread at normal priority that wakes, the one that migrates and
/// signals the workers first, then takes the CPU from a worker at once, even when thousands of
/// workers spin. At nice 10 a coordinator among 4096 spinning workers got no round in before
/// the run's second was over. The workers are preempted more often this way, which the stress
/// welcomes; on a machine busy with other work they run less, and still check exactness.
fn yield_to_the_coordinator() {
    // SAFETY: sched_setscheduler and setpriority on the calling thread (pid 0, and
    // PRIO_PROCESS with a thread id, name one thread on Linux) with a valid sched_param;
    // failure leaves the thread as it was, which is harmless.
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            libc::setpriority(libc::PRIO_PROCESS, gettid() as libc::id_t, 19);
        }
    }
}

pub(crate) fn gettid() -> i32 {
    // SAFETY: no precondition.
    unsafe { libc::gettid() }
}
