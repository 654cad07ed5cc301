//! The vocabulary of a benchmark run: what a family offers ([`Family`], [`Case`], [`Workload`],
//! [`Unit`]), what the runner measured ([`Measured`], [`Stats`], [`Skipped`]) and how the run
//! was laid out ([`RunInfo`]). Reports read these types; nothing here knows how results are
//! measured or shown.

use std::time::Duration;

/// What a result counts, and which way is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Nanoseconds per operation on one thread, averaged over the threads (lower is better).
    /// Counted in the threads' CPU time, so that time spent preempted by other load is left
    /// out.
    NsPerOp,
    /// Bytes per counter, a size the workload measured itself (lower is better).
    BytesPerCounter,
    /// Bytes, a size the workload measured itself (lower is better).
    Bytes,
    /// Milliseconds per run of a whole program-shaped task, a time the workload measured
    /// itself (lower is better).
    Ms,
}

impl Unit {
    /// The unit as reports write it.
    pub fn label(self) -> &'static str {
        match self {
            Unit::NsPerOp => "ns/op",
            Unit::BytesPerCounter => "B/counter",
            Unit::Bytes => "bytes",
            Unit::Ms => "ms",
        }
    }

    /// The unit a report's label names, for reading reports back.
    pub fn from_label(label: &str) -> Option<Unit> {
        [Unit::NsPerOp, Unit::BytesPerCounter, Unit::Bytes, Unit::Ms]
            .into_iter()
            .find(|unit| unit.label() == label)
    }

    /// Whether a smaller number is an improvement.
    pub fn lower_is_better(self) -> bool {
        matches!(
            self,
            Unit::NsPerOp | Unit::BytesPerCounter | Unit::Bytes | Unit::Ms
        )
    }
}

/// The work one case measures.
///
/// The runner calls `prepare` before each measurement, then `run` from every worker thread
/// in chunks until the round's time is up, then `verify` with the number of operations all
/// workers performed since `prepare` (warm-up included).
pub trait Workload: Send + Sync {
    /// Told once, before calibration, how the run is laid out: a workload may size itself by
    /// it (a smaller task under `--quick`).
    fn start(&self, _run: &RunInfo) {}

    /// The number of worker threads the case's shape sets (a producer whose consumer is a
    /// thread of the workload's own, say): measured with that many only, whatever `--threads`
    /// asks. `None`, the default: every thread count of the run.
    fn fixed_threads(&self) -> Option<usize> {
        None
    }

    /// The chunk of operations the runner hands each worker, for a workload whose figure is
    /// not its timed part (it measures in `prepare`): calibration, which would `prepare` it
    /// once more, is skipped. `None`, the default: the runner calibrates.
    fn fixed_chunk(&self) -> Option<u64> {
        None
    }

    /// Resets state before a measurement with `threads` workers.
    fn prepare(&self, _threads: usize) {}

    /// Performs `ops` operations on the calling thread, which is worker number `worker`.
    fn run(&self, worker: usize, ops: u64);

    /// Performs `ops` operations as `run` does and says how long they took, by which the
    /// runner sizes its chunks of work. A workload that runs them elsewhere (a child process)
    /// times them there, so that the round trip does not shrink the chunks.
    fn run_timed(&self, worker: usize, ops: u64) -> std::time::Duration {
        let start = std::time::Instant::now();
        self.run(worker, ops);
        start.elapsed()
    }

    /// Ends what `prepare` left running for calibration (background threads), so that it does
    /// not take CPU time from the calibration and the rounds of the other cases.
    fn end_calibration(&self) {}

    /// Checks the state after a measurement; an error fails the whole run.
    fn verify(&self, _ops: u64) -> std::result::Result<(), String> {
        Ok(())
    }

    /// A value the workload measured itself during the last measurement (a size, say),
    /// reported instead of one derived from the timing.
    fn reading(&self) -> Option<f64> {
        None
    }

    /// The share of the wall-clock time the operations were running, when the workload ran
    /// them somewhere the runner's clocks do not see (a child process).
    fn on_cpu_share(&self) -> Option<f64> {
        None
    }
}

