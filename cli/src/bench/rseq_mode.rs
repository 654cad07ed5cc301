//! `rseq-mode`: what the kernel's legacy rseq mode costs against its optimized mode (Linux
//! 7.1+), on context switches and on system calls.
//!
//! In legacy mode (a 32-byte registration) the kernel rewrites the area's id fields and
//! evaluates `rseq_cs` after every context switch; in optimized mode (a registration of the
//! feature size rounded up to the alignment) only when something changed or user space was
//! interrupted. One process has one mode in every thread, so each case runs in a child process
//! of its own: this binary again, with glibc's registration turned off
//! (`GLIBC_TUNABLES=glibc.pthread.rseq=0`) so that thiscpu registers its own area, 32 bytes
//! with `THISCPU_RSEQ_AREA=legacy`, the optimized length without. The child confirms the mode
//! it got before it measures anything.
//!
//! The parent sends the child a call count on its standard input; the child makes them and
//! answers with the process CPU time they took, which is what the cases report per call (so
//! the pipe, the parent and other load on the machine stay out of the numbers). Each of the
//! runner's operations is a batch of [`CALLS_PER_OP`] calls, so that reading the clock (a
//! system call for process CPU time, slow under an emulator) and the round trip to the child
//! stay small next to what is measured.
//!
//! - `yield-*`: two threads of the child pinned to one CPU take turns with `sched_yield`; one
//!   operation is one yield of the measuring thread, a round trip of two context switches.
//! - `getppid-*`: a loop of `getppid` system calls, which switch no context.

use super::model::{Case, Family, Measured, Stats, Unit, Workload};
use crate::report::table::{fmt_ns, fmt_ratio};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use thiscpu::{CpuSource, RseqMode};

/// Set in the environment of the child process to the work it does (`yield` or `getppid`).
pub const CHILD_ENV: &str = "THISCPU_BENCH_RSEQ_MODE_CHILD";

/// Calls the child makes for each of the runner's operations.
const CALLS_PER_OP: u64 = 1000;

/// The family.
pub static FAMILY: Family = Family {
    name: "rseq-mode",
    about: "cost of the kernel's legacy rseq mode: context switches and system calls with a \
            32-byte against an optimized registration, each in a child process (ns/op)",
    case_names: &[
        "yield-legacy",
        "yield-optimized",
        "getppid-legacy",
        "getppid-optimized",
    ],
    default_threads: &[1],
    baseline: None,
    cases,
    report,
};

/// What a child process measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    /// `sched_yield` ping-pong between two threads on one CPU.
    Yield,
    /// `getppid` system calls.
    Getppid,
}

impl Work {
    const ALL: [Work; 2] = [Work::Yield, Work::Getppid];

    fn name(self) -> &'static str {
        match self {
            Work::Yield => "yield",
            Work::Getppid => "getppid",
        }
    }

    fn from_name(name: &str) -> Option<Work> {
        Work::ALL.into_iter().find(|work| work.name() == name)
    }

    fn case(self, mode: RseqMode) -> &'static str {
        match (self, mode) {
            (Work::Yield, RseqMode::Legacy) => "yield-legacy",
            (Work::Yield, RseqMode::Optimized) => "yield-optimized",
            (Work::Getppid, RseqMode::Legacy) => "getppid-legacy",
            (Work::Getppid, RseqMode::Optimized) => "getppid-optimized",
        }
    }

    fn how(self, mode: RseqMode, size: u32) -> String {
        let what = match self {
            Work::Yield => "sched_yield round trip of two threads on one CPU",
            Work::Getppid => "getppid system call",
        };
        format!("{what}, child with a {size}-byte ({}) area", mode.name())
    }
}

/// Why this machine cannot compare the modes, if it cannot.
fn cannot_compare(source: &thiscpu::Source) -> Option<String> {
    if let Some(why) = source.unavailable
        && why == thiscpu::Unavailable::TurnedOff
    {
        return Some(format!("cannot compare: rseq is {why}"));
    }
    if source.optimized_size.is_none() {
        return Some(if source.kernel_feature_size <= 32 {
            format!(
                "cannot compare: the kernel has only the legacy rseq mode (AT_RSEQ_FEATURE_SIZE \
                 {} is not above 32; the optimized mode needs Linux 7.1 or later)",
                source.kernel_feature_size
            )
        } else {
            format!(
                "cannot compare: the kernel's optimized mode (feature size {}, alignment {}) \
                 needs more than thiscpu's own 64-byte area",
                source.kernel_feature_size, source.kernel_align
            )
        });
    }
    if std::env::current_exe().is_err() {
        return Some("cannot compare: this program cannot find its own executable".to_owned());
    }
    None
}

