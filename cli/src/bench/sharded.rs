//! `sharded`: one value per CPU taken by a restartable sequence (`thiscpu::Sharded`) against
//! the ways a Rust program shares a value among threads: one `std::sync::Mutex`, one
//! `parking_lot::Mutex`, an array of `parking_lot` mutexes picked by a hash of the thread id
//! (dashmap's shape: four per possible CPU), and the `thread_local` crate's `ThreadLocal`
//! folded on read.
//!
//! Two operations, each taking the structure, changing the value and giving it back:
//! - `update`: a small update (a count and a last value);
//! - `insert`: one `HashMap<u64, u64>` insert (1,024 keys, so the maps stay small).
//!
//! Every value counts its updates; after each round the fold over all of them must equal the
//! operations performed, or the run fails.
//!
//! `memory-N/...`: the heap bytes a structure holds (glibc's `mallinfo2`, every arena) once N
//! threads, all still alive, have each updated it once: a `Sharded` is one 128-byte shard per
//! possible CPU whatever N, a `ThreadLocal` one entry per thread.

use super::model::{Case, Family, Measured, Measuring, Unit, Workload, median_of as median};
use super::rseq_off;
use crate::report::table::{
    Targets, align_right, competitors_table, fmt_num, fmt_ratio, new_table, render,
    thread_counts, titled, verdict,
};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::hint::black_box;
use std::sync::{Mutex, RwLock};
use thiscpu::{CachePadded, Sharded};
use thread_local::ThreadLocal;

const CASES: &[&str] = &[
    "update/std-mutex",
    "update/parking_lot",
    "update/hashed-mutexes",
    "update/thread_local",
    "update/thiscpu",
    "insert/std-mutex",
    "insert/parking_lot",
    "insert/hashed-mutexes",
    "insert/thread_local",
    "insert/thiscpu",
    "memory-100/thread_local",
    "memory-100/thiscpu",
    "memory-1000/thread_local",
    "memory-1000/thiscpu",
    "update/thiscpu-rseq-off",
    "insert/thiscpu-rseq-off",
];

/// The competitors, in table order.
const KINDS: &[&str] = &[
    "std-mutex",
    "parking_lot",
    "hashed-mutexes",
    "thread_local",
    "thiscpu",
];

/// The family.
pub static FAMILY: Family = Family {
    name: "sharded",
    about: "take + update + release of a value shared by all threads (ns per operation, per \
            thread), by 1 thread and one per CPU; heap bytes with 100 and 1,000 threads alive",
    case_names: CASES,
    default_threads: &[1, 2],
    baseline: Some("*/parking_lot"),
    cases,
    report,
};

/// The value each structure shares, and what one operation does to it.
trait Payload: Default + Send + 'static {
    fn apply(&mut self, i: u64);
    fn updates(&self) -> u64;
}

/// `update`: a count and the last value.
#[derive(Default)]
struct Small {
    count: u64,
    last: u64,
}

impl Payload for Small {
    #[inline(always)]
    fn apply(&mut self, i: u64) {
        self.count += 1;
        self.last = black_box(i);
    }
    fn updates(&self) -> u64 {
        self.count
    }
}

/// `insert`: a map and a count.
#[derive(Default)]
struct Map {
    map: HashMap<u64, u64>,
    count: u64,
}

impl Payload for Map {
    #[inline(always)]
    fn apply(&mut self, i: u64) {
        self.map.insert(i & 1023, i);
        self.count += 1;
    }
    fn updates(&self) -> u64 {
        self.count
    }
}

/// A structure shared by the workers: `ops` operations, and the fold of the updates.
trait Shared: Send + Sync + 'static {
    fn run(&self, ops: u64);
    fn updates(&self) -> u64;
}

struct StdMutex<P>(Mutex<P>);

impl<P: Payload> Shared for StdMutex<P> {
    fn run(&self, ops: u64) {
        for i in 0..ops {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).apply(i);
        }
    }
    fn updates(&self) -> u64 {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).updates()
    }
}

struct ParkingLot<P>(parking_lot::Mutex<P>);

impl<P: Payload> Shared for ParkingLot<P> {
    fn run(&self, ops: u64) {
        for i in 0..ops {
            self.0.lock().apply(i);
        }
    }
    fn updates(&self) -> u64 {
        self.0.lock().updates()
    }
}

/// Four mutexes per possible CPU, picked by a hash of the thread's id (computed once per chunk
/// of operations, as a program would cache it).
struct HashedMutexes<P> {
    shards: Box<[CachePadded<parking_lot::Mutex<P>>]>,
    hasher: RandomState,
}

