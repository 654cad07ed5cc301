//! `bpf`: the BPF map-increment benchmarks of seed 001 (the arm64 JIT inlining
//! `bpf_get_smp_processor_id`), in user space: a counter slot chosen by the current CPU id and
//! incremented, with the CPU id read four ways. The seed's programs were:
//!
//! - `glob-arr-inc`: `arr[cpu].value += 1` on a global array of 128-byte-aligned counters;
//! - `arr-inc`: a per-CPU array map looked up, then `*p += 1`;
//! - `hash-inc`: a per-CPU hash map looked up, then `*p += 1`.
//!
//! BPF programs run with migration disabled, so their increments are plain. A user-space thread
//! can migrate between reading its CPU id and adding, so here each increment is an atomic
//! `fetch_add` (`Relaxed`) on the chosen slot; workers are pinned, so the slots stay
//! uncontended, as the kernel's are. The maps become a `PerCpu` (indexed by CPU) and a std
//! `HashMap` keyed by CPU id, built up front, with padded values (as a per-CPU map's are
//! apart).
//!
//! Case names are `<shape>/<source>`; the report prints each shape as the seed's before/after
//! row: `syscall | vdso | sched_getcpu | current_cpu`, with the change against the last two.

use super::counter::{Exact, Shape};
use super::model::{Case, Family, Measured, Unit};
use crate::report::table::{align_right, fmt_num, fmt_percent, new_table, render};
use std::collections::HashMap;
use std::hint::black_box;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use thiscpu::{CachePadded, PerCpu};

const SHAPES: [&str; 3] = ["glob-arr-inc", "arr-inc", "hash-inc"];
const SOURCES: [&str; 4] = ["syscall", "vdso", "sched_getcpu", "current_cpu"];

/// The family.
pub static FAMILY: Family = Family {
    name: "bpf",
    about: "seed 001's glob-arr-inc, arr-inc and hash-inc in user space, CPU id from each \
            source (ns/op of CPU time; M ops/s in the seed's table)",
    case_names: &[
        "glob-arr-inc/syscall",
        "glob-arr-inc/vdso",
        "glob-arr-inc/sched_getcpu",
        "glob-arr-inc/current_cpu",
        "arr-inc/syscall",
        "arr-inc/vdso",
        "arr-inc/sched_getcpu",
        "arr-inc/current_cpu",
        "hash-inc/syscall",
        "hash-inc/vdso",
        "hash-inc/sched_getcpu",
        "hash-inc/current_cpu",
    ],
    default_threads: &[1],
    baseline: Some("*/current_cpu"),
    cases,
    report,
};

/// Where the CPU id comes from (the BPF program's `bpf_get_smp_processor_id()`), and the
/// names of the three cases that use it.
trait CpuId: Send + Sync + 'static {
    const NAME: &'static str;
    const CASES: [&'static str; 3];
    fn cpu() -> u32;
}

struct Syscall;
struct Vdso;
struct SchedGetcpu;
struct CurrentCpu;

impl CpuId for Syscall {
    const NAME: &'static str = "syscall";
    const CASES: [&'static str; 3] = [
        "glob-arr-inc/syscall",
        "arr-inc/syscall",
        "hash-inc/syscall",
    ];
    #[inline(always)]
    fn cpu() -> u32 {
        thiscpu::via::syscall().map_or(0, |here| here.cpu)
    }
}

