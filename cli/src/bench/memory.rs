//! `memory`: what a counter costs in memory, dense (`thiscpu::Counter`, 8 bytes per CPU in the
//! stride allocator's rows) against padded (`PerCpu<AtomicU64>`, 128 bytes per possible CPU),
//! and how long creating one takes.
//!
//! A measurement creates a batch of counters, then one thread, pinned in turn to each of the
//! CPUs the round uses (its thread count: the first CPUs of the order the runner pins workers
//! in), increments every counter once. Before creation and after the increments it reads:
//!
//! - the address space: `VmSize` in `/proc/self/status`, and for the dense layout the bytes
//!   `thiscpu::dense::stats()` says its ranges reserve;
//! - the resident memory: `Rss` in `/proc/self/smaps_rollup` (summed from the page tables, so
//!   exact; `VmRSS` is the kernel's cached per-CPU count and lags), or `VmRSS` where the former
//!   is missing.
//!
//! The differences divided by the batch size are the results, in bytes per counter. Counters
//! are never freed (only the vector of their handles is): a freed dense slot (or heap block)
//! would be handed to the next batch, whose growth would then read zero. The vector that holds a batch's handles is filled before the
//! first reading, so only the counters' own memory is counted. After the second reading every
//! counter must hold exactly one increment per CPU used, or the run fails.
//!
//! The padded layout is measured on a twentieth as many counters (each costs 128 bytes per
//! possible CPU, plus the allocator's rounding) and reported per counter like the dense one.

use super::runner::cpus_for;
use super::model::{
    Case, Family, Measured, Measuring, ProcessMemory, Unit, median_of, on_each_cpu,
};
use crate::report::table::{
    Targets, align_right, fmt_num, new_table, thread_counts, titled, verdict,
};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use thiscpu::{Counter, PerCpu};

/// Counters per dense batch.
const DENSE_BATCH: usize = 100_000;
/// Counters per padded batch (enough pages that rounding to a page is below 1 %).
const PADDED_BATCH: usize = DENSE_BATCH / 20;

/// The family.
pub static FAMILY: Family = Family {
    name: "memory",
    about: "bytes per counter, dense (thiscpu::Counter) against padded (PerCpu<AtomicU64>), \
            after an increment from each CPU used; ns of CPU time per creation",
    case_names: &[
        "dense/reserved",
        "dense/address-space",
        "dense/resident",
        "dense/create",
        "padded/address-space",
        "padded/resident",
        "padded/create",
    ],
    default_threads: &[1, 2],
    baseline: None,
    cases,
    report,
};

/// The two layouts compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    Dense,
    Padded,
}

/// Which figure of a measurement a case reports.
#[derive(Clone, Copy, Debug)]
enum Figure {
    /// Growth of `dense::stats().reserved_bytes`, per counter.
    Reserved,
    /// Growth of `VmSize`, per counter.
    AddressSpace,
    /// Growth of the resident set, per counter.
    Resident,
    /// Nanoseconds per creation.
    Create,
}

/// One measurement, per counter.
#[derive(Clone, Copy, Debug)]
struct Figures {
    reserved: f64,
    address_space: f64,
    resident: f64,
    create_ns: f64,
}

impl Figures {
    fn pick(&self, figure: Figure) -> f64 {
        match figure {
            Figure::Reserved => self.reserved,
            Figure::AddressSpace => self.address_space,
            Figure::Resident => self.resident,
            Figure::Create => self.create_ns,
        }
    }
}

/// What the process holds at one moment, in bytes.
#[derive(Clone, Copy, Debug)]
struct Snapshot {
    vm_size: u64,
    resident: u64,
    reserved: u64,
}

impl Snapshot {
    fn take() -> Result<Snapshot, String> {
        let now = ProcessMemory::now()?;
        Ok(Snapshot {
            vm_size: now.vm_size,
            resident: now.resident,
            reserved: thiscpu::dense::stats().reserved_bytes as u64,
        })
    }
}


/// Per-counter figures from two snapshots around a batch of `batch` counters.
fn per_counter(before: Snapshot, after: Snapshot, batch: usize, create_ns: f64) -> Figures {
    let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / batch as f64;
    Figures {
        reserved: per(after.reserved, before.reserved),
        address_space: per(after.vm_size, before.vm_size),
        resident: per(after.resident, before.resident),
        create_ns,
    }
}

