//! Cases that run thiscpu with restartable sequences turned off: the portable path, which every
//! target without an rseq port takes (each per-CPU update an atomic read-modify-write on the
//! current CPU's slot, `Sharded`, `RwLock` and `EpochCell` in their atomic modes). Measured on
//! Linux beside the fast path, the same structure and the same work, so that the cost off Linux
//! is a figure rather than a guess.
//!
//! Whether rseq is used is decided once per process, so such a case runs in a child process:
//! this program again, with `THISCPU_RSEQ=off` and [`CHILD_ENV`] naming the family and the case
//! it mirrors. The child builds that case and serves the runner's calls on its standard input:
//! `prepare`, `run` and `verify`, as the runner makes them here. Each parent worker has a twin
//! thread in the child pinned to the same CPU, which runs the operations and answers with the
//! CPU time it took; the parent worker waits meanwhile, so the two never compete for the CPU.
//! The case's figure is the child's CPU time per operation, the same measure as every other
//! case's, and the round trip over the pipes stays out of it.
//!
//! The runner's first `run` of each worker after `prepare` is its warm-up, outside the timed
//! part; the child's CPU time for it is left out in the same way.

use super::model::{Case, Measured, Unit, Workload, median_of};
use super::runner::thread_cpu_time;
use crate::report::table::{align_right, fmt_num, fmt_ratio, new_table, render};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Set in the environment of the child process to `family/case`, the case it runs.
pub const CHILD_ENV: &str = "THISCPU_BENCH_RSEQ_OFF_CHILD";

/// How a child process that serves a case is started, and what it checks before it measures.
/// The `…-rseq-off` cases use [`RSEQ_OFF`]; another family may serve its cases in a child set
/// up otherwise (an allocator that needs rseq for itself, say).
#[derive(Clone, Copy, Debug)]
pub struct ChildSetup {
    /// The variable that names `family/case` in the child's environment.
    pub var: &'static str,
    /// Other variables set in the child's environment.
    pub env: &'static [(&'static str, &'static str)],
    /// How the child differs, for messages: "with rseq off".
    pub what: &'static str,
}

/// The child of a `…-rseq-off` case.
pub const RSEQ_OFF: ChildSetup = ChildSetup {
    var: CHILD_ENV,
    env: &[("THISCPU_RSEQ", "off")],
    what: "with rseq off",
};

/// The suffix of a case that mirrors another with rseq off.
pub const SUFFIX: &str = "-rseq-off";

/// The cases of `names` (a family's case list) named with [`SUFFIX`]: each runs the case of
/// `built` named without it in a child process with restartable sequences off, and is described
/// as that case is.
pub fn mirrors(family: &'static str, names: &[&'static str], built: &[Case]) -> Vec<Case> {
    names
        .iter()
        .filter_map(|&name| Some((name, name.strip_suffix(SUFFIX)?)))
        .map(|(name, mirrored)| {
            let Some(original) = built.iter().find(|case| case.name == mirrored) else {
                return Case::skipped(name, Unit::NsPerOp, format!("no case {mirrored} here"));
            };
            if std::env::current_exe().is_err() {
                return Case::skipped(
                    name,
                    Unit::NsPerOp,
                    "this program cannot find its own executable to start a child with rseq off",
                );
            }
            Case::new(
                name,
                format!(
                    "{}; run with THISCPU_RSEQ=off (atomic updates instead), in a child process",
                    original.how
                ),
                Unit::NsPerOp,
                Mirror::new(family, mirrored, RSEQ_OFF),
            )
        })
        .collect()
}

