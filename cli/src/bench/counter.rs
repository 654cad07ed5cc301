//! `counter`: one counter incremented by every worker thread, in each shape a Rust program
//! might give it: a shared atomic, cache-padded per-CPU atomics (the BPF `glob-arr-inc` shape),
//! per-thread slots (a LongAdder-style crate, the `thread_local` crate), a plain thread-local
//! (the floor: no sharing at all), and thiscpu's `Counter`, whose increment is one restartable
//! sequence with a plain `add`, spread by CPU or by `mm_cid`.
//!
//! Every increment is a side effect the optimizer must keep (an atomic read-modify-write, a
//! volatile store or an `asm!` block), and every case checks after each round that the counter
//! counted exactly the increments made: a lost or doubled update fails the run. The return value
//! of `fetch_add` is not routed through `black_box`: that would add a store per operation that
//! `Counter::inc` (which returns nothing) does not pay.

use super::model::{Case, Family, Measured, Stats, Unit, Workload};
use super::reference;
use super::rseq_off;
use crate::report::table::{
    Targets, align_right, fmt_num, fmt_ratio, new_table, threads_phrase, titled,
};
use contatori::counters::Observable;
use std::cell::Cell;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use thiscpu::{CachePadded, Counter, PerCpu, Spread};

/// Every case, in the order they run.
const CASES: &[&str] = &[
    "atomic-global",
    "percpu-atomic",
    "thread-slot-atomic",
    "thread_local",
    "tls-plain",
    "thiscpu-counter",
    "thiscpu-adder",
    "thiscpu-counter-mm_cid",
    "thiscpu-adder-mm_cid",
    "c-rseq-add",
    "c-rseq-add-reloaded",
    "thiscpu-counter-rseq-off",
    "thiscpu-adder-rseq-off",
];

/// The family.
pub static FAMILY: Family = Family {
    name: "counter",
    about: "increments of one shared counter by 1 thread and by one thread per CPU \
            (ns/op of each thread's CPU time; Mops/s below)",
    case_names: CASES,
    default_threads: &[1, 2],
    baseline: Some("atomic-global"),
    cases,
    report,
};

/// A way to count: the hot loop of increments, and how a reader totals the counter.
pub(super) trait Shape: Send + Sync + 'static {
    /// Makes `ops` increments on the calling thread.
    ///
    /// Each implementation is compiled on its own (`#[inline(never)]`), so that the loop's
    /// code depends on the shape alone. Inlined into the runner's `Exact::run`, whether LLVM
    /// kept the rseq area's address and the counter's row count in registers across
    /// `Counter::inc` calls (and unswitched the loop on the counter's spread) changed with
    /// unrelated edits elsewhere in this crate: 0.61 against 0.93 ns per increment on one
    /// machine, from the same library code (compare `objdump -d` of `Exact<S>::run` in two
    /// such builds). An `Adder` keeps them in registers by construction.
    fn increments(&self, ops: u64);

    /// The counter's total as a reader sees it (exact once the writers stopped).
    fn total(&self) -> u64;
}

/// A shape as a workload: the total is read before each round, and after it the difference
/// must equal the increments made.
pub(super) struct Exact<S> {
    shape: S,
    start: AtomicU64,
}

impl<S: Shape> Exact<S> {
    pub(super) fn new(shape: S) -> Self {
        Exact {
            shape,
            start: AtomicU64::new(0),
        }
    }
}

impl<S: Shape> Workload for Exact<S> {
    fn prepare(&self, _threads: usize) {
        self.start.store(self.shape.total(), Relaxed);
    }

    fn run(&self, _worker: usize, ops: u64) {
        self.shape.increments(ops);
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        let counted = black_box(self.shape.total()).wrapping_sub(self.start.load(Relaxed));
        if counted == ops {
            Ok(())
        } else {
            Err(format!(
                "the counter is not exact: {ops} increments made, {counted} counted \
                 ({} lost)",
                i128::from(ops) - i128::from(counted)
            ))
        }
    }
}

/// One `AtomicU64` that every thread `fetch_add`s: the cache line moves between CPUs.
struct AtomicGlobal(CachePadded<AtomicU64>);

impl Shape for AtomicGlobal {
    #[inline(never)]
    fn increments(&self, ops: u64) {
        let counter = black_box(&self.0);
        for _ in 0..ops {
            counter.fetch_add(1, Relaxed);
        }
    }