impl CpuId for Vdso {
    const NAME: &'static str = "vdso";
    const CASES: [&'static str; 3] = ["glob-arr-inc/vdso", "arr-inc/vdso", "hash-inc/vdso"];
    #[inline(always)]
    fn cpu() -> u32 {
        thiscpu::via::vdso().map_or(0, |here| here.cpu)
    }
}

impl CpuId for SchedGetcpu {
    const NAME: &'static str = "sched_getcpu";
    const CASES: [&'static str; 3] = [
        "glob-arr-inc/sched_getcpu",
        "arr-inc/sched_getcpu",
        "hash-inc/sched_getcpu",
    ];
    #[inline(always)]
    fn cpu() -> u32 {
        thiscpu::via::sched_getcpu().unwrap_or(0)
    }
}

impl CpuId for CurrentCpu {
    const NAME: &'static str = "current_cpu";
    const CASES: [&'static str; 3] = [
        "glob-arr-inc/current_cpu",
        "arr-inc/current_cpu",
        "hash-inc/current_cpu",
    ];
    #[inline(always)]
    fn cpu() -> u32 {
        thiscpu::current_cpu()
    }
}

/// Slots of the global array: 1024, CPU ids masked to it as the seed's program masks with
/// `CPU_MASK` (two CPUs sharing a slot would still count exactly: the adds are atomic).
const GLOBAL_SLOTS: usize = 1024;

/// The global array of `glob-arr-inc`: in the program's data, not behind a pointer.
static GLOBAL: [CachePadded<AtomicU64>; GLOBAL_SLOTS] =
    [const { CachePadded(AtomicU64::new(0)) }; GLOBAL_SLOTS];

/// `glob-arr-inc`: `GLOBAL[cpu & 1023] += 1`.
struct GlobArrInc<S>(PhantomData<S>);

impl<S: CpuId> Shape for GlobArrInc<S> {
    fn increments(&self, ops: u64) {
        let slots = black_box(&GLOBAL);
        for _ in 0..ops {
            slots[S::cpu() as usize & (GLOBAL_SLOTS - 1)].fetch_add(1, Relaxed);
        }
    }

    fn total(&self) -> u64 {
        GLOBAL.iter().map(|slot| slot.load(Relaxed)).sum()
    }
}

/// `arr-inc`: a `PerCpu` looked up by CPU id (bounds-checked, as the map lookup is).
struct ArrInc<S>(PerCpu<AtomicU64>, PhantomData<S>);

impl<S: CpuId> Shape for ArrInc<S> {
    fn increments(&self, ops: u64) {
        let map = black_box(&self.0);
        for _ in 0..ops {
            if let Some(slot) = map.get(S::cpu()) {
                slot.fetch_add(1, Relaxed);
            }
        }
    }

    fn total(&self) -> u64 {
        self.0.iter().map(|slot| slot.load(Relaxed)).sum()
    }
}

/// `hash-inc`: a std `HashMap` (SipHash) from CPU id to a padded counter, one entry per
/// possible CPU, looked up on every increment.
struct HashInc<S>(HashMap<u32, CachePadded<AtomicU64>>, PhantomData<S>);

impl<S: CpuId> Shape for HashInc<S> {
    fn increments(&self, ops: u64) {
        let map = black_box(&self.0);
        for _ in 0..ops {
            if let Some(slot) = map.get(&S::cpu()) {
                slot.fetch_add(1, Relaxed);
            }
        }
    }

