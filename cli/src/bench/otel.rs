//! `otel`: OpenTelemetry counters, the SDK's (`opentelemetry_sdk`) against per-CPU ones
//! (`thiscpu-opentelemetry`), on the SDK's own stress workload:
//!
//! - `unbound/...`: `add(1, attributes)` with three attributes (`attribute1..3`), each value drawn
//!   at random from ten (`value1..10`) by a per-thread xorshift: 1,000 series. The attribute
//!   array is built in the loop, as a program builds it.
//! - `bound/...`: `add(1)` on a handle bound to three fixed attributes; `bound/counter-inc` is
//!   `thiscpu::Counter::inc`, the floor a per-CPU bound handle aims at.
//! - `...+collector`: the same while a thread collects (a flush of the SDK pipeline, here an
//!   in-memory exporter, every 10 ms), as a service exporting its metrics does.
//! - `thiscpu-otel`: the per-CPU counter through OpenTelemetry's own `Counter<u64>`, what code
//!   changed by one line calls. There is no bound case of it: per-CPU bound handles come from
//!   `PerCpuCounter::bind` (`bound/thiscpu`), as `thiscpu-opentelemetry` leaves the API's bound
//!   instruments off.
//!
//! Every case reads its total through the SDK pipeline (the exporter's cumulative sum after a
//! flush) before and after each round; the growth must equal the adds made, or the run fails.
//!
//! `memory/...`: bytes per series of a per-CPU counter once 20 counters of 1,000 series each
//! (the workload's attribute sets) were added to from every CPU the round uses (one CPU per
//! thread of the row): the growth of the resident set (`Rss` of `/proc/self/smaps_rollup`) and
//! of the address space (`VmSize`), divided by the series. The shared registry of the series is
//! included; from two CPU counts the report separates it from the part on each CPU, so the
//! rows are that shared part plus one per-CPU part per CPU.

use super::runner::cpus_for;
use super::model::{
    Case, Family, Measured, Measuring, ProcessMemory, Unit, Workload, median_of,
};
use crate::report::table::{fmt_num, fmt_ratio, verdict};
use opentelemetry::KeyValue;
use opentelemetry::metrics::{BoundCounter as OtelBoundCounter, Counter, MeterProvider};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider,
    Temporality,
};
use std::cell::Cell;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiscpu_opentelemetry::{BoundCounter, PerCpuCounter, PerCpuMeterExt};

const CASES: &[&str] = &[
    "unbound/sdk",
    "unbound/thiscpu",
    "unbound/thiscpu-otel",
    "unbound/sdk+collector",
    "unbound/thiscpu+collector",
    "bound/counter-inc",
    "bound/sdk",
    "bound/thiscpu",
    "bound/sdk+collector",
    "bound/thiscpu+collector",
    "memory/resident",
    "memory/address-space",
];

/// The family.
pub static FAMILY: Family = Family {
    name: "otel",
    about: "OpenTelemetry counter adds, the SDK's against per-CPU ones, on the SDK's stress \
            workload (3 attributes x 10 random values; a bound counter), without and with a \
            collector (ns/op per thread); bytes per series",
    case_names: CASES,
    default_threads: &[1, 2],
    baseline: Some("*/sdk"),
    cases,
    report,
};

const KEYS: [&str; 3] = ["attribute1", "attribute2", "attribute3"];
const VALUES: [&str; 10] = [
    "value1", "value2", "value3", "value4", "value5", "value6", "value7", "value8", "value9",
    "value10",
];
/// Between two collections by the collector thread.
const COLLECT_EVERY: Duration = Duration::from_millis(10);
const METRIC: &str = "requests";

thread_local! {
    /// The xorshift state of this thread's draws.
    static RNG: Cell<u64> = const { Cell::new(0) };
}

