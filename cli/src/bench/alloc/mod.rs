//! `alloc`: memory allocators side by side in one run — glibc's `malloc`, mimalloc, jemalloc,
//! tcmalloc and thiscpu's per-CPU front (`thiscpu::PerCpuAlloc`):
//!
//! - `pairSIZE/ALLOC`: `alloc` then `dealloc` of one SIZE-byte object (16 to 4096), on 1 and 2
//!   pinned workers, each allocator called through its own type ([`pairs`]);
//! - `remote/ALLOC`: 64-byte objects allocated by a producer and freed by a consumer pinned to
//!   another CPU, in batches of 256 ([`pairs::Remote`]);
//! - `threads1k/ALLOC`: peak resident memory of 1,000 threads alive at once, each holding and
//!   churning small objects;
//! - `json/ALLOC`, `strings/ALLOC`: a ~1 MB JSON document parsed into a `serde_json::Value`
//!   and dropped; a million short `String`s built, sorted and dropped;
//! - `larson/ALLOC`, `bignum/ALLOC`, `sharing/ALLOC`, `mixed/ALLOC`: four tasks modelled on
//!   the published allocator benchmarks ([`programs`]): Larson's server, a big-number
//!   computation's churn, cache-scratch's false sharing, a long-lived heap that grows and
//!   shrinks. Each program-shaped task gives milliseconds per run, and (`TASK-rss`) the peak
//!   resident memory it added.
//!
//! tcmalloc's per-CPU caches need the thread's rseq registration for tcmalloc itself, which
//! glibc has already made in this process (tcmalloc then runs without them, on its central
//! lists: 17 ns per 16-byte pair instead of 10 here). So tcmalloc's cases run in a child process
//! started with `GLIBC_TUNABLES=glibc.pthread.rseq=0` (and thiscpu's rseq off), where tcmalloc
//! registers rseq for itself; the child checks that its per-CPU caches are in use. Its pair and
//! remote cases are served there by twins of the workers, as the `…-rseq-off` cases are
//! ([`rseq_off::in_child`]), and timed in the child's CPU time like the others.
//!
//! The last three parts need the allocator to be the process's global allocator, so each runs in a
//! child process of this program ([`child`]), one per allocator, task and round; the time and
//! peak of a task come from the same child. Their cases are measured once per round whatever
//! `--threads` says (`threads1k` has its own 1,000 threads; the others are single-threaded).

pub mod child;
pub mod pairs;
pub mod programs;
pub mod switch;

use super::model::{Case, Family, Measured, RunInfo, Unit, Workload, median_of};
use super::rseq_off::{self, ChildSetup};
use crate::report::table::{
    Targets, align_right, fmt_num, fmt_ratio, new_table, render, thread_counts, threads_phrase,
};
use child::{ChildCase, Figure, Task, Unread};
use switch::{Kind, PEERS_BUILT};

/// Object sizes of the pair cases.
const SIZES: [usize; 5] = [16, 64, 256, 1024, 4096];
/// Object size of the remote cases.
const REMOTE_SIZE: usize = 64;

/// [`PREFIXES`], the prefixes of the case names, one per measured thing in the tables' order
/// (the pairs' first, in the order of [`SIZES`]), and [`CASES`], each prefix with each
/// allocator.
macro_rules! prefixes_and_cases {
    ($($prefix:literal),* $(,)?) => {
        const PREFIXES: &[&str] = &[$($prefix),*];
        const CASES: &[&str] = &[$(
            concat!($prefix, "/glibc"),
            concat!($prefix, "/mimalloc"),
            concat!($prefix, "/jemalloc"),
            concat!($prefix, "/tcmalloc"),
            concat!($prefix, "/thiscpu"),
        )*];
    };
}

prefixes_and_cases![
    "pair16",
    "pair64",
    "pair256",
    "pair1024",
    "pair4096",
    "remote",
    "threads1k",
    "json",
    "json-rss",
    "strings",
    "strings-rss",
    "larson",
    "larson-rss",
    "bignum",
    "bignum-rss",
    "sharing",
    "sharing-rss",
    "mixed",
    "mixed-rss",
];