    fn total(&self) -> u64 {
        self.0.values().map(|slot| slot.load(Relaxed)).sum()
    }
}

fn hash_map() -> HashMap<u32, CachePadded<AtomicU64>> {
    (0..thiscpu::topology::possible_cpus() as u32)
        .map(|cpu| (cpu, CachePadded(AtomicU64::new(0))))
        .collect()
}

/// The three shapes with the CPU id from `S`, or the reason `S` does not work here.
fn shapes<S: CpuId>(works: Result<(), String>, out: &mut Vec<Case>) {
    let ns = Unit::NsPerOp;
    let (names, source) = (S::CASES, S::NAME);
    if let Err(why) = works {
        out.extend(names.map(|name| Case::skipped(name, ns, why.clone())));
        return;
    }
    out.push(Case::new(
        names[0],
        format!("static [padded AtomicU64; 1024][cpu], cpu from {source}"),
        ns,
        Exact::new(GlobArrInc::<S>(PhantomData)),
    ));
    out.push(Case::new(
        names[1],
        format!("PerCpu<AtomicU64>.get(cpu), cpu from {source}"),
        ns,
        Exact::new(ArrInc::<S>(PerCpu::default(), PhantomData)),
    ));
    out.push(Case::new(
        names[2],
        format!("HashMap<u32, padded AtomicU64>.get(cpu), cpu from {source}"),
        ns,
        Exact::new(HashInc::<S>(hash_map(), PhantomData)),
    ));
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::with_capacity(12);
    shapes::<Syscall>(Ok(()), &mut cases);
    let vdso = thiscpu::via::vdso()
        .map(|_| ())
        .ok_or_else(|| "the vDSO has no getcpu".to_owned());
    shapes::<Vdso>(vdso, &mut cases);
    let glibc = thiscpu::via::sched_getcpu()
        .map(|_| ())
        .ok_or_else(|| "sched_getcpu() fails here".to_owned());
    shapes::<SchedGetcpu>(glibc, &mut cases);
    shapes::<CurrentCpu>(Ok(()), &mut cases);
    // Shape-major order, as the seed lists them.
    cases.sort_by_key(|case| {
        SHAPES
            .iter()
            .position(|shape| case.name.split('/').next() == Some(shape))
    });
    cases
}

/// The seed's own figures (arm64, M ops/s): before and after inlining.
const SEED: [(&str, f64, f64); 3] = [
    ("glob-arr-inc", 23.817, 24.631),
    ("arr-inc", 23.253, 23.742),
    ("hash-inc", 12.258, 12.625),
];

/// Seed 001's table, one row per shape: each source's median in M ops/s (1000 / ns per
/// operation), then current_cpu's change against sched_getcpu and against the vDSO; the
/// seed's arm64 figures below.
fn report(results: &[Measured]) -> String {
    let Some(threads) = results.iter().map(|m| m.threads).min() else {
        return String::new();
    };
    let median = |case: String| {
        results
            .iter()
            .find(|m| m.case == case && m.threads == threads)
            .map(|m| 1e3 / m.stats().median.max(1e-12))
    };
    let cell = |value: Option<f64>| value.map_or_else(|| "–".to_owned(), fmt_num);
    let change = |after: Option<f64>, before: Option<f64>| match (after, before) {
        (Some(after), Some(before)) if before > 0.0 => fmt_percent(100.0 * (after / before - 1.0)),
        _ => "–".to_owned(),
    };
    let mut table = new_table();
    let mut header = vec!["M ops/s".to_owned()];
    header.extend(SOURCES.iter().map(|s| s.to_string()));
    header.push("vs sched_getcpu".to_owned());
    header.push("vs vdso".to_owned());
    table.set_header(header);
    for shape in SHAPES {
        let values: Vec<Option<f64>> = SOURCES
            .iter()
            .map(|source| median(format!("{shape}/{source}")))
            .collect();
        let mut row = vec![shape.to_owned()];
        row.extend(values.iter().map(|&v| cell(v)));
        row.push(change(values[3], values[2]));
        row.push(change(values[3], values[1]));
        table.add_row(row);
    }
    align_right(&mut table, &[1, 2, 3, 4, 5, 6]);

    let mut seed = new_table();
    seed.set_header(vec!["seed 001, arm64 JIT", "before", "after", "change"]);
    for (shape, before, after) in SEED {
        seed.add_row(vec![
            shape.to_owned(),
            format!("{before:.3}"),
            format!("{after:.3}"),
            fmt_percent(100.0 * (after / before - 1.0)),
        ]);
    }
    align_right(&mut seed, &[1, 2, 3]);
    format!(
        "\nseed 001 in user space, {threads} thread{} (M ops/s = 1000 / median ns per \
         operation; change = current_cpu against the source named):\n{}\n\n{}",
        if threads == 1 { "" } else { "s" },
        render(&table),
        render(&seed)
    )
}
