//! `thiscpu compare BEFORE.json AFTER.json`: the change of every (bench, case, threads)
//! median between two reports, in the seeds' before / after / difference shape. With
//! `--threshold PCT` it fails (exit status 1) when a case got worse by more than PCT percent
//! and outside its spread, so that CI can gate on it.

use crate::error::{Error, Result};
use crate::report::json::{self, Report, ResultRow};
use crate::report::output::Output;
use crate::report::table::{self, align_right, fmt_num, fmt_percent, new_table};
use comfy_table::Table;
use std::path::Path;

/// Reads both reports, prints the comparison, and checks the threshold.
pub fn run(
    before: &Path,
    after: &Path,
    threshold: Option<f64>,
    markdown: Option<&Path>,
) -> Result<()> {
    let markdown = markdown.map(Output::open).transpose()?;
    let old = json::read(before)?;
    let new = json::read(after)?;
    let (before_name, after_name) = (before.display().to_string(), after.display().to_string());
    if !markdown.as_ref().is_some_and(Output::is_stdout) {
        println!(
            "{}",
            render(&old, &new, &before_name, &after_name, Style::Text)
        );
    }
    if let Some(output) = markdown {
        let mut text = render(&old, &new, &before_name, &after_name, Style::Markdown);
        text.push('\n');
        output.commit(text.as_bytes())?;
    }
    let Some(percent) = threshold else {
        return Ok(());
    };
    let worse = regressions(&old, &new, percent);
    if worse.is_empty() {
        return Ok(());
    }
    Err(Error::failed(format!(
        "{} case{} got worse by more than {percent} % and outside the spread: {}",
        worse.len(),
        if worse.len() == 1 { "" } else { "s" },
        worse.join(", ")
    )))
}

/// How tables are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// The terminal's house style.
    Text,
    /// Markdown pipe tables under headings.
    Markdown,
}

/// Cases present in both reports, in the same unit, that got worse by more than `percent`
/// with min-max ranges that do not overlap: `bench/case ×threads (+12.3 %)`.
pub fn regressions(before: &Report, after: &Report, percent: f64) -> Vec<String> {
    let mut worse = Vec::new();
    for new in &after.results {
        let Some(old) = before.results.iter().find(|old| key(old) == key(new)) else {
            continue;
        };
        if old.unit != new.unit || old.median == 0.0 {
            continue;
        }
        let change = 100.0 * (new.median - old.median) / old.median;
        let worse_by = if old.lower_is_better() {
            change
        } else {
            -change
        };
        let overlap = new.min <= old.max && old.min <= new.max;
        if worse_by > percent && !overlap {
            worse.push(format!("{} ({})", label(key(new)), fmt_percent(change)));
        }
    }
    worse
}

type Key<'a> = (&'a str, &'a str, u64);

fn key(row: &ResultRow) -> Key<'_> {
    (row.bench.as_str(), row.case.as_str(), row.threads)
}

fn label((bench, case, threads): Key<'_>) -> String {
    format!("{bench}/{case} ×{threads}")
}

/// The comparison as text or Markdown.
pub fn render(
    before: &Report,
    after: &Report,
    before_name: &str,
    after_name: &str,
    style: Style,
) -> String {
    let mut out = String::new();
    if style == Style::Markdown {
        out.push_str("# thiscpu compare\n\n");
    }
    out.push_str(&header(before, after, before_name, after_name, style));
    let mut unmatched = Unmatched::default();
    for bench in benches(before, after) {
        if let Some(table) = bench_table(before, after, bench, &mut unmatched) {
            out.push_str(&in_style(bench, table, style));
        }
    }
    if !unmatched.only_before.is_empty() {
        out.push_str(&format!(
            "\nonly in before ({before_name}): {}\n",
            unmatched.only_before.join(", ")
        ));
    }
    if !unmatched.only_after.is_empty() {
        out.push_str(&format!(
            "\nonly in after ({after_name}): {}\n",
            unmatched.only_after.join(", ")
        ));
    }
    out.trim_end().to_owned()
}

/// Which file is which, and the machine (or each file's, when they differ).
fn header(
    before: &Report,
    after: &Report,
    before_name: &str,
    after_name: &str,
    style: Style,
) -> String {
    let header = if before.machine.summary() == after.machine.summary() {
        format!(
            "before: {before_name}\nafter:  {after_name}\nmachine: {}\n",
            before.machine.summary()
        )
    } else {
        format!(
            "before: {before_name} — {}\nafter:  {after_name} — {}\n",
            before.machine.summary(),
            after.machine.summary()
        )
    };
    match style {
        Style::Text => header,
        // One list item per line, or Markdown would join them into one paragraph.
        Style::Markdown => header
            .lines()
            .map(|line| format!("- {}\n", line.replacen(":  ", ": ", 1)))
            .collect(),
    }
}

