//! Whole program-shaped tasks, each in a child process whose global allocator is the one
//! measured (one binary cannot have five global allocators at once; see [`super::switch`]).
//!
//! The parent starts this program again with [`CHILD_ENV`] set to `ALLOCATOR/TASK/SIZE`
//! (`SIZE` is `full`, or `quick` for `--quick`'s smaller tasks). The child checks that its
//! global allocator is the one named, runs the task once and prints one JSON line, a
//! [`ChildReport`], then exits with status 0; a malformed variable exits with status 2, a
//! failed task with 1, each with one line on standard error.
//!
//! Memory is the child's peak resident set (`VmHWM` in `/proc/self/status`) above its resident
//! set (`VmRSS`) before the task began: what the task and its allocator added at their peak.

use super::programs::{self, Size, xorshift};
use super::switch::{self, CHILD_ENV, Kind};
use crate::bench::model::{RunInfo, Unit, Workload};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hint::black_box;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::time::Instant;

/// A task a child runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Task {
    /// Many threads alive at once, each holding and churning small objects.
    Threads,
    /// A generated ~1 MB JSON document parsed into a `serde_json::Value` and dropped.
    Json,
    /// Short `String`s built, sorted and dropped.
    Strings,
    /// Two threads replacing objects and handing them to each other ([`programs::larson`]).
    Larson,
    /// Big-number arithmetic making a new small object per operation ([`programs::bignum`]).
    Bignum,
    /// Objects of one thread given to two threads on two CPUs that write their own
    /// ([`programs::sharing`]).
    Sharing,
    /// A long-lived heap that grows and shrinks ([`programs::mixed`]).
    Mixed,
}

impl Task {
    pub const ALL: [Task; 7] = [
        Task::Threads,
        Task::Json,
        Task::Strings,
        Task::Larson,
        Task::Bignum,
        Task::Sharing,
        Task::Mixed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Task::Threads => "threads",
            Task::Json => "json",
            Task::Strings => "strings",
            Task::Larson => "larson",
            Task::Bignum => "bignum",
            Task::Sharing => "sharing",
            Task::Mixed => "mixed",
        }
    }

    fn from_name(name: &str) -> Option<Task> {
        Task::ALL.into_iter().find(|task| task.name() == name)
    }
}

impl Size {
    fn name(self) -> &'static str {
        match self {
            Size::Full => "full",
            Size::Quick => "quick",
        }
    }

    /// Threads of the `threads` task.
    pub fn threads(self) -> usize {
        match self {
            Size::Full => 1000,
            Size::Quick => 100,
        }
    }

    /// Parses of the `json` task's document.
    fn parses(self) -> usize {
        match self {
            Size::Full => 3,
            Size::Quick => 1,
        }
    }

    /// Bytes of the `json` task's document, about.
    pub fn json_bytes(self) -> usize {
        match self {
            Size::Full => 1 << 20,
            Size::Quick => 1 << 18,
        }
    }

    /// Strings of the `strings` task.
    pub fn strings(self) -> usize {
        match self {
            Size::Full => 1_000_000,
            Size::Quick => 50_000,
        }
    }
}

/// Small objects each thread of the `threads` task holds at once.
pub const HELD: usize = 64;
/// Objects each thread replaces, one at a time, after making its first [`HELD`].
pub const CHURN: usize = 1000;
/// Sizes of those objects, chosen at random.
const SIZES: [usize; 8] = [16, 24, 32, 48, 64, 96, 128, 256];
/// Stack of each thread of the `threads` task: small, so that stacks do not drown the heap.
const THREAD_STACK: usize = 64 * 1024;

/// What a child prints: one JSON line.
#[derive(Debug, Serialize, Deserialize)]
pub struct ChildReport {
    pub allocator: String,
    pub task: String,
    pub size: String,
    /// Milliseconds per run of the task (each of the `json` task's parses, 3 of them or 1
    /// with `--quick`; one run for the others).
    pub ms_per_run: f64,
    pub runs: usize,
    /// Peak resident set above the resident set before the task, bytes.
    pub peak_bytes: u64,
    /// The resident set before the task, bytes.
    pub start_bytes: u64,
    /// For thiscpu's allocator: whether its per-CPU caches were in use (they are not in a
    /// process without rseq, where it passes every call to glibc's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thiscpu_caching: Option<bool>,
    /// For tcmalloc: whether its per-CPU caches were in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcmalloc_per_cpu: Option<bool>,
}

