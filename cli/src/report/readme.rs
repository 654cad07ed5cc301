//! Blocks of a Markdown file (the README) that quote recorded runs, refreshed from the
//! reports they name.
//!
//! A block opens with a marker line naming a report, relative to the Markdown file's folder,
//! and closes with `<!-- end bench -->`:
//!
//! ```text
//! <!-- bench-run results/bench.json -->          where, when and how the run was made
//! <!-- bench-family results/bench.json getcpu --> what the run printed for one family
//! ```
//!
//! Everything between a marker and its end is replaced; everything else is left as it is.

use crate::error::{Error, Result};
use crate::report::output::Output;
use crate::report::replay::Replay;
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
            ("bench-run" | "bench-family", _) => {
                return Some(Err(format!(
                    "a bench marker is `<!-- bench-run REPORT -->` or \
                     `<!-- bench-family REPORT FAMILY -->`, not `{}`",
                    line.trim()
                )));
            }
            _ => return None,
        };
        Some(Ok(block))
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(block: &Block) -> Result<String> {
        Ok(match block {
            Block::Run { report } => format!("run of {report}"),
            Block::Family { report, family } => format!("{family} of {report}"),
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

    #[test]
    fn the_readme_quotes_its_recorded_runs_exactly() {
        // Compiled in: the test runs where the repository is not (an emulated guest).
        const README: &str = include_str!("../../../README.md");
        const RECORDED: &str = include_str!("../../../results/bench.json");
        const RWLOCK: &str = include_str!("../../../results/rwlock.json");
        let (quoted, blocks) = quote_reports(README, &mut |report| match report {
            "results/bench.json" => Replay::parse(RECORDED),
            "results/rwlock.json" => Replay::parse(RWLOCK),
            other => Err(Error::input(format!(
                "a report this test does not know: {other}"
            ))),
        })
        .expect("every block names a known report and family");
        assert!(blocks > 0, "README quotes no recorded run");
        assert!(
            quoted == README,
            "README's bench blocks differ from the reports they quote: \
             `cargo run --release -- report --readme README.md` rewrites them"
        );
    }
}
