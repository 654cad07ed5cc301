//! Benchmark families and the runner they share.
//!
//! A *family* (`getcpu`, ...) is one file in this folder that exports a [`Family`]; the
//! `families!` line at the bottom of this file lists them. A family offers *cases*, each a
//! [`Workload`] measured in one [`Unit`]; these types live in [`model`], which reports read.
//! The runner measures every (case, thread count) pair in interleaved rounds (A B C A B C ...),
//! each round for the same fixed time, with every worker thread pinned to its own CPU and all
//! workers released together by a barrier. A round yields one number per pair; the report
//! gives min, median and max over the rounds.
//!
//! # Adding a family
//! Write `bench/NAME.rs` exporting `pub static FAMILY: Family`, and add `NAME` to the
//! `families!` line. Everything else (the command line, `--cases`, `--threads`, tables, JSON,
//! SVG, `compare`) follows. A sketch:
//!
//! ```text
//! use super::model::{Case, Family, Loop, Measured, Unit};
//!
//! pub static FAMILY: Family = Family {
//!     name: "counter",
//!     about: "nanoseconds per increment of per-CPU counters",
//!     case_names: &["percpu", "atomic"],
//!     default_threads: &[1, 2],
//!     baseline: Some("atomic"),
//!     cases,
//!     report: |_: &[Measured]| String::new(),
//! };
//!
//! fn cases() -> Vec<Case> {
//!     vec![Case::new("percpu", "thiscpu Counter::add", Unit::NsPerOp, PercpuWorkload::new())]
//! }
//! ```
//!
//! A workload with state implements [`Workload`]: `prepare` resets it before each round,
//! `run(worker, ops)` does `ops` operations, `verify(ops)` checks exactness afterwards (a
//! counter's sum must equal the increments performed); an error from `verify` stops the run
//! with exit status 1.

use crate::error::{Error, Result};
use crate::machine::Machine;
use crate::report;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use thiscpu::stress::StartGate;

pub mod model;

use model::{Case, CaseFilter, Family, Measured, RunInfo, Skipped, Unit, Workload};

/// Parses a thread-count list: `1,2,4`, ranges `1-4`, or `start:end:step` (`1:8:2`).
pub fn parse_threads(text: &str) -> std::result::Result<Vec<usize>, String> {
    const MAX: usize = 1024;
    let bad = || format!("expected thread counts like 1,2 or 1-4 or 1:8:2, got {text:?}");
    let number = |s: &str| s.trim().parse::<usize>().map_err(|_| bad());
    let mut counts = Vec::new();
    for part in text.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(bad());
        }
        let fields: Vec<&str> = part.split(':').collect();
        let (first, last, step) = match fields.as_slice() {
            [one] => match one.split_once('-') {
                Some((first, last)) => (number(first)?, number(last)?, 1),
                None => (number(one)?, number(one)?, 1),
            },
            [first, last] => (number(first)?, number(last)?, 1),
            [first, last, step] => (number(first)?, number(last)?, number(step)?),
            _ => return Err(bad()),
        };
        if first == 0 || last < first || step == 0 {
            return Err(format!(
                "thread counts start at 1 and ranges go upwards, got {text:?}"
            ));
        }
        if last > MAX {
            return Err(format!("at most {MAX} threads, got {last}"));
        }
        counts.extend((first..=last).step_by(step));
    }
    counts.dedup();
    Ok(counts)
}

/// What `thiscpu bench` was asked to do.
#[derive(Debug)]
pub struct Options {
    /// Families to run, in order (all when the user named none).
    pub families: Vec<&'static Family>,
    /// A few seconds in all, for smoke tests.
    pub quick: bool,
    /// Total time budget in seconds.
    pub seconds: Option<f64>,
    /// Rounds per (case, thread count).
    pub rounds: Option<u32>,
    /// Thread counts, instead of each family's default.
    pub threads: Option<Vec<usize>>,
    /// Which cases to run.
    pub cases: Option<CaseFilter>,
    /// Where to write the JSON report.
    pub json: Option<PathBuf>,
    /// Where to write one SVG chart per family.
    pub svg: Option<PathBuf>,
    /// Where to write the tables as Markdown.
    pub markdown: Option<PathBuf>,
}

/// Default total time: about a minute for a whole run.
const DEFAULT_SECONDS: f64 = 60.0;
/// Default rounds: odd, so that the median is one of them.
const DEFAULT_ROUNDS: u32 = 21;
const QUICK_SECONDS: f64 = 1.0;
const QUICK_ROUNDS: u32 = 3;
/// No round is shorter than this, whatever the budget.
const MIN_ROUND: Duration = Duration::from_millis(2);