/// The program-shaped tasks after `threads1k`, each with a time case named as the task and a
/// peak case with `-rss` after it: the task, and what its time case measures.
const PROGRAM_TASKS: [(Task, &str); 6] = [
    (
        Task::Json,
        "ms per parse of a ~1 MB JSON document (256 KB with --quick) into serde_json::Value + \
         drop",
    ),
    (
        Task::Strings,
        "ms to build, sort and drop 1,000,000 short Strings (50,000 with --quick)",
    ),
    (
        Task::Larson,
        "ms for Larson's server: 2 threads replace random 8-1000 B objects among 5,000 each and \
         hand them over every 10,000, 100 times (5 with --quick)",
    ),
    (
        Task::Bignum,
        "ms for 5,000 (300 with --quick) big-number sequences of 300 convergents of √2, a new \
         object for every sum",
    ),
    (
        Task::Sharing,
        "ms for cache-scratch: 2 threads on 2 CPUs free an 8 B object made by a third, then \
         allocate, write 1,000 times and free 20,000 (1,000 with --quick)",
    ),
    (
        Task::Mixed,
        "ms for a heap of 16 B-64 KiB objects that grows to 50,000 (5,000 with --quick) and \
         shrinks to a tenth 5 times (2), a fifth of it long-lived",
    ),
];

/// The family.
pub static FAMILY: Family = Family {
    name: "alloc",
    about: "allocators side by side: glibc, mimalloc, jemalloc, tcmalloc, thiscpu PerCpuAlloc; \
            alloc+free pairs and remote frees (ns/op), 1,000 threads' peak memory, JSON and \
            String tasks (ms, peak bytes) in child processes",
    case_names: CASES,
    default_threads: &[1, 2],
    baseline: Some("*/glibc"),
    cases,
    report,
};

/// The child process in which tcmalloc's cases run: glibc leaves rseq to tcmalloc.
pub const TCMALLOC_CHILD: ChildSetup = ChildSetup {
    var: "THISCPU_BENCH_ALLOC_TCMALLOC_CHILD",
    env: &[
        ("GLIBC_TUNABLES", "glibc.pthread.rseq=0"),
        ("THISCPU_RSEQ", "off"),
    ],
    what: "where tcmalloc holds rseq",
};

/// The set-up and check of a [`TCMALLOC_CHILD`]: the child may run on every online CPU (it
/// inherits the affinity of the parent's thread that started it, pinned to one), and
/// tcmalloc's per-CPU caches are in use once it has allocated.
pub fn tcmalloc_ready() -> Result<(), String> {
    // SAFETY: `cpu_set_t` is plain data, all zeroes an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in thiscpu::topology::online_cpus() {
        if (cpu as usize) < libc::CPU_SETSIZE as usize {
            // SAFETY: `cpu` is below `CPU_SETSIZE`, the number of bits in the set.
            unsafe { libc::CPU_SET(cpu as usize, &mut set) };
        }
    }
    // SAFETY: sets the calling thread's affinity from a set we own, of the size given.
    let widened = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if widened != 0 {
        return Err(format!(
            "cannot let the child run on every online CPU: {}",
            std::io::Error::last_os_error()
        ));
    }
    // Each size once on each CPU first: tcmalloc's first object of a size on a CPU took
    // milliseconds here (its cache for that CPU is set up), which made the runner's calibration,
    // timed in the child, settle on one operation per call, and the call's own cost (a read of
    // the thread's CPU time) the figure.
    for cpu in thiscpu::topology::online_cpus() {
        let Ok(_pinned) = thiscpu::topology::pin_to(cpu) else {
            continue;
        };
        for size in SIZES.into_iter().chain([REMOTE_SIZE]) {
            pairs::pairs(Kind::Tcmalloc, size).run(0, 1000);
        }
    }
    if switch::tcmalloc_per_cpu_caches() {
        Ok(())
    } else {
        Err("tcmalloc's per-CPU caches are not in use in its child process".to_owned())
    }
}

