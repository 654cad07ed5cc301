//! The JSON report every benchmark family writes, and reads back for `compare`.
//!
//! The shape is fixed by `docs/bench-schema.json`: a `machine` object and a `results` array
//! of `{bench, case, threads, unit, median, min, max, rounds}`; `skipped` lists the cases
//! left out. Other fields are extras that readers may ignore.

use crate::bench::model::{Measured, RunInfo, Skipped, Stats};
use crate::error::{Error, Result};
use crate::machine::Machine;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A whole report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The version of this document's shape (absent in reports written before it existed).
    #[serde(default)]
    pub schema_version: u32,
    /// The machine and rseq state.
    pub machine: Machine,
    /// How the run was laid out (extra).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<Run>,
    /// One entry per (bench, case, threads).
    pub results: Vec<ResultRow>,
    /// Cases this machine could not run.
    #[serde(default)]
    pub skipped: Vec<SkippedRow>,
}

/// How the run was laid out.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Run {
    /// Version of the thiscpu command that measured.
    pub thiscpu_version: String,
    /// Rounds per (case, thread count).
    pub rounds: u32,
    /// Length of one measurement, in seconds.
    pub round_seconds: f64,
    /// The time budget asked for, in seconds.
    pub budget_seconds: f64,
    /// Whether `--quick` was given.
    pub quick: bool,
    /// The CPUs workers were pinned to, in order.
    pub cpus: Vec<u32>,
    /// When the report was written, in seconds since the Unix epoch.
    pub unix_time: u64,
    /// The command line that made the report, program name first (absent in older reports).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
}

/// One (bench, case, threads) result.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ResultRow {
    /// The family.
    pub bench: String,
    /// The case.
    pub case: String,
    /// Worker threads.
    pub threads: u64,
    /// Unit of every number in this row: `ns/op`, `Mops/s`.
    pub unit: String,
    /// Median over the rounds.
    pub median: f64,
    /// Smallest round.
    pub min: f64,
    /// Largest round.
    pub max: f64,
    /// Mean of the rounds (absent in reports written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean: Option<f64>,
    /// Sample standard deviation of the rounds (absent in older reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stddev: Option<f64>,
    /// Every round's value, in the order measured.
    pub rounds: Vec<f64>,
    /// `"lower"` or `"higher"`: which way is better (extra).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub better: Option<String>,
    /// What the case calls (extra).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub how: Option<String>,
    /// CPUs the workers were pinned to (extra).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cpus: Vec<u32>,
    /// Operations timed over all rounds and threads (extra).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops: Option<u64>,
    /// Median over the rounds of the share of wall-clock time the workers ran (extra): well
    /// below 1 on a busy machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_cpu: Option<f64>,
    /// That share in every round, in round order (extra; absent in older reports).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_cpu_rounds: Vec<f64>,
}

impl ResultRow {
    /// Whether a smaller number is better: from `better` when present, else from the unit.
    pub fn lower_is_better(&self) -> bool {
        match self.better.as_deref() {
            Some("higher") => false,
            Some("lower") => true,
            _ => !self.unit.contains("/s"),
        }
    }
}

/// A case left out, and why.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SkippedRow {
    /// The family.
    pub bench: String,
    /// The case.
    pub case: String,
    /// Why.
    pub reason: String,
}

impl Report {
    /// The report of a run.
    pub fn build(
        machine: &Machine,
        info: &RunInfo,
        measured: &[Measured],
        skipped: &[Skipped],
    ) -> Report {
        let unix_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Report {
            schema_version: crate::report::output::SCHEMA_VERSION,
            machine: machine.clone(),
            run: Some(Run {
                thiscpu_version: env!("CARGO_PKG_VERSION").to_owned(),
                rounds: info.rounds,
                round_seconds: info.round.as_secs_f64(),
                budget_seconds: info.budget_seconds,
                quick: info.quick,
                cpus: info.cpus.clone(),
                unix_time,
                command: std::env::args().collect(),
            }),
            results: measured.iter().map(row).collect(),
            skipped: skipped
                .iter()
                .map(|s| SkippedRow {
                    bench: s.bench.to_owned(),
                    case: s.case.to_owned(),
                    reason: s.reason.clone(),
                })
                .collect(),
        }
    }
}

fn row(m: &Measured) -> ResultRow {
    let stats = m.stats();
    ResultRow {
        bench: m.bench.to_owned(),
        case: m.case.to_owned(),
        threads: m.threads as u64,
        unit: m.unit.label().to_owned(),
        median: stats.median,
        min: stats.min,
        max: stats.max,
        mean: Some(stats.mean),
        stddev: Some(stats.stddev),
        rounds: m.rounds.clone(),
        better: Some(
            if m.unit.lower_is_better() {
                "lower"
            } else {
                "higher"
            }
            .to_owned(),
        ),
        how: (!m.how.is_empty()).then(|| m.how.clone()),
        cpus: m.cpus.clone(),
        ops: Some(m.ops),
        on_cpu: (!m.on_cpu.is_empty()).then(|| Stats::of(&m.on_cpu).median),
        on_cpu_rounds: m.on_cpu.clone(),
    }
}

/// Reads a report written by `thiscpu bench --json`.
pub fn read(path: &Path) -> Result<Report> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::read(path, e))?;
    serde_json::from_str(&text).map_err(|e| {
        Error::input(format!(
            "{}: not a thiscpu bench report: {e}",
            path.display()
        ))
    })
}