/// The child process's side: runs the task [`CHILD_ENV`] names. Returns the exit status.
pub fn child_main(spec: &str) -> i32 {
    let Some((kind, task, size)) = parse_spec(spec) else {
        eprintln!(
            "thiscpu: {CHILD_ENV}={spec:?}: expected ALLOCATOR/TASK/SIZE, with ALLOCATOR one of \
             {}, TASK one of {} and SIZE full or quick",
            Kind::ALL.map(Kind::name).join(", "),
            Task::ALL.map(Task::name).join(", "),
        );
        return 2;
    };
    let chosen = switch::chosen();
    if chosen != kind {
        eprintln!(
            "thiscpu: the global allocator is {}, not {} as {CHILD_ENV} asks",
            chosen.name(),
            kind.name()
        );
        return 1;
    }
    let outcome = run_task(task, size);
    match outcome {
        Ok((ms_per_run, runs, start_bytes, peak_bytes)) => {
            let report = ChildReport {
                allocator: kind.name().to_owned(),
                task: task.name().to_owned(),
                size: size.name().to_owned(),
                ms_per_run,
                runs,
                peak_bytes,
                start_bytes,
                thiscpu_caching: (kind == Kind::Thiscpu).then(|| switch::THISCPU.stats().caching),
                tcmalloc_per_cpu: (kind == Kind::Tcmalloc).then(switch::tcmalloc_per_cpu_caches),
            };
            match serde_json::to_string(&report) {
                Ok(line) => {
                    println!("{line}");
                    0
                }
                Err(error) => {
                    eprintln!("thiscpu: cannot write the child's report: {error}");
                    1
                }
            }
        }
        Err(why) => {
            eprintln!("thiscpu: {}: {why}", task.name());
            1
        }
    }
}

fn parse_spec(spec: &str) -> Option<(Kind, Task, Size)> {
    let mut parts = spec.split('/');
    let kind = Kind::from_name(parts.next()?)?;
    let task = Task::from_name(parts.next()?)?;
    let size = match parts.next()? {
        "full" => Size::Full,
        "quick" => Size::Quick,
        _ => return None,
    };
    parts.next().is_none().then_some((kind, task, size))
}

/// A field of `/proc/self/status` in bytes.
fn status_bytes(field: &str) -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    status
        .lines()
        .find_map(|line| {
            let rest = line.strip_prefix(field)?.strip_prefix(':')?;
            let kb: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            Some(kb * 1024)
        })
        .ok_or_else(|| format!("no {field} in /proc/self/status"))
}

/// Runs `task`: milliseconds per run, runs, and the resident set before and its peak above it.
fn run_task(task: Task, size: Size) -> Result<(f64, usize, u64, u64), String> {
    // The single-threaded tasks, and the thread that gives `sharing` its objects, run where a
    // single worker of the other families runs; the threads of the others pin themselves.
    let _pinned = match task {
        Task::Threads | Task::Larson => None,
        Task::Json | Task::Strings | Task::Bignum | Task::Sharing | Task::Mixed => crate::bench::runner::worker_cpus()
            .first()
            .and_then(|&cpu| thiscpu::topology::pin_to(cpu).ok()),
    };
    let start = status_bytes("VmRSS")?;
    let (elapsed, runs) = match task {
        Task::Threads => (threads_task(size.threads())?, 1),
        Task::Json => {
            let document = json_document(size.json_bytes());
            let runs = size.parses();
            let began = Instant::now();
            for _ in 0..runs {
                let value: serde_json::Value = serde_json::from_str(black_box(&document))
                    .map_err(|e| format!("the generated document does not parse: {e}"))?;
                drop(black_box(value));
            }
            (began.elapsed(), runs)
        }
        Task::Strings => (timed(|size| strings_task(size.strings()), size)?, 1),
        Task::Larson => (timed(programs::larson, size)?, 1),
        Task::Bignum => (timed(programs::bignum, size)?, 1),
        Task::Sharing => (timed(programs::sharing, size)?, 1),
        Task::Mixed => (timed(programs::mixed, size)?, 1),
    };
    let peak = status_bytes("VmHWM")?;
    Ok((
        elapsed.as_secs_f64() * 1e3 / runs as f64,
        runs,
        start,
        peak.saturating_sub(start),
    ))
}

