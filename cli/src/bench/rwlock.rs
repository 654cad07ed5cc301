//! `rwlock`: read-mostly data. A read lock + read + unlock of `thiscpu::RwLock`, and a pin +
//! read + unpin of `thiscpu::EpochCell`, against `std::sync::RwLock`, `parking_lot::RwLock`,
//! `crossbeam_utils::sync::ShardedLock` and an `arc_swap::ArcSwap` load.
//!
//! - `read/KIND`: reads only (ns per read, per thread);
//! - `w1k/KIND`, `w10k/KIND`, `w100k/KIND`: each worker also writes once every 1,000, 10,000
//!   or 100,000 of its reads (ns per operation, writes included);
//! - `write/KIND`: a write lock + write + unlock (a `store` of a new `Arc` for the cells), no
//!   readers;
//! - `write-under-readers/KIND`: the same while a reader thread on each other allowed CPU
//!   (pinned there) reads in a loop;
//! - `resident/thiscpu`, `address-space/thiscpu`: what a `thiscpu::RwLock` costs in memory, from
//!   `MEMORY_LOCKS` locks made (their vector filled before the first reading, so that only the
//!   locks' reader counts are counted), each read once on each CPU the round uses: the growth
//!   of `Rss` per lock per CPU that read, and of `VmSize` per lock per possible CPU. The locks
//!   are kept: freed counts would serve the next measurement.
//!
//! The value is four words that every write sets to one number; after each round every
//! structure must hold four equal words, or the run fails.

use super::runner::cpus_for;
use super::model::{
    Case, Family, Measured, Measuring, ProcessMemory, Unit, Workload, median_of as median,
    on_each_cpu,
};
use super::rseq_off;
use crate::report::table::{
    Targets, align_right, competitors_table, fmt_num, fmt_ratio, new_table, render,
    thread_counts, threads_phrase, titled,
};
use arc_swap::ArcSwap;
use crossbeam_utils::sync::ShardedLock;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use thiscpu::{CachePadded, EpochCell};

const CASES: &[&str] = &[
    "read/std",
    "read/parking_lot",
    "read/sharded_lock",
    "read/arc_swap",
    "read/thiscpu",
    "read/epoch",
    "w1k/std",
    "w1k/parking_lot",
    "w1k/sharded_lock",
    "w1k/arc_swap",
    "w1k/thiscpu",
    "w1k/epoch",
    "w10k/std",
    "w10k/parking_lot",
    "w10k/sharded_lock",
    "w10k/arc_swap",
    "w10k/thiscpu",
    "w10k/epoch",
    "w100k/std",
    "w100k/parking_lot",
    "w100k/sharded_lock",
    "w100k/arc_swap",
    "w100k/thiscpu",
    "w100k/epoch",
    "write/std",
    "write/parking_lot",
    "write/sharded_lock",
    "write/arc_swap",
    "write/thiscpu",
    "write/epoch",
    "write-under-readers/std",
    "write-under-readers/parking_lot",
    "write-under-readers/sharded_lock",
    "write-under-readers/arc_swap",
    "write-under-readers/thiscpu",
    "write-under-readers/epoch",
    "resident/thiscpu",
    "address-space/thiscpu",
    "read/thiscpu-lazy",
    "read/thiscpu-rseq-off",
    "read/epoch-rseq-off",
    "write/thiscpu-rseq-off",
    "write/epoch-rseq-off",
];

/// Locks per memory measurement: 8192 locks' counts, 16 bytes each per row, fill exactly two
/// of the dense arena's 64 KiB rows, so that the address space grows by whole ranges alone.
const MEMORY_LOCKS: usize = 8192;

/// The competitors, in table order.
const KINDS: &[&str] = &[
    "std",
    "parking_lot",
    "sharded_lock",
    "arc_swap",
    "thiscpu",
    "epoch",
];

