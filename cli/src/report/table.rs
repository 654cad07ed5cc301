//! Human-readable tables: the run header, one table per family, the seed-shaped tables.

use crate::bench::model::{Family, Measured, RunInfo, Skipped, Stats, Unit};
use crate::machine::{Machine, format_cpu_list};
use comfy_table::{CellAlignment, ContentArrangement, Table};

/// comfy-table's preset format: a line under the header and nothing else (no borders, no
/// lines between rows or columns).
const HEADER_LINE_ONLY: &str = "     ──            ";

/// The seeds' ASCII boxes, with `+` where the header line meets a column.
const SEED_BOXES: &str = "||--+=++|-+||++++++";

/// A table in the house style: a line under the header, nothing else, cells padded by one
/// space.
pub fn new_table() -> Table {
    let mut table = Table::new();
    table
        .load_preset(HEADER_LINE_ONLY)
        .set_content_arrangement(ContentArrangement::Disabled);
    table
}

/// The table as text, without the trailing spaces of its padded last column.
pub fn render(table: &Table) -> String {
    table
        .lines()
        .map(|line| line.trim_end().to_owned())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Right-aligns the given columns.
pub fn align_right(table: &mut Table, columns: &[usize]) {
    for &index in columns {
        if let Some(column) = table.column_mut(index) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
}

/// One row per competitor (`kinds`) and, for each thread count, its median (`at`) and its
/// ratio to the structure it is compared with (`ours`: none for thiscpu's own rows). A row per
/// competitor rather than a column keeps the table narrow however many competitors there are.
pub fn competitors_table(
    kinds: &[&str],
    threads: &[usize],
    unit: &str,
    ratio_label: &str,
    at: impl Fn(&str, usize) -> Option<f64>,
    ours: impl Fn(&str) -> Option<&'static str>,
) -> Table {
    let mut table = new_table();
    let mut header = vec!["".to_owned()];
    for &n in threads {
        header.push(format!(
            "{n} thread{} {unit}",
            if n == 1 { "" } else { "s" }
        ));
        header.push(ratio_label.to_owned());
    }
    table.set_header(header);
    for &kind in kinds {
        let mut row = vec![kind.to_owned()];
        for &n in threads {
            let theirs = at(kind, n);
            row.push(theirs.map_or("–".to_owned(), fmt_num));
            row.push(match (theirs, ours(kind).and_then(|ours| at(ours, n))) {
                (Some(theirs), Some(ours)) if ours > 0.0 => fmt_ratio(theirs / ours),
                _ => String::new(),
            });
        }
        table.add_row(row);
    }
    align_right(&mut table, &(1..=2 * threads.len()).collect::<Vec<_>>());
    table
}

/// `text` with every line of prose longer than [`WIDTH`] wrapped, continuation lines indented
/// two more than the first; table lines (a run of three spaces between cells, or a rule) are
/// left as they are.
pub fn fit(text: &str) -> String {
    let mut out = Vec::new();
    for line in text.lines() {
        let body = line.trim_start();
        let indent = line.len() - body.len();
        let tabular = body.contains("   ") || body.starts_with('─') || body.starts_with('|');
        if line.chars().count() <= WIDTH as usize || tabular {
            out.push(line.to_owned());
            continue;
        }
        let mut cell = Table::new();
        cell.load_preset(comfy_table::presets::NOTHING)
            .set_content_arrangement(ContentArrangement::Dynamic)
            // comfy-table pads the cell by one space on each side, which leaves room for the
            // continuation lines' extra indent.
            .set_width(WIDTH.saturating_sub(indent as u16))
            .add_row(vec![body]);
        for (i, wrapped) in cell.lines().enumerate() {
            let wrapped = wrapped.trim();
            let pad = if i == 0 { indent } else { indent + 2 };
            out.push(format!("{:pad$}{wrapped}", ""));
        }
    }
    let mut fitted = out.join("\n");
    if text.ends_with('\n') {
        fitted.push('\n');
    }
    fitted
}

/// `text` without its blocks of the project's own performance targets: a line at the margin
/// that begins with `targets` and ends with `:`, and the indented lines under it. These say
/// whether a run met what the project aims at, which is the project's business more than the
/// reader's; `--targets` asks for them.
pub fn without_targets(text: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut in_targets = false;
    for line in text.lines() {
        if line.starts_with("targets") && line.trim_end().ends_with(':') {
            in_targets = true;
            // The blank line that set the block off goes with it.
            if out.last().is_some_and(|last| last.trim().is_empty()) {
                out.pop();
            }
            continue;
        }
        if in_targets && line.starts_with("  ") {
            continue;
        }
        in_targets = false;
        out.push(line);
    }
    let mut kept = out.join("\n");
    if text.ends_with('\n') && !kept.is_empty() {
        kept.push('\n');
    }
    kept
}

/// A duration in nanoseconds with three significant digits: `0.312`, `4.56`, `78.9`, `182`.
pub fn fmt_num(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude >= 100.0 || magnitude == 0.0 {
        format!("{value:.0}")
    } else if magnitude >= 10.0 {
        format!("{value:.1}")
    } else if magnitude >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    }
}

/// A duration in nanoseconds with its unit: `0.312 ns`.
pub fn fmt_ns(value: f64) -> String {
    format!("{} ns", fmt_num(value))
}

/// A ratio: `1.23×`, `12.3×`, `123×`.
pub fn fmt_ratio(ratio: f64) -> String {
    format!("{}×", fmt_num(ratio))
}

/// A signed percentage: `+3.1 %`, `-24.7 %`.
pub fn fmt_percent(percent: f64) -> String {
    if percent.abs() >= 10.0 {
        format!("{percent:+.1} %")
    } else {
        format!("{percent:+.2} %")
    }
}

/// The lines printed before any result: machine, rseq, how the run is laid out.
pub fn run_header(machine: &Machine, info: &RunInfo) -> String {
    let quick = if info.quick { " (--quick)" } else { "" };
    let order: Vec<String> = info.cpus.iter().map(u32::to_string).collect();
    format!(
        "thiscpu bench · {}\n{}; current_cpu() answers from {}, fallback {}\n\
         {} round{} of {:.3} s per case, interleaved{quick}; workers pinned to CPUs in the order {}",
        machine.summary(),
        machine.rseq.summary(),
        machine.cpu_source,
        machine.fallback,
        info.rounds,
        if info.rounds == 1 { "" } else { "s" },
        info.round.as_secs_f64(),
        order.join(", "),
    )
}

/// One family's results: a row per (case, thread count), then the cases left out.
pub fn family(family: &Family, results: &[Measured], skipped: &[Skipped]) -> String {
    let mut out = format!("{} — {}\n", family.name, family.about);
    if let Some(table) = family_table(family, results, Layout::Terminal) {
        out.push_str(&render(&table));
        out.push('\n');
        out.push_str(&fit(&legend(family, results)));
    }
    for (reason, cases) in by_reason(skipped) {
        out.push_str(&format!("  left out: {}: {reason}\n", cases.join(", ")));
    }
    let on_cpu: Vec<f64> = results
        .iter()
        .flat_map(|m| m.on_cpu.iter().copied())
        .collect();
    let share = Stats::of(&on_cpu).median;
    if !on_cpu.is_empty() && share < 0.9 {
        out.push_str(&format!(
            "  note: the workers were on their CPUs {:.0} % of the wall-clock time (other load, \
             or an emulator); ns/op counts only their CPU time\n",
            100.0 * share
        ));
    }
    out.trim_end().to_owned()
}

/// The same as [`family`], in Markdown: a heading, the table, the cases left out.
pub fn family_markdown(family: &Family, results: &[Measured], skipped: &[Skipped]) -> String {
    let mut out = format!("## {}\n\n{}\n", family.name, family.about);
    if let Some(mut table) = family_table(family, results, Layout::Markdown) {
        out.push('\n');
        out.push_str(&markdown(&mut table));
        out.push('\n');
    }
    if !skipped.is_empty() {
        out.push('\n');
    }
    for (reason, cases) in by_reason(skipped) {
        let cases: Vec<String> = cases.iter().map(|case| format!("`{case}`")).collect();
        out.push_str(&format!("- left out: {}: {reason}\n", cases.join(", ")));
    }
    out
}

/// The cases left out, grouped by reason in the order first met: a reason shared by several
/// cases (a kernel without a feature, say) is said once.
fn by_reason(skipped: &[Skipped]) -> Vec<(String, Vec<&'static str>)> {
    let mut groups = Vec::new();
    for skip in skipped {
        crate::bench::group_by_reason(&mut groups, &skip.reason, skip.case);
    }
    groups
}

/// A table as a Markdown pipe table.
pub fn markdown(table: &mut Table) -> String {
    table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    render(table)
}

/// The width the terminal output keeps to.
pub const WIDTH: u16 = 120;

/// Where a family's table goes: a terminal, which keeps to [`WIDTH`] columns and has what each
/// case calls in a legend below, or Markdown, which has it in a column.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    Terminal,
    Markdown,
}