/// Whether tcmalloc's pair and remote cases run in a [`TCMALLOC_CHILD`]: in the parent, on a
/// kernel with rseq, when this program can start itself.
fn tcmalloc_in_child() -> bool {
    let no_rseq = matches!(
        thiscpu::source().unavailable,
        Some(thiscpu::Unavailable::NoSyscall | thiscpu::Unavailable::Refused(_))
    );
    std::env::var_os(TCMALLOC_CHILD.var).is_none()
        && !no_rseq
        && std::env::current_exe().is_ok()
}

/// What tcmalloc's pair and remote rows add to their description.
fn tcmalloc_where(in_child: bool) -> &'static str {
    if in_child {
        "; in a child with glibc.pthread.rseq=0, so that tcmalloc holds rseq"
    } else if std::env::var_os(TCMALLOC_CHILD.var).is_some() {
        ""
    } else {
        "; no rseq here: without tcmalloc's per-CPU caches"
    }
}

/// A workload measured with `threads` workers only.
struct FixedThreads<W>(W, usize);

impl<W: Workload> Workload for FixedThreads<W> {
    fn start(&self, run: &RunInfo) {
        self.0.start(run)
    }
    fn fixed_threads(&self) -> Option<usize> {
        Some(self.1)
    }
    fn prepare(&self, threads: usize) {
        self.0.prepare(threads)
    }
    fn run(&self, worker: usize, ops: u64) {
        self.0.run(worker, ops)
    }
    fn run_timed(&self, worker: usize, ops: u64) -> std::time::Duration {
        self.0.run_timed(worker, ops)
    }
    fn verify(&self, ops: u64) -> Result<(), String> {
        self.0.verify(ops)
    }
    fn reading(&self) -> Option<f64> {
        self.0.reading()
    }
    fn on_cpu_share(&self) -> Option<f64> {
        self.0.on_cpu_share()
    }
}

/// The case named `prefix/allocator`, from [`CASES`] (case names are `'static`).
fn case_name(prefix: &str, kind: Kind) -> &'static str {
    CASES
        .iter()
        .copied()
        .find(|name| name.split_once('/') == Some((prefix, kind.name())))
        .unwrap_or("unknown")
}

fn cases() -> Vec<Case> {
    let in_child = tcmalloc_in_child();
    let mut cases = pair_cases(in_child);
    cases.extend(remote_cases(in_child));
    cases.extend(child_cases());
    mark_unbuilt_peers(&mut cases);
    cases
}

/// Where tcmalloc's cases run, for their descriptions (the others run in this process).
fn place(kind: Kind, in_child: bool) -> &'static str {
    if kind == Kind::Tcmalloc {
        tcmalloc_where(in_child)
    } else {
        ""
    }
}

/// One alloc + dealloc pair per operation, for each size and allocator.
fn pair_cases(in_child: bool) -> Vec<Case> {
    let mut cases = Vec::new();
    for (prefix, size) in PREFIXES.iter().zip(SIZES) {
        for kind in Kind::ALL {
            let name = case_name(prefix, kind);
            cases.push(Case {
                name,
                how: format!(
                    "{}: alloc + write a word + dealloc, {size} B{}",
                    kind.what(),
                    place(kind, in_child)
                ),
                unit: Unit::NsPerOp,
                workload: Ok(if kind == Kind::Tcmalloc && in_child {
                    Box::new(rseq_off::in_child(FAMILY.name, name, TCMALLOC_CHILD))
                } else {
                    pairs::pairs(kind, size)
                }),
            });
        }
    }
    cases
}

