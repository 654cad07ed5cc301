//! `mask`: setting and clearing CPU bits in a mask that every worker updates, the shape of the
//! kernel's `mm_cpumask` in `switch_mm` (seed 002). Each worker owns one bit, and all bits
//! share one word, so every write moves the cache line between the workers' cores.
//!
//! Three ways to update a bit, each under three patterns:
//! - `always-rmw`: a bare `fetch_or`/`fetch_and`, as `cpumask_set_cpu` does;
//! - `read-skip`: a relaxed load, and the read-modify-write only when the bit differs (the
//!   switch_mm patch's idea in its simplest form);
//! - `thiscpu`: `CpuMask::set`/`clear`, read-first with a predictor that switches to the bare
//!   read-modify-write when recent calls kept changing the bit.
//!
//! Patterns: `idle` (every call finds the bit already set), `mixed` (one call in 16 changes
//! it), `alternate` (every call changes it). After each chunk every worker checks that its bit
//! holds the value its last call asked for: a lost update fails the run.

use super::model::{Case, Family, Measured, Unit, Workload, median_of as median};
use crate::report::table::{align_right, fmt_num, fmt_ratio, new_table, render, verdict};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use thiscpu::{CachePadded, CpuMask};

const STRATEGIES: &[&str] = &["always-rmw", "read-skip", "thiscpu"];
const PATTERNS: &[&str] = &["idle", "mixed", "alternate"];

/// Every case: strategy/pattern.
const CASES: &[&str] = &[
    "always-rmw/idle",
    "read-skip/idle",
    "thiscpu/idle",
    "always-rmw/mixed",
    "read-skip/mixed",
    "thiscpu/mixed",
    "always-rmw/alternate",
    "read-skip/alternate",
    "thiscpu/alternate",
];

/// The family.
pub static FAMILY: Family = Family {
    name: "mask",
    about: "set/clear of one CPU's bit in a mask all workers share, by strategy and pattern \
            (ns per call, per thread)",
    case_names: CASES,
    default_threads: &[1, 2],
    baseline: Some("always-rmw/*"),
    cases,
    report,
};

/// A way to update one bit of a shared mask.
trait Strategy: Send + Sync + 'static {
    fn set(&self, bit: u32);
    fn clear(&self, bit: u32);
    fn contains(&self, bit: u32) -> bool;
    fn reset(&self);
}

/// One word, updated with an atomic read-modify-write on every call.
struct AlwaysRmw(CachePadded<AtomicU64>);

impl Strategy for AlwaysRmw {
    #[inline(always)]
    fn set(&self, bit: u32) {
        self.0.fetch_or(1 << bit, Relaxed);
    }
    #[inline(always)]
    fn clear(&self, bit: u32) {
        self.0.fetch_and(!(1 << bit), Relaxed);
    }
    fn contains(&self, bit: u32) -> bool {
        self.0.load(Relaxed) & (1 << bit) != 0
    }
    fn reset(&self) {
        self.0.store(0, Relaxed);
    }
}

/// One word, read first; the read-modify-write only when the bit differs.
struct ReadSkip(CachePadded<AtomicU64>);

impl Strategy for ReadSkip {
    #[inline(always)]
    fn set(&self, bit: u32) {
        if self.0.load(Relaxed) & (1 << bit) == 0 {
            self.0.fetch_or(1 << bit, Relaxed);
        }
    }
    #[inline(always)]
    fn clear(&self, bit: u32) {
        if self.0.load(Relaxed) & (1 << bit) != 0 {
            self.0.fetch_and(!(1 << bit), Relaxed);
        }
    }
    fn contains(&self, bit: u32) -> bool {
        self.0.load(Relaxed) & (1 << bit) != 0
    }
    fn reset(&self) {
        self.0.store(0, Relaxed);
    }
}

/// `thiscpu::CpuMask`.
struct Thiscpu(CpuMask);

impl Strategy for Thiscpu {
    #[inline(always)]
    fn set(&self, bit: u32) {
        self.0.set(bit);
    }
    #[inline(always)]
    fn clear(&self, bit: u32) {
        self.0.clear(bit);
    }
    fn contains(&self, bit: u32) -> bool {
        self.0.contains(bit)
    }
    fn reset(&self) {
        self.0.clear_all();
    }
}

/// How often a call changes the bit.
#[derive(Clone, Copy)]
enum Pattern {
    Idle,
    Mixed,
    Alternate,
}

impl Pattern {
    /// Whether call `i` asks for the bit set.
    #[inline(always)]
    fn want(self, i: u64) -> bool {
        match self {
            Pattern::Idle => true,
            Pattern::Mixed => (i / 16).is_multiple_of(2),
            Pattern::Alternate => i.is_multiple_of(2),
        }
    }
}

/// A strategy under a pattern, each worker on its own bit of one word.
struct MaskWorkload<S> {
    strategy: S,
    pattern: Pattern,
    wrong: AtomicU64,
}