/// What each case of `results` calls, once per case, wrapped to [`WIDTH`] columns; and, for
/// a baseline of `operation/structure`, what the ratio column divides by.
fn legend(family: &Family, results: &[Measured]) -> String {
    let mut table = new_table();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(WIDTH);
    let mut seen: Vec<&str> = Vec::new();
    for m in results {
        if !seen.contains(&m.case) && !m.how.is_empty() {
            seen.push(m.case);
            table.add_row(vec![m.case.to_owned(), m.how.clone()]);
        }
    }
    if seen.is_empty() {
        return String::new();
    }
    let has_ratio_column = results
        .iter()
        .any(|m| family.baseline_for(m.case).as_deref() == Some(m.case));
    let ratio = match (family.baseline, family.baseline_label()) {
        (Some(baseline), Some(label)) if baseline.contains('*') && has_ratio_column => format!(
            " (÷ {label}: each row's median over the {label} row with the same {} and thread \
             count)",
            if baseline.starts_with('*') {
                "prefix"
            } else {
                "suffix"
            }
        ),
        _ => String::new(),
    };
    format!("what each case calls{ratio}:\n{}\n", render(&table))
}

/// Which columns a family's table has.
struct Columns {
    /// What each case calls (Markdown only: the terminal has it in a legend).
    calls: bool,
    /// The thread count, when there are several.
    threads: bool,
    /// The unit beside each median, when the results have several.
    unit_per_row: bool,
    /// Each median over its baseline's, labelled so, when the baseline ran.
    ratio: Option<&'static str>,
}