/// Objects allocated here and freed by a thread on another CPU, for each allocator.
fn remote_cases(in_child: bool) -> Vec<Case> {
    let consumer = pairs::consumer_cpu();
    let mut cases = Vec::new();
    for kind in Kind::ALL {
        let name = case_name("remote", kind);
        cases.push(match consumer {
            Some(cpu) => Case {
                name,
                how: format!(
                    "{}: {REMOTE_SIZE} B objects allocated here, freed by a thread on CPU {cpu}; \
                     producer's CPU time per object{}",
                    kind.what(),
                    place(kind, in_child)
                ),
                unit: Unit::NsPerOp,
                workload: Ok(if kind == Kind::Tcmalloc && in_child {
                    Box::new(FixedThreads(
                        rseq_off::in_child(FAMILY.name, name, TCMALLOC_CHILD),
                        1,
                    ))
                } else {
                    pairs::remote(kind, REMOTE_SIZE, cpu)
                }),
            },
            None => Case::skipped(name, Unit::NsPerOp, "a remote free needs two CPUs"),
        });
    }
    cases
}

/// The whole-program cases, each run in a child process with one allocator as its global one.
fn child_cases() -> Vec<Case> {
    let unread = Unread::default();
    let children = std::env::current_exe().is_ok();
    let mut cases = Vec::new();
    let mut child_case = |prefix: &str, task: Task, figure: Figure, how: String| {
        for kind in Kind::ALL {
            let name = case_name(prefix, kind);
            cases.push(if children {
                Case {
                    name,
                    how: format!(
                        "{}, global allocator {}{}",
                        how,
                        kind.what(),
                        if kind == Kind::Tcmalloc {
                            " (child with glibc.pthread.rseq=0)"
                        } else {
                            ""
                        }
                    ),
                    unit: figure.unit(),
                    workload: Ok(Box::new(ChildCase::new(kind, task, figure, unread.clone()))),
                }
            } else {
                Case::skipped(
                    name,
                    figure.unit(),
                    "this program cannot find its own executable to start a child",
                )
            });
        }
    };
    child_case(
        "threads1k",
        Task::Threads,
        Figure::Peak,
        format!(
            "peak RSS growth in a child: 1,000 threads (100 with --quick), each making {} small \
             objects and replacing {}",
            child::HELD,
            child::CHURN
        ),
    );
    for (task, how) in PROGRAM_TASKS {
        let prefix = task.name();
        child_case(prefix, task, Figure::Time, format!("{how}, in a child"));
        child_case(
            &format!("{prefix}-rss"),
            task,
            Figure::Peak,
            format!("peak RSS growth of the {prefix} child"),
        );
    }
    cases
}

/// Turns the cases of the peers this build leaves out into skipped ones that say why.
fn mark_unbuilt_peers(cases: &mut [Case]) {
    for case in cases {
        let kind = case.name.split_once('/').and_then(|(_, kind)| Kind::from_name(kind));
        if let Some(kind) = kind.filter(|kind| !kind.built()) {
            let why = if kind == Kind::Tcmalloc && PEERS_BUILT {
                "tcmalloc is built into the command only with `--features tcmalloc`: linked in, \
                 it takes every thread's rseq area at start-up where glibc does not register one"
            } else {
                "mimalloc, jemalloc and tcmalloc are built into the command on x86_64 Linux only"
            };
            *case = Case::skipped(case.name, case.unit, why);
        }
    }
}

/// Mebibytes, three significant digits.
fn mib(bytes: f64) -> String {
    fmt_num(bytes / (1024.0 * 1024.0))
}