/// Creates `DENSE_BATCH` counters, increments each once from every CPU of `cpus`, checks and
/// keeps them.
fn measure_dense(cpus: &[u32]) -> Result<Figures, String> {
    let mut batch: Vec<Option<Counter>> = Vec::with_capacity(DENSE_BATCH);
    batch.resize_with(DENSE_BATCH, || None);
    let before = Snapshot::take()?;
    let start = super::runner::thread_cpu_time().as_nanos() as f64;
    for slot in &mut batch {
        *slot = Some(Counter::new());
    }
    let create_ns = (super::runner::thread_cpu_time().as_nanos() as f64 - start) / DENSE_BATCH as f64;
    on_each_cpu(cpus, || {
        for counter in batch.iter().flatten() {
            black_box(counter).inc();
        }
    })?;
    let after = Snapshot::take()?;
    let expected = cpus.len() as u64;
    if let Some((index, sum)) = batch
        .iter()
        .flatten()
        .map(Counter::sum)
        .enumerate()
        .find(|&(_, sum)| sum != expected)
    {
        return Err(format!(
            "counter {index} holds {sum} after {expected} increments"
        ));
    }
    // Kept until the process exits: freed slots would serve the next batch.
    batch.into_iter().for_each(std::mem::forget);
    Ok(per_counter(before, after, DENSE_BATCH, create_ns))
}

/// As `measure_dense`, for `PADDED_BATCH` `PerCpu<AtomicU64>`s incremented with `fetch_add`.
fn measure_padded(cpus: &[u32]) -> Result<Figures, String> {
    let mut batch: Vec<Option<PerCpu<AtomicU64>>> = Vec::with_capacity(PADDED_BATCH);
    batch.resize_with(PADDED_BATCH, || None);
    let before = Snapshot::take()?;
    let start = super::runner::thread_cpu_time().as_nanos() as f64;
    for slot in &mut batch {
        *slot = Some(PerCpu::default());
    }
    let create_ns = (super::runner::thread_cpu_time().as_nanos() as f64 - start) / PADDED_BATCH as f64;
    on_each_cpu(cpus, || {
        for counter in batch.iter().flatten() {
            black_box(counter).current().fetch_add(1, Relaxed);
        }
    })?;
    let after = Snapshot::take()?;
    let expected = cpus.len() as u64;
    if let Some((index, sum)) = batch
        .iter()
        .flatten()
        .map(|slots| slots.iter().map(|slot| slot.load(Relaxed)).sum::<u64>())
        .enumerate()
        .find(|&(_, sum)| sum != expected)
    {
        return Err(format!(
            "padded counter {index} holds {sum} after {expected} increments"
        ));
    }
    batch.into_iter().for_each(std::mem::forget);
    Ok(per_counter(before, after, PADDED_BATCH, create_ns))
}

fn case(name: &'static str, how: &str, layout: Layout, figure: Figure) -> Case {
    let unit = match figure {
        Figure::Create => Unit::NsPerOp,
        _ => Unit::BytesPerCounter,
    };
    Case::new(
        name,
        how,
        unit,
        Measuring::new(move |threads| {
            let cpus = cpus_for(threads);
            let figures = match layout {
                Layout::Dense => measure_dense(&cpus),
                Layout::Padded => measure_padded(&cpus),
            };
            figures.map(|figures| figures.pick(figure))
        }),
    )
}

fn cases() -> Vec<Case> {
    use Figure::*;
    use Layout::*;
    vec![
        case(
            "dense/reserved",
            "dense::stats() reserved bytes growth",
            Dense,
            Reserved,
        ),
        case("dense/address-space", "VmSize growth", Dense, AddressSpace),
        case("dense/resident", "Rss growth", Dense, Resident),
        case("dense/create", "Counter::new()", Dense, Create),
        case("padded/address-space", "VmSize growth", Padded, AddressSpace),
        case("padded/resident", "Rss growth", Padded, Resident),
        case(
            "padded/create",
            "PerCpu::<AtomicU64>::default()",
            Padded,
            Create,
        ),
    ]
}

/// Bytes per counter, at most 4 significant digits.
fn bytes(value: f64) -> String {
    if value >= 1000.0 {
        format!("{value:.0}")
    } else {
        fmt_num(value)
    }
}

/// The measured figures side by side, against the targets and a 256-CPU machine.
fn report(results: &[Measured]) -> String {
    let thread_counts = thread_counts(results);
    let possible = thiscpu::topology::possible_cpus();
    let mut out = bytes_table(results, &thread_counts, possible);
    // Targets, from the run with the most CPUs.
    if let Some(&threads) = thread_counts.last() {
        let targets = targets(results, threads, possible);
        if !targets.is_empty() {
            out.push_str(&targets.ended());
        }
    }
    out.push_str(&on_256_cpus());
    out.trim_end().to_owned()
}