/// A family's table, `None` without results.
fn family_table(family: &Family, results: &[Measured], layout: Layout) -> Option<Table> {
    if results.is_empty() {
        return None;
    }
    let units = {
        let mut units: Vec<Unit> = results.iter().map(|m| m.unit).collect();
        units.dedup();
        units
    };
    let columns = Columns {
        calls: layout == Layout::Markdown,
        threads: thread_counts(results).len() > 1,
        unit_per_row: units.len() > 1,
        ratio: family.baseline_label().filter(|_| {
            results
                .iter()
                .any(|m| family.baseline_for(m.case).as_deref() == Some(m.case))
        }),
    };
    let unit = match units.as_slice() {
        [one] => one.label(),
        _ => "",
    };
    let mut table = new_table();
    let mut header = vec!["case".to_owned()];
    if columns.calls {
        header.push("what it calls".to_owned());
    }
    if columns.threads {
        header.push("threads".to_owned());
    }
    header.push(format!("median {unit}"));
    header.push("min – max".to_owned());
    header.push("mean ± sd".to_owned());
    header.push("CPUs".to_owned());
    if let Some(label) = columns.ratio {
        header.push(format!("÷ {label}"));
    }
    table.set_header(header);
    for m in results {
        table.add_row(family_row(family, results, m, &columns));
    }
    let first_number = usize::from(columns.calls) + if columns.threads { 2 } else { 1 };
    align_right(
        &mut table,
        &[
            first_number,
            first_number + 1,
            first_number + 2,
            first_number + 3,
            first_number + 4,
        ],
    );
    Some(table)
}

/// The row of result `m` in its family's table.
fn family_row(
    family: &Family,
    results: &[Measured],
    m: &Measured,
    columns: &Columns,
) -> Vec<String> {
    let stats = m.stats();
    let mut row = vec![m.case.to_owned()];
    if columns.calls {
        row.push(m.how.clone());
    }
    if columns.threads {
        row.push(m.threads.to_string());
    }
    let suffix = if columns.unit_per_row {
        format!(" {}", m.unit.label())
    } else {
        String::new()
    };
    row.push(format!("{}{suffix}", fmt_num(stats.median)));
    row.push(format!("{} – {}", fmt_num(stats.min), fmt_num(stats.max)));
    row.push(format!(
        "{} ± {}",
        fmt_num(stats.mean),
        fmt_num(stats.stddev)
    ));
    row.push(format_cpu_list(&m.cpus));
    if columns.ratio.is_some() {
        row.push(match baseline_median(family, results, m) {
            Some(base) if base > 0.0 => fmt_ratio(stats.median / base),
            _ => String::new(),
        });
    }
    row
}

