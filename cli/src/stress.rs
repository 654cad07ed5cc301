//! `thiscpu stress`: the library's exactness self-tests, run for as long as asked, with what
//! they did and whether anything was lost.
//!
//! Runs `thiscpu_stress::run_counter` (a `Counter` incremented by workers that another thread
//! migrates between CPUs at random and storms with signals whose handlers increment the same
//! counter, while short-lived threads come and go), then `thiscpu_stress::run_pool` (the same
//! storm around a `Pool`, with a thread draining CPU caches), then `thiscpu_stress::run_alloc`
//! (the same storm around a `PerCpuAlloc` whose objects carry patterns checked before they are
//! freed, with a thread releasing CPU caches). Each run lasts `--seconds`, so the command takes
//! about three times that.
//! Exit status 0 when every increment, every object and every allocation was accounted for, 1
//! otherwise.

use crate::args::StressArgs;
use crate::error::{Error, Result, plain};
use crate::report::output::{Output, SCHEMA_VERSION};
use serde_json::{Value, json};
use std::io::IsTerminal;
use std::time::Duration;
use thiscpu_stress::{
    AllocStressConfig, AllocStressReport, PoolStressConfig, PoolStressReport, StressConfig,
    StressReport, run_alloc, run_counter, run_pool,
};

/// Runs the stresses and reports; an inexact result is an error with exit status 1.
pub fn run(args: StressArgs) -> Result<()> {
    let output = args.json.as_deref().map(Output::open).transpose()?;
    let mut config = StressConfig {
        duration: Duration::from_secs_f64(args.seconds),
        ..StressConfig::default()
    };
    if let Some(threads) = args.threads {
        config.threads = threads as usize;
    }
    let reports = run_all(&config, args.seconds)?;

    let source = thiscpu::source();
    let json_to_stdout = output.as_ref().is_some_and(Output::is_stdout);
    if let Some(output) = output {
        output.commit_json(&reports.json(&source, args.seconds))?;
    }
    if !json_to_stdout {
        reports.print(&source);
    }
    if reports.exact() {
        Ok(())
    } else {
        Err(reports.inexact_error())
    }
}

/// What the three stresses reported.
struct Reports {
    counter: StressReport,
    pool: PoolStressReport,
    alloc: AllocStressReport,
}

/// Runs the counter, pool and allocator stresses one after the other, each under the
/// spinner.
fn run_all(config: &StressConfig, seconds: f64) -> Result<Reports> {
    let failed =
        |what: &str, e: std::io::Error| Error::failed(format!("{what} stress: {}", plain(&e)));
    let progress = spinner();
    let phase = |what: &str| {
        progress.set_message(format!(
            "{what} stress: {} workers for {seconds} s",
            config.threads
        ));
    };
    phase("counter");
    let counter = run_counter(config).map_err(|e| failed("counter", e))?;
    phase("pool");
    let pool = run_pool(&PoolStressConfig {
        stress: config.clone(),
        ..PoolStressConfig::default()
    })
    .map_err(|e| failed("pool", e))?;
    phase("allocator");
    let alloc = run_alloc(&AllocStressConfig {
        stress: config.clone(),
        ..AllocStressConfig::default()
    })
    .map_err(|e| failed("allocator", e))?;
    progress.finish_and_clear();
    Ok(Reports {
        counter,
        pool,
        alloc,
    })
}

impl Reports {
    fn exact(&self) -> bool {
        self.counter.exact() && self.pool.exact() && self.alloc.exact()
    }

    fn json(&self, source: &thiscpu::Source, seconds: f64) -> Value {
        let lost = self.counter.lost.unsigned_abs() + self.pool.lost.unsigned_abs();
        json!({
            "schema_version": SCHEMA_VERSION,
            "exact": self.exact(),
            "lost": lost,
            "seconds": seconds,
            "source": {
                "registrar": source.registrar.name(),
                "this_thread": source.this_thread.name(),
                "fallback": source.fallback.name(),
                "mm_cid": source.mm_cid,
            },
            "counter": counter_json(&self.counter),
            "pool": pool_json(&self.pool),
            "allocator": alloc_json(&self.alloc),
        })
    }

    fn print(&self, source: &thiscpu::Source) {
        println!(
            "thiscpu stress · rseq registered by {}; this thread answers from {}, fallback {}; \
             mm_cid {}",
            source.registrar.name(),
            source.this_thread.name(),
            source.fallback.name(),
            if source.mm_cid {
                "usable"
            } else {
                "not usable"
            },
        );
        println!("\n{}", counter_text(&self.counter));
        println!("\n{}", pool_text(&self.pool));
        println!("\n{}", alloc_text(&self.alloc));
        println!(
            "\n{}",
            if self.exact() {
                "exact: nothing lost, nothing doubled"
            } else {
                "NOT exact: see above"
            }
        );
    }

    fn inexact_error(&self) -> Error {
        let (counter, pool, alloc) = (&self.counter, &self.pool, &self.alloc);
        Error::failed(format!(
            "the stress lost updates: counter {} (of {}), pool {} objects, {} double hand-outs, \
             {} duplicates; allocator {} objects corrupted, {} allocations lost, {} bytes left \
             cached",
            counter.lost,
            counter.operations,
            pool.lost,
            pool.double_handouts,
            pool.duplicates,
            alloc.corrupted,
            alloc.lost,
            alloc.cached_after_release
        ))
    }
}

/// What runs now, with the time spent, on standard error when it is a terminal.
fn spinner() -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new_spinner();
    if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

fn counter_json(r: &StressReport) -> Value {
    json!({
        "exact": r.exact(),
        "operations": r.operations,
        "counted": r.counted,
        "lost": lost_json(r.lost),
        "aborts": r.aborts,
        "migrations": r.migrations,
        "signals_sent": r.signals,
        "signals_handled": r.signal_increments,
        "threads_created": r.threads_created,
        "workers": r.workers,
        "elapsed_seconds": r.elapsed.as_secs_f64(),
    })
}