/// One family's plan: its runnable cases (after `--cases`), thread counts, and skipped cases.
struct Plan {
    family: &'static Family,
    cases: Vec<(Case, Box<dyn Workload>)>,
    threads: Vec<usize>,
    skipped: Vec<Skipped>,
}

/// Runs `thiscpu bench`.
pub fn run(options: Options) -> Result<()> {
    let rounds = options.rounds.unwrap_or(if options.quick {
        QUICK_ROUNDS
    } else {
        DEFAULT_ROUNDS
    });
    let budget = options.seconds.unwrap_or(if options.quick {
        QUICK_SECONDS
    } else {
        DEFAULT_SECONDS
    });

    let plans = plan(&options)?;
    let measurements: usize = plans
        .iter()
        .map(|plan| plan.cases.len() * plan.threads.len())
        .sum::<usize>()
        * rounds as usize;
    // Families whose every case this machine leaves out (rseq-mode on a kernel without the
    // optimized mode) still print why; only a run with nothing at all to report fails.
    if plans.is_empty() {
        return Err(Error::input("no case to run on this machine"));
    }

    // Open every output before measuring, so that a bad path fails in a moment, not after a
    // minute of benchmarks.
    let json_output = options
        .json
        .as_deref()
        .map(report::output::Output::open)
        .transpose()?;
    let markdown_output = options
        .markdown
        .as_deref()
        .map(report::output::Output::open)
        .transpose()?;
    if json_output
        .as_ref()
        .is_some_and(report::output::Output::is_stdout)
        && markdown_output
            .as_ref()
            .is_some_and(report::output::Output::is_stdout)
    {
        return Err(Error::input(
            "--json - and --export-markdown - cannot both use standard output",
        ));
    }
    // With the JSON or the Markdown on standard output, the text goes to standard error.
    let to_stderr = json_output
        .iter()
        .chain(&markdown_output)
        .any(report::output::Output::is_stdout);
    let say = |text: &str| {
        if to_stderr {
            eprintln!("{text}");
        } else {
            println!("{text}");
        }
    };
    let svg_files = match &options.svg {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| Error::write(dir, e))?;
            let mut files = Vec::new();
            for plan in plans.iter().filter(|plan| !plan.cases.is_empty()) {
                let path = dir.join(format!("{}.svg", plan.family.name));
                let file = std::fs::File::create(&path).map_err(|e| Error::write(&path, e))?;
                files.push((path, file));
            }
            files
        }
        None => Vec::new(),
    };

    let round = Duration::from_secs_f64(budget / measurements.max(1) as f64).max(MIN_ROUND);
    let info = RunInfo {
        rounds,
        round,
        budget_seconds: budget,
        quick: options.quick,
        cpus: worker_cpus(),
    };
    let machine = Machine::describe();
    say(&report::table::run_header(&machine, &info));
    let most_threads = plans.iter().flat_map(|plan| plan.threads.iter()).max();
    if let Some(&threads) = most_threads
        && threads > info.cpus.len()
    {
        say(&format!(
            "note: up to {threads} threads on {} CPU{}: some workers share a CPU",
            info.cpus.len(),
            if info.cpus.len() == 1 { "" } else { "s" }
        ));
    }

    let mut measured = Vec::new();
    let mut skipped = Vec::new();
    let mut markdown = format!(
        "# thiscpu bench\n\n{}\n\n{} rounds of {:.3} s per case{}\n",
        machine.summary(),
        info.rounds,
        info.round.as_secs_f64(),
        if info.quick { " (--quick)" } else { "" }
    );
    for plan in &plans {
        let results = run_family(plan, &info)?;
        say("");
        say(&report::table::family(plan.family, &results, &plan.skipped));
        let extra = (plan.family.report)(&results);
        if !extra.is_empty() {
            say(&extra);
        }
        markdown.push('\n');
        markdown.push_str(&report::table::family_markdown(
            plan.family,
            &results,
            &plan.skipped,
        ));
        measured.extend(results);
        skipped.extend(plan.skipped.iter().cloned());
    }

    let document = report::json::Report::build(&machine, &info, &measured, &skipped);
    if let Some(output) = markdown_output {
        let path = output.path().map(|path| path.display().to_string());
        output.commit(markdown.as_bytes())?;
        if let Some(path) = path {
            say(&format!("wrote {path}"));
        }
    }
    if let Some(output) = json_output {
        let path = output.path().map(|path| path.display().to_string());
        output.commit_json(&document)?;
        if let Some(path) = path {
            say(&format!("\nwrote {path}"));
        }
    }
    let charted = plans.iter().filter(|plan| !plan.cases.is_empty());
    for ((path, file), plan) in svg_files.into_iter().zip(charted) {
        let results: Vec<&Measured> = measured
            .iter()
            .filter(|m| m.bench == plan.family.name)
            .collect();
        report::svg::write(&path, file, plan.family, &results, &machine, &info)?;
        say(&format!("wrote {}", path.display()));
    }
    Ok(())
}