fn cases() -> Vec<Case> {
    let source = thiscpu::source();
    let reason = cannot_compare(&source);
    let mut cases = Vec::new();
    for work in Work::ALL {
        for mode in [RseqMode::Legacy, RseqMode::Optimized] {
            let name = work.case(mode);
            match (&reason, source.optimized_size) {
                (None, Some(optimized)) => {
                    let size = if mode == RseqMode::Legacy {
                        32
                    } else {
                        optimized
                    };
                    cases.push(Case::new(
                        name,
                        work.how(mode, size),
                        Unit::NsPerOp,
                        ChildWorkload::new(work, mode),
                    ));
                }
                (reason, _) => cases.push(Case::skipped(
                    name,
                    Unit::NsPerOp,
                    reason.clone().unwrap_or_default(),
                )),
            }
        }
    }
    cases
}

/// A case measured by a child process, started on first use and kept for the whole run.
struct ChildWorkload {
    work: Work,
    mode: RseqMode,
    state: Mutex<ChildState>,
}

#[derive(Default)]
struct ChildState {
    child: Option<RunningChild>,
    /// Why the child cannot measure; reported by `verify`, which fails the run.
    failure: Option<String>,
    /// CPU time the child reported since `prepare`, and the calls it made in it.
    nanos: f64,
    calls: u64,
}

