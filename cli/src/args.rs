//! The command line: every subcommand's clap definition, the parsers of option values
//! (thread lists, case filters, seconds, percentages), and how a parse error is shown.

use crate::bench::{self, command::Options, model::CaseFilter, model::Family};
use crate::error::{self, Error};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::path::PathBuf;

const ABOUT: &str = "Which CPU and NUMA node am I running on, in about a nanosecond, via the \
                     kernel's restartable sequences (rseq); and how that compares with every \
                     other way Linux offers.";

const EXAMPLES: &str = "\
Examples:
  thiscpu                          print the CPU and node this process runs on
  thiscpu info                     machine, rseq state, available sources, CPUs and nodes
  thiscpu bench getcpu             time every way to ask \"which CPU\" (about a minute)
  thiscpu bench --quick --json out.json --svg charts/
  thiscpu compare before.json after.json
  thiscpu report --readme README.md docs/*.md    refresh the documentation's tables from the recorded runs";

#[derive(Debug, Parser)]
#[command(name = "thiscpu", version, about = ABOUT, after_help = EXAMPLES)]
pub struct Cli {
    /// The subcommand; none prints where this thread runs.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// `thiscpu`'s subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Describe the machine, rseq's state, and which source answers "which CPU".
    #[command(after_help = "\
Shows the CPU model, kernel and glibc; who registered rseq (glibc or thiscpu), glibc's
__rseq_size and __rseq_offset, the kernel's rseq feature size and alignment, whether node_id
and mm_cid are usable; the registration's length and mode (legacy: 32 bytes; optimized: longer
than 32 and at least the feature size, Linux 7.1+), with a note when glibc holds a legacy area
on a kernel that offers the optimized mode; which sources work here (rseq, rdpid, rdtscp, vDSO, syscall) and which one answers;
the possible and online CPUs with their NUMA nodes; and the current cpu, node and mm_cid.

Example:
  thiscpu info --json - | jq .chosen.id")]
    Info {
        /// Write JSON to FILE instead of printing text, or print it with `-` (also what a bare
        /// --json means).
        #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-")]
        json: Option<PathBuf>,
    },

    /// Measure benchmark families in interleaved, pinned rounds.
    Bench(BenchArgs),

    /// Compare two `bench --json` reports: before, after, difference, percent change.
    #[command(after_help = "\
Matches results by (bench, case, threads) and prints, per family, both medians with their
min-max ranges, the difference, and the percent change, marked better or worse (or 'within
spread' where the two min-max ranges overlap). Results found in only one file are listed.

Example:
  thiscpu bench --json before.json && (rebuild) && thiscpu bench --json after.json
  thiscpu compare before.json after.json
  thiscpu compare --threshold 5 before.json after.json || echo 'a case got slower'")]
    Compare {
        /// The report measured first.
        before: PathBuf,
        /// The report measured second.
        after: PathBuf,
        /// Exit with status 1 when a case got worse by more than PCT percent and outside its
        /// spread (the two min-max ranges do not overlap).
        #[arg(long, value_name = "PCT", allow_negative_numbers = true, value_parser = parse_percent)]
        threshold: Option<f64>,
        /// Write the comparison's tables as Markdown to FILE (`-`: standard output instead of
        /// the text).
        #[arg(long, value_name = "FILE")]
        export_markdown: Option<PathBuf>,
    },

    /// Print a recorded `bench --json` report's tables again, or refresh the blocks of
    /// Markdown files (the README, docs/) that quote recorded reports.
    #[command(after_help = "\
With FILE, prints what the run printed: its header, every family's table, the cases left
out and the family's own tables and targets, rebuilt from the report by the same code.

With --readme, rewrites every block of those Markdown files that quotes a report, between a
marker and `<!-- end bench -->`:
  <!-- bench-run results/bench.json -->            where, when and how the run was made
  <!-- bench-family results/bench.json getcpu -->  one family's tables
  <!-- bench-rows results/bench.json getcpu/current_cpu@1 pool/thiscpu-pool@2 -->
                                                   chosen results as one Markdown table
A row is FAMILY/CASE@THREADS, or REPORT#FAMILY/CASE@THREADS for a result of another report.
Report paths are relative to the Markdown file's folder. --check writes nothing and exits
with status 1 when a block differs from its report.

Examples:
  thiscpu bench --json results/bench.json --svg results/svg
  thiscpu report --readme README.md docs/*.md
  thiscpu report results/bench.json")]
    Report {
        /// A report to print.
        #[arg(value_name = "FILE", required_unless_present = "readme")]
        file: Option<PathBuf>,
        /// Markdown files whose bench blocks to refresh from the reports they name.
        #[arg(long, value_name = "FILE", num_args = 1..)]
        readme: Vec<PathBuf>,
        /// With --readme: change nothing, fail when a block is out of date.
        #[arg(long, requires = "readme")]
        check: bool,
        /// With FILE: also print the project's own performance targets, and whether the run
        /// met them.
        #[arg(long, requires = "file")]
        targets: bool,
    },

    /// Check that a Counter, a Pool and the per-CPU allocator stay exact under migration,
    /// signals and thread churn: three parts, each running --seconds.
    Stress(StressArgs),
}

/// `bench --help`'s closing text, with the families as registered.
fn bench_help() -> String {
    let width = bench::FAMILIES
        .iter()
        .map(|family| family.name.len())
        .max()
        .unwrap_or(0);
    let families: Vec<String> = bench::FAMILIES
        .iter()
        .map(|family| format!("  {:<width$}  {}", family.name, family.about))
        .collect();
    format!(
        "\
Families (`--list` shows every case):
{}

Every case runs in rounds interleaved with the other cases (A B C A B C ...), each round for
the same fixed time, on worker threads pinned to one CPU each and started by a barrier. The
tables give the median and the min-max over the rounds; ratios are ratios of medians. getcpu
also prints the seeds' tables: 1e9 calls of a noinline get_cpu_id() before and after, and
getcpu() latency before (vDSO, syscall) and after (rseq).

Examples:
  thiscpu bench                          every family, about three minutes
  thiscpu bench getcpu --cases 'current_cpu*,vdso'
  thiscpu bench --quick --json out.json --svg charts/
  thiscpu bench --threads 1,2 --rounds 21 --seconds 120
  thiscpu bench --list",
        families.join("\n")
    )
}

/// `thiscpu bench`'s options.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Families to run (default: all).
    #[arg(value_name = "FAMILY")]
    families: Vec<String>,

    /// List the families and their cases, then exit.
    #[arg(long)]
    pub list: bool,

    /// A smoke run: 3 short rounds, 1 s of timed rounds in all; with thread start-up,
    /// calibration, the memory cases and alloc's child processes, every family takes about
    /// 6 s on 2 CPUs.
    #[arg(long)]
    quick: bool,

    /// Time budget in seconds for the timed rounds of the whole run; starting threads,
    /// calibrating, the memory cases and alloc's child processes come on top [default: 60, or 1
    /// with --quick].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = parse_seconds)]
    seconds: Option<f64>,

    /// Rounds per case [default: 21, or 3 with --quick].
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        value_parser = clap::value_parser!(u32).range(1..=10_000)
    )]
    rounds: Option<u32>,

    /// Thread counts, e.g. 1,2 or 1-4 or 1:8:2 [default: each family's own].
    #[arg(long, value_name = "LIST", allow_negative_numbers = true, value_parser = parse_threads)]
    threads: Option<ThreadList>,

    /// Only cases whose name contains one of these comma-separated strings or matches one of
    /// these globs (`*`, `?`).
    #[arg(long, value_name = "FILTER", value_parser = parse_cases)]
    cases: Option<CaseFilter>,

    /// Write the results, with every round's value and the machine, as JSON to FILE (`-`:
    /// standard output, the tables then go to standard error). The file is replaced whole
    /// when the run succeeds and left alone when it fails.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Write one SVG chart per family into DIR (created if missing).
    #[arg(long, value_name = "DIR")]
    svg: Option<PathBuf>,

    /// Write the tables as Markdown to FILE (`-`: standard output).
    #[arg(long, value_name = "FILE")]
    export_markdown: Option<PathBuf>,

    /// Also print the project's own performance targets, and whether this run met them.
    #[arg(long)]
    targets: bool,
}

/// A parsed `--threads` list (a newtype, so that clap takes it as one value).
#[derive(Clone, Debug)]
struct ThreadList(Vec<usize>);

fn parse_threads(text: &str) -> Result<ThreadList, String> {
    thread_counts(text).map(ThreadList)
}

fn parse_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds > 0.0 && seconds <= 86_400.0 => Ok(seconds),
        Ok(_) => Err("expected a number of seconds above 0 and at most 86400".to_owned()),
        Err(_) => Err("expected a number of seconds, e.g. 60 or 0.5".to_owned()),
    }
}

fn parse_percent(text: &str) -> Result<f64, String> {
    match text.trim_end_matches('%').parse::<f64>() {
        Ok(percent) if percent.is_finite() && percent >= 0.0 => Ok(percent),
        Ok(_) => Err("expected a percentage of 0 or more, e.g. 5 or 2.5".to_owned()),
        Err(_) => Err("expected a percentage, e.g. 5 or 2.5".to_owned()),
    }
}

/// What `thiscpu bench` was asked to do, with the families named on the command line looked
/// up.
pub fn bench_options(args: BenchArgs) -> Result<Options, Error> {
    let mut families = Vec::new();
    for name in &args.families {
        let family = bench::family(name).ok_or_else(|| {
            let known: Vec<&str> = bench::FAMILIES.iter().map(|f| f.name).collect();
            Error::input(format!(
                "unknown benchmark family '{name}' (families: {})",
                known.join(", ")
            ))
        })?;
        if !families.iter().any(|f: &&Family| f.name == family.name) {
            families.push(family);
        }
    }
    if families.is_empty() {
        families = bench::FAMILIES.to_vec();
    }
    Ok(Options {
        families,
        quick: args.quick,
        seconds: args.seconds,
        rounds: args.rounds,
        threads: args.threads.map(|list| list.0),
        cases: args.cases,
        json: args.json,
        svg: args.svg,
        markdown: args.export_markdown,
        targets: args.targets,
    })
}

/// `thiscpu stress`'s options.
#[derive(Debug, clap::Args)]
pub struct StressArgs {
    /// How long each of the three parts (the counter, the pool, then the allocator) runs, in
    /// seconds (fractions allowed): the whole run takes about three times N.
    #[arg(
        long,
        value_name = "N",
        default_value = "5",
        allow_negative_numbers = true,
        value_parser = parse_seconds
    )]
    pub seconds: f64,

    /// Long-lived worker threads [default: 4 per online CPU].
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        value_parser = clap::value_parser!(u32).range(1..=4096)
    )]
    pub threads: Option<u32>,

    /// Write one JSON object to FILE (the text is still printed), or print it instead of the
    /// text with `-` (also what a bare --json means).
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-")]
    pub json: Option<PathBuf>,
}

/// Parses a thread-count list: `1,2,4`, ranges `1-4`, or `start:end:step` (`1:8:2`).
fn thread_counts(text: &str) -> Result<Vec<usize>, String> {
    const MAX: usize = 1024;
    let bad = || format!("expected thread counts like 1,2 or 1-4 or 1:8:2, got {text:?}");
    let number = |s: &str| s.trim().parse::<usize>().map_err(|_| bad());
    let mut counts = Vec::new();
    for part in text.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(bad());
        }
        let fields: Vec<&str> = part.split(':').collect();
        let (first, last, step) = match fields.as_slice() {
            [one] => match one.split_once('-') {
                Some((first, last)) => (number(first)?, number(last)?, 1),
                None => (number(one)?, number(one)?, 1),
            },
            [first, last] => (number(first)?, number(last)?, 1),
            [first, last, step] => (number(first)?, number(last)?, number(step)?),
            _ => return Err(bad()),
        };
        if first == 0 || last < first || step == 0 {
            return Err(format!(
                "thread counts start at 1 and ranges go upwards, got {text:?}"
            ));
        }
        if last > MAX {
            return Err(format!("at most {MAX} threads, got {last}"));
        }
        counts.extend((first..=last).step_by(step));
    }
    counts.dedup();
    Ok(counts)
}

/// Parses `--cases`: comma-separated patterns (see [`CaseFilter`]); fails on an empty list.
fn parse_cases(text: &str) -> Result<CaseFilter, String> {
    let patterns: Vec<String> = text
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect();
    if patterns.is_empty() {
        return Err("expected case names or patterns, e.g. current_cpu,vdso*".to_owned());
    }
    Ok(CaseFilter::new(patterns))
}

/// clap's message on one line: its first line names the problem, and when that line ends in a
/// colon, the indented lines after it (the missing arguments) complete it; tips and usage,
/// after a blank line, are left out.
fn one_line(rendered: &str) -> String {
    let mut lines = rendered.lines();
    let first = lines.next().unwrap_or("invalid arguments");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    if !first.ends_with(':') {
        return first.to_owned();
    }
    let rest: Vec<&str> = lines
        .take_while(|line| !line.trim().is_empty())
        .map(str::trim)
        .collect();
    format!("{first} {}", rest.join(", "))
}

/// Parses the command line. Help and version are printed with exit status 0; a bad command line
/// is one line on standard error and exit status 2, never a usage dump.
pub fn parse() -> Cli {
    let command = Cli::command().mut_subcommand("bench", |bench| bench.after_help(bench_help()));
    let parsed = command
        .try_get_matches()
        .and_then(|matches| Cli::from_arg_matches(&matches));
    match parsed {
        Ok(cli) => cli,
        Err(error) => {
            use clap::error::ErrorKind;
            if matches!(
                error.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = error.print();
                std::process::exit(0);
            }
            eprintln!(
                "thiscpu: {} (see thiscpu --help)",
                one_line(&error.render().to_string())
            );
            std::process::exit(error::BAD_INPUT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_lists() {
        assert_eq!(thread_counts("1,2").unwrap(), vec![1, 2]);
        assert_eq!(thread_counts("1-4").unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(thread_counts("1:8:3").unwrap(), vec![1, 4, 7]);
        for bad in ["", "0", "a", "2-1", "1,,2", "1:2:0", "5000"] {
            assert!(thread_counts(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn case_lists() {
        let filter = parse_cases(" vdso , current_cpu-*,").unwrap();
        assert_eq!(filter.patterns(), ["vdso", "current_cpu-*"]);
        assert!(parse_cases(" , ").is_err());
    }
}