/// Builds each family's cases and applies `--cases` and `--threads`.
fn plan(options: &Options) -> Result<Vec<Plan>> {
    let mut plans = Vec::new();
    for &family in &options.families {
        let selected = |case: &str| {
            options
                .cases
                .as_ref()
                .is_none_or(|filter| filter.matches(family.name, case))
        };
        let mut cases = Vec::new();
        let mut skipped = Vec::new();
        for mut case in (family.cases)() {
            if !selected(case.name) {
                continue;
            }
            match std::mem::replace(&mut case.workload, Err(String::new())) {
                Ok(workload) => cases.push((case, workload)),
                Err(reason) => skipped.push(Skipped {
                    bench: family.name,
                    case: case.name,
                    reason,
                }),
            }
        }
        if cases.is_empty() && skipped.is_empty() {
            continue;
        }
        let threads = options
            .threads
            .clone()
            .unwrap_or_else(|| family.default_threads.to_vec());
        plans.push(Plan {
            family,
            cases,
            threads,
            skipped,
        });
    }
    if plans.is_empty()
        && let Some(filter) = &options.cases
    {
        let known: Vec<&str> = options
            .families
            .iter()
            .flat_map(|family| family.case_names.iter().copied())
            .collect();
        return Err(Error::input(format!(
            "no case matches --cases {} (cases: {})",
            filter.patterns().join(","),
            known.join(", ")
        )));
    }
    Ok(plans)
}

/// Measures one family: every (case, thread count) pair, in interleaved rounds.
fn run_family(plan: &Plan, info: &RunInfo) -> Result<Vec<Measured>> {
    let chunk_target = if info.quick {
        Duration::from_micros(50)
    } else {
        Duration::from_micros(200)
    }
    .min(info.round / 10);
    let chunks: Vec<u64> = plan
        .cases
        .iter()
        .map(|(case, workload)| {
            calibrate(workload.as_ref(), info.cpus[0], chunk_target)
                .map_err(|why| Error::failed(format!("{}/{}: {why}", plan.family.name, case.name)))
        })
        .collect::<Result<_>>()?;

    let mut results: Vec<Measured> = Vec::new();
    for (case, _) in &plan.cases {
        for &threads in &plan.threads {
            results.push(Measured {
                bench: plan.family.name,
                case: case.name,
                how: case.how.clone(),
                threads,
                cpus: Vec::new(),
                unit: case.unit,
                rounds: Vec::with_capacity(info.rounds as usize),
                ops: 0,
                on_cpu: Vec::with_capacity(info.rounds as usize),
            });
        }
    }

    let progress = progress_bar(info.rounds as u64 * results.len() as u64, plan.family.name);
    for _ in 0..info.rounds {
        let mut slot = 0;
        for ((case, workload), &chunk) in plan.cases.iter().zip(&chunks) {
            for &threads in &plan.threads {
                progress.set_message(format!("{} ×{threads}", case.name));
                let sample = measure(workload.as_ref(), threads, &info.cpus, chunk, info.round)
                    .map_err(|why| {
                        Error::failed(format!("{}/{}: {why}", plan.family.name, case.name))
                    })?;
                let result = &mut results[slot];
                result.rounds.push(sample.value(case.unit));
                result.ops += sample.ops;
                result.on_cpu.push(sample.on_cpu());
                result.cpus = sample.cpus;
                slot += 1;
                progress.inc(1);
            }
        }
    }
    progress.finish_and_clear();
    Ok(results)
}

/// A progress bar on standard error when it is a terminal, nothing otherwise.
fn progress_bar(length: u64, family: &str) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(length),
        indicatif::ProgressDrawTarget::stderr(),
    );
    let style = indicatif::ProgressStyle::with_template(
        "{prefix:>8} [{bar:30}] {pos}/{len} {msg:24} {elapsed}/{duration}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(family.to_owned());
    bar
}