/// Three random attributes of the workload.
#[inline(always)]
fn random_attributes() -> [KeyValue; 3] {
    let mut x = RNG.with(|rng| rng.get());
    if x == 0 {
        // Seeded per thread, so threads draw different sequences.
        x = thiscpu::topology::possible_cpus() as u64 ^ (&x as *const u64 as u64) | 1;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    RNG.with(|rng| rng.set(x));
    let pick = |shift: u32| VALUES[((x >> shift) % 10) as usize];
    [
        KeyValue::new(KEYS[0], pick(8)),
        KeyValue::new(KEYS[1], pick(24)),
        KeyValue::new(KEYS[2], pick(40)),
    ]
}

fn fixed_attributes() -> [KeyValue; 3] {
    [
        KeyValue::new(KEYS[0], VALUES[0]),
        KeyValue::new(KEYS[1], VALUES[1]),
        KeyValue::new(KEYS[2], VALUES[2]),
    ]
}

/// An SDK pipeline ending in an in-memory exporter with cumulative temporality, so that the
/// last export holds every total.
struct Pipeline {
    provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
}

impl Pipeline {
    fn new() -> Pipeline {
        let exporter = InMemoryMetricExporterBuilder::new()
            .with_temporality(Temporality::Cumulative)
            .build();
        let reader = PeriodicReader::builder(exporter.clone())
            .with_interval(Duration::from_secs(3600))
            .build();
        let provider = SdkMeterProvider::builder().with_reader(reader).build();
        Pipeline { provider, exporter }
    }

    /// Collects, exports, and returns the sum over every series of the metric, forgetting the
    /// exports so that they do not pile up.
    fn collect(&self) -> Result<u64, String> {
        self.provider
            .force_flush()
            .map_err(|e| format!("flush failed: {e}"))?;
        let exports = self
            .exporter
            .get_finished_metrics()
            .map_err(|e| format!("no exported metrics: {e}"))?;
        self.exporter.reset();
        let mut total = 0;
        if let Some(last) = exports.last() {
            for scope in last.scope_metrics() {
                for metric in scope.metrics().filter(|m| m.name() == METRIC) {
                    match metric.data() {
                        AggregatedMetrics::U64(MetricData::Sum(sum)) => {
                            total += sum.data_points().map(|p| p.value()).sum::<u64>();
                        }
                        _ => return Err(format!("{METRIC} is not a u64 sum")),
                    }
                }
            }
        }
        Ok(total)
    }
}

/// How one case adds.
enum Adds {
    Sdk(Counter<u64>),
    PerCpu(PerCpuCounter),
    Otel(Counter<u64>),
    SdkBound(OtelBoundCounter<u64>),
    PerCpuBound(BoundCounter),
}

/// A case: the pipeline, the adds, and the collector thread when there is one.
struct OtelCase {
    pipeline: Arc<Pipeline>,
    adds: Adds,
    collector: bool,
    running: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<Result<(), String>>>>,
    start: AtomicU64,
}

impl OtelCase {
    fn new(sdk: bool, bound: bool, through_otel: bool, collector: bool) -> OtelCase {
        let pipeline = Arc::new(Pipeline::new());
        let meter = pipeline.provider.meter("bench");
        let adds = if sdk {
            let counter = meter.u64_counter(METRIC).build();
            if bound {
                Adds::SdkBound(counter.bind(&fixed_attributes()))
            } else {
                Adds::Sdk(counter)
            }
        } else {
            let counter = meter.percpu_u64_counter(METRIC).build();
            match (bound, through_otel) {
                (false, false) => Adds::PerCpu(counter),
                (false, true) => Adds::Otel(counter.counter()),
                (true, _) => Adds::PerCpuBound(counter.bind(&fixed_attributes())),
            }
        };
        OtelCase {
            pipeline,
            adds,
            collector,
            running: Arc::new(AtomicBool::new(false)),
            thread: Mutex::new(None),
            start: AtomicU64::new(0),
        }
    }

    fn stop_collector(&self) -> Result<(), String> {
        self.running.store(false, Ordering::Release);
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        match thread {
            Some(thread) => thread
                .join()
                .map_err(|_| "the collector panicked".to_owned())?,
            None => Ok(()),
        }
    }
}

impl Workload for OtelCase {
    fn prepare(&self, _threads: usize) {
        // A collector left from the previous round stops first; the total is read with none.
        let _ = self.stop_collector();
        self.start
            .store(self.pipeline.collect().unwrap_or(u64::MAX), Ordering::Relaxed);
        if self.collector {
            self.running.store(true, Ordering::Release);
            let (pipeline, running) = (self.pipeline.clone(), self.running.clone());
            let thread = std::thread::spawn(move || {
                while running.load(Ordering::Acquire) {
                    pipeline.collect()?;
                    std::thread::sleep(COLLECT_EVERY);
                }
                Ok(())
            });
            *self.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        }
    }

    fn end_calibration(&self) {
        // Its errors are the rounds' to report: the collection fails there again.
        let _ = self.stop_collector();
    }

    fn run(&self, _worker: usize, ops: u64) {
        let adds = black_box(&self.adds);
        match adds {
            Adds::Sdk(counter) | Adds::Otel(counter) => {
                for _ in 0..ops {
                    counter.add(1, &random_attributes());
                }
            }
            Adds::PerCpu(counter) => {
                for _ in 0..ops {
                    counter.add(1, &random_attributes());
                }
            }
            Adds::SdkBound(bound) => {
                for _ in 0..ops {
                    bound.add(1);
                }
            }
            Adds::PerCpuBound(bound) => {
                for _ in 0..ops {
                    bound.add(1);
                }
            }
        }
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        self.stop_collector()?;
        let start = self.start.load(Ordering::Relaxed);
        if start == u64::MAX {
            return Err("the total before the round could not be collected".to_owned());
        }
        let end = self.pipeline.collect()?;
        let grown = end.wrapping_sub(start);
        if grown == ops {
            Ok(())
        } else {
            Err(format!(
                "the exported total grew by {grown}, {ops} adds were made"
            ))
        }
    }
}

/// `thiscpu::Counter::inc` on one counter, checked like the others.
struct CounterInc {
    counter: thiscpu::Counter,
    start: AtomicU64,
}

impl Workload for CounterInc {
    fn prepare(&self, _threads: usize) {
        self.start.store(self.counter.sum(), Ordering::Relaxed);
    }

    fn run(&self, _worker: usize, ops: u64) {
        let counter = black_box(&self.counter);
        for _ in 0..ops {
            counter.inc();
        }
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        let grown = self
            .counter
            .sum()
            .wrapping_sub(self.start.load(Ordering::Relaxed));
        if grown == ops {
            Ok(())
        } else {
            Err(format!("the counter grew by {grown}, {ops} increments were made"))
        }
    }
}

/// Counters per memory measurement, and series in each (the workload's 1,000 attribute sets).
const MEMORY_COUNTERS: usize = 20;
const SERIES: usize = 1000;

/// Which figure a memory case reports.
#[derive(Clone, Copy, Debug)]
enum Figure {
    Resident,
    AddressSpace,
}

/// Bytes per series: counters made (with a provider that has no reader, so nothing
/// collects), every series added to once from each CPU of `cpus`, checked, and kept.
fn measure_memory(cpus: &[u32]) -> Result<(f64, f64), String> {
    let provider = SdkMeterProvider::builder().build();
    let meter = provider.meter("memory");
    let sets: Vec<[KeyValue; 3]> = (0..SERIES)
        .map(|i| {
            [
                KeyValue::new(KEYS[0], VALUES[i % 10]),
                KeyValue::new(KEYS[1], VALUES[i / 10 % 10]),
                KeyValue::new(KEYS[2], VALUES[i / 100 % 10]),
            ]
        })
        .collect();
    let mut counters = Vec::with_capacity(MEMORY_COUNTERS);
    let before = ProcessMemory::now()?;
    for _ in 0..MEMORY_COUNTERS {
        counters.push(meter.percpu_u64_counter(METRIC).build());
    }
    for &cpu in cpus {
        let _pinned = thiscpu::topology::pin_to(cpu)
            .map_err(|error| format!("cannot pin to CPU {cpu}: {error}"))?;
        for counter in &counters {
            for set in &sets {
                counter.add(1, set);
            }
        }
    }
    let after = ProcessMemory::now()?;
    for counter in &counters {
        let totals = counter.totals();
        if totals.len() != SERIES || totals.iter().any(|(_, n)| *n != cpus.len() as u64) {
            return Err("a counter does not hold one add per series per CPU".to_owned());
        }
    }
    // Kept: freed memory would serve the next measurement, whose growth would read lower.
    std::mem::forget(counters);
    std::mem::forget(provider);
    let per = |after: u64, before: u64| {
        after.saturating_sub(before) as f64 / (MEMORY_COUNTERS * SERIES) as f64
    };
    Ok((
        per(after.resident, before.resident),
        per(after.vm_size, before.vm_size),
    ))
}

fn cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    let case = |name, how: &str, sdk, bound, through_otel, collector| {
        Case::new(
            name,
            how,
            ns,
            OtelCase::new(sdk, bound, through_otel, collector),
        )
    };
    let memory = |name, how: &str, figure| {
        Case::new(
            name,
            how,
            Unit::Bytes,
            Measuring::new(move |threads| {
                measure_memory(&cpus_for(threads)).map(|(resident, size)| match figure {
                    Figure::Resident => resident,
                    Figure::AddressSpace => size,
                })
            }),
        )
    };
    vec![
        case("unbound/sdk", "SDK Counter::add, 3 random attributes", true, false, false, false),
        case("unbound/thiscpu", "PerCpuCounter::add, 3 random attributes", false, false, false, false),
        case("unbound/thiscpu-otel", "per-CPU through opentelemetry Counter::add", false, false, true, false),
        case("unbound/sdk+collector", "unbound/sdk, a flush every 10 ms", true, false, false, true),
        case("unbound/thiscpu+collector", "unbound/thiscpu, a flush every 10 ms", false, false, false, true),
        Case::new(
            "bound/counter-inc",
            "thiscpu::Counter::inc",
            ns,
            CounterInc {
                counter: thiscpu::Counter::new(),
                start: AtomicU64::new(0),
            },
        ),
        case("bound/sdk", "SDK BoundCounter::add", true, true, false, false),
        case("bound/thiscpu", "thiscpu_opentelemetry::BoundCounter::add", false, true, false, false),
        case("bound/sdk+collector", "bound/sdk, a flush every 10 ms", true, true, false, true),
        case("bound/thiscpu+collector", "bound/thiscpu, a flush every 10 ms", false, true, false, true),
        memory(
            "memory/resident",
            "Rss growth per series, every series added to from each CPU used",
            Figure::Resident,
        ),
        memory(
            "memory/address-space",
            "VmSize growth per series, every series added to from each CPU used",
            Figure::AddressSpace,
        ),
    ]
}