/// How long `task` took at `size`.
fn timed(
    task: fn(Size) -> Result<(), String>,
    size: Size,
) -> Result<std::time::Duration, String> {
    let began = Instant::now();
    task(size)?;
    Ok(began.elapsed())
}


/// `threads` threads, all alive at once, each making [`HELD`] objects of random small sizes,
/// then replacing one at random [`CHURN`] times; all wait, holding theirs, until every thread
/// has done so, then free them and end.
fn threads_task(threads: usize) -> Result<std::time::Duration, String> {
    let all_holding = Arc::new(Barrier::new(threads + 1));
    let began = Instant::now();
    let mut handles = Vec::with_capacity(threads);
    for index in 0..threads {
        let all_holding = Arc::clone(&all_holding);
        let spawned = std::thread::Builder::new()
            .stack_size(THREAD_STACK)
            .spawn(move || {
                let mut state = 0x9e37_79b9_7f4a_7c15 ^ (index as u64 + 1);
                let make = |state: &mut u64| -> Vec<u8> {
                    let size = SIZES[(xorshift(state) % SIZES.len() as u64) as usize];
                    vec![index as u8; size]
                };
                let mut held: Vec<Vec<u8>> = (0..HELD).map(|_| make(&mut state)).collect();
                for _ in 0..CHURN {
                    let at = (xorshift(&mut state) % HELD as u64) as usize;
                    held[at] = make(&mut state);
                }
                all_holding.wait();
                black_box(&held);
            });
        match spawned {
            Ok(handle) => handles.push(handle),
            Err(error) => {
                // The threads made so far wait for the others forever: the process ends here.
                return Err(format!("cannot start thread {} of {threads}: {error}", index + 1));
            }
        }
    }
    all_holding.wait();
    for handle in handles {
        handle
            .join()
            .map_err(|_| "a thread of the task panicked".to_owned())?;
    }
    Ok(began.elapsed())
}

/// A JSON document of about `bytes` bytes: an array of records with strings, numbers, flags,
/// nested arrays and objects, the same in every child.
pub fn json_document(bytes: usize) -> String {
    use std::fmt::Write;
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut out = String::with_capacity(bytes + 1024);
    out.push('[');
    let mut id = 0u64;
    while out.len() < bytes {
        if id > 0 {
            out.push(',');
        }
        let r = xorshift(&mut state);
        let _ = write!(
            out,
            r#"{{"id":{id},"name":"user-{r:x}","email":"u{id}@example.org","score":{:.3},"active":{},"tags":["t{}","t{}","t{}"],"address":{{"city":"city-{}","zip":"{:05}"}},"friends":[{},{},{},{}]}}"#,
            (r % 100_000) as f64 / 7.0,
            r.is_multiple_of(2),
            r % 17,
            r % 31,
            r % 5,
            r % 1000,
            r % 100_000,
            r % 9973,
            r % 7919,
            r % 104_729,
            r % 65_537,
        );
        id += 1;
    }
    out.push(']');
    out
}

/// `count` short strings (7 to 16 bytes) in random order, sorted, checked and dropped.
fn strings_task(count: usize) -> Result<(), String> {
    let mut state = 0x853c_49e6_748f_ea9b_u64;
    let mut strings: Vec<String> = (0..count)
        .map(|_| {
            let r = xorshift(&mut state);
            format!("{:x}", r >> (r % 37))
        })
        .collect();
    strings.sort_unstable();
    if strings.windows(2).any(|pair| pair[0] > pair[1]) {
        return Err("the strings are not in order after sorting".to_owned());
    }
    drop(black_box(strings));
    Ok(())
}

/// Which figure of a child's report a case gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Figure {
    /// Milliseconds per run.
    Time,
    /// Peak resident bytes above the start.
    Peak,
}

impl Figure {
    pub fn unit(self) -> Unit {
        match self {
            Figure::Time => Unit::Ms,
            Figure::Peak => Unit::Bytes,
        }
    }
}

/// Reports of children not yet read by the case that wants their other figure: a time case
/// leaves its child's report here for the peak case of the same allocator and task, which
/// comes after it in each round, so that one child gives both.
pub type Unread = Arc<Mutex<HashMap<(Kind, Task), ChildReport>>>;