/// Each mirrored case beside the case it mirrors: ns/op with rseq and without, and their
/// ratio, per thread count; empty when no mirrored case ran.
pub fn report(results: &[Measured]) -> String {
    let mut table = new_table();
    table.set_header(vec![
        "case",
        "threads",
        "rseq ns",
        "rseq off ns",
        "off ÷ rseq",
    ]);
    let mut rows = 0;
    for off in results.iter().filter(|m| m.case.ends_with(SUFFIX)) {
        let fast_case = &off.case[..off.case.len() - SUFFIX.len()];
        let fast = median_of(results, fast_case, off.threads);
        let slow = off.stats().median;
        table.add_row(vec![
            fast_case.to_owned(),
            off.threads.to_string(),
            fast.map_or("–".to_owned(), fmt_num),
            fmt_num(slow),
            fast.filter(|&fast| fast > 0.0)
                .map_or("–".to_owned(), |fast| fmt_ratio(slow / fast)),
        ]);
        rows += 1;
    }
    if rows == 0 {
        return String::new();
    }
    align_right(&mut table, &[1, 2, 3, 4]);
    format!(
        "\nthe portable path (rseq off, as on every target without an rseq port), medians:\n{}\n",
        render(&table)
    )
}

/// The case `family/case` served by a child process set up as `setup` says: the parent's side,
/// a workload whose operations the child's twin of each worker makes.
pub fn in_child(family: &'static str, case: &'static str, setup: ChildSetup) -> impl Workload {
    Mirror::new(family, case, setup)
}

/// The parent's side of a mirrored case.
struct Mirror {
    family: &'static str,
    case: &'static str,
    setup: ChildSetup,
    child: Mutex<Option<Arc<Link>>>,
    totals: Mutex<Totals>,
}

/// What the child measured since the last `prepare`.
#[derive(Default)]
struct Totals {
    /// Workers whose warm-up `run` has been made.
    warmed: Vec<bool>,
    /// CPU and wall-clock time of the timed runs, and their operations.
    cpu_nanos: u128,
    wall_nanos: u128,
    ops: u64,
    /// Why the child cannot measure; `verify` reports it and fails the run.
    failure: Option<String>,
}

impl Mirror {
    fn new(family: &'static str, case: &'static str, setup: ChildSetup) -> Mirror {
        Mirror {
            family,
            case,
            setup,
            child: Mutex::new(None),
            totals: Mutex::new(Totals::default()),
        }
    }

    fn totals(&self) -> MutexGuard<'_, Totals> {
        lock(&self.totals)
    }

    /// The child, started on first use; `None` once it failed.
    fn link(&self) -> Option<Arc<Link>> {
        let mut child = lock(&self.child);
        if child.is_none() && self.totals().failure.is_none() {
            match Link::start(self.family, self.case, self.setup) {
                Ok(link) => *child = Some(Arc::new(link)),
                Err(why) => self.totals().failure = Some(why),
            }
        }
        child.clone()
    }

    /// Has the child's twin of `worker` make `ops` operations; the CPU and wall-clock time they
    /// took there, in ns, counted unless they were the worker's warm-up.
    fn run_in_child(&self, worker: usize, ops: u64) -> Option<(u128, u128)> {
        let link = self.link()?;
        // The runner pins each worker before its first operation.
        let cpu = thiscpu::current_cpu();
        let answer = link.call(Key::Worker(worker), &format!("run {worker} {ops} {cpu}"));
        let parsed = answer.and_then(|answer| {
            let fields: Vec<&str> = answer.split_whitespace().collect();
            match fields.as_slice() {
                ["ran", cpu, wall] => cpu.parse::<u128>().ok().zip(wall.parse::<u128>().ok()),
                _ => None,
            }
            .ok_or_else(|| format!("the child answered {answer:?} to a run"))
        });
        let (cpu_nanos, wall_nanos) = match parsed {
            Ok(times) => times,
            Err(why) => {
                self.fail(why);
                return None;
            }
        };
        let mut totals = self.totals();
        if totals.warmed.len() <= worker {
            totals.warmed.resize(worker + 1, false);
        }
        if std::mem::replace(&mut totals.warmed[worker], true) {
            totals.cpu_nanos += cpu_nanos;
            totals.wall_nanos += wall_nanos;
            totals.ops += ops;
        }
        Some((cpu_nanos, wall_nanos))
    }

    fn fail(&self, why: String) {
        let mut totals = self.totals();
        if totals.failure.is_none() {
            totals.failure = Some(why);
        }
    }
}