/// A figure in bytes, or a dash where it was not measured.
fn cell(value: Option<f64>) -> String {
    value.map_or_else(|| "–".to_owned(), bytes)
}

/// Each layout's bytes per counter at each thread count: reserved, address space and resident,
/// in total and per CPU, and the time to make one.
fn bytes_table(results: &[Measured], thread_counts: &[usize], possible: usize) -> String {
    let mut table = new_table();
    table.set_header(vec![
        "layout",
        "CPUs that ran",
        "reserved",
        "address space",
        "per possible CPU",
        "resident",
        "per CPU that ran",
        "create ns",
    ]);
    for layout in ["dense", "padded"] {
        for &threads in thread_counts {
            let ran = cpus_for(threads).len();
            let space = median_of(results, &format!("{layout}/address-space"), threads);
            let resident = median_of(results, &format!("{layout}/resident"), threads);
            table.add_row(vec![
                layout.to_owned(),
                ran.to_string(),
                cell(median_of(results, &format!("{layout}/reserved"), threads)),
                cell(space),
                cell(space.map(|s| s / possible as f64)),
                cell(resident),
                cell(resident.map(|r| r / ran as f64)),
                cell(median_of(results, &format!("{layout}/create"), threads)),
            ]);
        }
    }
    align_right(&mut table, &[1, 2, 3, 4, 5, 6, 7]);
    titled(
        &format!(
            "bytes per counter (medians), {possible} possible CPU{}; dense batches of \
             {DENSE_BATCH}, padded of {PADDED_BATCH}",
            if possible == 1 { "" } else { "s" },
        ),
        &table,
    )
}

/// The dense layout's targets at `threads`, and what the padded layout's figures are made of.
fn targets(results: &[Measured], threads: usize, possible: usize) -> Targets {
    let mut targets = Targets::new("targets");
    let ran = cpus_for(threads).len();
    if let Some(resident) = median_of(results, "dense/resident", threads) {
        let each = resident / ran as f64;
        targets.check(
            format!(
                "dense resident: {} B per counter per CPU that ran ({ran})",
                bytes(each)
            ),
            "≤ 8 B plus a small constant",
            each <= 8.5,
        );
    }
    if let Some(reserved) = median_of(results, "dense/reserved", threads) {
        let rows = possible + 1;
        let each = reserved / possible as f64;
        let expected = 8.0 * rows as f64 / possible as f64;
        targets.note(format!(
            "dense address space: {} B per counter per possible CPU (target ≤ 8 B): {}; \
             a range has {rows} rows for {possible} possible CPUs (one spare row), so \
             {} B is expected here; the rest comes from where a batch starts and ends in \
             partly used 64 KiB ranges",
            bytes(each),
            verdict(each <= 8.0),
            bytes(expected)
        ));
    }
    if results.iter().any(|m| m.case.starts_with("padded/")) {
        let floor = 128.0 * possible as f64;
        targets.note(format!(
            "padded: {} B of data per counter ({possible} × 128 B); the rest of its resident \
             figure ({} B) is the allocator's rounding for 128-byte alignment. Its address-space \
             figure is approximate: the heap hands out space freed earlier, already counted \
             in VmSize",
            bytes(floor),
            cell(median_of(results, "padded/resident", threads)),
        ));
    }
    targets
}

/// The same counters on a 256-CPU machine, by arithmetic.
fn on_256_cpus() -> String {
    const CPUS: f64 = 256.0;
    let padded = CPUS * 128.0;
    let dense_space = (CPUS + 1.0) * 8.0;
    format!(
        "\non a 256-CPU machine (arithmetic), per counter:\n\
         \x20 padded: {padded:.0} B of address space, all resident (PerCpu::new writes every slot)\n\
         \x20 dense:  {dense_space:.0} B of address space (257 rows × 8 B) plus at most one partly used \
         range per process (257 × 64 KiB = 16 MiB); resident 8 B × CPUs that ran \
         (16 B for 2, {:.0} B for all 256)\n\
         \x20 100,000 counters: padded {:.2} GB; dense {:.0} MB of address space, resident \
         {:.1} MB for 2 CPUs",
        8.0 * CPUS,
        padded * 1e5 / 1e9,
        dense_space * 1e5 / 1e6,
        16.0 * 1e5 / 1e6,
    )
}