impl ChildWorkload {
    fn new(work: Work, mode: RseqMode) -> ChildWorkload {
        ChildWorkload {
            work,
            mode,
            state: Mutex::new(ChildState::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, ChildState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Workload for ChildWorkload {
    fn prepare(&self, _threads: usize) {
        let mut state = self.state();
        state.nanos = 0.0;
        state.calls = 0;
        if state.child.is_none() && state.failure.is_none() {
            match RunningChild::start(self.work, self.mode) {
                Ok(child) => state.child = Some(child),
                Err(why) => state.failure = Some(why),
            }
        }
    }

    fn run(&self, _worker: usize, ops: u64) {
        let mut state = self.state();
        let Some(child) = state.child.as_mut() else {
            return;
        };
        let calls = ops.saturating_mul(CALLS_PER_OP);
        match child.measure(calls) {
            Ok(nanos) => {
                state.nanos += nanos;
                state.calls += calls;
            }
            Err(why) => {
                state.child = None;
                state.failure = Some(why);
            }
        }
    }

    fn verify(&self, _ops: u64) -> Result<(), String> {
        match &self.state().failure {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    fn reading(&self) -> Option<f64> {
        let state = self.state();
        (state.calls > 0).then(|| state.nanos / state.calls as f64)
    }
}

/// A child process and its pipes.
struct RunningChild {
    process: Child,
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl RunningChild {
    /// Starts the child for `work` in `mode`, and checks that it got that mode.
    fn start(work: Work, mode: RseqMode) -> Result<RunningChild, String> {
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find this program's executable: {e}"))?;
        let mut command = Command::new(exe);
        command
            .env(CHILD_ENV, work.name())
            .env("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
            .env_remove("THISCPU_RSEQ")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match mode {
            RseqMode::Legacy => command.env("THISCPU_RSEQ_AREA", "legacy"),
            RseqMode::Optimized => command.env_remove("THISCPU_RSEQ_AREA"),
        };
        let mut process = command
            .spawn()
            .map_err(|e| format!("cannot start the child process: {e}"))?;
        let (Some(input), Some(output)) = (process.stdin.take(), process.stdout.take()) else {
            return Err("the child process has no pipes".to_owned());
        };
        let mut child = RunningChild {
            process,
            input: Some(input),
            output: BufReader::new(output),
        };
        let hello = child.read_line()?;
        // `ready MODE SIZE`
        let fields: Vec<&str> = hello.split_whitespace().collect();
        match fields.as_slice() {
            ["ready", got, _] if *got == mode.name() => Ok(child),
            ["ready", got, size] => Err(format!(
                "the child's {size}-byte registration runs in {got} mode, not {}",
                mode.name()
            )),
            _ => Err(format!("the child said {hello:?}")),
        }
    }

    /// One line from the child, or what went wrong with it.
    fn read_line(&mut self) -> Result<String, String> {
        let mut line = String::new();
        match self.output.read_line(&mut line) {
            Ok(n) if n > 0 => Ok(line.trim().to_owned()),
            _ => Err(self.failure()),
        }
    }

    /// What the child said on its way out.
    fn failure(&mut self) -> String {
        drop(self.input.take());
        let mut stderr = String::new();
        if let Some(mut pipe) = self.process.stderr.take() {
            let _ = pipe.read_to_string(&mut stderr);
        }
        let status = self
            .process
            .wait()
            .map_or_else(|e| e.to_string(), |s| s.to_string());
        format!("the child process failed ({status}): {}", stderr.trim())
    }

    /// Has the child make `calls` calls; the process CPU time they took, in ns.
    fn measure(&mut self, calls: u64) -> Result<f64, String> {
        let sent = match self.input.as_mut() {
            Some(input) => writeln!(input, "{calls}").and_then(|()| input.flush()),
            None => return Err("the child process is gone".to_owned()),
        };
        if sent.is_err() {
            return Err(self.failure());
        }
        let answer = self.read_line()?;
        answer
            .parse::<f64>()
            .map_err(|_| format!("the child answered {answer:?}"))
    }
}

impl Drop for RunningChild {
    fn drop(&mut self) {
        // End of input tells the child to exit.
        drop(self.input.take());
        let _ = self.process.wait();
    }
}

/// The child process's side: `THISCPU_BENCH_RSEQ_MODE_CHILD` is set to `work`. Registers
/// thiscpu's own area, says which mode it got, then answers each call count on standard
/// input with the process CPU time the calls took. Returns the exit status.
pub fn child_main(work: &str) -> i32 {
    let Some(work) = Work::from_name(work) else {
        eprintln!("{CHILD_ENV}={work:?}: expected yield or getppid");
        return 2;
    };
    // Both threads of the ping-pong on the CPU this process was started on.
    let cpu = thiscpu::current_cpu();
    let _pinned = match thiscpu::topology::pin_to(cpu) {
        Ok(pinned) => pinned,
        Err(error) => {
            eprintln!("cannot pin to CPU {cpu}: {error}");
            return 1;
        }
    };
    let source = thiscpu::source();
    let Some(mode) = source.mode.filter(|_| source.this_thread == CpuSource::RseqThiscpu) else {
        eprintln!("thiscpu's own rseq registration is not in use here: {source:?}");
        return 1;
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if writeln!(out, "ready {} {}", mode.name(), source.registered_size)
        .and_then(|()| out.flush())
        .is_err()
    {
        return 1;
    }
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { return 1 };
        let Ok(calls) = line.trim().parse::<u64>() else {
            eprintln!("expected a call count, got {line:?}");
            return 2;
        };
        let nanos = match work {
            Work::Yield => match yield_round_trips(cpu, mode, calls) {
                Ok(nanos) => nanos,
                Err(why) => {
                    eprintln!("{why}");
                    return 1;
                }
            },
            Work::Getppid => getppid_calls(calls),
        };
        if writeln!(out, "{nanos}").and_then(|()| out.flush()).is_err() {
            return 1;
        }
    }
    0
}

/// CPU time of the whole process (all threads), in nanoseconds.
fn process_cpu_nanos() -> u128 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes one `timespec` that we own.
    let ret = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) };
    if ret != 0 {
        return 0;
    }
    now.tv_sec as u128 * 1_000_000_000 + now.tv_nsec as u128
}

fn sched_yield() {
    // SAFETY: `sched_yield` has no arguments and no precondition.
    unsafe {
        libc::sched_yield();
    }
}

/// `calls` yields of this thread while a partner thread, pinned to the same CPU and registered
/// in the same mode, yields back: the process CPU time of both threads over that span.
fn yield_round_trips(cpu: u32, mode: RseqMode, calls: u64) -> Result<u128, String> {
    let ready = AtomicBool::new(false);
    let running = AtomicBool::new(true);
    std::thread::scope(|scope| {
        let partner = std::thread::Builder::new().spawn_scoped(scope, || {
            let pinned = thiscpu::topology::pin_to(cpu);
            let _ = thiscpu::current_cpu();
            let source = thiscpu::source();
            let registered =
                source.this_thread == CpuSource::RseqThiscpu && source.mode == Some(mode);
            ready.store(true, Ordering::Release);
            while running.load(Ordering::Relaxed) {
                sched_yield();
            }
            if pinned.is_ok() && registered {
                Ok(())
            } else {
                Err(format!(
                    "the partner thread is not pinned to CPU {cpu} with a {} registration: \
                     {source:?}",
                    mode.name()
                ))
            }
        });
        let partner = partner.map_err(|error| {
            format!(
                "the system refused to create the partner thread: {}",
                crate::error::plain(&error)
            )
        })?;
        while !ready.load(Ordering::Acquire) {
            if partner.is_finished() {
                break;
            }
            sched_yield();
        }
        let start = process_cpu_nanos();
        for _ in 0..calls {
            sched_yield();
        }
        let spent = process_cpu_nanos().saturating_sub(start);
        running.store(false, Ordering::Relaxed);
        partner
            .join()
            .map_err(|_| "the partner thread panicked".to_owned())??;
        Ok(spent)
    })
}

/// `calls` `getppid` system calls: the process CPU time they took.
fn getppid_calls(calls: u64) -> u128 {
    let start = process_cpu_nanos();
    for _ in 0..calls {
        // SAFETY: `getppid` has no arguments and cannot fail. Called through `syscall` so that
        // every call enters the kernel.
        std::hint::black_box(unsafe { libc::syscall(libc::SYS_getppid) });
    }
    process_cpu_nanos().saturating_sub(start)
}

/// The legacy/optimized ratio of each kind of work: of the medians, and the spread of the
/// ratios of rounds measured side by side.
fn report(results: &[Measured]) -> String {
    let find = |case: &str| results.iter().find(|m| m.case == case);
    let mut lines = Vec::new();
    for work in Work::ALL {
        let (Some(legacy), Some(optimized)) = (
            find(work.case(RseqMode::Legacy)),
            find(work.case(RseqMode::Optimized)),
        ) else {
            continue;
        };
        let (l, o) = (legacy.stats().median, optimized.stats().median);
        if o <= 0.0 {
            continue;
        }
        let per_round: Vec<f64> = legacy
            .rounds
            .iter()
            .zip(&optimized.rounds)
            .filter(|(_, o)| **o > 0.0)
            .map(|(l, o)| l / o)
            .collect();
        let spread = Stats::of(&per_round);
        lines.push(format!(
            "  {:<8} legacy {} / optimized {} = {}   (round by round {}-{})",
            work.name(),
            fmt_ns(l),
            fmt_ns(o),
            fmt_ratio(l / o),
            fmt_ratio(spread.min),
            fmt_ratio(spread.max)
        ));
    }
    if lines.is_empty() {
        return String::new();
    }
    format!(
        "\nlegacy / optimized rseq mode (the ratio is what counts: under an emulator such as \
         qemu's TCG the absolute times mean nothing)\n{}",
        lines.join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_follow_work_and_mode() {
        for work in Work::ALL {
            assert_eq!(Work::from_name(work.name()), Some(work));
            for mode in [RseqMode::Legacy, RseqMode::Optimized] {
                let case = work.case(mode);
                assert!(FAMILY.case_names.contains(&case), "{case}");
                assert_eq!(case, format!("{}-{}", work.name(), mode.name()));
            }
        }
        assert_eq!(Work::from_name("spin"), None);
    }

    #[test]
    fn cases_run_exactly_where_the_kernel_offers_the_optimized_mode() {
        let source = thiscpu::source();
        let cases = cases();
        assert_eq!(cases.len(), FAMILY.case_names.len());
        for case in &cases {
            match &case.workload {
                Ok(_) => assert!(source.optimized_size.is_some(), "{}", case.name),
                Err(reason) => {
                    assert!(reason.starts_with("cannot compare"), "{reason}");
                    assert!(source.optimized_size.is_none() || source.registrar.name() == "none");
                }
            }
        }
    }
}
