//! `Counter` exact under migration, signals and thread churn, and (built with
//! `--cfg thiscpu_inject`) delays inside the sections. `.ci/run` runs this file in every
//! environment (glibc's registration, thiscpu's own, `THISCPU_RSEQ=off`, linked statically)
//! and once built with `--cfg thiscpu_inject`.
//!
//! Linux only, like the crate.
#![cfg(target_os = "linux")]

use std::time::Duration;
use thiscpu_stress::{StressConfig, StressReport, run_counter};

fn stress(config: StressConfig) -> StressReport {
    let report = run_counter(&config).expect("stress run");
    eprintln!("{report:?}");
    assert!(
        report.exact(),
        "lost {} of {} increments: {report:?}",
        report.lost,
        report.operations
    );
    assert!(report.operations > 0);
    report
}

#[test]
fn counter_is_exact_under_migration_signals_and_churn() {
    let report = stress(StressConfig {
        duration: Duration::from_millis(1500),
        ..Default::default()
    });
    assert!(
        report.signal_increments > 0,
        "the signal storm reached no handler: {report:?}"
    );
    assert!(report.migrations > 0 || thiscpu::topology::online_cpus().len() == 1);
    assert!(report.threads_created > 0);
}

/// Without thread churn the same workers run for the whole second, so each is migrated and
/// signalled many times over.
#[cfg(not(thiscpu_inject))]
#[test]
fn counter_is_exact_on_long_lived_threads() {
    stress(StressConfig {
        duration: Duration::from_millis(1000),
        churn: false,
        ..Default::default()
    });
}

/// Built with `--cfg thiscpu_inject` only: delay loops inside every section make preemption
/// and signals land inside sections, so sections abort, and every increment must still count
/// exactly once. The aborts the counter's retries counted are the witness that the abort path
/// ran.
#[cfg(thiscpu_inject)]
#[test]
fn aborted_sections_are_retried_exactly() {
    use thiscpu::ops;
    if ops::position().is_none() {
        // Only where the environment says so (`THISCPU_EXPECT_REGISTRAR=none`): anywhere else
        // this would pass with no section run at all.
        assert_eq!(
            std::env::var("THISCPU_EXPECT_REGISTRAR").as_deref(),
            Ok("none"),
            "no rseq here, so no section to abort"
        );
        eprintln!("rseq not in use here: no section to abort");
        return;
    }
    for point in 0..ops::inject::POINTS {
        ops::inject::set_delay(point, 20_000);
    }
    let report = stress(StressConfig {
        duration: Duration::from_millis(1000),
        churn: false,
        ..Default::default()
    });
    eprintln!("aborts: {}", report.aborts);
    assert!(
        report.aborts > 0,
        "delays inside the sections, yet no section aborted: {report:?}"
    );
}
