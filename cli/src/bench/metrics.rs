//! `metrics`: thiscpu against the real exporters, as services use them.
//!
//! Through the `metrics` facade, one `metrics::counter!(KEY).increment(1)` per operation (the
//! whole statement an application writes: the macro finds the recorder, the recorder looks the
//! key up and returns a handle, the handle increments and is dropped):
//! - `exporter`: metrics-exporter-prometheus' own recorder (`PrometheusBuilder::build_recorder`):
//!   its registry's shared `AtomicU64` per counter, and the handle's `Arc` cloned per call.
//! - `exporter-layered`: the same recorder behind `thiscpu::metrics::PerCpuLayer`: per-CPU
//!   counters, published to the exporter every second by the layer's thread.
//! - `percpu-recorder`: `thiscpu::metrics::PerCpuRecorder` alone, which exports nothing.
//!
//! In one `prometheus_client` registry, one call on a held metric per operation:
//! - `pclient-counter` / `thiscpu-pclient-counter`: prometheus-client's `Counter` (a shared
//!   `AtomicU64`) against `thiscpu::prometheus::Counter`.
//! - `pclient-histogram` / `thiscpu-pclient-histogram`: prometheus-client's `Histogram` (a
//!   mutex around buckets, count and sum) against `thiscpu::prometheus::Histogram`, with the
//!   same buckets and values spread over them.
//!
//! After every round each case checks its count where a scrape would read it: the exporter's
//! rendered text (after a flush, for the layered case), the registry's encoded text.

use super::model::{Case, Family, Measured, Stats, Unit, Workload};
use crate::report::table::{align_right, fmt_num, fmt_ratio, new_table, render, verdict};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use metrics_util::layers::Layer;
use prometheus_client::registry::Registry;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use thiscpu::metrics::{PerCpuLayer, PerCpuRecorder, Publisher};

/// The key every facade operation increments.
const KEY: &str = "bench_requests";

/// Histogram bounds of both histogram cases; the values observed cycle over all buckets.
const BOUNDS: [f64; 8] = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2];

/// The value of observation `i`: twenty values from 0.0005 to 0.384, spread over every
/// bucket including `+Inf`.
#[inline(always)]
fn value(i: u64) -> f64 {
    0.0005 * (1u64 << (i % 20 / 2)) as f64 * if i.is_multiple_of(2) { 1.0 } else { 1.5 }
}

const CASES: &[&str] = &[
    "exporter",
    "exporter-layered",
    "percpu-recorder",
    "pclient-counter",
    "thiscpu-pclient-counter",
    "pclient-histogram",
    "thiscpu-pclient-histogram",
];

/// The family.
pub static FAMILY: Family = Family {
    name: "metrics",
    about: "a counter through the metrics facade into metrics-exporter-prometheus, alone and \
            behind PerCpuLayer; prometheus-client's Counter and Histogram against thiscpu's \
            (ns per call, per thread)",
    case_names: CASES,
    default_threads: &[1, 2],
    baseline: None,
    cases,
    report,
};

fn cases() -> Vec<Case> {
    let mut cases = facade_cases();
    cases.extend(prometheus_client_cases());
    cases
}

/// A counter through the `metrics` facade, into the exporter alone, behind `PerCpuLayer`, and
/// into `PerCpuRecorder`.
fn facade_cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    let exporter = PrometheusBuilder::new().build_recorder();
    let exporter_handle = exporter.handle();
    let layered_inner = PrometheusBuilder::new().build_recorder();
    let layered_handle = layered_inner.handle();
    let layered = PerCpuLayer::new().layer(layered_inner);
    let publisher = layered.publisher();
    vec![
        Case::new(
            "exporter",
            "counter!().increment(1), metrics-exporter-prometheus",
            ns,
            Facade::new(
                exporter,
                Scrape::Exporter {
                    handle: exporter_handle,
                    publisher: None,
                },
            ),
        ),
        Case::new(
            "exporter-layered",
            "the same behind thiscpu PerCpuLayer",
            ns,
            Facade::new(
                layered,
                Scrape::Exporter {
                    handle: layered_handle,
                    publisher: Some(publisher),
                },
            ),
        ),
        Case::new(
            "percpu-recorder",
            "counter!().increment(1), thiscpu PerCpuRecorder",
            ns,
            {
                let recorder = PerCpuRecorder::new();
                Facade::new(recorder.clone(), Scrape::Snapshot(recorder))
            },
        ),
    ]
}