/// What one measurement produced.
struct Sample {
    /// What each worker did in the timed part.
    workers: Vec<WorkerRun>,
    /// Timed operations of all workers.
    ops: u64,
    /// CPUs the workers were pinned to.
    cpus: Vec<u32>,
    /// What the workload measured itself, if anything.
    reading: Option<f64>,
}

impl Sample {
    fn value(&self, unit: Unit) -> f64 {
        if let Some(value) = self.reading {
            return value;
        }
        match unit {
            // The time the threads ran: preemption by other load on the machine is not the
            // operation's latency.
            Unit::NsPerOp => {
                let nanos: f64 = self.workers.iter().map(|w| w.cpu.as_nanos() as f64).sum();
                nanos / self.ops.max(1) as f64
            }
            // A size comes from `reading`; without one nothing was measured.
            Unit::BytesPerCounter | Unit::Bytes => 0.0,
        }
    }
}

/// What one worker did in the timed part of a measurement.
struct WorkerRun {
    /// Operations performed.
    ops: u64,
    /// Wall-clock time from the barrier to the last operation.
    wall: Duration,
    /// CPU time of the thread over the same span (user and system).
    cpu: Duration,
}

impl Sample {
    /// The share of the wall-clock time the workers were running (1.0 on an idle machine).
    fn on_cpu(&self) -> f64 {
        let wall: f64 = self.workers.iter().map(|w| w.wall.as_secs_f64()).sum();
        let cpu: f64 = self.workers.iter().map(|w| w.cpu.as_secs_f64()).sum();
        if wall > 0.0 {
            (cpu / wall).min(1.0)
        } else {
            1.0
        }
    }
}

/// CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes one `timespec` that we own.
    let ret = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    if ret != 0 {
        return Duration::ZERO;
    }
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// Finds how many operations take about `target`, on a thread pinned like worker 0.
fn calibrate(
    workload: &dyn Workload,
    cpu: u32,
    target: Duration,
) -> std::result::Result<u64, String> {
    std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .spawn_scoped(scope, || {
                pin_to(cpu);
                workload.prepare(1);
                let mut ops = 1u64;
                loop {
                    let start = Instant::now();
                    workload.run(0, ops);
                    if start.elapsed() >= target || ops >= 1 << 40 {
                        return ops;
                    }
                    ops *= 2;
                }
            })
            .map_err(|e| thread_refused("a calibration thread", &e))?;
        Ok(thread.join().unwrap_or(1))
    })
}

/// The message for a thread the system would not create.
fn thread_refused(what: &str, error: &std::io::Error) -> String {
    format!(
        "the system refused to create {what}: {}",
        crate::error::plain(error)
    )
}

/// Runs `workload` on `threads` pinned workers, released together, for `duration`.
fn measure(
    workload: &dyn Workload,
    threads: usize,
    cpus: &[u32],
    chunk: u64,
    duration: Duration,
) -> std::result::Result<Sample, String> {
    workload.prepare(threads);
    // Not `std::sync::Barrier`: its waiters leave through a mutex one at a time, which with
    // hundreds of workers on a few CPUs, the first ones already spinning, takes minutes.
    let gate = StartGate::new(threads);
    let stop = AtomicBool::new(false);
    let outcomes = std::thread::scope(|scope| {
        let mut workers = Vec::with_capacity(threads);
        for worker in 0..threads {
            let (gate, stop) = (&gate, &stop);
            let cpu = cpus[worker % cpus.len()];
            let spawned = std::thread::Builder::new().spawn_scoped(scope, move || {
                let pinned = pin_to(cpu);
                // Warm up: first-use work (rseq registration, page faults) stays out of
                // the timed part. A panic here still reaches the gate (or the other
                // threads would wait there forever) and is raised after it.
                let warm_up = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    workload.run(worker, chunk)
                }));
                let opened = gate.arrive();
                if let Err(panic) = warm_up {
                    std::panic::resume_unwind(panic);
                }
                let opened = opened?;
                // Each worker stops by its own clock: with many more workers than CPUs, the
                // thread that sets `stop` may wait long for a CPU.
                let deadline = opened + duration;
                let begin = Instant::now();
                let begin_cpu = thread_cpu_time();
                let mut ops = 0u64;
                loop {
                    workload.run(worker, chunk);
                    ops += chunk;
                    if stop.load(Ordering::Relaxed) || Instant::now() >= deadline {
                        break;
                    }
                }
                let run = WorkerRun {
                    ops,
                    wall: begin.elapsed(),
                    cpu: thread_cpu_time().saturating_sub(begin_cpu),
                };
                Some((chunk, run, pinned))
            });
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(error) => {
                    gate.cancel();
                    return Err(thread_refused(
                        &format!("worker thread {} of {threads}", worker + 1),
                        &error,
                    ));
                }
            }
        }
        if !gate.wait_for_all(|| workers.iter().any(|w| w.is_finished())) {
            gate.cancel();
            // Joined here, not by the scope, which would raise a worker's panic.
            for worker in workers {
                let _ = worker.join();
            }
            return Err(format!(
                "a worker thread of {threads} ended before it could start (the system may be \
                 short of memory or threads)"
            ));
        }
        gate.open();
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        Ok(workers
            .into_iter()
            .map(|w| w.join().ok().flatten())
            .collect::<Vec<Option<(u64, WorkerRun, bool)>>>())
    })?;
    let mut sample = Sample {
        workers: Vec::with_capacity(threads),
        ops: 0,
        cpus: Vec::with_capacity(threads),
        reading: None,
    };
    let mut performed = 0u64;
    for (worker, outcome) in outcomes.into_iter().enumerate() {
        let (warm, run, pinned) = outcome.ok_or_else(|| format!("worker {worker} panicked"))?;
        performed += warm + run.ops;
        sample.ops += run.ops;
        sample.workers.push(run);
        if pinned {
            sample.cpus.push(cpus[worker % cpus.len()]);
        }
    }
    workload.verify(performed)?;
    sample.reading = workload.reading();
    Ok(sample)
}