fn pool_json(r: &PoolStressReport) -> Value {
    json!({
        "exact": r.exact(),
        "operations": r.operations,
        "created": r.created,
        "found": r.found,
        "lost": lost_json(r.lost),
        "double_handouts": r.double_handouts,
        "duplicates": r.duplicates,
        "drains": r.drains,
        "drains_unavailable": r.drains_unavailable,
        "drained_objects": r.drained_objects,
        "drain_method": r.drain_method.map(|method| format!("{method:?}").to_lowercase()),
        "aborts": r.aborts,
        "migrations": r.migrations,
        "signals_sent": r.signals,
        "signals_handled": r.signals_handled,
        "threads_created": r.threads_created,
        "workers": r.workers,
        "elapsed_seconds": r.elapsed.as_secs_f64(),
    })
}

fn alloc_json(r: &AllocStressReport) -> Value {
    json!({
        "exact": r.exact(),
        "caching": r.caching,
        "operations": r.operations,
        "reallocs": r.reallocs,
        "traded": r.traded,
        "corrupted": r.corrupted,
        "lost": r.lost,
        "cached_after_release": r.cached_after_release,
        "misses": r.misses,
        "spills": r.spills,
        "releases": r.releases,
        "released_bytes": r.released_bytes,
        "releases_unavailable": r.releases_unavailable,
        "aborts": r.aborts,
        "migrations": r.migrations,
        "signals_sent": r.signals,
        "signals_handled": r.signals_handled,
        "threads_created": r.threads_created,
        "workers": r.workers,
        "elapsed_seconds": r.elapsed.as_secs_f64(),
    })
}

/// A count that is normally small: a JSON integer when it fits, else its decimal text.
fn lost_json(lost: i128) -> Value {
    i64::try_from(lost).map_or_else(|_| Value::from(lost.to_string()), Value::from)
}

/// The handled count, with why it falls short of the sent one: the kernel keeps one pending
/// instance per standard signal, so a signal sent while its kind is still pending is merged with it.
fn signals_handled(handled: u64) -> String {
    format!("{handled} (can be fewer than sent: signals of one kind merge while one is pending)")
}

/// `label  value` lines, values aligned.
fn lines(title: &str, rows: &[(&str, String)]) -> String {
    let width = rows.iter().map(|(label, _)| label.len()).max().unwrap_or(0);
    let mut out = title.to_owned();
    for (label, value) in rows {
        out.push_str(&format!("\n  {label:<width$}  {value}"));
    }
    out
}

fn counter_text(r: &StressReport) -> String {
    lines(
        &format!(
            "counter: {} workers for {:.2} s, migrated, signalled, with thread churn",
            r.workers,
            r.elapsed.as_secs_f64()
        ),
        &[
            ("operations", r.operations.to_string()),
            ("counted", r.counted.to_string()),
            ("lost", r.lost.to_string()),
            ("aborts (retried)", r.aborts.to_string()),
            ("migrations", r.migrations.to_string()),
            ("signals sent", r.signals.to_string()),
            ("signals handled", signals_handled(r.signal_increments)),
            ("threads created", r.threads_created.to_string()),
        ],
    )
}

fn pool_text(r: &PoolStressReport) -> String {
    lines(
        &format!(
            "pool: {} workers for {:.2} s, migrated, signalled, drained, with thread churn",
            r.workers,
            r.elapsed.as_secs_f64()
        ),
        &[
            ("operations", r.operations.to_string()),
            ("objects created", r.created.to_string()),
            ("objects found after", r.found.to_string()),
            ("lost", r.lost.to_string()),
            ("double hand-outs", r.double_handouts.to_string()),
            ("duplicates", r.duplicates.to_string()),
            (
                "drains",
                format!(
                    "{} ({} objects moved, {} unavailable, method {})",
                    r.drains,
                    r.drained_objects,
                    r.drains_unavailable,
                    r.drain_method
                        .map_or("none".to_owned(), |m| format!("{m:?}").to_lowercase())
                ),
            ),
            ("aborts (retried)", r.aborts.to_string()),
            ("migrations", r.migrations.to_string()),
            ("signals sent", r.signals.to_string()),
            ("signals handled", signals_handled(r.signals_handled)),
            ("threads created", r.threads_created.to_string()),
        ],
    )
}

fn alloc_text(r: &AllocStressReport) -> String {
    lines(
        &format!(
            "allocator: {} workers for {:.2} s, migrated, signalled, released, with thread churn{}",
            r.workers,
            r.elapsed.as_secs_f64(),
            if r.caching {
                ""
            } else {
                " (no rseq here: the pass-through path)"
            }
        ),
        &[
            (
                "objects",
                format!(
                    "{} allocated, {} resized, {} freed by another thread",
                    r.operations, r.reallocs, r.traded
                ),
            ),
            ("corrupted", r.corrupted.to_string()),
            ("allocations lost", r.lost.to_string()),
            (
                "cached after release",
                format!("{} bytes", r.cached_after_release),
            ),
            ("misses / spills", format!("{} / {}", r.misses, r.spills)),
            (
                "releases",
                format!(
                    "{} ({} bytes given back, {} unavailable)",
                    r.releases, r.released_bytes, r.releases_unavailable
                ),
            ),
            ("aborts (retried)", r.aborts.to_string()),
            ("migrations", r.migrations.to_string()),
            ("signals sent", r.signals.to_string()),
            ("signals handled", signals_handled(r.signals_handled)),
            ("threads created", r.threads_created.to_string()),
        ],
    )
}