    fn total(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// A padded `AtomicU64` per CPU, chosen by `current_cpu()` and `fetch_add`ed: atomic because
/// the thread may migrate between reading its CPU and adding.
struct PercpuAtomic(PerCpu<AtomicU64>);

impl Shape for PercpuAtomic {
    #[inline(never)]
    fn increments(&self, ops: u64) {
        let slots = black_box(&self.0);
        for _ in 0..ops {
            slots.current().fetch_add(1, Relaxed);
        }
    }

    fn total(&self) -> u64 {
        self.0.iter().map(|slot| slot.load(Relaxed)).sum()
    }
}

/// contatori's `Unsigned`: 128 padded atomics, each thread given one slot round-robin when it
/// first counts (a LongAdder without the re-hashing on contention).
struct ThreadSlot(Box<contatori::counters::unsigned::Unsigned>);

impl Shape for ThreadSlot {
    #[inline(never)]
    fn increments(&self, ops: u64) {
        let counter = black_box(&*self.0);
        for _ in 0..ops {
            counter.add(1);
        }
    }

    fn total(&self) -> u64 {
        self.0.value().as_u64()
    }
}

/// The `thread_local` crate: an `AtomicU64` per thread, found by thread id on every increment,
/// written only by its thread (a load and a store), summed by the reader.
struct ThreadLocalCrate(thread_local::ThreadLocal<AtomicU64>);

impl Shape for ThreadLocalCrate {
    #[inline(never)]
    fn increments(&self, ops: u64) {
        let slots = black_box(&self.0);
        for _ in 0..ops {
            let mine = slots.get_or_default();
            mine.store(mine.load(Relaxed).wrapping_add(1), Relaxed);
        }
    }

    fn total(&self) -> u64 {
        self.0
            .iter()
            .map(|slot| slot.load(Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

thread_local! {
    /// The floor's counter: a plain `u64` in static TLS.
    static PLAIN: Cell<u64> = const { Cell::new(0) };
}

/// A volatile increment of a plain thread-local `u64`: no sharing, no atomic, no CPU lookup.
/// No other thread can read it, so each call adds what its thread counted to `flushed`, which
/// the exactness check reads.
struct TlsPlain {
    flushed: AtomicU64,
}

impl Shape for TlsPlain {
    #[inline(never)]
    fn increments(&self, ops: u64) {
        let before = PLAIN.with(Cell::get);
        for _ in 0..ops {
            PLAIN.with(|cell| {
                let value = cell.as_ptr();
                // SAFETY: `value` points to this thread's own cell, alive while `with` runs;
                // nothing else reads or writes it meanwhile (no reference to it escapes).
                unsafe { value.write_volatile(value.read_volatile().wrapping_add(1)) };
            });
        }
        let after = PLAIN.with(Cell::get);
        self.flushed
            .fetch_add(after.wrapping_sub(before), Relaxed);
    }

    fn total(&self) -> u64 {
        self.flushed.load(Relaxed)
    }
}

/// A C reference section (`reference.c`), what thiscpu's is measured against: the slots it
/// adds to and the loop that adds (`Slots::add_loop` or `Slots::add_loop_reloaded`).
struct CRseqAdd {
    slots: reference::Slots,
    add_loop: fn(&reference::Slots, u64) -> bool,
}

impl Shape for CRseqAdd {
    #[inline(never)]
    fn increments(&self, ops: u64) {
        // A loop that could not run adds nothing, and the round's count check then fails.
        let _ = (self.add_loop)(&self.slots, ops);
    }

    fn total(&self) -> u64 {
        self.slots.sum()
    }
}

/// `thiscpu::Counter::inc`: one restartable sequence, a plain `add` to the word of this CPU
/// (or, by `mm_cid`, of the thread's concurrency id).
struct ThiscpuCounter<S: Spread>(Counter<S>);

impl<S: Spread> Shape for ThiscpuCounter<S> {
    #[inline(never)]
    fn increments(&self, ops: u64) {
        let counter = black_box(&self.0);
        for _ in 0..ops {
            counter.inc();
        }
    }

    fn total(&self) -> u64 {
        self.0.sum()
    }
}

/// `Counter::adder()` once per round, then `adder.inc()`: the counter's address, rows and area
/// offset stay in registers across the loop.
struct ThiscpuAdder<S: Spread>(Counter<S>);

impl<S: Spread> Shape for ThiscpuAdder<S> {
    #[inline(never)]
    fn increments(&self, ops: u64) {
        let adder = black_box(&self.0).adder();
        for _ in 0..ops {
            adder.inc();
        }
    }

    fn total(&self) -> u64 {
        self.0.sum()
    }
}

fn cases() -> Vec<Case> {
    let mm_cid = thiscpu::source().mm_cid;
    let mut cases = rival_cases();
    cases.extend(thiscpu_cases(mm_cid));
    cases.extend(c_reference_cases());
    let mirrors = rseq_off::mirrors("counter", CASES, &cases);
    cases.extend(mirrors);
    cases
}

/// The other ways to count from many threads: one atomic, atomics by CPU or by thread, and
/// thread-locals.
fn rival_cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    vec![
        Case::new(
            "atomic-global",
            "one AtomicU64, fetch_add",
            ns,
            Exact::new(AtomicGlobal(CachePadded(AtomicU64::new(0)))),
        ),
        Case::new(
            "percpu-atomic",
            "PerCpu<AtomicU64> by current_cpu(), fetch_add",
            ns,
            Exact::new(PercpuAtomic(PerCpu::default())),
        ),
        Case::new(
            "thread-slot-atomic",
            "128 padded atomics, each thread given its own slot: fetch_add on it, a sum to read \
             (the contatori crate's Unsigned)",
            ns,
            Exact::new(ThreadSlot(Box::new(
                contatori::counters::unsigned::Unsigned::new(),
            ))),
        ),
        Case::new(
            "thread_local",
            "thread_local::ThreadLocal<AtomicU64>, load+store",
            ns,
            Exact::new(ThreadLocalCrate(thread_local::ThreadLocal::new())),
        ),
        Case::new(
            "tls-plain",
            "thread_local! Cell<u64>, volatile +1 (floor)",
            ns,
            Exact::new(TlsPlain {
                flushed: AtomicU64::new(0),
            }),
        ),
    ]
}

/// thiscpu's `Counter`, by CPU and by mm_cid, each through `inc()` and through an adder.
fn thiscpu_cases(mm_cid: bool) -> Vec<Case> {
    let ns = Unit::NsPerOp;
    let mm_cid_how = if mm_cid {
        "thiscpu Counter::by_mm_cid().inc()"
    } else {
        "Counter::by_mm_cid().inc(); no mm_cid here: spreads by CPU"
    };
    vec![
        Case::new(
            "thiscpu-counter",
            "thiscpu Counter::inc(), by CPU",
            ns,
            Exact::new(ThiscpuCounter(Counter::new())),
        ),
        Case::new(
            "thiscpu-adder",
            "thiscpu Counter::adder() per round, then adder.inc()",
            ns,
            Exact::new(ThiscpuAdder(Counter::new())),
        ),
        Case::new(
            "thiscpu-counter-mm_cid",
            mm_cid_how,
            ns,
            Exact::new(ThiscpuCounter(Counter::by_mm_cid())),
        ),
        Case::new(
            "thiscpu-adder-mm_cid",
            "Counter::by_mm_cid().adder() per round, then adder.inc()",
            ns,
            Exact::new(ThiscpuAdder(Counter::by_mm_cid())),
        ),
    ]
}

/// The same increment as a C rseq section, the floor thiscpu's counter is measured against:
/// with what the section needs held in registers (the floor of `Counter::adder().inc()`), and
/// read from memory at every increment, as a C counter type's `inc` must after each section's
/// memory clobber (the floor of `Counter::inc()`).
fn c_reference_cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    let slots = || reference::Slots::new(thiscpu::topology::possible_cpus());
    match reference::unavailable() {
        None => vec![
            Case::new(
                "c-rseq-add",
                "C: the same restartable load, add and store on the CPU's slot, its area \
                 offset, slots and bound in registers (floor)",
                ns,
                Exact::new(CRseqAdd {
                    slots: slots(),
                    add_loop: reference::Slots::add_loop,
                }),
            ),
            Case::new(
                "c-rseq-add-reloaded",
                "C: the same section through a struct pointer, its area offset, slots and \
                 bound loaded again before every increment, as the section's memory clobber \
                 makes a C counter_inc(&counter) do (floor of Counter::inc)",
                ns,
                Exact::new(CRseqAdd {
                    slots: slots(),
                    add_loop: reference::Slots::add_loop_reloaded,
                }),
            ),
        ],
        Some(why) => vec![
            Case::skipped("c-rseq-add", ns, why.clone()),
            Case::skipped("c-rseq-add-reloaded", ns, why),
        ],
    }
}

/// Per-round values of one (case, threads) result, mapped through `f`.
fn mapped(result: &Measured, f: impl Fn(f64) -> f64) -> Stats {
    let values: Vec<f64> = result.rounds.iter().map(|&v| f(v)).collect();
    Stats::of(&values)
}

/// Median ns per increment of one thread of `case` run with `threads` threads.
fn ns_per_op(results: &[Measured], case: &str, threads: usize) -> Option<f64> {
    super::model::median_of(results, case, threads)
}

/// Million operations per second from ns per operation.
fn mops(ns: f64) -> f64 {
    1e3 / ns.max(1e-12)
}


/// Throughput per thread and in total beside the ns/op table, then the targets.
fn report(results: &[Measured]) -> String {
    let mut out = throughput_table(results);
    let mut targets = Targets::new("targets (ratios of medians)");
    let fewest = results.iter().map(|m| m.threads).min();
    let most = results.iter().map(|m| m.threads).max();
    if let Some(one) = fewest {
        fewest_threads_targets(&mut targets, results, one);
    }
    if let Some(n) = most.filter(|&n| Some(n) != fewest) {
        most_threads_targets(&mut targets, results, n);
    }
    out.push_str(&targets.joined());
    out.push_str(&rseq_off::report(results));
    out.trim_end().to_owned()
}

/// Millions of operations per second, per thread and in total, of every result.
fn throughput_table(results: &[Measured]) -> String {
    let mut table = new_table();
    table.set_header(vec![
        "case",
        "threads",
        "Mops/s per thread",
        "min – max",
        "Mops/s total",
        "min – max",
    ]);
    for m in results {
        let threads = m.threads as f64;
        let each = mapped(m, mops);
        let total = mapped(m, |value| threads * mops(value));
        table.add_row(vec![
            m.case.to_owned(),
            m.threads.to_string(),
            fmt_num(each.median),
            format!("{} – {}", fmt_num(each.min), fmt_num(each.max)),
            fmt_num(total.median),
            format!("{} – {}", fmt_num(total.min), fmt_num(total.max)),
        ]);
    }
    align_right(&mut table, &[1, 2, 3, 4, 5]);
    titled(
        "throughput (total = threads × per thread, from each thread's CPU time)",
        &table,
    )
}

/// The targets at the fewest threads: one increment's cost, and against a per-CPU atomic.
fn fewest_threads_targets(targets: &mut Targets, results: &[Measured], one: usize) {
    let threads = threads_phrase(one);
    let inc = ns_per_op(results, "thiscpu-counter", one);
    if let Some(ns) = inc {
        targets.check(
            format!("Counter::inc, {threads}: {} ns/op", fmt_num(ns)),
            "≤ 1.0 ns",
            ns <= 1.0,
        );
    }
    let adder = ns_per_op(results, "thiscpu-adder", one);
    if let (Some(adder), Some(inc)) = (adder, inc) {
        targets.note(format!(
            "Counter::adder() then inc, {threads}: {} ns/op, {} Counter::inc's",
            fmt_num(adder),
            fmt_ratio(adder / inc)
        ));
    }
    let floor = ns_per_op(results, "c-rseq-add", one);
    let reloaded = ns_per_op(results, "c-rseq-add-reloaded", one);
    for (ours, what, c, which) in [
        (adder, "Counter::adder() then inc", floor, "its state in registers"),
        (inc, "Counter::inc", reloaded, "its state reloaded per increment"),
    ] {
        if let (Some(ours), Some(c)) = (ours, c) {
            targets.check(
                format!(
                    "{what} vs the C rseq add section with {which}, {threads}: {} ({} vs {} \
                     ns/op)",
                    fmt_ratio(ours / c),
                    fmt_num(ours),
                    fmt_num(c)
                ),
                "≤ 1.15×",
                ours <= 1.15 * c,
            );
        }
    }
    if let (Some(ours), Some(c)) = (inc, floor) {
        targets.note(format!(
            "Counter::inc vs the C section with its state in registers, {threads}: {}; the \
             C section's own cost of reloading: {}",
            fmt_ratio(ours / c),
            reloaded.map_or_else(|| "not measured".to_owned(), |r| fmt_ratio(r / c))
        ));
    }
    if let (Some(ours), Some(theirs)) = (inc, ns_per_op(results, "percpu-atomic", one)) {
        let ratio = theirs / ours;
        targets.check(
            format!("thiscpu-counter vs percpu-atomic, {threads}: {} faster", fmt_ratio(ratio)),
            "≥ 2×",
            ratio >= 2.0,
        );
    }
}

/// The targets at the most threads: against one global atomic, and every case's ratio to it.
fn most_threads_targets(targets: &mut Targets, results: &[Measured], n: usize) {
    let global = ns_per_op(results, "atomic-global", n);
    if let (Some(ours), Some(theirs)) = (ns_per_op(results, "thiscpu-counter", n), global) {
        let ratio = theirs / ours;
        targets.check(
            format!(
                "thiscpu-counter vs atomic-global per thread, {n} threads: {}",
                fmt_ratio(ratio)
            ),
            "≥ 8×",
            ratio >= 8.0,
        );
    }
    let others: Vec<String> = CASES
        .iter()
        .filter_map(|&case| {
            let ours = ns_per_op(results, case, n)?;
            Some(format!("{case} {}", fmt_ratio(global? / ours)))
        })
        .collect();
    if !others.is_empty() {
        targets.note(format!(
            "per-thread throughput ÷ atomic-global's, {n} threads: {}",
            others.join(", ")
        ));
    }
}