impl<S: Strategy> MaskWorkload<S> {
    /// The hot loop, monomorphized per strategy and pattern.
    #[inline(never)]
    fn calls(&self, bit: u32, ops: u64) {
        let strategy = std::hint::black_box(&self.strategy);
        for i in 0..ops {
            if self.pattern.want(i) {
                strategy.set(bit);
            } else {
                strategy.clear(bit);
            }
        }
    }
}

impl<S: Strategy> Workload for MaskWorkload<S> {
    fn prepare(&self, _threads: usize) {
        self.strategy.reset();
        self.wrong.store(0, Relaxed);
    }

    fn run(&self, worker: usize, ops: u64) {
        // Workers beyond 64 share bits with others; the check below is only for own bits.
        let bit = (worker % 64) as u32;
        self.calls(bit, ops);
        if worker < 64 && ops > 0 && self.strategy.contains(bit) != self.pattern.want(ops - 1) {
            self.wrong.fetch_add(1, Relaxed);
        }
    }

    fn verify(&self, _ops: u64) -> Result<(), String> {
        match self.wrong.load(Relaxed) {
            0 => Ok(()),
            n => Err(format!(
                "{n} chunks ended with a bit other than the one last asked for"
            )),
        }
    }
}

fn case<S: Strategy>(name: &'static str, how: String, strategy: S, pattern: Pattern) -> Case {
    Case::new(
        name,
        how,
        Unit::NsPerOp,
        MaskWorkload {
            strategy,
            pattern,
            wrong: AtomicU64::new(0),
        },
    )
}

fn cases() -> Vec<Case> {
    let patterns = [
        (Pattern::Idle, "bit already set"),
        (Pattern::Mixed, "1 change in 16 calls"),
        (Pattern::Alternate, "every call changes it"),
    ];
    let mut cases = Vec::new();
    let mut names = CASES.iter();
    for (pattern, what) in patterns {
        let mut next = || *names.next().expect("a name per case");
        cases.push(case(
            next(),
            format!("fetch_or/fetch_and; {what}"),
            AlwaysRmw(CachePadded(AtomicU64::new(0))),
            pattern,
        ));
        cases.push(case(
            next(),
            format!("load, then fetch_or/and if needed; {what}"),
            ReadSkip(CachePadded(AtomicU64::new(0))),
            pattern,
        ));
        cases.push(case(
            next(),
            format!("CpuMask::set/clear; {what}"),
            Thiscpu(CpuMask::with_capacity(64)),
            pattern,
        ));
    }
    cases
}


/// Cost of each strategy relative to `always-rmw` under the same pattern and thread count,
/// then the targets.
fn report(results: &[Measured]) -> String {
    let mut threads: Vec<usize> = results.iter().map(|m| m.threads).collect();
    threads.sort_unstable();
    threads.dedup();
    let mut table = new_table();
    table.set_header(vec![
        "pattern",
        "threads",
        "always-rmw ns",
        "read-skip ns",
        "thiscpu ns",
        "always-rmw ÷ thiscpu",
        "thiscpu ÷ read-skip",
    ]);
    let mut rows = 0;
    for pattern in PATTERNS {
        for &n in &threads {
            let get = |strategy: &str| median(results, &format!("{strategy}/{pattern}"), n);
            let [always, skip, ours] = [0, 1, 2].map(|i| get(STRATEGIES[i]));
            let show = |v: Option<f64>| v.map_or("–".to_owned(), fmt_num);
            let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => fmt_ratio(a / b),
                _ => "–".to_owned(),
            };
            table.add_row(vec![
                (*pattern).to_owned(),
                n.to_string(),
                show(always),
                show(skip),
                show(ours),
                ratio(always, ours),
                ratio(ours, skip),
            ]);
            rows += 1;
        }
    }
    if rows == 0 {
        return String::new();
    }
    align_right(&mut table, &[1, 2, 3, 4, 5, 6]);
    let mut out = String::from("\nby pattern (medians over rounds):\n");
    out.push_str(&render(&table));
    out.push('\n');

    let mut lines = Vec::new();
    if let Some(&most) = threads.last().filter(|&&n| n >= 2)
        && let (Some(always), Some(ours)) = (
            median(results, "always-rmw/idle", most),
            median(results, "thiscpu/idle", most),
        )
    {
        let ratio = always / ours;
        lines.push(format!(
            "  idle, {most} threads: thiscpu {} faster than always-rmw (target ≥ 10×): {}",
            fmt_ratio(ratio),
            verdict(ratio >= 10.0)
        ));
    }
    for &n in &threads {
        if let (Some(always), Some(ours)) = (
            median(results, "always-rmw/alternate", n),
            median(results, "thiscpu/alternate", n),
        ) {
            let ratio = ours / always;
            lines.push(format!(
                "  alternate, {n} thread{}: thiscpu costs {} of always-rmw (target ≤ 1.1×): {}",
                if n == 1 { "" } else { "s" },
                fmt_ratio(ratio),
                verdict(ratio <= 1.1)
            ));
        }
    }
    if !lines.is_empty() {
        out.push_str("\ntargets (ratios of medians):\n");
        out.push_str(&lines.join("\n"));
    }
    out.trim_end().to_owned()
}