/// The goals, as ratios of medians.
fn report(results: &[Measured]) -> String {
    let ns = |case: &str, threads: usize| median_of(results, case, threads);
    let mut lines = Vec::new();
    let mut goal = |label: String, ratio: Option<f64>, met: fn(f64) -> bool, target: &str| {
        if let Some(ratio) = ratio {
            lines.push(format!(
                "  {label}: {} (target {target}): {}",
                fmt_ratio(ratio),
                verdict(met(ratio))
            ));
        }
    };
    let ratio = |theirs: Option<f64>, ours: Option<f64>| Some(theirs? / ours?);
    for threads in [1, 2] {
        let (ours, theirs) = (ns("unbound/thiscpu", threads), ns("unbound/sdk", threads));
        let (target, met): (&str, fn(f64) -> bool) = if threads == 1 {
            ("≥ 3×", |r| r >= 3.0)
        } else {
            ("≥ 10×", |r| r >= 10.0)
        };
        goal(
            format!("unbound thiscpu vs SDK throughput, {threads} thread(s)"),
            ratio(theirs, ours),
            met,
            target,
        );
        goal(
            format!("bound thiscpu ÷ Counter::inc time, {threads} thread(s)"),
            ratio(ns("bound/thiscpu", threads), ns("bound/counter-inc", threads)),
            |r| r <= 2.0,
            "≤ 2×",
        );
    }
    goal(
        "bound thiscpu vs SDK bound throughput, 2 threads".to_owned(),
        ratio(ns("bound/sdk", 2), ns("bound/thiscpu", 2)),
        |r| r >= 5.0,
        "≥ 5×",
    );
    let mut out = String::new();
    for (case, what) in [
        ("memory/resident", "resident"),
        ("memory/address-space", "address space"),
    ] {
        // Each figure is shared + n x per CPU per series with n CPUs: two CPU counts separate
        // the series' shared part from its part on each CPU.
        let fewest = results.iter().filter(|m| m.case == case).min_by_key(|m| m.threads);
        let most = results.iter().filter(|m| m.case == case).max_by_key(|m| m.threads);
        if let (Some(a), Some(b)) = (fewest, most)
            && b.threads > a.threads
        {
            let (n1, m1) = (a.threads as f64, a.stats().median);
            let (n2, m2) = (b.threads as f64, b.stats().median);
            let per_cpu = (m2 - m1) / (n2 - n1);
            let shared = m1 - n1 * per_cpu;
            out.push_str(&format!(
                "\nmemory per series, {what}: {} B on each CPU that adds to it, {} B shared \
                 (from {} and {} CPUs)",
                fmt_num(per_cpu),
                fmt_num(shared),
                a.threads,
                b.threads
            ));
        }
    }
    out.push('\n');
    if !lines.is_empty() {
        out.push_str("\ntargets (ratios of medians):\n");
        out.push_str(&lines.join("\n"));
    }
    out.trim_end().to_owned()
}