/// A case that measures a figure itself (a size, say) instead of timing operations: `measure`
/// runs in `prepare`, with the round's thread count, before the runner's workers start (their
/// stacks would count otherwise); the timed part is an empty loop, so that the runner's
/// calibration ends; the figure is the case's reading, and a failed measurement fails the run.
pub struct Measuring<F> {
    measure: F,
    last: std::sync::Mutex<Option<Result<f64, String>>>,
}

impl<F: Fn(usize) -> Result<f64, String> + Send + Sync> Measuring<F> {
    pub fn new(measure: F) -> Self {
        Measuring {
            measure,
            last: std::sync::Mutex::new(None),
        }
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Option<Result<f64, String>>> {
        self.last.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<F: Fn(usize) -> Result<f64, String> + Send + Sync> Workload for Measuring<F> {
    fn prepare(&self, threads: usize) {
        let measured = (self.measure)(threads);
        *self.last() = Some(measured);
    }

    fn run(&self, _worker: usize, ops: u64) {
        for op in 0..ops {
            std::hint::black_box(op);
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

/// The process's address space (`VmSize`) and resident set (`Rss` of `smaps_rollup`, summed
/// from the page tables and exact; `VmRSS` where that file is missing), in bytes.
#[derive(Clone, Copy, Debug)]
pub struct ProcessMemory {
    pub vm_size: u64,
    pub resident: u64,
}

impl ProcessMemory {
    pub fn now() -> Result<ProcessMemory, String> {
        let kb_field = |text: &str, field: &str| {
            text.lines().find_map(|line| {
                let rest = line.strip_prefix(field)?.strip_prefix(':')?;
                let kb: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
                Some(kb * 1024)
            })
        };
        let status = std::fs::read_to_string("/proc/self/status")
            .map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
        let vm_size = kb_field(&status, "VmSize").ok_or("no VmSize in /proc/self/status")?;
        let resident = std::fs::read_to_string("/proc/self/smaps_rollup")
            .ok()
            .and_then(|rollup| kb_field(&rollup, "Rss"))
            .or_else(|| kb_field(&status, "VmRSS"))
            .ok_or("no Rss in /proc/self/smaps_rollup nor VmRSS in /proc/self/status")?;
        Ok(ProcessMemory { vm_size, resident })
    }
}

/// Runs `touch` on the calling thread pinned to each CPU of `cpus` in turn; the thread's
/// affinity is restored after each.
pub fn on_each_cpu(cpus: &[u32], mut touch: impl FnMut()) -> Result<(), String> {
    for &cpu in cpus {
        let _pinned = thiscpu::topology::pin_to(cpu)
            .map_err(|error| format!("cannot pin to CPU {cpu}: {error}"))?;
        // sched_setaffinity moves the thread before returning; the loop only guards against
        // a kernel that would not.
        for _ in 0..1000 {
            if thiscpu::current_cpu() == cpu {
                break;
            }
            std::thread::yield_now();
        }
        touch();
    }
    Ok(())
}

/// A stateless workload: a function that performs `ops` operations.
#[derive(Debug)]
pub struct Loop(pub fn(u64));

impl Workload for Loop {
    fn run(&self, _worker: usize, ops: u64) {
        (self.0)(ops)
    }
}

/// One case of a family: a name, a few words on what it calls, and its workload, or the reason
/// this machine cannot run it.
pub struct Case {
    /// The case's name in reports (stable: JSON files are compared by it).
    pub name: &'static str,
    /// What the case calls, in a few words.
    pub how: String,
    /// The unit of its results.
    pub unit: Unit,
    /// The workload, or why the case is left out on this machine.
    pub workload: std::result::Result<Box<dyn Workload>, String>,
}

impl Case {
    /// A case this machine can run.
    pub fn new(
        name: &'static str,
        how: impl Into<String>,
        unit: Unit,
        workload: impl Workload + 'static,
    ) -> Case {
        Case {
            name,
            how: how.into(),
            unit,
            workload: Ok(Box::new(workload)),
        }
    }

    /// A case left out, and why.
    pub fn skipped(name: &'static str, unit: Unit, reason: impl Into<String>) -> Case {
        Case {
            name,
            how: String::new(),
            unit,
            workload: Err(reason.into()),
        }
    }
}

/// A benchmark family: one file in `bench/`, listed once in `families!`.
#[derive(Debug)]
pub struct Family {
    /// The name on the command line and in reports.
    pub name: &'static str,
    /// What the family measures, in one line.
    pub about: &'static str,
    /// Every case name the family knows, whether or not this machine can run it.
    pub case_names: &'static [&'static str],
    /// Thread counts measured when `--threads` is not given.
    pub default_threads: &'static [usize],
    /// The case the table's relative column divides by. One `*` in place of a part of an
    /// `a/b` name stands for that part of each row's own name: `*/parking_lot` divides
    /// `write/std` by `write/parking_lot`, `always-rmw/*` divides `thiscpu/idle` by
    /// `always-rmw/idle`, so that a row is only ever divided by a like one.
    pub baseline: Option<&'static str>,
    /// The cases, built for this machine.
    pub cases: fn() -> Vec<Case>,
    /// Lines printed after the family's table (seed-shaped tables, ratios); may be empty.
    pub report: fn(&[Measured]) -> String,
}

impl Family {
    /// The case `case` is divided by in the table's relative column, if any.
    pub fn baseline_for(&self, case: &str) -> Option<String> {
        let baseline = self.baseline?;
        let (Some((first, second)), Some((own_first, own_second))) =
            (baseline.split_once('/'), case.split_once('/'))
        else {
            return (!baseline.contains('*')).then(|| baseline.to_owned());
        };
        Some(match (first, second) {
            ("*", _) => format!("{own_first}/{second}"),
            (_, "*") => format!("{first}/{own_second}"),
            _ => baseline.to_owned(),
        })
    }

    /// The baseline's name as a column header shows it: `parking_lot` for `*/parking_lot`.
    pub fn baseline_label(&self) -> Option<&'static str> {
        let baseline = self.baseline?;
        Some(
            baseline
                .strip_prefix("*/")
                .or_else(|| baseline.strip_suffix("/*"))
                .unwrap_or(baseline),
        )
    }
}

/// All results of one (case, thread count) pair.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The family.
    pub bench: &'static str,
    /// The case.
    pub case: &'static str,
    /// What the case calls.
    pub how: String,
    /// Worker threads.
    pub threads: usize,
    /// The CPUs the workers were pinned to (empty where pinning failed).
    pub cpus: Vec<u32>,
    /// Unit of `rounds`.
    pub unit: Unit,
    /// One value per round, in round order.
    pub rounds: Vec<f64>,
    /// Operations performed in all timed rounds by all workers.
    pub ops: u64,
    /// Per round, the share of wall-clock time the workers were running.
    pub on_cpu: Vec<f64>,
}

impl Measured {
    /// Min, median and max over the rounds.
    pub fn stats(&self) -> Stats {
        Stats::of(&self.rounds)
    }
}

/// Min, median, max, mean and standard deviation of a set of rounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Smallest round.
    pub min: f64,
    /// Median round (the mean of the two middle ones for an even count).
    pub median: f64,
    /// Largest round.
    pub max: f64,
    /// Arithmetic mean of the rounds.
    pub mean: f64,
    /// Sample standard deviation of the rounds (divided by n - 1; 0 for one round).
    pub stddev: f64,
}

impl Stats {
    /// Statistics of `values`, all zero for none.
    pub fn of(values: &[f64]) -> Stats {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        if n == 0 {
            return Stats {
                min: 0.0,
                median: 0.0,
                max: 0.0,
                mean: 0.0,
                stddev: 0.0,
            };
        }
        let mean = sorted.iter().sum::<f64>() / n as f64;
        let stddev = if n > 1 {
            let squares: f64 = sorted.iter().map(|v| (v - mean) * (v - mean)).sum();
            (squares / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Stats {
            min: sorted[0],
            median,
            max: sorted[n - 1],
            mean,
            stddev,
        }
    }
}

/// A case left out of a run, and why.
#[derive(Clone, Debug)]
pub struct Skipped {
    /// The family.
    pub bench: &'static str,
    /// The case.
    pub case: &'static str,
    /// Why this machine cannot run it.
    pub reason: String,
}

/// Which cases `--cases` selects: comma-separated patterns, each a substring of the case name
/// or, when it holds `*` or `?`, a glob that must match the whole name. A pattern may also be
/// written `family/case`.
#[derive(Clone, Debug)]
pub struct CaseFilter {
    patterns: Vec<String>,
}

impl CaseFilter {
    /// A filter of these patterns.
    pub fn new(patterns: Vec<String>) -> CaseFilter {
        CaseFilter { patterns }
    }

    /// The patterns, as given.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// Whether `family/case` is selected.
    pub fn matches(&self, family: &str, case: &str) -> bool {
        let full = format!("{family}/{case}");
        self.patterns.iter().any(|pattern| {
            if pattern.contains(['*', '?']) {
                glob(pattern, case) || glob(pattern, &full)
            } else {
                case.contains(pattern.as_str()) || full == *pattern
            }
        })
    }
}

/// Matches `*` (any run) and `?` (any one character) against the whole of `text`.
fn glob(pattern: &str, text: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let text: Vec<char> = text.chars().collect();
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && (pattern[p] == '?' || pattern[p] == text[t]) {
            p += 1;
            t += 1;
        } else if p < pattern.len() && pattern[p] == '*' {
            star = Some((p, t));
            p += 1;
        } else if let Some((star_p, star_t)) = star {
            p = star_p + 1;
            t = star_t + 1;
            star = Some((star_p, star_t + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// How a run is laid out, as reports describe it.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// Rounds per (case, thread count).
    pub rounds: u32,
    /// Length of one measurement.
    pub round: Duration,
    /// Total budget asked for, in seconds.
    pub budget_seconds: f64,
    /// Whether `--quick` was given.
    pub quick: bool,
    /// CPUs this process may run on, in the order workers are pinned to them.
    pub cpus: Vec<u32>,
}

/// The median of `case` run with `threads` threads, for the families' reports.
pub fn median_of(results: &[Measured], case: &str, threads: usize) -> Option<f64> {
    let result = results
        .iter()
        .find(|m| m.case == case && m.threads == threads)?;
    Some(result.stats().median)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        let odd = Stats::of(&[3.0, 1.0, 2.0]);
        assert_eq!((odd.min, odd.median, odd.max), (1.0, 2.0, 3.0));
        assert_eq!(Stats::of(&[4.0, 1.0, 2.0, 3.0]).median, 2.5);
        // Mean 5, squared deviations 9+1+1+1+0+4+16+0 = 32 over n - 1 = 7.
        let spread = Stats::of(&[2.0, 4.0, 4.0, 4.0, 5.0, 7.0, 9.0, 5.0]);
        assert_eq!(spread.mean, 5.0);
        assert!((spread.stddev - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!(Stats::of(&[3.0]).stddev, 0.0);
    }

    #[test]
    fn a_row_is_divided_by_the_like_baseline_row() {
        let family = |baseline| Family {
            name: "f",
            about: "",
            case_names: &[],
            default_threads: &[1],
            baseline,
            cases: Vec::new,
            report: |_| String::new(),
        };
        let by_structure = family(Some("*/parking_lot"));
        assert_eq!(
            by_structure.baseline_for("write/std").as_deref(),
            Some("write/parking_lot")
        );
        assert_eq!(by_structure.baseline_label(), Some("parking_lot"));
        let by_pattern = family(Some("always-rmw/*"));
        assert_eq!(
            by_pattern.baseline_for("thiscpu/idle").as_deref(),
            Some("always-rmw/idle")
        );
        assert_eq!(by_pattern.baseline_label(), Some("always-rmw"));
        let plain = family(Some("atomic-global"));
        assert_eq!(
            plain.baseline_for("tls-plain").as_deref(),
            Some("atomic-global")
        );
        assert_eq!(by_structure.baseline_for("flat"), None);
        assert_eq!(family(None).baseline_for("write/std"), None);
    }

    #[test]
    fn case_filters_take_substrings_and_globs() {
        let filter = CaseFilter::new(vec!["vdso".to_owned(), "current_cpu-*".to_owned()]);
        assert!(filter.matches("getcpu", "vdso-getcpu"));
        assert!(filter.matches("getcpu", "current_cpu-noinline"));
        assert!(!filter.matches("getcpu", "current_cpu"));
        assert!(!filter.matches("getcpu", "syscall"));
        let filter = CaseFilter::new(vec!["getcpu/getcpu".to_owned()]);
        assert!(filter.matches("getcpu", "getcpu"));
        assert!(glob("*", ""));
        assert!(glob("r?p*d", "rdpid"));
        assert!(!glob("r?p", "rdpid"));
    }
}