/// The median of the row `m` is divided by: its baseline's, at the same thread count.
///
/// A ratio only between like rows: of one unit (bytes divided by nanoseconds means nothing)
/// and, where case names are `operation/structure` and the baseline is one structure's, of
/// one operation (a write divided by a read neither).
fn baseline_median(family: &Family, results: &[Measured], m: &Measured) -> Option<f64> {
    let like = family.baseline_for(m.case)?;
    results
        .iter()
        .find(|base| base.case == like && base.threads == m.threads && base.unit == m.unit)
        .map(|base| base.stats().median)
}

/// Seed 000's table: a number of calls and the time they take, before and after, with the
/// decrease. Here one row per "before" source, each with its decrease to the "after" one.
pub fn seed_calls_table(befores: &[(&str, f64)], after: (&str, f64)) -> String {
    const CALLS: f64 = 1e9;
    let nanos = |ns_per_call: f64| format!("{:.0} ns", ns_per_call * CALLS);
    let mut table = Table::new();
    table
        .load_preset(SEED_BOXES)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(vec![
            "",
            "Number of Calls",
            "Time taken",
            "Difference (decrease)",
        ]);
    for &(label, before) in befores {
        let decrease = (before - after.1) * CALLS;
        table.add_row(vec![
            format!("Before: {label}"),
            format!("{CALLS:.0}"),
            nanos(before),
            format!(
                "{decrease:.0} ns ({:.2}%)",
                100.0 * (before - after.1) / before
            ),
        ]);
    }
    table.add_row(vec![
        format!("After: {}", after.0),
        format!("{CALLS:.0}"),
        nanos(after.1),
        String::new(),
    ]);
    align_right(&mut table, &[1, 2, 3]);
    render(&table)
}

/// Seed 003's figures: getcpu latency before (vDSO, syscall) and after (rseq), on this
/// machine beside the seed's own two machines.
pub fn seed_latency_table(vdso: Option<f64>, syscall: Option<f64>, after: f64) -> String {
    let cell = |value: Option<f64>| value.map_or_else(|| "–".to_owned(), fmt_ns);
    let mut table = new_table();
    table.set_header(vec![
        "",
        "before: vDSO getcpu",
        "before: syscall",
        "after: thiscpu getcpu",
    ]);
    table.add_row(vec![
        "this machine".to_owned(),
        cell(vdso),
        cell(syscall),
        fmt_ns(after),
    ]);
    table.add_row(vec!["seed 003, x86_64 (i7-8550U)", "10 ns", "–", "2 ns"]);
    table.add_row(vec![
        "seed 003, aarch64 (no vDSO getcpu)",
        "–",
        "130 ns",
        "1 ns",
    ]);
    align_right(&mut table, &[1, 2, 3]);
    render(&table)
}

/// `met` or `NOT met`, for the families' target lines.
pub fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