impl Workload for Mirror {
    fn prepare(&self, threads: usize) {
        {
            let mut totals = self.totals();
            totals.warmed = vec![false; threads.max(1)];
            (totals.cpu_nanos, totals.wall_nanos, totals.ops) = (0, 0, 0);
        }
        if let Some(link) = self.link()
            && let Err(why) = link.call(Key::Control, &format!("prepare {threads}"))
        {
            self.fail(why);
        }
    }

    fn run(&self, worker: usize, ops: u64) {
        self.run_in_child(worker, ops);
    }

    fn run_timed(&self, worker: usize, ops: u64) -> Duration {
        Duration::from_nanos(
            self.run_in_child(worker, ops)
                .map_or(0, |(_, wall)| wall as u64),
        )
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        if let Some(why) = &self.totals().failure {
            return Err(why.clone());
        }
        let link = self.link().ok_or("the child process is gone")?;
        let answer = link.call(Key::Control, &format!("verify {ops}"))?;
        match answer.strip_prefix("verified") {
            Some(_) => Ok(()),
            None => Err(answer.strip_prefix("failed ").unwrap_or(&answer).to_owned()),
        }
    }

    fn reading(&self) -> Option<f64> {
        let totals = self.totals();
        (totals.ops > 0).then(|| totals.cpu_nanos as f64 / totals.ops as f64)
    }

    fn on_cpu_share(&self) -> Option<f64> {
        let totals = self.totals();
        (totals.wall_nanos > 0)
            .then(|| (totals.cpu_nanos as f64 / totals.wall_nanos as f64).min(1.0))
    }
}

/// Whom an answer of the child is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    Control,
    Worker(usize),
}

/// A running child process: its input, and its answers sorted by whom they are for (a reader
/// thread takes them off the pipe as they come, so workers never wait for each other's).
struct Link {
    process: Mutex<Child>,
    input: Mutex<Option<ChildStdin>>,
    inbox: Arc<Inbox>,
}

#[derive(Default)]
struct Inbox {
    answers: Mutex<Answers>,
    arrived: Condvar,
}

#[derive(Default)]
struct Answers {
    waiting: HashMap<Key, String>,
    /// Set when the child's output ended: what it said on its way out.
    gone: Option<String>,
}