/// CPUs this process may run on, highest first, so that a single worker avoids CPU 0, which
/// takes most housekeeping interrupts.
fn worker_cpus() -> Vec<u32> {
    let mut cpus = allowed_cpus();
    if cpus.is_empty() {
        cpus = thiscpu::topology::online_cpus();
    }
    if cpus.is_empty() {
        cpus.push(0);
    }
    cpus.sort_unstable_by(|a, b| b.cmp(a));
    cpus
}

/// The calling thread's CPU affinity mask, as CPU ids.
fn allowed_cpus() -> Vec<u32> {
    // SAFETY: `cpu_set_t` is a plain bit array, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes at most `size_of::<cpu_set_t>()` bytes into `set`.
    let ret = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if ret != 0 {
        return Vec::new();
    }
    let bits = 8 * std::mem::size_of_val(&set);
    (0..bits)
        // SAFETY: `cpu` is below the set's size in bits.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .map(|cpu| cpu as u32)
        .collect()
}

/// Pins the calling thread to `cpu`; returns whether it worked.
fn pin_to(cpu: u32) -> bool {
    // SAFETY: `cpu_set_t` is a plain bit array, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu as usize >= 8 * std::mem::size_of_val(&set) {
        return false;
    }
    // SAFETY: `cpu` is below the set's size in bits (checked above).
    unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    // SAFETY: `set` is a valid, initialized mask of the size passed.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) == 0 }
}

/// Declares the families: each name is a module in this folder that exports `FAMILY`.
/// Adding a family is one file and one name here.
macro_rules! families {
    ($($family:ident),* $(,)?) => {
        $(pub mod $family;)*

        /// Every benchmark family, in the order `thiscpu bench` runs them.
        pub static FAMILIES: &[&Family] = &[$(&$family::FAMILY),*];
    };
}

families![
    getcpu, counter, metrics, bpf, memory, mask, pool, sharded, rseq_mode
];

/// The text of `thiscpu bench --list`: every family and case, and why a case is left out here.
pub fn list(families: &[&'static Family]) -> String {
    let mut out = String::new();
    for family in families {
        out.push_str(&format!("{} — {}\n", family.name, family.about));
        for case in (family.cases)() {
            let what = match &case.workload {
                Ok(_) => case.how.clone(),
                Err(reason) => format!("left out here: {reason}"),
            };
            out.push_str(&format!("  {:<22} {what}\n", case.name));
        }
    }
    out.trim_end().to_owned()
}

/// The family called `name`.
pub fn family(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|family| family.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_lists() {
        assert_eq!(parse_threads("1,2").unwrap(), vec![1, 2]);
        assert_eq!(parse_threads("1-4").unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(parse_threads("1:8:3").unwrap(), vec![1, 4, 7]);
        for bad in ["", "0", "a", "2-1", "1,,2", "1:2:0", "5000"] {
            assert!(parse_threads(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_family_has_unique_case_names() {
        for family in FAMILIES {
            let mut names = family.case_names.to_vec();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), family.case_names.len(), "{}", family.name);
            for case in (family.cases)() {
                assert!(family.case_names.contains(&case.name), "{}", case.name);
            }
        }
    }
}