/// Read mixes: the case prefix and reads per write (0: none).
const MIXES: &[(&str, u64)] = &[("read", 0), ("w1k", 1000), ("w10k", 10_000), ("w100k", 100_000)];

/// The family.
pub static FAMILY: Family = Family {
    name: "rwlock",
    about: "read lock + unlock of read-mostly data (ns per read, per thread), read-only and \
            with a write every 1,000 / 10,000 / 100,000 reads; write latency alone and under \
            readers",
    case_names: CASES,
    default_threads: &[1, 2],
    baseline: Some("*/parking_lot"),
    cases,
    report,
};

type Value = [u64; 4];

/// A structure holding a `Value`.
trait Subject: Send + Sync + 'static {
    /// One read: lock (or pin), read the value, unlock.
    fn read(&self) -> u64;
    /// One write: lock, set every word to `n`, unlock (or swap in a new value).
    fn write(&self, n: u64);
}

#[inline(always)]
fn fold(value: &Value) -> u64 {
    black_box(value).iter().fold(0, |sum, &word| sum ^ word)
}

impl Subject for std::sync::RwLock<Value> {
    #[inline(always)]
    fn read(&self) -> u64 {
        fold(&self.read().unwrap_or_else(|p| p.into_inner()))
    }
    fn write(&self, n: u64) {
        *self.write().unwrap_or_else(|p| p.into_inner()) = [n; 4];
    }
}

impl Subject for parking_lot::RwLock<Value> {
    #[inline(always)]
    fn read(&self) -> u64 {
        fold(&self.read())
    }
    fn write(&self, n: u64) {
        *self.write() = [n; 4];
    }
}

impl Subject for ShardedLock<Value> {
    #[inline(always)]
    fn read(&self) -> u64 {
        fold(&self.read().unwrap_or_else(|p| p.into_inner()))
    }
    fn write(&self, n: u64) {
        *self.write().unwrap_or_else(|p| p.into_inner()) = [n; 4];
    }
}

impl Subject for ArcSwap<Value> {
    #[inline(always)]
    fn read(&self) -> u64 {
        fold(&self.load())
    }
    fn write(&self, n: u64) {
        self.store(Arc::new([n; 4]));
    }
}

impl Subject for thiscpu::RwLock<Value> {
    #[inline(always)]
    fn read(&self) -> u64 {
        fold(&self.read())
    }
    fn write(&self, n: u64) {
        *self.write() = [n; 4];
    }
}

impl Subject for EpochCell<Value> {
    #[inline(always)]
    fn read(&self) -> u64 {
        fold(&self.load())
    }
    fn write(&self, n: u64) {
        self.store([n; 4]);
    }
}

/// A lock made on first use, as a `static` holding a `thiscpu::RwLock` is written (its
/// constructor allocates, so it cannot be `const`): each read first checks that the lock was
/// made. The same check is what a lock allocating its reader counts on first use, behind a
/// `const` constructor such as `lock_api`'s `INIT`, would add to every read.
impl<F> Subject for std::sync::LazyLock<thiscpu::RwLock<Value>, F>
where
    F: FnOnce() -> thiscpu::RwLock<Value> + Send + Sync + 'static,
{
    #[inline(always)]
    fn read(&self) -> u64 {
        fold(&std::sync::LazyLock::force(self).read())
    }
    fn write(&self, n: u64) {
        *std::sync::LazyLock::force(self).write() = [n; 4];
    }
}

/// `make` called with a new structure of `kind`, monomorphized: the reads are inlined into
/// each workload's loop, as a program's would be.
fn with_subject<R>(kind: &str, make: impl Maker<R>) -> R {
    match kind {
        "std" => make.make(std::sync::RwLock::new([0; 4])),
        "parking_lot" => make.make(parking_lot::RwLock::new([0; 4])),
        "sharded_lock" => make.make(ShardedLock::new([0; 4])),
        "arc_swap" => make.make(ArcSwap::from_pointee([0; 4])),
        "thiscpu" => make.make(thiscpu::RwLock::new([0; 4])),
        "thiscpu-lazy" => make.make(std::sync::LazyLock::new(|| thiscpu::RwLock::new([0; 4]))),
        _ => make.make(EpochCell::new([0; 4])),
    }
}