/// The smallest median of the peers (mimalloc, jemalloc, tcmalloc) for `prefix`, and which.
fn best_peer(results: &[Measured], prefix: &str, threads: usize) -> Option<(Kind, f64)> {
    Kind::PEERS
        .into_iter()
        .filter_map(|kind| Some((kind, median_of(results, case_name(prefix, kind), threads)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

/// One part's table: a row per (group, allocator), and for each thread count its median, its
/// ratio to the best peer's and to glibc's.
fn part_table(
    results: &[Measured],
    groups: &[(&str, &str)],
    threads: &[usize],
    unit: &str,
    show: fn(f64) -> String,
) -> Option<String> {
    let mut table = new_table();
    let mut header = vec!["".to_owned(), "allocator".to_owned()];
    for &n in threads {
        let label = if threads.len() > 1 {
            format!("{n} thread{} {unit}", if n == 1 { "" } else { "s" })
        } else {
            unit.to_owned()
        };
        header.extend([label, "÷ best peer".to_owned(), "÷ glibc".to_owned()]);
    }
    table.set_header(header);
    let mut rows = 0;
    for &(label, prefix) in groups {
        for kind in Kind::ALL {
            let mut row = vec![label.to_owned(), kind.name().to_owned()];
            let mut any = false;
            for &n in threads {
                let value = median_of(results, case_name(prefix, kind), n);
                any |= value.is_some();
                let ratio = |base: Option<f64>| match (value, base) {
                    (Some(value), Some(base)) if base > 0.0 => fmt_ratio(value / base),
                    _ => String::new(),
                };
                row.push(value.map_or("–".to_owned(), show));
                row.push(ratio(best_peer(results, prefix, n).map(|(_, best)| best)));
                row.push(ratio(median_of(results, case_name(prefix, Kind::Glibc), n)));
            }
            if any {
                table.add_row(row);
                rows += 1;
            }
        }
    }
    if rows == 0 {
        return None;
    }
    align_right(&mut table, &(2..2 + 3 * threads.len()).collect::<Vec<_>>());
    Some(render(&table))
}

/// The sizes of the alloc + dealloc pairs: each size's label and its cases' prefix.
const PAIR_GROUPS: &[(&str, &str)] = &[
    ("16 B", "pair16"),
    ("64 B", "pair64"),
    ("256 B", "pair256"),
    ("1024 B", "pair1024"),
    ("4096 B", "pair4096"),
];

/// The four parts' tables, then the targets.
fn report(results: &[Measured]) -> String {
    let threads = thread_counts(results.iter().filter(|m| m.case.starts_with("pair")));
    let mut out = part_tables(results, &threads);
    let mut targets = Targets::new("targets (ratios of medians)");
    for &n in &threads {
        pair_targets(&mut targets, results, n);
    }
    program_targets(&mut targets, results);
    let peer_measured = Kind::PEERS.iter().any(|&peer| {
        results
            .iter()
            .any(|r| r.case.ends_with(&format!("/{}", peer.name())))
    });
    if !peer_measured && !targets.is_empty() {
        targets.note(
            "targets against mimalloc, jemalloc and tcmalloc: not judged, none of them was \
             measured",
        );
    }
    out.push_str(&targets.joined());
    out.trim_end().to_owned()
}

/// The tables of the parts that ran: pairs, remote frees, many threads, program-shaped tasks.
fn part_tables(results: &[Measured], threads: &[usize]) -> String {
    let mut out = String::new();
    if let Some(table) = part_table(results, PAIR_GROUPS, threads, "ns", fmt_num) {
        out.push_str(&format!(
            "\nalloc + dealloc pairs, per thread (medians; ÷ best peer: over the fastest of \
             mimalloc, jemalloc and tcmalloc at that size and thread count):\n{table}\n"
        ));
    }
    if let Some(table) = part_table(results, &[("64 B", "remote")], &[1], "ns/object", fmt_num) {
        out.push_str(&format!(
            "\nallocated on one CPU, freed on another (producer's CPU time per object, medians):\n\
             {table}\n"
        ));
    }
    if let Some(table) = part_table(results, &[("", "threads1k")], &[1], "peak MiB", mib) {
        out.push_str(&format!(
            "\npeak resident memory added by 1,000 threads holding small objects, each allocator \
             the child's global allocator (medians):\n{table}\n"
        ));
    }
    let rss: Vec<String> = PROGRAM_TASKS
        .iter()
        .map(|(task, _)| format!("{}-rss", task.name()))
        .collect();
    let times: Vec<(&str, &str)> = PROGRAM_TASKS
        .iter()
        .map(|(task, _)| (task.name(), task.name()))
        .collect();
    let peaks: Vec<(&str, &str)> = PROGRAM_TASKS
        .iter()
        .zip(&rss)
        .map(|((task, _), rss)| (task.name(), rss.as_str()))
        .collect();
    let times = part_table(results, &times, &[1], "ms", fmt_num);
    let peaks = part_table(results, &peaks, &[1], "peak MiB", mib);
    if times.is_some() || peaks.is_some() {
        out.push_str(
            "\nprogram-shaped tasks, each allocator the child's global allocator (medians):\n",
        );
        for table in [times, peaks].into_iter().flatten() {
            out.push_str(&table);
            out.push('\n');
        }
    }
    out
}

/// The pairs' targets at `n` threads, each at its worst size: against the best peer, and
/// glibc against thiscpu.
fn pair_targets(targets: &mut Targets, results: &[Measured], n: usize) {
    let worst = |ratio_of: &dyn Fn(&str) -> Option<f64>, better_high: bool| {
        PAIR_GROUPS
            .iter()
            .filter_map(|&(label, prefix)| Some((label, ratio_of(prefix)?)))
            .max_by(|a, b| {
                if better_high {
                    b.1.total_cmp(&a.1)
                } else {
                    a.1.total_cmp(&b.1)
                }
            })
    };
    let ours = |prefix: &str| median_of(results, case_name(prefix, Kind::Thiscpu), n);
    let threads = threads_phrase(n);
    if let Some((label, ratio)) = worst(
        &|prefix| Some(ours(prefix)? / best_peer(results, prefix, n)?.1),
        false,
    ) {
        targets.check(
            format!(
                "pairs, {threads}: thiscpu ÷ best peer, worst size ({label}): {}",
                fmt_ratio(ratio)
            ),
            "≤ 0.8×",
            ratio <= 0.8,
        );
    }
    if let Some((label, ratio)) = worst(
        &|prefix| Some(median_of(results, case_name(prefix, Kind::Glibc), n)? / ours(prefix)?),
        true,
    ) {
        targets.check(
            format!(
                "pairs, {threads}: glibc ÷ thiscpu, worst size ({label}): {}",
                fmt_ratio(ratio)
            ),
            "≥ 2×",
            ratio >= 2.0,
        );
    }
}

/// The targets of the program-shaped parts, at one thread: peak memory with 1,000 threads
/// against mimalloc and jemalloc, and each task's time against the best peer.
fn program_targets(targets: &mut Targets, results: &[Measured]) {
    let at_one = |prefix: &str, kind: Kind| median_of(results, case_name(prefix, kind), 1);
    for peer in [Kind::Mimalloc, Kind::Jemalloc] {
        if let (Some(ours), Some(theirs)) =
            (at_one("threads1k", Kind::Thiscpu), at_one("threads1k", peer))
            && theirs > 0.0
        {
            let ratio = ours / theirs;
            targets.check(
                format!(
                    "1,000 threads, peak memory: thiscpu ÷ {}: {}",
                    peer.name(),
                    fmt_ratio(ratio)
                ),
                "≤ 0.5×",
                ratio <= 0.5,
            );
        }
    }
    let mut time_ratios = Vec::new();
    let mut worst_against_glibc: Option<(&str, f64)> = None;
    let mut worst_peak: Option<(&str, Kind, f64)> = None;
    for (task, _) in PROGRAM_TASKS {
        let name = task.name();
        let ours = at_one(name, Kind::Thiscpu);
        if let (Some(ours), Some((peer, best))) = (ours, best_peer(results, name, 1))
            && best > 0.0
        {
            let ratio = ours / best;
            targets.check(
                format!(
                    "{name} time: thiscpu ÷ best peer ({}): {}",
                    peer.name(),
                    fmt_ratio(ratio)
                ),
                "≤ 1×",
                ratio <= 1.0,
            );
            time_ratios.push(ratio);
        }
        if let (Some(ours), Some(glibc)) = (ours, at_one(name, Kind::Glibc))
            && glibc > 0.0
            && worst_against_glibc.is_none_or(|(_, worst)| ours / glibc > worst)
        {
            worst_against_glibc = Some((name, ours / glibc));
        }
        let rss = format!("{name}-rss");
        if let (Some(ours), Some((peer, smallest))) =
            (at_one(&rss, Kind::Thiscpu), best_peer(results, &rss, 1))
            && smallest > 0.0
            && worst_peak.is_none_or(|(_, _, worst)| ours / smallest > worst)
        {
            worst_peak = Some((name, peer, ours / smallest));
        }
    }
    if !time_ratios.is_empty() {
        let mean = time_ratios.iter().map(|ratio| ratio.ln()).sum::<f64>() / time_ratios.len() as f64;
        let ratio = mean.exp();
        targets.check(
            format!(
                "program tasks' time: geometric mean of thiscpu ÷ best peer over {} tasks: {}",
                time_ratios.len(),
                fmt_ratio(ratio)
            ),
            "≤ 0.9×",
            ratio <= 0.9,
        );
    }
    if let Some((name, ratio)) = worst_against_glibc {
        targets.check(
            format!(
                "program tasks' time: thiscpu ÷ glibc, worst task ({name}): {}",
                fmt_ratio(ratio)
            ),
            "≤ 1×",
            ratio <= 1.0,
        );
    }
    if let Some((name, peer, ratio)) = worst_peak {
        targets.check(
            format!(
                "program tasks' peak memory: thiscpu ÷ smallest peer, worst task ({name}, {}): {}",
                peer.name(),
                fmt_ratio(ratio)
            ),
            "≤ 1.1×",
            ratio <= 1.1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prefix_has_a_case_for_every_allocator() {
        for prefix in PREFIXES {
            for kind in Kind::ALL {
                let name = case_name(prefix, kind);
                assert_eq!(name, format!("{prefix}/{}", kind.name()));
            }
        }
        assert_eq!(CASES.len(), PREFIXES.len() * Kind::ALL.len());
        for (task, _) in PROGRAM_TASKS {
            for prefix in [task.name().to_owned(), format!("{}-rss", task.name())] {
                assert!(PREFIXES.contains(&prefix.as_str()), "{prefix}");
            }
        }
    }

    fn measured(case: &'static str, threads: usize, unit: Unit, value: f64) -> Measured {
        Measured {
            bench: "alloc",
            case,
            how: String::new(),
            threads,
            cpus: vec![0],
            unit,
            rounds: vec![value; 3],
            ops: 3,
            on_cpu: vec![1.0; 3],
        }
    }

    #[test]
    fn ratios_are_to_the_best_peer_and_to_glibc_and_targets_take_the_worst_size() {
        let mut results = Vec::new();
        // ns per pair by allocator: glibc, mimalloc, jemalloc, tcmalloc, thiscpu.
        for (prefix, thiscpu) in [("pair16", 1.5), ("pair4096", 3.0)] {
            for threads in [1, 2] {
                for (kind, value) in Kind::ALL.into_iter().zip([8.0, 4.0, 5.0, 6.0, thiscpu]) {
                    let case = case_name(prefix, kind);
                    results.push(measured(case, threads, Unit::NsPerOp, value));
                }
            }
        }
        for (kind, mib) in Kind::ALL.into_iter().zip([10.0, 40.0, 20.0, 15.0, 9.0]) {
            let bytes = mib * 1024.0 * 1024.0;
            results.push(measured(case_name("threads1k", kind), 1, Unit::Bytes, bytes));
        }
        let text = report(&results);
        // As the command prints it: prose wrapped, tables as they are.
        for line in crate::report::table::fit(&text).lines() {
            assert!(line.chars().count() <= 120, "{line}");
        }
        let row = |start: &str| {
            text.lines()
                .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
                .find(|line| line.starts_with(start))
                .unwrap_or_else(|| panic!("no row {start:?}:\n{text}"))
        };
        // 1.5 over mimalloc's 4 and over glibc's 8, at both thread counts.
        assert_eq!(
            row("16 B thiscpu"),
            "16 B thiscpu 1.50 0.375× 0.188× 1.50 0.375× 0.188×"
        );
        assert_eq!(row("thiscpu 9.00"), "thiscpu 9.00 0.600× 0.900×", "{text}");
        assert!(
            text.contains("thiscpu ÷ best peer, worst size (4096 B): 0.750× (target ≤ 0.8×): met"),
            "{text}"
        );
        assert!(
            text.contains("glibc ÷ thiscpu, worst size (4096 B): 2.67× (target ≥ 2×): met"),
            "{text}"
        );
        assert!(
            text.contains("thiscpu ÷ jemalloc: 0.450× (target ≤ 0.5×): met"),
            "{text}"
        );
        assert!(
            text.contains("thiscpu ÷ mimalloc: 0.225× (target ≤ 0.5×): met"),
            "{text}"
        );
        assert!(!text.contains("json time"), "no json results, no json target:\n{text}");
        assert!(!text.contains("not judged"), "{text}");
    }

    /// Each program-shaped task's time against the best peer, their geometric mean, the worst
    /// against glibc, and the worst peak against the smallest peer's.
    #[test]
    fn program_targets_judge_each_task_their_mean_glibc_and_peaks() {
        let mut results = Vec::new();
        // ms by allocator: glibc, mimalloc, jemalloc, tcmalloc, thiscpu.
        for (task, times) in [
            ("larson", [20.0, 10.0, 8.0, 9.0, 6.0]),
            ("bignum", [6.0, 5.0, 4.0, 4.5, 7.0]),
        ] {
            for (kind, ms) in Kind::ALL.into_iter().zip(times) {
                results.push(measured(case_name(task, kind), 1, Unit::Ms, ms));
            }
        }
        for (kind, mib) in Kind::ALL.into_iter().zip([5.0, 8.0, 4.0, 6.0, 5.0]) {
            let bytes = mib * 1024.0 * 1024.0;
            results.push(measured(case_name("larson-rss", kind), 1, Unit::Bytes, bytes));
        }
        let text = report(&results);
        for expected in [
            "larson time: thiscpu ÷ best peer (jemalloc): 0.750× (target ≤ 1×): met",
            "bignum time: thiscpu ÷ best peer (jemalloc): 1.75× (target ≤ 1×): NOT met",
            // √(0.75 × 1.75)
            "geometric mean of thiscpu ÷ best peer over 2 tasks: 1.15× (target ≤ 0.9×): NOT met",
            "thiscpu ÷ glibc, worst task (bignum): 1.17× (target ≤ 1×): NOT met",
            "thiscpu ÷ smallest peer, worst task (larson, jemalloc): 1.25× (target ≤ 1.1×): NOT \
             met",
        ] {
            assert!(text.contains(expected), "{expected}\n{text}");
        }
        assert!(text.contains("program-shaped tasks"), "{text}");
    }

    /// Where the peers are not built (every target but x86_64 Linux) only glibc and thiscpu
    /// run: the targets against the peers say that they were not judged.
    #[test]
    fn without_peers_their_targets_are_not_judged() {
        let mut results = Vec::new();
        for threads in [1, 2] {
            for (kind, value) in [(Kind::Glibc, 8.0), (Kind::Thiscpu, 3.0)] {
                results.push(measured(case_name("pair16", kind), threads, Unit::NsPerOp, value));
            }
        }
        let text = report(&results);
        assert!(
            text.contains("glibc ÷ thiscpu, worst size (16 B): 2.67× (target ≥ 2×): met"),
            "{text}"
        );
        assert!(
            text.contains("targets against mimalloc, jemalloc and tcmalloc: not judged"),
            "{text}"
        );
        assert!(!text.contains("best peer,"), "{text}");
    }
}
