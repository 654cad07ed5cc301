//! Blocks of a Markdown file (the README, the pages under docs/) that quote recorded runs,
//! refreshed from the reports they name.
//!
//! A block opens with a marker line naming a report, relative to the Markdown file's folder,
//! and closes with `<!-- end bench -->`:
//!
//! ```text
//! <!-- bench-run results/bench.json -->          where, when and how the run was made
//! <!-- bench-family results/bench.json getcpu --> what the run printed for one family
//! <!-- bench-rows results/bench.json getcpu/current_cpu@1 other.json#pool/thiscpu-pool@2 -->
//!                                                 chosen results as one Markdown table
//! ```
//!
//! A row of `bench-rows` is `FAMILY/CASE@THREADS`, from the marker's report, or
//! `REPORT#FAMILY/CASE@THREADS` from another one. Everything between a marker and its end is
//! replaced; everything else is left as it is.

use crate::error::{Error, Result};
use crate::report::output::Output;
use crate::report::replay::Replay;
use crate::report::table;
use std::collections::HashMap;
use std::path::Path;

const END: &str = "<!-- end bench -->";

/// What a refresh found.
#[derive(Debug, PartialEq, Eq)]
pub struct Refreshed {
    /// Blocks rewritten from their reports.
    pub blocks: usize,
    /// Whether any of them differed from the file's text.
    pub changed: bool,
}

/// Rewrites every block of the file at `path` from its report. With `check`, writes nothing
/// and fails (exit status 1) when a block is out of date.
pub fn refresh(path: &Path, check: bool) -> Result<Refreshed> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::read(path, e))?;
    let folder = path.parent().unwrap_or(Path::new("."));
    let (new_text, blocks) = quote_reports(&text, &mut |report| Replay::read(&folder.join(report)))
        .map_err(|e| Error::input(format!("{}: {e}", path.display())))?;
    let refreshed = Refreshed {
        blocks,
        changed: new_text != text,
    };
    if check {
        if refreshed.changed {
            return Err(Error::failed(format!(
                "{}: its bench blocks differ from the reports they quote; \
                 `thiscpu report --readme {}` rewrites them",
                path.display(),
                path.display()
            )));
        }
    } else if refreshed.changed {
        Output::open(path)?.commit(new_text.as_bytes())?;
    }
    Ok(refreshed)
}

/// One marker: which report, and what of it.
#[derive(Debug, PartialEq, Eq)]
enum Block {
    Run { report: String },
    Family { report: String, family: String },
    Rows { rows: Vec<Row> },
}

/// One result named by a `bench-rows` marker.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    report: String,
    family: String,
    case: String,
    threads: usize,
}

impl Row {
    /// `[REPORT#]FAMILY/CASE@THREADS`, with `report` when it names none. Case names may hold
    /// `/` (`read/thiscpu`), family names do not.
    fn parse(word: &str, report: &str) -> Option<Row> {
        let (report, row) = word.split_once('#').unwrap_or((report, word));
        let (family, rest) = row.split_once('/')?;
        let (case, threads) = rest.rsplit_once('@')?;
        let threads = threads.parse().ok().filter(|&n: &usize| n > 0)?;
        if report.is_empty() || family.is_empty() || case.is_empty() {
            return None;
        }
        Some(Row {
            report: report.to_owned(),
            family: family.to_owned(),
            case: case.to_owned(),
            threads,
        })
    }
}

impl Block {
    /// The block a marker line opens, if it is one.
    fn parse(line: &str) -> Option<std::result::Result<Block, String>> {
        let inner = line
            .trim()
            .strip_prefix("<!-- ")?
            .strip_suffix(" -->")?
            .trim();
        let mut words = inner.split_whitespace();
        let kind = words.next()?;
        let words: Vec<&str> = words.collect();
        let block = match (kind, words.as_slice()) {
            ("bench-run", [report]) => Block::Run {
                report: (*report).to_owned(),
            },
            ("bench-family", [report, family]) => Block::Family {
                report: (*report).to_owned(),
                family: (*family).to_owned(),
            },
            ("bench-rows", [report, rows @ ..]) if !rows.is_empty() => {
                let parsed: Option<Vec<Row>> =
                    rows.iter().map(|row| Row::parse(row, report)).collect();
                match parsed {
                    Some(rows) => Block::Rows { rows },
                    None => return Some(Err(Block::usage(line))),
                }
            }
            ("bench-run" | "bench-family" | "bench-rows", _) => {
                return Some(Err(Block::usage(line)));
            }
            _ => return None,
        };
        Some(Ok(block))
    }