/// The parent's side of a case: each measurement (each round) starts one child, or takes the
/// report a child of the same round left for it, and gives one figure of it.
pub struct ChildCase {
    kind: Kind,
    task: Task,
    figure: Figure,
    quick: AtomicBool,
    unread: Unread,
    last: Mutex<Option<Result<f64, String>>>,
}

impl ChildCase {
    pub fn new(kind: Kind, task: Task, figure: Figure, unread: Unread) -> ChildCase {
        ChildCase {
            kind,
            task,
            figure,
            quick: AtomicBool::new(false),
            unread,
            last: Mutex::new(None),
        }
    }

    fn last(&self) -> MutexGuard<'_, Option<Result<f64, String>>> {
        self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn size(&self) -> Size {
        if self.quick.load(Ordering::Relaxed) {
            Size::Quick
        } else {
            Size::Full
        }
    }

    fn measure(&self) -> Result<f64, String> {
        let left = match self.figure {
            Figure::Peak => lock(&self.unread).remove(&(self.kind, self.task)),
            Figure::Time => None,
        };
        let report = match left {
            Some(report) => report,
            None => run_child(self.kind, self.task, self.size())?,
        };
        if report.tcmalloc_per_cpu == Some(false) && super::tcmalloc_in_child() {
            return Err(format!(
                "{}: tcmalloc's per-CPU caches were not in use in its child process",
                self.task.name()
            ));
        }
        let value = match self.figure {
            Figure::Time => report.ms_per_run,
            Figure::Peak => report.peak_bytes as f64,
        };
        if self.figure == Figure::Time {
            lock(&self.unread).insert((self.kind, self.task), report);
        }
        Ok(value)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Workload for ChildCase {
    fn start(&self, run: &RunInfo) {
        self.quick.store(run.quick, Ordering::Relaxed);
    }

    fn fixed_threads(&self) -> Option<usize> {
        Some(1)
    }

    fn fixed_chunk(&self) -> Option<u64> {
        Some(1000)
    }

    fn prepare(&self, _threads: usize) {
        let measured = self.measure();
        *self.last() = Some(measured);
    }

    fn run(&self, _worker: usize, ops: u64) {
        for op in 0..ops {
            black_box(op);
        }
    }

    fn verify(&self, _ops: u64) -> Result<(), String> {
        match &*self.last() {
            Some(Ok(_)) => Ok(()),
            Some(Err(why)) => Err(why.clone()),
            None => Err("nothing was measured".to_owned()),
        }
    }

    fn reading(&self) -> Option<f64> {
        self.last().as_ref()?.as_ref().ok().copied()
    }
}

/// Runs `task` on `kind` in a child process of this program and reads its report.
pub fn run_child(kind: Kind, task: Task, size: Size) -> Result<ChildReport, String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find this program's executable: {e}"))?;
    let spec = format!("{}/{}/{}", kind.name(), task.name(), size.name());
    let mut command = Command::new(exe);
    command.env(CHILD_ENV, &spec);
    if kind == Kind::Tcmalloc {
        command.envs(super::TCMALLOC_CHILD.env.iter().copied());
    }
    let output = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot start a child process for {spec}: {e}"))?;
    let said = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!(
            "the child process for {spec} failed ({}): {}",
            output.status,
            said.trim().replace('\n', " ")
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let report: ChildReport = serde_json::from_str(line)
        .map_err(|e| format!("the child process for {spec} answered {line:?}: {e}"))?;
    if report.allocator != kind.name() || report.task != task.name() {
        return Err(format!("the child process for {spec} answered for {line}"));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_an_allocator_a_task_and_a_size() {
        assert_eq!(
            parse_spec("jemalloc/json/quick"),
            Some((Kind::Jemalloc, Task::Json, Size::Quick))
        );
        for bad in ["", "jemalloc", "jemalloc/json", "ptmalloc/json/full", "glibc/xml/full",
                    "glibc/json/huge", "glibc/json/full/extra"] {
            assert_eq!(parse_spec(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_json_document_is_about_a_megabyte_and_parses() {
        let bytes = Size::Full.json_bytes();
        let document = json_document(bytes);
        assert!(document.len() >= bytes && document.len() < bytes + 4096);
        let value: serde_json::Value = serde_json::from_str(&document).expect("valid JSON");
        assert!(value.as_array().is_some_and(|records| records.len() > 1000));
    }
}