/// Benches in order of first appearance, before's first.
fn benches<'a>(before: &'a Report, after: &'a Report) -> Vec<&'a str> {
    let mut benches: Vec<&str> = Vec::new();
    for row in before.results.iter().chain(&after.results) {
        if !benches.contains(&row.bench.as_str()) {
            benches.push(&row.bench);
        }
    }
    benches
}

/// Results found in one report only, by label and why the other left them out.
#[derive(Default)]
struct Unmatched {
    only_before: Vec<String>,
    only_after: Vec<String>,
}

/// One bench's table of the results in both reports, in order of first appearance; `None`
/// when no result is in both. Those in one report only go to `unmatched`.
fn bench_table(
    before: &Report,
    after: &Report,
    bench: &str,
    unmatched: &mut Unmatched,
) -> Option<Table> {
    let find = |report: &'_ Report, k: Key<'_>| -> Option<ResultRow> {
        report.results.iter().find(|r| key(r) == k).cloned()
    };
    let mut keys: Vec<Key<'_>> = Vec::new();
    for row in before.results.iter().chain(&after.results) {
        let k = key(row);
        if row.bench == bench && !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut table = new_table();
    table.set_header(vec![
        "case",
        "threads",
        "unit",
        "before (min–max)",
        "after (min–max)",
        "difference",
        "change",
    ]);
    let mut rows = 0;
    for k in keys {
        match (find(before, k), find(after, k)) {
            (Some(old), Some(new)) => {
                table.add_row(comparison_row(&old, &new));
                rows += 1;
            }
            (Some(_), None) => unmatched.only_before.push(label(k) + &left_out(after, k)),
            (None, Some(_)) => unmatched.only_after.push(label(k) + &left_out(before, k)),
            (None, None) => {}
        }
    }
    if rows == 0 {
        return None;
    }
    align_right(&mut table, &[1, 3, 4, 5]);
    Some(table)
}

/// A result in both reports: both medians with their ranges, the difference, the change.
fn comparison_row(old: &ResultRow, new: &ResultRow) -> Vec<String> {
    let cell = |row: &ResultRow| {
        format!(
            "{} ({}–{})",
            fmt_num(row.median),
            fmt_num(row.min),
            fmt_num(row.max)
        )
    };
    let unit = if old.unit == new.unit {
        old.unit.clone()
    } else {
        format!("{} → {}", old.unit, new.unit)
    };
    let (difference, change) = if old.unit != new.unit {
        (String::new(), "unit changed".to_owned())
    } else {
        describe_change(old, new)
    };
    vec![
        old.case.clone(),
        old.threads.to_string(),
        unit,
        cell(old),
        cell(new),
        difference,
        change,
    ]
}

/// A bench's table under its name, as text or as a Markdown section.
fn in_style(bench: &str, mut table: Table, style: Style) -> String {
    match style {
        Style::Text => format!("\n{bench}\n{}\n", table::render(&table)),
        Style::Markdown => format!("\n## {bench}\n\n{}\n", table::markdown(&mut table)),
    }
}

/// ` (left out there: REASON)` when `report` lists the case as skipped.
fn left_out(report: &Report, (bench, case, _): Key<'_>) -> String {
    report
        .skipped
        .iter()
        .find(|s| s.bench == bench && s.case == case)
        .map_or_else(String::new, |s| format!(" (left out there: {})", s.reason))
}

/// The difference of the medians, and the percent change with a verdict: better, worse, or
/// within the spread (the two min–max ranges overlap).
fn describe_change(old: &ResultRow, new: &ResultRow) -> (String, String) {
    let difference = new.median - old.median;
    let sign = if difference > 0.0 { "+" } else { "" };
    let difference_text = format!("{sign}{}", fmt_num(difference));
    if old.median == 0.0 {
        return (difference_text, "n/a (before is 0)".to_owned());
    }
    let percent = 100.0 * difference / old.median;
    let overlap = new.min <= old.max && old.min <= new.max;
    let verdict = if overlap {
        "within spread"
    } else if (difference < 0.0) == old.lower_is_better() {
        "better"
    } else {
        "worse"
    };
    (
        difference_text,
        format!("{} {verdict}", fmt_percent(percent)),
    )
}
