//! `Counter` exact under migration, signals and thread churn, and (built with
//! `--cfg thiscpu_inject`) delays inside the sections. `.ci/run` runs this file in every
//! environment (glibc's registration, thiscpu's own, `THISCPU_RSEQ=off`, linked statically)
//! and once built with `--cfg thiscpu_inject`.

use std::time::Duration;
use thiscpu::ops;
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

/// Built with `--cfg thiscpu_inject`, delay loops inside every section make preemption and
/// signals land inside sections, so the abort path must run; without the cfg this test checks
/// exactness only.
#[test]
fn aborted_sections_are_retried_exactly() {
    #[cfg(thiscpu_inject)]
    for point in 0..ops::inject::POINTS {
        ops::inject::set_delay(point, 20_000);
    }
    let report = stress(StressConfig {
        duration: Duration::from_millis(1000),
        churn: false,
        ..Default::default()
    });
    let rseq_in_use = ops::position().is_some();
    eprintln!("aborts: {}, rseq in use: {rseq_in_use}", report.aborts);
    if cfg!(thiscpu_inject) && rseq_in_use {
        assert!(
            report.aborts > 0,
            "fault injection on, yet no section aborted: {report:?}"
        );
    }
}