/// A workload maker, generic over the structure.
trait Maker<R> {
    fn make<S: Subject>(self, subject: S) -> R;
}

struct MixMaker {
    every: u64,
}

impl Maker<Box<dyn Workload>> for MixMaker {
    fn make<S: Subject>(self, subject: S) -> Box<dyn Workload> {
        Box::new(Mix {
            subject,
            every: self.every,
            reads: (0..1024).map(|_| CachePadded(AtomicU64::new(0))).collect(),
        })
    }
}

struct WritesMaker {
    readers: usize,
}

impl Maker<Box<dyn Workload>> for WritesMaker {
    fn make<S: Subject>(self, subject: S) -> Box<dyn Workload> {
        Box::new(Writes {
            subject: Arc::new(subject),
            readers: self.readers,
            background: Mutex::new(None),
            written: AtomicU64::new(1),
        })
    }
}

/// Checks after a round that the value is whole: the fold of four equal words is 0.
fn verify_whole<S: Subject>(subject: &S) -> Result<(), String> {
    match subject.read() {
        0 => Ok(()),
        other => Err(format!(
            "a value written by halves: its words' xor is {other:#x}, not 0"
        )),
    }
}

/// Reads, with a write every `every` reads of each worker (0: never).
struct Mix<S> {
    subject: S,
    every: u64,
    /// Each worker's reads so far, on its own cache lines.
    reads: Box<[CachePadded<AtomicU64>]>,
}

impl<S: Subject> Workload for Mix<S> {
    fn run(&self, worker: usize, ops: u64) {
        let subject = black_box(&self.subject);
        if self.every == 0 {
            for _ in 0..ops {
                black_box(subject.read());
            }
            return;
        }
        let count = &self.reads[worker % self.reads.len()];
        let mut done = count.load(Ordering::Relaxed);
        for _ in 0..ops {
            done += 1;
            if done.is_multiple_of(self.every) {
                subject.write(done);
            } else {
                black_box(subject.read());
            }
        }
        count.store(done, Ordering::Relaxed);
    }

    fn verify(&self, _ops: u64) -> Result<(), String> {
        verify_whole(&self.subject)
    }
}

/// Readers running in the background of a writer case, stopped by `stop`.
struct Background {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Background {
    fn end(self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            let _ = thread.join();
        }
    }
}

/// Writes only, with `readers` reader threads in the background during each round.
struct Writes<S> {
    subject: Arc<S>,
    readers: usize,
    background: Mutex<Option<Background>>,
    written: AtomicU64,
}

impl<S: Subject> Writes<S> {
    fn end_background(&self) {
        let running = self
            .background
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(running) = running {
            running.end();
        }
    }
}

impl<S: Subject> Workload for Writes<S> {
    /// Starts the readers, each pinned to one of the CPUs after the first worker's, and returns
    /// once every one of them reads: calibrated against readers that have not started yet, a
    /// chunk of writes that block behind them (parking_lot's) took seconds instead of 50 µs.
    fn prepare(&self, _threads: usize) {
        self.end_background();
        if self.readers == 0 {
            return;
        }
        let cpus = crate::bench::runner::worker_cpus();
        let stop = Arc::new(AtomicBool::new(false));
        let reading = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..self.readers)
            .filter_map(|reader| {
                let (stop, reading, subject) =
                    (stop.clone(), reading.clone(), self.subject.clone());
                let cpu = cpus[(1 + reader) % cpus.len()];
                std::thread::Builder::new()
                    .spawn(move || {
                        let _pinned = thiscpu::topology::pin_to(cpu);
                        black_box(subject.read());
                        reading.fetch_add(1, Ordering::Release);
                        while !stop.load(Ordering::Relaxed) {
                            black_box(subject.read());
                        }
                    })
                    .ok()
            })
            .collect();
        let started = threads.len() as u64;
        while reading.load(Ordering::Acquire) < started
            && !threads.iter().any(|thread| thread.is_finished())
        {
            std::thread::yield_now();
        }
        *self.background.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Background { stop, threads });
    }

    fn end_calibration(&self) {
        self.end_background();
    }

    fn run(&self, _worker: usize, ops: u64) {
        for _ in 0..ops {
            let n = self.written.fetch_add(1, Ordering::Relaxed);
            self.subject.write(n);
        }
    }

    fn verify(&self, _ops: u64) -> Result<(), String> {
        self.end_background();
        verify_whole(&*self.subject)
    }
}