impl Link {
    fn start(family: &str, case: &str, setup: ChildSetup) -> Result<Link, String> {
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find this program's executable: {e}"))?;
        let what = setup.what;
        let mut process = Command::new(exe)
            .env(setup.var, format!("{family}/{case}"))
            .envs(setup.env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start a child process {what}: {e}"))?;
        let (Some(input), Some(output), Some(mut errors)) = (
            process.stdin.take(),
            process.stdout.take(),
            process.stderr.take(),
        ) else {
            return Err("the child process has no pipes".to_owned());
        };
        let inbox = Arc::new(Inbox::default());
        let reader = Arc::clone(&inbox);
        let spawned = std::thread::Builder::new()
            .name("rseq-off answers".to_owned())
            .spawn(move || {
                for line in BufReader::new(output).lines() {
                    let Ok(line) = line else { break };
                    let (key, answer) = sort_answer(line);
                    lock(&reader.answers).waiting.insert(key, answer);
                    reader.arrived.notify_all();
                }
                let mut said = String::new();
                let _ = errors.read_to_string(&mut said);
                let said = said.trim();
                lock(&reader.answers).gone = Some(if said.is_empty() {
                    format!("the child process {what} ended")
                } else {
                    format!("the child process {what} failed: {said}")
                });
                reader.arrived.notify_all();
            });
        let link = Link {
            process: Mutex::new(process),
            input: Mutex::new(Some(input)),
            inbox,
        };
        spawned.map_err(|e| format!("cannot start a thread to read the child's answers: {e}"))?;
        Ok(link)
    }

    /// Sends `command` and waits for the answer meant for `key`.
    fn call(&self, key: Key, command: &str) -> Result<String, String> {
        // A child that has ended is not written to: with SIGPIPE at its default, a write to its
        // closed pipe would end this process without a word.
        if let Some(why) = &lock(&self.inbox.answers).gone {
            return Err(why.clone());
        }
        let sent = match lock(&self.input).as_mut() {
            Some(input) => writeln!(input, "{command}").and_then(|()| input.flush()),
            None => return Err("the child process is gone".to_owned()),
        };
        let mut answers = lock(&self.inbox.answers);
        loop {
            if let Some(answer) = answers.waiting.remove(&key) {
                return Ok(answer);
            }
            if let Some(why) = &answers.gone {
                return Err(why.clone());
            }
            if let Err(error) = &sent {
                return Err(format!("cannot write to the child process: {error}"));
            }
            answers = self
                .inbox
                .arrived
                .wait(answers)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // The end of its input tells the child to exit.
        drop(lock(&self.input).take());
        let _ = lock(&self.process).wait();
    }
}

/// Whom a line of the child's output is for, and what to hand them: `ran WORKER CPU WALL`
/// reaches worker `WORKER` as `ran CPU WALL`; every other line is the control answer.
fn sort_answer(line: String) -> (Key, String) {
    let fields: Vec<&str> = line.split_whitespace().collect();
    match fields.as_slice() {
        ["ran", worker, rest @ ..] => match worker.parse() {
            Ok(worker) => (Key::Worker(worker), format!("ran {}", rest.join(" "))),
            Err(_) => (Key::Control, line),
        },
        _ => (Key::Control, line),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The child process's side: [`CHILD_ENV`] is `family/case`. Builds that case with rseq off
/// (and fails if rseq is on after all), then serves `prepare THREADS`, `run WORKER OPS CPU` and
/// `verify OPS` from its standard input until it ends. Returns the exit status.
pub fn child_main(spec: &str) -> i32 {
    serve_main(spec, RSEQ_OFF, rseq_turned_off)
}

/// The check of a `…-rseq-off` child: rseq must be off in it.
fn rseq_turned_off() -> Result<(), String> {
    let source = thiscpu::source();
    if source.unavailable != Some(thiscpu::Unavailable::TurnedOff) {
        return Err(format!(
            "rseq is not turned off in the child process (THISCPU_RSEQ=off): {source:?}"
        ));
    }
    Ok(())
}

/// The side of a child process set up as `setup` says, whose `setup.var` is `spec`: `check`s
/// that the child is what it must be, then builds the case and serves the parent's commands
/// (see [`child_main`]). Returns the exit status.
pub fn serve_main(spec: &str, setup: ChildSetup, check: fn() -> Result<(), String>) -> i32 {
    match serve(spec, setup, check) {
        Ok(()) => 0,
        Err(why) => {
            eprintln!("{}", why.replace('\n', " "));
            1
        }
    }
}

fn serve(spec: &str, setup: ChildSetup, check: fn() -> Result<(), String>) -> Result<(), String> {
    let var = setup.var;
    let (family_name, case_name) = spec
        .split_once('/')
        .ok_or_else(|| format!("{var}={spec:?}: expected FAMILY/CASE"))?;
    let family = super::family(family_name)
        .ok_or_else(|| format!("{var}: no benchmark family {family_name:?}"))?;
    check()?;
    let case = (family.cases)()
        .into_iter()
        .find(|case| case.name == case_name)
        .ok_or_else(|| format!("{var}: no case {case_name:?} in {family_name}"))?;
    let workload: Arc<dyn Workload> = Arc::from(case.workload.map_err(|why| {
        format!(
            "{family_name}/{case_name} cannot run {} here: {why}",
            setup.what
        )
    })?);
    let output = Arc::new(Mutex::new(std::io::stdout()));
    // `prepare` and `verify` wait for the runs sent before them: the runner sends none while
    // a run is under way, but the child does not rely on that.
    let busy = Arc::new(InFlight::default());
    let mut workers: HashMap<usize, mpsc::Sender<(u64, u32)>> = HashMap::new();
    let answer = |line: String| -> Result<(), String> {
        let mut out = lock(&output);
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
            .map_err(|e| format!("cannot answer the parent: {e}"))
    };
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("cannot read the parent's commands: {e}"))?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        let number = |at: usize| -> Result<u64, String> {
            fields
                .get(at)
                .and_then(|field| field.parse().ok())
                .ok_or_else(|| format!("a malformed command: {line:?}"))
        };
        match fields.first().copied() {
            Some("prepare") => {
                busy.wait_until_idle();
                workload.prepare(number(1)? as usize);
                answer("prepared".to_owned())?;
            }
            Some("run") => {
                let (worker, ops, cpu) = (number(1)? as usize, number(2)?, number(3)? as u32);
                let sender = match workers.get(&worker) {
                    Some(sender) => sender.clone(),
                    None => {
                        let sender = twin(
                            worker,
                            Arc::clone(&workload),
                            Arc::clone(&output),
                            Arc::clone(&busy),
                        )?;
                        workers.insert(worker, sender.clone());
                        sender
                    }
                };
                busy.start();
                sender
                    .send((ops, cpu))
                    .map_err(|_| format!("worker {worker} of the child has ended"))?;
            }
            Some("verify") => {
                busy.wait_until_idle();
                let verdict = match workload.verify(number(1)?) {
                    Ok(()) => "verified".to_owned(),
                    Err(why) => format!("failed {}", why.replace('\n', " ")),
                };
                answer(verdict)?;
            }
            _ => return Err(format!("an unknown command: {line:?}")),
        }
    }
    Ok(())
}

/// The child's twin of parent worker `worker`: runs the operations it is sent on the CPU the
/// parent worker is pinned to, and answers `ran WORKER CPU_NANOS WALL_NANOS`.
fn twin(
    worker: usize,
    workload: Arc<dyn Workload>,
    output: Arc<Mutex<std::io::Stdout>>,
    busy: Arc<InFlight>,
) -> Result<mpsc::Sender<(u64, u32)>, String> {
    let (sender, orders) = mpsc::channel::<(u64, u32)>();
    std::thread::Builder::new()
        .name(format!("worker {worker}"))
        .spawn(move || {
            let mut pinned: Option<(u32, thiscpu::topology::PinGuard)> = None;
            for (ops, cpu) in orders {
                if pinned.as_ref().map(|(at, _)| *at) != Some(cpu) {
                    // The guard being replaced restores the affinity first.
                    drop(pinned.take());
                    pinned = thiscpu::topology::pin_to(cpu)
                        .ok()
                        .map(|guard| (cpu, guard));
                }
                let (wall, cpu_time) = (Instant::now(), thread_cpu_time());
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    workload.run(worker, ops)
                }));
                if ran.is_err() {
                    // The panic hook has said why on standard error; the parent reads it there
                    // when the output ends.
                    std::process::exit(1);
                }
                let cpu_nanos = thread_cpu_time().saturating_sub(cpu_time).as_nanos();
                let wall_nanos = wall.elapsed().as_nanos();
                let mut out = lock(&output);
                let written = writeln!(out, "ran {worker} {cpu_nanos} {wall_nanos}")
                    .and_then(|()| out.flush());
                drop(out);
                busy.finish();
                if written.is_err() {
                    return;
                }
            }
        })
        .map_err(|e| format!("cannot start worker {worker} in the child: {e}"))?;
    Ok(sender)
}

/// How many runs the child's workers have been sent and not finished.
#[derive(Default)]
struct InFlight {
    runs: Mutex<usize>,
    finished: Condvar,
}

impl InFlight {
    fn start(&self) {
        *lock(&self.runs) += 1;
    }

    fn finish(&self) {
        let mut runs = lock(&self.runs);
        *runs = runs.saturating_sub(1);
        self.finished.notify_all();
    }

    fn wait_until_idle(&self) {
        let mut runs = lock(&self.runs);
        while *runs > 0 {
            runs = self
                .finished
                .wait(runs)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_answer_reaches_that_worker_only() {
        assert_eq!(
            sort_answer("ran 3 1200 1500".to_owned()),
            (Key::Worker(3), "ran 1200 1500".to_owned())
        );
        assert_eq!(
            sort_answer("verified".to_owned()),
            (Key::Control, "verified".to_owned())
        );
        assert_eq!(
            sort_answer("failed lost 2 increments".to_owned()),
            (Key::Control, "failed lost 2 increments".to_owned())
        );
    }
}