impl<P: Payload> Shared for HashedMutexes<P> {
    fn run(&self, ops: u64) {
        let index = self.hasher.hash_one(std::thread::current().id()) as usize % self.shards.len();
        let shard = &self.shards[index];
        for i in 0..ops {
            shard.lock().apply(i);
        }
    }
    fn updates(&self) -> u64 {
        self.shards.iter().map(|shard| shard.lock().updates()).sum()
    }
}

/// One value per thread. Workers share the `RwLock` for reading once per chunk of operations;
/// the fold takes it for writing, which `ThreadLocal::iter_mut` needs for a `RefCell`.
struct PerThread<P: Send>(RwLock<ThreadLocal<RefCell<P>>>);

impl<P: Payload> Shared for PerThread<P> {
    fn run(&self, ops: u64) {
        let values = self.0.read().unwrap_or_else(|p| p.into_inner());
        for i in 0..ops {
            values.get_or_default().borrow_mut().apply(i);
        }
    }
    fn updates(&self) -> u64 {
        let mut values = self.0.write().unwrap_or_else(|p| p.into_inner());
        values.iter_mut().map(|value| value.get_mut().updates()).sum()
    }
}

struct Thiscpu<P>(Sharded<P>);

impl<P: Payload> Shared for Thiscpu<P> {
    fn run(&self, ops: u64) {
        let sharded = black_box(&self.0);
        for i in 0..ops {
            sharded.with_current(|value| value.apply(i));
        }
    }
    fn updates(&self) -> u64 {
        self.0.fold(0, |sum, value| sum + value.updates())
    }
}

/// A structure as a workload: between `prepare` and `verify` its fold must grow by exactly the
/// operations performed (calibration runs happen outside, so the fold is read at `prepare`).
struct Counted<S> {
    shared: S,
    before: std::sync::atomic::AtomicU64,
}

impl<S: Shared> Workload for Counted<S> {
    fn prepare(&self, _threads: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        self.before.store(self.shared.updates(), Relaxed);
    }

    fn run(&self, _worker: usize, ops: u64) {
        self.shared.run(ops);
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        use std::sync::atomic::Ordering::Relaxed;
        let grown = self.shared.updates() - self.before.load(Relaxed);
        if grown == ops {
            Ok(())
        } else {
            Err(format!("the values gained {grown} updates, {ops} were made"))
        }
    }
}

fn counted(shared: impl Shared) -> Counted<impl Shared> {
    Counted {
        shared,
        before: std::sync::atomic::AtomicU64::new(0),
    }
}

fn structures<P: Payload>(op: &'static str) -> Vec<(String, Box<dyn Workload>)> {
    let cpus = thiscpu::topology::possible_cpus().max(1);
    let name = |kind: &str| format!("{op}/{kind}");
    vec![
        (
            name("std-mutex"),
            Box::new(counted(StdMutex(Mutex::new(P::default())))) as Box<dyn Workload>,
        ),
        (
            name("parking_lot"),
            Box::new(counted(ParkingLot(parking_lot::Mutex::new(P::default())))),
        ),
        (
            name("hashed-mutexes"),
            Box::new(counted(HashedMutexes {
                shards: (0..4 * cpus)
                    .map(|_| CachePadded(parking_lot::Mutex::new(P::default())))
                    .collect(),
                hasher: RandomState::new(),
            })),
        ),
        (
            name("thread_local"),
            Box::new(counted(PerThread(RwLock::new(ThreadLocal::<RefCell<P>>::new())))),
        ),
        (
            name("thiscpu"),
            Box::new(counted(Thiscpu(Sharded::<P>::default()))),
        ),
    ]
}

/// Heap bytes in use in every arena (glibc).
fn heap_in_use() -> usize {
    // SAFETY: mallinfo2 takes no argument and returns a plain struct.
    unsafe { libc::mallinfo2() }.uordblks
}

/// How a memory case holds its threads' values.
#[derive(Clone, Copy, Debug)]
enum Holder {
    ThreadLocal,
    Thiscpu,
}

/// The structure a memory case measures.
enum Values {
    /// Boxed like the shards, so that its 512 bytes of bucket pointers count too.
    ThreadLocal(Box<ThreadLocal<RefCell<Small>>>),
    Thiscpu(Sharded<Small>),
}

/// Steps that the measuring thread and its helpers go through together: helpers arrive at a
/// step and wait for the measuring thread to open it. Unlike a `Barrier`, it can open every
/// step at once when starting the helpers failed, so that no helper waits forever.
struct Steps {
    state: Mutex<(usize, [usize; 4])>,
    changed: std::sync::Condvar,
}

impl Steps {
    fn new() -> Steps {
        Steps {
            state: Mutex::new((0, [0; 4])),
            changed: std::sync::Condvar::new(),
        }
    }