/// The structure a kind of case uses, as a reader of the code would name it.
fn structure(kind: &str) -> &'static str {
    match kind {
        "std" => "std::sync::RwLock",
        "parking_lot" => "parking_lot::RwLock",
        "sharded_lock" => "crossbeam_utils::sync::ShardedLock",
        "arc_swap" => "arc_swap::ArcSwap",
        "thiscpu" => "thiscpu::RwLock",
        _ => "thiscpu::EpochCell",
    }
}

/// How one read begins: a read lock, or a load of the current value.
fn read_how(kind: &str) -> String {
    match kind {
        "arc_swap" | "epoch" => format!("{}: load() (a guard)", structure(kind)),
        _ => format!("{}: read()", structure(kind)),
    }
}

/// How one read ends.
fn read_end(kind: &str) -> &'static str {
    match kind {
        "arc_swap" | "epoch" => "drop the guard",
        _ => "unlock",
    }
}

/// What one write does.
fn write_how(kind: &str) -> String {
    match kind {
        "arc_swap" => format!("{}: store(Arc::new(value))", structure(kind)),
        "epoch" => format!("{}: store(value)", structure(kind)),
        _ => format!("{}: write(), write 4 words, unlock", structure(kind)),
    }
}

fn cases() -> Vec<Case> {
    let others = crate::bench::runner::worker_cpus()
        .len()
        .saturating_sub(1)
        .max(1);
    let name_of = |case: String| {
        CASES
            .iter()
            .copied()
            .find(|listed| **listed == case)
            .expect("listed")
    };
    let mut cases = Vec::new();
    for &(mix, every) in MIXES {
        for &kind in KINDS {
            let how = match every {
                0 => format!("{}, read 4 words, {}", read_how(kind), read_end(kind)),
                n => format!(
                    "{} reads as in read/{kind}, and a write every {n} reads per thread",
                    structure(kind)
                ),
            };
            cases.push(Case {
                name: name_of(format!("{mix}/{kind}")),
                how,
                unit: Unit::NsPerOp,
                workload: Ok(with_subject(kind, MixMaker { every })),
            });
        }
    }
    for (prefix, readers) in [("write", 0), ("write-under-readers", others)] {
        for &kind in KINDS {
            cases.push(Case {
                name: name_of(format!("{prefix}/{kind}")),
                how: match readers {
                    0 => format!("{}, no reader", write_how(kind)),
                    1 => format!("{}, a reader on another CPU", write_how(kind)),
                    n => format!("{}, a reader on each of {n} other CPUs", write_how(kind)),
                },
                unit: Unit::NsPerOp,
                workload: Ok(with_subject(kind, WritesMaker { readers })),
            });
        }
    }
    cases.push(Case {
        name: "read/thiscpu-lazy",
        how: "LazyLock<thiscpu::RwLock>: force, read(), read 4 words, unlock (a lock made on \
              first use: the cost of that check)"
            .to_owned(),
        unit: Unit::NsPerOp,
        workload: Ok(with_subject("thiscpu-lazy", MixMaker { every: 0 })),
    });
    let mirrors = rseq_off::mirrors("rwlock", CASES, &cases);
    cases.extend(mirrors);
    for (name, resident) in [("resident/thiscpu", true), ("address-space/thiscpu", false)] {
        cases.push(Case {
            name,
            how: format!(
                "thiscpu: {} growth per lock per {} CPU, {MEMORY_LOCKS} locks",
                if resident { "Rss" } else { "VmSize" },
                if resident { "reading" } else { "possible" }
            ),
            unit: Unit::Bytes,
            workload: Ok(Box::new(Measuring::new(move |threads| {
                measure_memory(&cpus_for(threads))
                    .map(|(rss, size)| if resident { rss } else { size })
            }))),
        });
    }
    cases
}