/// prometheus-client's Counter and Histogram beside thiscpu's, each in a registry.
fn prometheus_client_cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    vec![
        Case::new(
            "pclient-counter",
            "prometheus-client Counter::inc (AtomicU64)",
            ns,
            InRegistry::new(
                prometheus_client::metrics::counter::Counter::<u64>::default(),
                |c, ops, _| {
                    for _ in 0..ops {
                        let _ = c.inc();
                    }
                },
                "_total",
            ),
        ),
        Case::new(
            "thiscpu-pclient-counter",
            "thiscpu prometheus::Counter::inc",
            ns,
            InRegistry::new(
                thiscpu::prometheus::Counter::new(),
                |c, ops, _| (0..ops).for_each(|_| c.inc()),
                "_total",
            ),
        ),
        Case::new(
            "pclient-histogram",
            "prometheus-client Histogram::observe (mutex)",
            ns,
            InRegistry::new(
                prometheus_client::metrics::histogram::Histogram::new(BOUNDS),
                |h, ops, first| (first..first + ops).for_each(|i| h.observe(value(i))),
                "_count",
            ),
        ),
        Case::new(
            "thiscpu-pclient-histogram",
            "thiscpu prometheus::Histogram::observe",
            ns,
            InRegistry::new(
                thiscpu::prometheus::Histogram::new(BOUNDS),
                |h, ops, first| (first..first + ops).for_each(|i| h.observe(value(i))),
                "_count",
            ),
        ),
    ]
}

/// The value of sample line `series` in exposition `text`.
fn sample(text: &str, series: &str) -> Option<u64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse::<f64>().ok().map(|v| v as u64))?
        })
}

/// Where a facade case's count is read back.
enum Scrape {
    /// The exporter's rendered text, after publishing the layer's counters if there is one.
    Exporter {
        handle: PrometheusHandle,
        publisher: Option<Publisher<PrometheusRecorder>>,
    },
    /// A `PerCpuRecorder`'s snapshot.
    Snapshot(PerCpuRecorder),
}

impl Scrape {
    fn count(&self) -> u64 {
        match self {
            Scrape::Exporter { handle, publisher } => {
                if let Some(publisher) = publisher {
                    publisher.flush();
                }
                sample(&handle.render(), KEY).unwrap_or(0)
            }
            Scrape::Snapshot(recorder) => recorder.snapshot().counter(KEY).unwrap_or(0),
        }
    }
}

/// Facade increments of `KEY` through `recorder`, checked against the operations run.
struct Facade<R> {
    recorder: R,
    scrape: Scrape,
    /// The count when the measurement began.
    base: AtomicU64,
}

impl<R> Facade<R> {
    fn new(recorder: R, scrape: Scrape) -> Self {
        Facade {
            recorder,
            scrape,
            base: AtomicU64::new(0),
        }
    }
}

impl<R: metrics::Recorder + Send + Sync> Workload for Facade<R> {
    fn prepare(&self, _threads: usize) {
        self.base.store(self.scrape.count(), Ordering::Relaxed);
    }

    fn run(&self, _worker: usize, ops: u64) {
        metrics::with_local_recorder(&self.recorder, || {
            for _ in 0..ops {
                metrics::counter!(KEY).increment(1);
            }
        });
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        counted(self.scrape.count(), self.base.load(Ordering::Relaxed), ops)
    }
}

fn counted(now: u64, base: u64, ops: u64) -> Result<(), String> {
    match now.checked_sub(base) {
        Some(counted) if counted == ops => Ok(()),
        Some(counted) => Err(format!("counted {counted} operations of {ops}")),
        None => Err(format!("the count went down from {base} to {now}")),
    }
}

/// A metric registered in a `prometheus_client` registry, driven by `run(metric, ops, first
/// operation's index)`; its count is read from the encoded registry, at series `suffix`.
struct InRegistry<M> {
    metric: M,
    run: fn(&M, u64, u64),
    registry: Registry,
    suffix: &'static str,
    base: AtomicU64,
    /// Operations started so far, so that each thread's values go on cycling.
    started: AtomicU64,
    /// Encoding is not reentrant for one buffer; this keeps one.
    text: Mutex<String>,
}