    /// The error for a malformed marker line.
    fn usage(line: &str) -> String {
        format!(
            "a bench marker is `<!-- bench-run REPORT -->`, \
             `<!-- bench-family REPORT FAMILY -->` or \
             `<!-- bench-rows REPORT [REPORT#]FAMILY/CASE@THREADS... -->`, not `{}`",
            line.trim()
        )
    }
}

/// The text with every block's body replaced by `render(block)`, and the number of blocks.
fn rewrite(
    text: &str,
    render: &mut dyn FnMut(&Block) -> Result<String>,
) -> std::result::Result<(String, usize), String> {
    let mut out = String::with_capacity(text.len());
    let mut blocks = 0;
    let mut lines = text.split_inclusive('\n').enumerate();
    while let Some((at, line)) = lines.next() {
        out.push_str(line);
        let Some(block) = Block::parse(line) else {
            continue;
        };
        let block = block.map_err(|e| format!("line {}: {e}", at + 1))?;
        let end = lines.by_ref().find(|(_, line)| line.trim() == END);
        let Some((_, end_line)) = end else {
            return Err(format!("line {}: the block has no `{END}` line", at + 1));
        };
        let body = render(&block).map_err(|e| format!("line {}: {e}", at + 1))?;
        out.push_str(body.trim_end());
        out.push('\n');
        out.push_str(end_line);
        blocks += 1;
    }
    Ok((out, blocks))
}

/// The text with every block rewritten from the report it names, each report loaded once by
/// `load`, and the number of blocks.
fn quote_reports(
    text: &str,
    load: &mut dyn FnMut(&str) -> Result<Replay>,
) -> std::result::Result<(String, usize), String> {
    let mut reports = Reports {
        load,
        read: HashMap::new(),
    };
    rewrite(text, &mut |block| reports.render(block))
}

/// The reports blocks name, each loaded once.
struct Reports<'a> {
    load: &'a mut dyn FnMut(&str) -> Result<Replay>,
    read: HashMap<String, Replay>,
}

