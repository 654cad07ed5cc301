//! The measuring engine: calibrates each case's chunk of work, then measures every (case,
//! thread count) pair of a family in interleaved rounds, on worker threads pinned one to a CPU
//! and released together by a start gate, and checks each workload's exactness afterwards.

use super::model::{Case, Family, Measured, RunInfo, Skipped, Unit, Workload};
use crate::error::{Error, Result};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use thiscpu::topology;
use thiscpu_stress::StartGate;

/// One family's plan: its runnable cases (after `--cases`), thread counts, and skipped cases.
pub struct Plan {
    /// The family.
    pub family: &'static Family,
    /// Its runnable cases, each with the workload taken out of it.
    pub cases: Vec<(Case, Box<dyn Workload>)>,
    /// Thread counts to measure each case with.
    pub threads: Vec<usize>,
    /// Its cases this machine cannot run.
    pub skipped: Vec<Skipped>,
}

/// Measures one family: every (case, thread count) pair, in interleaved rounds.
pub fn run_family(plan: &Plan, info: &RunInfo) -> Result<Vec<Measured>> {
    let chunk_target = if info.quick {
        Duration::from_micros(50)
    } else {
        Duration::from_micros(200)
    }
    .min(info.round / 10);
    for (_, workload) in &plan.cases {
        workload.start(info);
    }
    let chunks: Vec<u64> = plan
        .cases
        .iter()
        .map(|(case, workload)| match workload.fixed_chunk() {
            Some(chunk) => Ok(chunk),
            None => calibrate(workload.as_ref(), info.cpus[0], chunk_target)
                .map_err(|why| Error::failed(format!("{}/{}: {why}", plan.family.name, case.name))),
        })
        .collect::<Result<_>>()?;

    let mut results: Vec<Measured> = Vec::new();
    for (case, workload) in &plan.cases {
        for threads in threads_of(plan, workload.as_ref()) {
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
            for threads in threads_of(plan, workload.as_ref()) {
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

/// The thread counts `workload` is measured with: its own, or the plan's.
pub fn threads_of(plan: &Plan, workload: &dyn Workload) -> Vec<usize> {
    match workload.fixed_threads() {
        Some(threads) => vec![threads],
        None => plan.threads.clone(),
    }
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
    /// The on-CPU share the workload measured itself, if it did.
    on_cpu_share: Option<f64>,
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
            // A size or a task's time comes from `reading`; without one nothing was measured.
            Unit::BytesPerCounter | Unit::Bytes | Unit::Ms => 0.0,
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
        if let Some(share) = self.on_cpu_share {
            return share;
        }
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
pub fn thread_cpu_time() -> Duration {
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
                let _pinned = topology::pin_to(cpu);
                workload.prepare(1);
                let mut ops = 1u64;
                while workload.run_timed(0, ops) < target && ops < 1 << 40 {
                    ops *= 2;
                }
                workload.end_calibration();
                ops
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
                run_worker(workload, worker, cpu, chunk, duration, gate, stop)
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
            .collect::<Vec<Option<WorkerOutcome>>>())
    })?;
    sample_of(workload, outcomes, cpus)
}

/// What one worker did: the operations of its warm-up, its timed run, and whether it was
/// pinned.
type WorkerOutcome = (u64, WorkerRun, bool);

/// One worker of [`measure`]: pinned to `cpu`, it warms up, waits at the gate, then runs
/// until `stop` or its own deadline. `None` when the gate was cancelled.
fn run_worker(
    workload: &dyn Workload,
    worker: usize,
    cpu: u32,
    chunk: u64,
    duration: Duration,
    gate: &StartGate,
    stop: &AtomicBool,
) -> Option<WorkerOutcome> {
    let pinned = topology::pin_to(cpu);
    // Warm up: first-use work (rseq registration, page faults) stays out of the timed part. A
    // panic here still reaches the gate (or the other threads would wait there forever) and is
    // raised after it.
    let warm_up =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| workload.run(worker, chunk)));
    let opened = gate.arrive();
    if let Err(panic) = warm_up {
        std::panic::resume_unwind(panic);
    }
    let opened = opened?;
    // Each worker stops by its own clock: with many more workers than CPUs, the thread that sets
    // `stop` may wait long for a CPU.
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
    Some((chunk, run, pinned.is_ok()))
}

/// The workers' outcomes as one sample, once the workload agrees that every operation was
/// done.
fn sample_of(
    workload: &dyn Workload,
    outcomes: Vec<Option<WorkerOutcome>>,
    cpus: &[u32],
) -> std::result::Result<Sample, String> {
    let threads = outcomes.len();
    let mut sample = Sample {
        workers: Vec::with_capacity(threads),
        ops: 0,
        cpus: Vec::with_capacity(threads),
        reading: None,
        on_cpu_share: None,
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
    sample.on_cpu_share = workload.on_cpu_share();
    Ok(sample)
}

/// CPUs this process may run on, highest first, so that a single worker avoids CPU 0, which
/// takes most housekeeping interrupts.
pub fn worker_cpus() -> Vec<u32> {
    let mut cpus = topology::allowed_cpus().unwrap_or_default();
    if cpus.is_empty() {
        cpus = thiscpu::topology::online_cpus();
    }
    if cpus.is_empty() {
        cpus.push(0);
    }
    cpus.sort_unstable_by(|a, b| b.cmp(a));
    cpus
}

/// The CPUs a measurement with `threads` threads uses: the first ones the runner pins workers
/// to, each once.
pub fn cpus_for(threads: usize) -> Vec<u32> {
    let mut cpus = worker_cpus();
    cpus.truncate(threads.max(1));
    cpus
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// Records what calibration asked of it, in order.
    #[derive(Default)]
    struct Recorded {
        prepared: AtomicBool,
        ran: AtomicU64,
        ended_after_runs: AtomicU64,
    }

    impl Workload for Recorded {
        fn prepare(&self, _threads: usize) {
            self.prepared.store(true, Ordering::Relaxed);
        }
        fn run(&self, _worker: usize, ops: u64) {
            self.ran.fetch_add(ops, Ordering::Relaxed);
            std::hint::black_box(ops);
        }
        fn end_calibration(&self) {
            self.ended_after_runs
                .store(self.ran.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// What `prepare` started for calibration ends with it, after its last run.
    #[test]
    fn calibration_ends_what_it_prepared() {
        let workload = Recorded::default();
        let ops = calibrate(&workload, worker_cpus()[0], Duration::from_micros(50)).unwrap();
        assert!(workload.prepared.load(Ordering::Relaxed));
        assert!(ops >= 1);
        let ran = workload.ran.load(Ordering::Relaxed);
        assert!(ran >= ops, "{ran} ops run, {ops} chosen");
        assert_eq!(workload.ended_after_runs.load(Ordering::Relaxed), ran);
    }
}