/// Bytes of `Rss` per lock per CPU that read and of `VmSize` per lock per possible CPU, from
/// `MEMORY_LOCKS` locks read once on each CPU of `cpus`; the locks are checked and kept.
fn measure_memory(cpus: &[u32]) -> Result<(f64, f64), String> {
    let mut locks: Vec<Option<thiscpu::RwLock<Value>>> = Vec::with_capacity(MEMORY_LOCKS);
    locks.resize_with(MEMORY_LOCKS, || None);
    let before = ProcessMemory::now()?;
    for lock in &mut locks {
        *lock = Some(thiscpu::RwLock::new([0; 4]));
    }
    on_each_cpu(cpus, || {
        for lock in locks.iter().flatten() {
            black_box(lock.read()[0]);
        }
    })?;
    let after = ProcessMemory::now()?;
    if let Some(index) = locks.iter().flatten().position(|lock| lock.readers_inside() != 0) {
        return Err(format!("lock {index} counts a reader after every reader left"));
    }
    // Kept until the process exits: freed counts would serve the next measurement.
    locks.into_iter().for_each(std::mem::forget);
    let possible = thiscpu::topology::possible_cpus();
    let resident = after.resident.saturating_sub(before.resident) as f64
        / (MEMORY_LOCKS * cpus.len()) as f64;
    let size = after.vm_size.saturating_sub(before.vm_size) as f64 / (MEMORY_LOCKS * possible) as f64;
    Ok((resident, size))
}

/// One write per how many reads makes `kind` cost as much as thiscpu's lock (or the epoch, for
/// `arc_swap`), from the read-only and write-alone medians: `None` when one of them wins at
/// every ratio.
fn break_even(results: &[Measured], kind: &str, ours: &str, threads: usize) -> Option<f64> {
    let r_theirs = median(results, &format!("read/{kind}"), threads)?;
    let r_ours = median(results, &format!("read/{ours}"), threads)?;
    let w_theirs = median(results, &format!("write/{kind}"), 1)?;
    let w_ours = median(results, &format!("write/{ours}"), 1)?;
    // Per operation at write fraction f: (1 - f) r + f w; equal where
    // f = (r_theirs - r_ours) / ((w_ours - w_theirs) + (r_theirs - r_ours)).
    let read_gain = r_theirs - r_ours;
    let write_loss = w_ours - w_theirs;
    if read_gain <= 0.0 || write_loss <= 0.0 {
        return None;
    }
    let f = read_gain / (write_loss + read_gain);
    Some(1.0 / f)
}

