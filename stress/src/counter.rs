//! The counter stress: workers increment one [`Counter`] (half of them through an
//! [`Adder`](thiscpu::Adder)) in the storm, signal handlers increment it too, and every
//! increment is also counted privately.

use crate::gate::StartGate;
use crate::signal::{HANDLER_INCREMENTS, HandlerGuard, HandlerTarget, RUN};
use crate::storm::{Churn, Disturber, StressConfig, allowed_cpus};
use crate::workers::{call_off, spawn_workers, start_worker};
use core::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiscpu::Counter;

/// What happened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StressReport {
    /// Increments made (by workers, short-lived threads and signal handlers).
    pub operations: u64,
    /// What the counter says.
    pub counted: u64,
    /// `operations - counted`: must be 0.
    pub lost: i128,
    /// Aborted restartable sequences retried during the run.
    pub aborts: u64,
    /// Affinity changes made to workers.
    pub migrations: u64,
    /// Signals sent to workers.
    pub signals: u64,
    /// Increments made inside signal handlers.
    pub signal_increments: u64,
    /// Short-lived threads created.
    pub threads_created: u64,
    /// Long-lived worker threads.
    pub workers: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl StressReport {
    /// Whether every increment was counted exactly once.
    pub fn exact(&self) -> bool {
        self.lost == 0
    }
}

/// Runs the stress on a fresh [`Counter`] and reports. Only one run at a time in a process.
///
/// ```
/// use std::time::Duration;
/// let config = thiscpu_stress::StressConfig {
///     duration: Duration::from_millis(100),
///     threads: 4,
///     ..Default::default()
/// };
/// let report = thiscpu_stress::run_counter(&config).unwrap();
/// assert!(report.exact(), "{report:?}");
/// ```
pub fn run_counter(config: &StressConfig) -> std::io::Result<StressReport> {
    let _one_at_a_time = RUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let counter = Arc::new(Counter::new());
    let workers = config.threads.max(1);
    let cpus = allowed_cpus();
    let stop = Arc::new(AtomicBool::new(false));
    // Workers stop by their own clock, but not before the disturber's first round: a run
    // that moved and signalled nobody would test nothing.
    let disturbed = Arc::new(AtomicBool::new(false));
    let gate = Arc::new(StartGate::new(workers));
    let tids: Arc<Vec<AtomicI32>> = Arc::new((0..workers).map(|_| AtomicI32::new(0)).collect());
    let aborts_before = thiscpu::ops::aborts();
    HANDLER_INCREMENTS.store(0, Ordering::Relaxed);
    let guard = if config.signals {
        Some(HandlerGuard::install(config.signal)?)
    } else {
        None
    };
    let target = HandlerTarget::publish(&counter);
    let duration = config.duration;

    let worker_handles = spawn_workers(workers, &gate, |index| {
        let (counter, stop, disturbed, gate, tids) = (
            counter.clone(),
            stop.clone(),
            disturbed.clone(),
            gate.clone(),
            tids.clone(),
        );
        move || {
            let Some(deadline) = start_worker(&tids, index, &gate, duration) else {
                return 0;
            };
            let mut made = 0u64;
            // Half the workers add through one `Adder` for the whole run: what it read once
            // must stay right across every migration and signal.
            let adder = (index % 2 == 1).then(|| counter.adder());
            while !stop.load(Ordering::Relaxed) {
                match adder {
                    Some(adder) => (0..64).for_each(|_| adder.inc()),
                    None => (0..64).for_each(|_| counter.inc()),
                }
                made += 64;
                if made.is_multiple_of(4096)
                    && Instant::now() >= deadline
                    && disturbed.load(Ordering::Acquire)
                {
                    break;
                }
            }
            tids[index].store(0, Ordering::Release);
            made
        }
    })?;

    if !gate.wait_for_all(|| worker_handles.iter().any(|h| h.is_finished())) {
        return Err(call_off(&gate, worker_handles));
    }
    let began = gate.open();
    let deadline = began + config.duration;
    let mut disturber = Disturber::new(config);
    let mut churn = Churn::default();
    let mut refused = None;
    // The first round comes before the first look at the clock: waking a thousand workers can
    // take longer than the run asked for.
    loop {
        disturber.round(&tids, &cpus);
        disturbed.store(true, Ordering::Release);
        if config.churn {
            let counter = counter.clone();
            let by_adder = churn.created % 2 == 1;
            let spawned = churn.spawn(move || {
                let n = 2_000;
                if by_adder {
                    // Made on this new thread, whose registration `adder()` itself makes.
                    let adder = counter.adder();
                    (0..n).for_each(|_| adder.inc());
                } else {
                    (0..n).for_each(|_| counter.inc());
                }
                n
            });
            if let Err(error) = spawned {
                refused = Some(error);
                break;
            }
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    stop.store(true, Ordering::Relaxed);
    let mut operations: u64 = worker_handles
        .into_iter()
        .map(|handle| handle.join().expect("stress worker panicked"))
        .sum();
    let threads_created = churn.created;
    operations += churn.finish();
    let elapsed = began.elapsed();
    if let Some(error) = refused {
        return Err(error);
    }
    // The storm's signals went only to workers, all joined now; a signal still pending when
    // its worker exited was discarded with it, neither handled nor counted. A signal sent to
    // the whole process may still run the handler on another thread: withdrawing the target
    // waits for it.
    drop(guard);
    drop(target);
    let signal_increments = HANDLER_INCREMENTS.load(Ordering::Relaxed);
    operations += signal_increments;
    let counted = counter.sum();
    Ok(StressReport {
        operations,
        counted,
        lost: i128::from(operations) - i128::from(counted),
        aborts: thiscpu::ops::aborts() - aborts_before,
        migrations: disturber.migrations,
        signals: disturber.signals,
        signal_increments,
        threads_created,
        workers,
        elapsed,
    })
}