    /// A helper arrives at `step` and waits until it is open.
    fn arrive(&self, step: usize) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.1[step] += 1;
        self.changed.notify_all();
        while state.0 <= step {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits until `helpers` have arrived at `step`.
    fn wait_for(&self, step: usize, helpers: usize) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while state.1[step] < helpers {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Opens every step up to `step` included.
    fn open(&self, step: usize) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.0 = state.0.max(step + 1);
        self.changed.notify_all();
    }
}

/// Heap bytes of a fresh structure once `threads` live threads have each updated it once. The
/// threads exist (stacks, descriptors) before the first reading; the structure is made between
/// the readings; the threads are still alive at the second.
fn measure_memory(holder: Holder, threads: usize) -> Result<f64, String> {
    const ALIVE: usize = 0;
    const UPDATE: usize = 1;
    const MEASURED: usize = 2;
    let steps = Steps::new();
    let values: std::sync::OnceLock<Values> = std::sync::OnceLock::new();
    let bytes = std::thread::scope(|s| {
        let mut started = 0;
        for _ in 0..threads {
            let (steps, values) = (&steps, &values);
            let thread = std::thread::Builder::new()
                .stack_size(64 * 1024)
                .spawn_scoped(s, move || {
                    steps.arrive(ALIVE);
                    match values.get() {
                        Some(Values::ThreadLocal(values)) => {
                            values.get_or_default().borrow_mut().apply(1)
                        }
                        Some(Values::Thiscpu(values)) => values.with_current(|v| v.apply(1)),
                        None => {}
                    }
                    steps.arrive(UPDATE);
                    steps.arrive(MEASURED);
                });
            if thread.is_err() {
                break;
            }
            started += 1;
        }
        if started < threads {
            steps.open(MEASURED);
            return Err(format!("could start only {started} of {threads} threads"));
        }
        steps.wait_for(ALIVE, threads);
        let before = heap_in_use();
        let _ = values.set(match holder {
            Holder::ThreadLocal => Values::ThreadLocal(Box::default()),
            Holder::Thiscpu => Values::Thiscpu(Sharded::default()),
        });
        steps.open(ALIVE);
        steps.wait_for(UPDATE, threads);
        let after = heap_in_use();
        steps.open(MEASURED);
        Ok(after.saturating_sub(before) as f64)
    })?;
    let updates = match values.into_inner() {
        Some(Values::ThreadLocal(mut values)) => {
            values.iter_mut().map(|v| v.get_mut().updates()).sum()
        }
        Some(Values::Thiscpu(values)) => values.fold(0, |n, v| n + v.updates()),
        None => 0,
    };
    if updates != threads as u64 {
        return Err(format!("{updates} updates from {threads} threads"));
    }
    Ok(bytes)
}

fn cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    let mode = if Sharded::<()>::default().uses_rseq() {
        "restartable take, one release store"
    } else {
        "no rseq or membarrier here: compare-and-swap take"
    };
    let how = |name: &str| -> String {
        let (op, kind) = name.split_once('/').unwrap_or((name, ""));
        let what = if op == "update" {
            "count += 1, last = i"
        } else {
            "HashMap<u64, u64>::insert"
        };
        match kind {
            "std-mutex" => format!("one std Mutex: lock, {what}, unlock"),
            "parking_lot" => format!("one parking_lot Mutex: lock, {what}, unlock"),
            "hashed-mutexes" => format!("parking_lot Mutex per thread-id hash (4/CPU): {what}"),
            "thread_local" => format!("ThreadLocal<RefCell<T>>: get_or_default, {what}"),
            _ => format!("thiscpu Sharded::with_current ({mode}): {what}"),
        }
    };
    let mut cases = Vec::new();
    for (name, workload) in structures::<Small>("update")
        .into_iter()
        .chain(structures::<Map>("insert"))
    {
        let name = CASES
            .iter()
            .copied()
            .find(|case| *case == name)
            .unwrap_or("update/thiscpu");
        cases.push(Case {
            name,
            how: how(name),
            unit: ns,
            workload: Ok(workload),
        });
    }
    let mirrors = rseq_off::mirrors("sharded", CASES, &cases);
    cases.extend(mirrors);
    for (name, holder, threads) in [
        ("memory-100/thread_local", Holder::ThreadLocal, 100),
        ("memory-100/thiscpu", Holder::Thiscpu, 100),
        ("memory-1000/thread_local", Holder::ThreadLocal, 1000),
        ("memory-1000/thiscpu", Holder::Thiscpu, 1000),
    ] {
        let what = match holder {
            Holder::ThreadLocal => "ThreadLocal<RefCell<T>>",
            Holder::Thiscpu => "thiscpu Sharded<T>",
        };
        cases.push(Case::new(
            name,
            format!("heap bytes of a {what} after one update from each of {threads} live threads"),
            Unit::Bytes,
            Measuring::new(move |_| measure_memory(holder, threads)),
        ));
    }
    cases
}