impl Reports<'_> {
    fn replay(&mut self, report: &str) -> Result<&Replay> {
        if !self.read.contains_key(report) {
            let replay = (self.load)(report)?;
            self.read.insert(report.to_owned(), replay);
        }
        Ok(&self.read[report])
    }

    fn render(&mut self, block: &Block) -> Result<String> {
        match block {
            Block::Run { report } => {
                let replay = self.replay(report)?;
                let command = replay.command().map_or_else(
                    || "a command the report does not record".to_owned(),
                    |command| format!("`{command}`"),
                );
                Ok(format!(
                    "Recorded in [`{report}`]({report}) on {} by {command}:\n\n\
                     ```text\n{}\n```",
                    replay.date(),
                    replay.header()
                ))
            }
            Block::Family { report, family } => {
                let text = self.replay(report)?.family(family).ok_or_else(|| {
                    Error::input(format!("{report} has no results of family '{family}'"))
                })?;
                Ok(format!("```text\n{text}\n```"))
            }
            Block::Rows { rows } => self.rows(rows),
        }
    }

    /// The rows as a Markdown table, then the reports they come from.
    fn rows(&mut self, rows: &[Row]) -> Result<String> {
        let mut out = String::from(
            "| family/case | what it measures | threads | median | min – max |\n\
             |---|---|--:|--:|--:|\n",
        );
        let mut sources: Vec<&str> = Vec::new();
        for row in rows {
            let replay = self.replay(&row.report)?;
            let found = replay
                .result(&row.family, &row.case, row.threads)
                .ok_or_else(|| {
                    Error::input(format!(
                        "{} has no result {}/{} at {} thread(s)",
                        row.report, row.family, row.case, row.threads
                    ))
                })?;
            let stats = found.stats();
            out.push_str(&format!(
                "| {}/{} | {} | {} | {} {} | {} – {} |\n",
                row.family,
                row.case,
                found.how.replace('|', "\\|"),
                row.threads,
                table::fmt_num(stats.median),
                found.unit.label(),
                table::fmt_num(stats.min),
                table::fmt_num(stats.max),
            ));
            if !sources.contains(&row.report.as_str()) {
                sources.push(&row.report);
            }
        }
        let mut quoted = Vec::new();
        for report in sources {
            let date = self.replay(report)?.date();
            quoted.push(format!("[`{report}`]({report}) ({date})"));
        }
        out.push_str(&format!(
            "\nMedians and min – max over the rounds, from {}.",
            quoted.join(" and ")
        ));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(block: &Block) -> Result<String> {
        Ok(match block {
            Block::Run { report } => format!("run of {report}"),
            Block::Family { report, family } => format!("{family} of {report}"),
            Block::Rows { rows } => rows
                .iter()
                .map(|row| format!("{}:{}/{}@{}", row.report, row.family, row.case, row.threads))
                .collect::<Vec<_>>()
                .join(" "),
        })
    }

    #[test]
    fn blocks_are_replaced_and_the_rest_kept() {
        let text = "intro\n<!-- bench-run r.json -->\nold\nold\n<!-- end bench -->\nmiddle\n\
                    <!-- bench-family r.json getcpu -->\n<!-- end bench -->\nend\n";
        let (out, blocks) = rewrite(text, &mut fake).unwrap();
        assert_eq!(blocks, 2);
        assert_eq!(
            out,
            "intro\n<!-- bench-run r.json -->\nrun of r.json\n<!-- end bench -->\nmiddle\n\
             <!-- bench-family r.json getcpu -->\ngetcpu of r.json\n<!-- end bench -->\nend\n"
        );
        // A second pass changes nothing.
        assert_eq!(rewrite(&out, &mut fake).unwrap(), (out.clone(), 2));
    }

    #[test]
    fn rows_name_their_report_family_case_and_threads() {
        let text = "<!-- bench-rows r.json getcpu/current_cpu@1 o.json#rwlock/read/thiscpu@2 -->\n\
                    <!-- end bench -->\n";
        let (out, blocks) = rewrite(text, &mut fake).unwrap();
        assert_eq!(blocks, 1);
        assert!(
            out.contains("\nr.json:getcpu/current_cpu@1 o.json:rwlock/read/thiscpu@2\n"),
            "{out}"
        );
        for bad in [
            "<!-- bench-rows r.json -->",
            "<!-- bench-rows r.json getcpu/current_cpu -->",
            "<!-- bench-rows r.json getcpu@1 -->",
            "<!-- bench-rows r.json getcpu/current_cpu@0 -->",
            "<!-- bench-rows r.json #getcpu/current_cpu@1 -->",
        ] {
            let error = rewrite(&format!("{bad}\n<!-- end bench -->\n"), &mut fake).unwrap_err();
            assert!(error.contains("FAMILY/CASE@THREADS"), "{bad}: {error}");
        }
    }

    #[test]
    fn rows_render_as_a_markdown_table_of_the_recorded_results() {
        let text = "<!-- bench-rows results/bench.json getcpu/syscall@1 counter/atomic-global@2 -->\n\
                    <!-- end bench -->\n";
        let (out, _) = quote_reports(text, &mut |_| Replay::parse(RECORDED)).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[1..5],
            [
                "| family/case | what it measures | threads | median | min – max |",
                "|---|---|--:|--:|--:|",
                "| getcpu/syscall | getcpu(2) system call | 1 | 101 ns/op | 98.2 – 104 |",
                "| counter/atomic-global | one AtomicU64, fetch_add | 2 | 14.0 ns/op | 12.4 – 15.4 |",
            ]
        );
        assert!(
            out.contains("from [`results/bench.json`](results/bench.json) (2026-12-05)."),
            "{out}"
        );
        // A result the report does not hold is an error naming it.
        let missing =
            "<!-- bench-rows results/bench.json getcpu/syscall@3 -->\n<!-- end bench -->\n";
        let error = quote_reports(missing, &mut |_| Replay::parse(RECORDED)).unwrap_err();
        assert!(error.contains("getcpu/syscall at 3 thread(s)"), "{error}");
    }

    #[test]
    fn an_unclosed_or_malformed_block_is_an_error_with_its_line() {
        let unclosed = "a\n<!-- bench-run r.json -->\nold\n";
        let error = rewrite(unclosed, &mut fake).unwrap_err();
        assert!(error.starts_with("line 2: the block has no"), "{error}");
        let malformed = "<!-- bench-family r.json -->\n<!-- end bench -->\n";
        let error = rewrite(malformed, &mut fake).unwrap_err();
        assert!(error.contains("bench-family REPORT FAMILY"), "{error}");
        // Other comments are not markers.
        let other = "<!-- a note -->\n";
        assert_eq!(rewrite(other, &mut fake).unwrap(), (other.to_owned(), 0));
    }

    const RECORDED: &str = include_str!("../../../results/bench.json");
    const RWLOCK: &str = include_str!("../../../results/rwlock.json");
    const OTEL: &str = include_str!("../../../results/otel.json");
    const PORTABLE: &str = include_str!("../../../results/portable.json");

    /// The repository's Markdown files that quote recorded runs, by path from its root.
    /// Compiled in: the test runs where the repository is not (an emulated guest).
    /// Where the repository is at hand, `cli/tests/docs.rs` checks every Markdown file that
    /// holds a block with `report --readme FILE --check`, listed here or not.
    const DOCUMENTS: &[(&str, &str)] = &[
        ("README.md", include_str!("../../../README.md")),
        ("docs/results.md", include_str!("../../../docs/results.md")),
        (
            "docs/opentelemetry.md",
            include_str!("../../../docs/opentelemetry.md"),
        ),
    ];

    /// `report` as named from a file in `folder`, as a path from the repository's root
    /// (`docs` and `../results/bench.json` give `results/bench.json`).
    fn from_root(folder: &str, report: &str) -> String {
        let mut parts: Vec<&str> = folder.split('/').filter(|p| !p.is_empty()).collect();
        for part in report.split('/') {
            match part {
                ".." => {
                    parts.pop();
                }
                "." | "" => {}
                part => parts.push(part),
            }
        }
        parts.join("/")
    }

    #[test]
    fn report_paths_are_resolved_from_the_quoting_file() {
        assert_eq!(from_root("", "results/bench.json"), "results/bench.json");
        assert_eq!(
            from_root("docs", "../results/bench.json"),
            "results/bench.json"
        );
        assert_eq!(from_root("docs", "./runs/a.json"), "docs/runs/a.json");
    }

    #[test]
    fn the_documents_quote_their_recorded_runs_exactly() {
        for &(path, text) in DOCUMENTS {
            let folder = path.rsplit_once('/').map_or("", |(folder, _)| folder);
            let (quoted, blocks) = quote_reports(
                text,
                &mut |report| match from_root(folder, report).as_str() {
                    "results/bench.json" => Replay::parse(RECORDED),
                    "results/rwlock.json" => Replay::parse(RWLOCK),
                    "results/otel.json" => Replay::parse(OTEL),
                    "results/portable.json" => Replay::parse(PORTABLE),
                    other => Err(Error::input(format!(
                        "a report this test does not know: {other}"
                    ))),
                },
            )
            .unwrap_or_else(|e| panic!("{path}: {e}"));
            assert!(blocks > 0, "{path} quotes no recorded run");
            assert!(
                quoted == text,
                "{path}: its bench blocks differ from the reports they quote: \
                 `cargo run --release -- report --readme {path}` rewrites them"
            );
        }
    }
}
