//! The counter stress: workers increment one [`Counter`] (half of them through an
//! [`Adder`](thiscpu::Adder)) in the storm, signal handlers increment it too, and every
//! increment is also counted privately.

use crate::storm::{Shift, StressConfig, Workload, run_storm};
use std::sync::Arc;
use std::time::Duration;
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
    let workload = Arc::new(Increments {
        counter: Arc::new(Counter::new()),
    });
    let storm = run_storm(config, &workload)?;
    // The handler increments the counter under test, so its increments are operations too.
    let operations = storm.tally + storm.signals_handled;
    let counted = workload.counter.sum();
    Ok(StressReport {
        operations,
        counted,
        lost: i128::from(operations) - i128::from(counted),
        aborts: storm.aborts(),
        migrations: storm.migrations,
        signals: storm.signals,
        signal_increments: storm.signals_handled,
        threads_created: storm.threads_created,
        workers: storm.workers,
        elapsed: storm.elapsed,
    })
}

/// The counter stress's workload: increments, counted privately.
struct Increments {
    counter: Arc<Counter>,
}

impl Workload for Increments {
    type Tally = u64;
    type Background = ();

    fn work(&self, index: usize, shift: &Shift) -> u64 {
        let mut made = 0u64;
        // Half the workers add through one `Adder` for the whole run: what it read once
        // must stay right across every migration and signal.
        let adder = (index % 2 == 1).then(|| self.counter.adder());
        while !shift.stopped() {
            match adder {
                Some(adder) => (0..64).for_each(|_| adder.inc()),
                None => (0..64).for_each(|_| self.counter.inc()),
            }
            made += 64;
            if made.is_multiple_of(4096) && shift.over() {
                break;
            }
        }
        made
    }

    fn churn(&self, earlier: u64) -> u64 {
        let n = 2_000;
        if earlier % 2 == 1 {
            // Made on this new thread, whose registration `adder()` itself makes.
            let adder = self.counter.adder();
            (0..n).for_each(|_| adder.inc());
        } else {
            (0..n).for_each(|_| self.counter.inc());
        }
        n
    }

    fn handler_target(&self) -> Arc<Counter> {
        self.counter.clone()
    }
}