/// ns/op per competitor and the ratios to thiscpu, the memory table, and the targets.
fn report(results: &[Measured]) -> String {
    let threads = thread_counts(results.iter().filter(|m| m.unit == Unit::NsPerOp));
    if threads.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    for op in ["update", "insert"] {
        let table = competitors_table(
            KINDS,
            &threads,
            "ns",
            "÷ thiscpu",
            |kind, n| median(results, &format!("{op}/{kind}"), n),
            |kind| (kind != "thiscpu").then_some("thiscpu"),
        );
        out.push_str(&titled(
            &format!(
                "{op} (medians over rounds, ns per operation per thread; ÷ thiscpu: times \
                 thiscpu's)"
            ),
            &table,
        ));
    }
    out.push_str(&memory_table(results));
    out.push_str(&targets(results, &threads).ended());
    out.push_str(&rseq_off::report(results));
    out.trim_end().to_owned()
}

/// The median of the memory case `case`, at whatever thread count it ran.
fn memory_median(results: &[Measured], case: &str) -> Option<f64> {
    results
        .iter()
        .find(|m| m.case == case)
        .map(|m| m.stats().median)
}

/// Heap bytes of each holder with 100 and 1000 threads alive, in total and per thread or
/// shard.
fn memory_table(results: &[Measured]) -> String {
    let shards = thiscpu::topology::possible_cpus().max(1);
    let mut table = new_table();
    table.set_header(vec![
        "threads alive",
        "thread_local bytes",
        "per thread",
        "thiscpu bytes",
        "per shard",
    ]);
    for alive in [100usize, 1000] {
        let theirs = memory_median(results, &format!("memory-{alive}/thread_local"));
        let ours = memory_median(results, &format!("memory-{alive}/thiscpu"));
        table.add_row(vec![
            alive.to_string(),
            theirs.map_or("–".to_owned(), fmt_num),
            theirs.map_or("–".to_owned(), |b| fmt_num(b / alive as f64)),
            ours.map_or("–".to_owned(), fmt_num),
            ours.map_or("–".to_owned(), |b| fmt_num(b / shards as f64)),
        ]);
    }
    align_right(&mut table, &[0, 1, 2, 3, 4]);
    format!(
        "\nheap memory (medians), {shards} possible CPUs, each live thread updated once:\n{}",
        render(&table)
    )
}

/// Updates against parking_lot and hashed mutexes at the fewest and the most threads, and
/// memory that must not grow with the threads.
fn targets(results: &[Measured], threads: &[usize]) -> Targets {
    let mut targets = Targets::new("targets (ratios of medians)");
    let one = threads[0];
    let most = *threads.last().unwrap_or(&one);
    let ratio = |case: &str, n: usize| -> Option<f64> {
        let theirs = median(results, case, n)?;
        let ours = median(results, "update/thiscpu", n)?;
        (ours > 0.0).then(|| theirs / ours)
    };
    if let Some(r) = ratio("update/parking_lot", one) {
        targets.check(
            format!("update, {one} thread: thiscpu {} faster than parking_lot", fmt_ratio(r)),
            "≥ 2×",
            r >= 2.0,
        );
    }
    if most > one {
        if let Some(r) = ratio("update/parking_lot", most) {
            targets.check(
                format!(
                    "update, {most} threads: thiscpu {} the per-thread throughput of one \
                     parking_lot",
                    fmt_ratio(r)
                ),
                "≥ 10×",
                r >= 10.0,
            );
        }
        if let Some(r) = ratio("update/hashed-mutexes", most) {
            targets.check(
                format!("update, {most} threads: hashed-mutexes cost {} of thiscpu", fmt_ratio(r)),
                "≥ 1×",
                r >= 1.0,
            );
        }
    }
    if let (Some(few), Some(many)) = (
        memory_median(results, "memory-100/thiscpu"),
        memory_median(results, "memory-1000/thiscpu"),
    ) {
        // The aligned allocation's placement moves the figure by a few dozen bytes between
        // rounds; growing with the threads would add at least a byte per thread.
        let per_extra_thread = (many - few) / 900.0;
        targets.note(format!(
            "memory: thiscpu {} bytes with 100 threads alive, {} with 1000, {} per extra \
             thread (target: independent of the threads, < 1 byte per thread): {}",
            fmt_num(few),
            fmt_num(many),
            fmt_num(per_extra_thread),
            verdict(per_extra_thread < 1.0)
        ));
    }
    targets
}
