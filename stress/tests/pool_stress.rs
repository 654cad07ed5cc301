//! `Pool`: every object in exactly one place under migration, signals, thread churn, drains and
//! (built with `--cfg thiscpu_inject`) delays inside the sections. `.ci/run` runs this file in
//! every environment and once built with `--cfg thiscpu_inject`.
//!
//! Linux only, like the crate.
#![cfg(target_os = "linux")]

use std::time::Duration;
use thiscpu_stress::{PoolStressConfig, PoolStressReport, StressConfig, run_pool};

fn stress(config: PoolStressConfig) -> PoolStressReport {
    let report = run_pool(&config).expect("pool stress run");
    eprintln!("{report:?}");
    assert!(
        report.exact(),
        "objects lost or handed out twice: {report:?}"
    );
    assert!(report.operations > 0);
    assert!(report.created > 0 && report.found == report.created);
    report
}

#[test]
fn pool_is_exact_under_migration_signals_churn_and_drains() {
    let report = stress(PoolStressConfig {
        stress: StressConfig {
            duration: Duration::from_millis(1500),
            ..Default::default()
        },
        ..Default::default()
    });
    assert!(
        report.signals_handled > 0,
        "the signal storm reached no handler: {report:?}"
    );
    assert!(report.migrations > 0 || thiscpu::topology::online_cpus().len() == 1);
    assert!(report.threads_created > 0);
    assert!(
        report.drains > 0 || report.drains_unavailable > 0,
        "the drainer never ran: {report:?}"
    );
    if report.drains > 0 {
        assert!(
            report.drained_objects > 0,
            "drains never found an object to move: {report:?}"
        );
    } else {
        eprintln!("draining is unavailable here: {report:?}");
    }
}

/// Without thread churn the same workers run for the whole second, so each is migrated,
/// signalled and drained under many times over.
#[cfg(not(thiscpu_inject))]
#[test]
fn pool_is_exact_on_long_lived_threads() {
    stress(PoolStressConfig {
        stress: StressConfig {
            duration: Duration::from_millis(1000),
            churn: false,
            ..Default::default()
        },
        ..Default::default()
    });
}

/// Built with `--cfg thiscpu_inject` only: delay loops inside the push and pop sections
/// (between the `stopped` check and the commit) make preemption, signals and drains land
/// inside them, so sections abort, and every object must still be in exactly one place. The
/// aborts the pool's retries counted are the witness that the abort path ran.
#[cfg(thiscpu_inject)]
#[test]
fn aborted_pool_sections_are_retried_exactly() {
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
    let report = stress(PoolStressConfig {
        stress: StressConfig {
            duration: Duration::from_millis(1000),
            churn: false,
            ..Default::default()
        },
        ..Default::default()
    });
    eprintln!("aborts: {}", report.aborts);
    assert!(
        report.aborts > 0,
        "delays inside the sections, yet no section aborted: {report:?}"
    );
}