/// The thread counts of `results`, ascending, each once.
pub fn thread_counts<'a>(results: impl IntoIterator<Item = &'a Measured>) -> Vec<usize> {
    let mut counts: Vec<usize> = results.into_iter().map(|m| m.threads).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// `1 thread`, `4 threads`.
pub fn threads_phrase(n: usize) -> String {
    format!("{n} thread{}", if n == 1 { "" } else { "s" })
}

/// `table` under its title, the way families print their own tables: a blank line, the title
/// and a colon, the table, and a line end.
pub fn titled(title: &str, table: &Table) -> String {
    format!("\n{title}:\n{}\n", render(table))
}

/// A family's target lines under their heading (`targets (ratios of medians)`, say): claims
/// checked against their targets, and figures shown beside them.
pub struct Targets {
    heading: &'static str,
    lines: Vec<String>,
}

impl Targets {
    pub fn new(heading: &'static str) -> Self {
        Targets {
            heading,
            lines: Vec::new(),
        }
    }

    /// `  {claim} (target {target}): met`, or `NOT met`.
    pub fn check(&mut self, claim: impl std::fmt::Display, target: &str, met: bool) {
        self.lines
            .push(format!("  {claim} (target {target}): {}", verdict(met)));
    }

    /// A line of its own, indented as the claims are.
    pub fn note(&mut self, line: impl std::fmt::Display) {
        self.lines.push(format!("  {line}"));
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// The heading and the lines, the last one without a line end; nothing without lines.
    pub fn joined(&self) -> String {
        if self.lines.is_empty() {
            return String::new();
        }
        format!("\n{}:\n{}", self.heading, self.lines.join("\n"))
    }

    /// The heading and the lines, each ended; the heading even without lines.
    pub fn ended(&self) -> String {
        let mut text = format!("\n{}:\n", self.heading);
        for line in &self.lines {
            text.push_str(line);
            text.push('\n');
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_blocks_are_taken_out_and_nothing_else() {
        let report = "\nsummary: 3 B per counter\n\ntargets (ratios of medians):\n  a: 2× (target ≥ 1×): met\n  \
                      b: 1× (target ≥ 2×): NOT met\nafter: kept\n  indented, kept\n";
        let kept = without_targets(report);
        assert_eq!(
            kept,
            "\nsummary: 3 B per counter\nafter: kept\n  indented, kept\n"
        );
        assert_eq!(without_targets("no targets here\n"), "no targets here\n");
    }

    #[test]
    fn long_prose_is_wrapped_and_tables_are_not() {
        let prose = format!("  note: {}", "word ".repeat(60));
        let table_line = format!(" case{}median", " ".repeat(150));
        let fitted = fit(&format!("{prose}\n{table_line}\n"));
        let lines: Vec<&str> = fitted.lines().collect();
        assert!(lines.len() > 3, "{fitted}");
        assert!(
            lines
                .iter()
                .filter(|l| l.contains("word"))
                .all(|l| l.chars().count() <= 120),
            "{fitted}"
        );
        assert!(lines[0].starts_with("  note: word"), "{fitted}");
        assert!(lines[1].starts_with("    word"), "{fitted}");
        assert_eq!(lines.last(), Some(&table_line.as_str()));
        let words = fitted.matches("word").count();
        assert_eq!(words, 60, "no word lost or repeated");
    }

    #[test]
    fn numbers_keep_three_significant_digits() {
        assert_eq!(fmt_num(0.31234), "0.312");
        assert_eq!(fmt_num(4.567), "4.57");
        assert_eq!(fmt_num(78.91), "78.9");
        assert_eq!(fmt_num(182.4), "182");
        assert_eq!(fmt_percent(-24.74), "-24.7 %");
        assert_eq!(fmt_percent(3.1), "+3.10 %");
    }

    #[test]
    fn seed_table_reproduces_the_seed_arithmetic() {
        // Seed 000: 1602888401 ns before, 1206212658 ns after, 396675743 ns (24.74%).
        let table = seed_calls_table(&[("x", 1.602888401)], ("y", 1.206212658));
        assert!(table.contains("396675743 ns (24.75%)"), "{table}");
        assert!(table.contains("1602888401 ns"));
    }

    fn measured(case: &'static str, unit: Unit, value: f64) -> Measured {
        Measured {
            bench: "mixed",
            case,
            how: String::new(),
            threads: 1,
            cpus: vec![0],
            unit,
            rounds: vec![value; 3],
            ops: 3,
            on_cpu: vec![1.0; 3],
        }
    }

    static MIXED: Family = Family {
        name: "mixed",
        about: "timed and sized cases",
        case_names: &["base", "timed", "sized", "sized-base"],
        default_threads: &[1],
        baseline: Some("base"),
        cases: Vec::new,
        report: |_: &[Measured]| String::new(),
    };

    #[test]
    fn ratios_only_between_rows_of_one_unit() {
        let results = [
            measured("base", Unit::NsPerOp, 4.0),
            measured("timed", Unit::NsPerOp, 8.0),
            measured("sized", Unit::Bytes, 9000.0),
        ];
        let text = family(&MIXED, &results, &[]);
        let row = |case: &str| {
            text.lines()
                .find(|line| line.split_whitespace().next() == Some(case))
                .unwrap_or_else(|| panic!("no {case} row:\n{text}"))
                .to_owned()
        };
        assert!(row("timed").ends_with("2.00×"), "{text}");
        assert!(!row("sized").contains('×'), "bytes divided by ns:\n{text}");
    }

    #[test]
    fn a_reason_shared_by_several_cases_is_said_once() {
        let skip = |case| Skipped {
            bench: "mixed",
            case,
            reason: "the kernel lacks it".to_owned(),
        };
        let skipped = [skip("timed"), skip("sized"), skip("sized-base")];
        for text in [
            family(&MIXED, &[], &skipped),
            family_markdown(&MIXED, &[], &skipped),
        ] {
            assert_eq!(text.matches("the kernel lacks it").count(), 1, "{text}");
            for case in ["timed", "sized", "sized-base"] {
                assert!(text.contains(case), "{case} not named:\n{text}");
            }
        }
    }
}