/// Per peer, the write rate above which it beats thiscpu's structure: one write per this many
/// reads, at each thread count, and the one number to go by, the largest of them (below that
/// rate thiscpu wins at every thread count measured).
fn break_even_table(results: &[Measured], threads: &[usize]) -> String {
    let mut table = new_table();
    let mut header = vec!["peer".to_owned(), "against".to_owned()];
    header.extend(
        threads
            .iter()
            .map(|n| format!("{n} thread{}", if *n == 1 { "" } else { "s" })),
    );
    header.push("thiscpu wins below 1 write in".to_owned());
    table.set_header(header);
    let mut rows = 0;
    for (kind, ours) in [
        ("std", "thiscpu"),
        ("parking_lot", "thiscpu"),
        ("sharded_lock", "thiscpu"),
        ("arc_swap", "epoch"),
    ] {
        let evens: Vec<Option<f64>> = threads
            .iter()
            .map(|&n| break_even(results, kind, ours, n).map(f64::ceil))
            .collect();
        let Some(worst) = evens.iter().flatten().copied().reduce(f64::max) else {
            continue;
        };
        let mut row = vec![kind.to_owned(), ours.to_owned()];
        row.extend(evens.iter().map(|even| even.map_or("–".to_owned(), |n| format!("{n:.0}"))));
        row.push(format!("{worst:.0} reads"));
        table.add_row(row);
        rows += 1;
    }
    if rows == 0 {
        return String::new();
    }
    align_right(&mut table, &(2..threads.len() + 3).collect::<Vec<_>>());
    format!(
        "\nbreak-even: one write per this many reads costs as much as the peer (from the \
         read-only and single-writer medians):\n{}\n",
        render(&table)
    )
}

/// The tables: ns per operation for each mix, write latencies, break-even ratios, targets.
fn report(results: &[Measured]) -> String {
    let threads = thread_counts(results);
    if threads.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    for &(mix, _) in MIXES {
        out.push_str(&mix_table(results, &threads, mix));
    }
    out.push_str(&write_table(results, &threads));
    out.push_str(&memory_lines(results, &threads));
    out.push_str(&break_even_table(results, &threads));
    out.push_str(&lazy_lines(results, &threads));
    out.push_str(&targets(results, &threads).ended());
    out.push_str(&rseq_off::report(results));
    out.trim_end().to_owned()
}

/// ns per operation of every competitor for one mix of reads and writes.
fn mix_table(results: &[Measured], threads: &[usize], mix: &str) -> String {
    let table = competitors_table(
        KINDS,
        threads,
        "ns",
        "÷ ours",
        |kind, n| median(results, &format!("{mix}/{kind}"), n),
        |kind| match kind {
            "arc_swap" => Some("epoch"),
            "thiscpu" | "epoch" => None,
            _ => Some("thiscpu"),
        },
    );
    let what = match mix {
        "read" => "reads only".to_owned(),
        other => format!("a write every {} reads", &other[1..]),
    };
    titled(
        &format!(
            "{what} (medians over rounds, ns per operation per thread; ÷ ours: times \
             thiscpu's, arc_swap's times epoch's)"
        ),
        &table,
    )
}

/// ns per write of every competitor, alone and under readers.
fn write_table(results: &[Measured], threads: &[usize]) -> String {
    let mut table = new_table();
    let mut header = vec!["writers".to_owned()];
    header.extend(KINDS.iter().map(|kind| format!("{kind} ns")));
    table.set_header(header);
    for prefix in ["write", "write-under-readers"] {
        for &n in threads {
            let mut row = vec![format!("{n}{}", if prefix == "write" { "" } else { " + readers" })];
            row.extend(KINDS.iter().map(|kind| {
                median(results, &format!("{prefix}/{kind}"), n).map_or("–".to_owned(), fmt_num)
            }));
            table.add_row(row);
        }
    }
    align_right(&mut table, &(0..=KINDS.len()).collect::<Vec<_>>());
    format!(
        "\nwrite lock + write + unlock (medians, ns per write):\n{}",
        render(&table)
    )
}

/// Resident and address-space bytes of thiscpu's lock at each thread count; nothing when
/// they were not measured.
fn memory_lines(results: &[Measured], threads: &[usize]) -> String {
    let memory: Vec<String> = threads
        .iter()
        .filter_map(|&n| {
            let resident = median(results, "resident/thiscpu", n)?;
            let size = median(results, "address-space/thiscpu", n)?;
            Some(format!(
                "  {n} reading CPU{}: {} B resident per lock per reading CPU, {} B of address \
                 space per lock per possible CPU\n",
                if n == 1 { "" } else { "s" },
                fmt_num(resident),
                fmt_num(size)
            ))
        })
        .collect();
    if memory.is_empty() {
        return String::new();
    }
    format!(
        "\nmemory of thiscpu::RwLock (medians; its counts are 16 B per possible CPU plus a \
         spare row):\n{}",
        memory.concat()
    )
}