impl<M: prometheus_client::registry::Metric + Clone> InRegistry<M> {
    fn new(metric: M, run: fn(&M, u64, u64), suffix: &'static str) -> Self {
        let mut registry = Registry::default();
        registry.register(KEY, "operations of the benchmark", metric.clone());
        InRegistry {
            metric,
            run,
            registry,
            suffix,
            base: AtomicU64::new(0),
            started: AtomicU64::new(0),
            text: Mutex::default(),
        }
    }

    fn count(&self) -> u64 {
        let mut text = self.text.lock().unwrap_or_else(|e| e.into_inner());
        text.clear();
        prometheus_client::encoding::text::encode(&mut *text, &self.registry)
            .expect("writing to a String");
        sample(&text, &format!("{KEY}{}", self.suffix)).unwrap_or(0)
    }
}

impl<M: prometheus_client::registry::Metric + Clone> Workload for InRegistry<M> {
    fn prepare(&self, _threads: usize) {
        self.base.store(self.count(), Ordering::Relaxed);
    }

    fn run(&self, _worker: usize, ops: u64) {
        let first = self.started.fetch_add(ops, Ordering::Relaxed);
        (self.run)(&self.metric, ops, first);
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        counted(self.count(), self.base.load(Ordering::Relaxed), ops)
    }
}

/// Median ns per operation of one thread of `case` with `threads` threads.
fn ns_per_op(results: &[Measured], case: &str, threads: usize) -> Option<f64> {
    super::model::median_of(results, case, threads)
}

/// The pairs the targets compare: (thiscpu's case, the competitor, what, the target with one
/// thread per CPU; without one, the pair is only reported).
const PAIRS: &[(&str, &str, &str, Option<f64>)] = &[
    (
        "exporter-layered",
        "exporter",
        "counter!() behind PerCpuLayer vs the exporter alone",
        Some(5.0),
    ),
    (
        "thiscpu-pclient-histogram",
        "pclient-histogram",
        "thiscpu Histogram::observe vs prometheus-client's",
        Some(3.0),
    ),
    (
        "thiscpu-pclient-counter",
        "pclient-counter",
        "thiscpu Counter::inc vs prometheus-client's",
        None,
    ),
];

/// Per-thread throughput beside the ns/op table, then the targets.
fn report(results: &[Measured]) -> String {
    let mut table = new_table();
    table.set_header(vec!["case", "threads", "Mops/s per thread", "min – max"]);
    for m in results {
        let values: Vec<f64> = m.rounds.iter().map(|&ns| 1e3 / ns.max(1e-12)).collect();
        let each = Stats::of(&values);
        table.add_row(vec![
            m.case.to_owned(),
            m.threads.to_string(),
            fmt_num(each.median),
            format!("{} – {}", fmt_num(each.min), fmt_num(each.max)),
        ]);
    }
    align_right(&mut table, &[1, 2, 3]);
    let mut out = String::from("\nthroughput (per thread, from each thread's CPU time):\n");
    out.push_str(&render(&table));
    out.push('\n');

    let fewest = results.iter().map(|m| m.threads).min();
    let most = results.iter().map(|m| m.threads).max();
    let mut lines = Vec::new();
    for &(ours, theirs, what, target) in PAIRS {
        if let Some(one) = fewest
            && let (Some(us), Some(them)) = (
                ns_per_op(results, ours, one),
                ns_per_op(results, theirs, one),
            )
        {
            let ratio = them / us;
            let judged = match target {
                Some(_) => format!(" (target ≥ 1×, no slower): {}", verdict(ratio >= 1.0)),
                None => String::new(),
            };
            lines.push(format!(
                "  {what}, {one} thread{}: {} the throughput{judged}",
                if one == 1 { "" } else { "s" },
                fmt_ratio(ratio),
            ));
        }
        if let Some(n) = most.filter(|&n| Some(n) != fewest)
            && let (Some(us), Some(them)) =
                (ns_per_op(results, ours, n), ns_per_op(results, theirs, n))
        {
            let ratio = them / us;
            let judged = match target {
                Some(target) => format!(" (target ≥ {target}×): {}", verdict(ratio >= target)),
                None => String::new(),
            };
            lines.push(format!(
                "  {what}, {n} threads: {} the per-thread throughput{judged}",
                fmt_ratio(ratio),
            ));
        }
    }
    if !lines.is_empty() {
        out.push_str("\ntargets (ratios of medians):\n");
        out.push_str(&lines.join("\n"));
    }
    out.trim_end().to_owned()
}