/// What a lock made on first use costs a read, at each thread count.
fn lazy_lines(results: &[Measured], threads: &[usize]) -> String {
    let mut out = String::new();
    for &n in threads {
        if let (Some(lazy), Some(plain)) = (
            median(results, "read/thiscpu-lazy", n),
            median(results, "read/thiscpu", n),
        ) {
            out.push_str(&format!(
                "made on first use (a LazyLock around the lock), {}: a read {} ns \
                 against {} ns, {:+.2} ns for the check\n",
                threads_phrase(n),
                fmt_num(lazy),
                fmt_num(plain),
                lazy - plain
            ));
        }
    }
    out
}

/// Reads at one and two threads, against sharded_lock and parking_lot, epoch against
/// arc_swap, and an uncontended write.
fn targets(results: &[Measured], threads: &[usize]) -> Targets {
    let mut targets = Targets::new("targets (medians)");
    let read = |kind: &str, n: usize| median(results, &format!("read/{kind}"), n);
    if let Some(ns) = read("thiscpu", 1) {
        targets.check(
            format!("read lock + unlock, 1 thread: {} ns", fmt_num(ns)),
            "≤ 3.0",
            ns <= 3.0,
        );
    }
    if let Some(ns) = read("thiscpu", 2) {
        targets.check(
            format!("read lock + unlock, 2 threads: {} ns per thread", fmt_num(ns)),
            "≤ 3.5",
            ns <= 3.5,
        );
        for (kind, target) in [("sharded_lock", 3.0), ("parking_lot", 10.0)] {
            if let Some(theirs) = read(kind, 2) {
                let r = theirs / ns;
                targets.check(
                    format!("2 threads: thiscpu {} faster than {kind}", fmt_ratio(r)),
                    &format!("≥ {target}×"),
                    r >= target,
                );
            }
        }
    }
    for &n in threads {
        if let (Some(theirs), Some(ours)) = (read("arc_swap", n), read("epoch", n)) {
            let r = theirs / ours;
            targets.check(
                format!(
                    "{}: epoch pin + unpin {} faster than an ArcSwap load",
                    threads_phrase(n),
                    fmt_ratio(r)
                ),
                "≥ 5×",
                r >= 5.0,
            );
        }
    }
    if let Some(ns) = median(results, "write/thiscpu", 1) {
        targets.check(
            format!("uncontended write: {} µs", fmt_num(ns / 1000.0)),
            "≤ 10",
            ns <= 10_000.0,
        );
    }
    targets
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts its reads.
    #[derive(Default)]
    struct CountedReads(AtomicU64);

    impl Subject for CountedReads {
        fn read(&self) -> u64 {
            self.0.fetch_add(1, Ordering::Relaxed);
            0
        }
        fn write(&self, _n: u64) {}
    }

    /// Calibration and rounds see the readers they are measured against: `prepare` returns
    /// once each of them reads, and after calibration none is left reading.
    #[test]
    fn writes_under_readers_start_them_before_and_stop_them_after_calibration() {
        let subject = Arc::new(CountedReads::default());
        let writes = Writes {
            subject: subject.clone(),
            readers: 2,
            background: Mutex::new(None),
            written: AtomicU64::new(1),
        };
        writes.prepare(1);
        assert!(subject.0.load(Ordering::Relaxed) >= 2, "prepare returned before the readers read");
        writes.end_calibration();
        let after = subject.0.load(Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(subject.0.load(Ordering::Relaxed), after, "a reader still reads");
        assert!(writes.background.lock().unwrap().is_none());
    }
}
