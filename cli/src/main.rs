//! The `thiscpu` command: which CPU am I on, how fast can a program ask, and how do two runs
//! compare. Argument parsing and dispatch only; the work is in the modules.

mod bench;
mod error;
mod info;
mod machine;
mod report;
mod stress;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use error::Error;
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
  thiscpu compare before.json after.json";

#[derive(Debug, Parser)]
#[command(name = "thiscpu", version, about = ABOUT, after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
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

    /// Check that a Counter and a Pool stay exact under migration, signals and thread churn.
    Stress(stress::StressArgs),
}

/// `bench --help`'s closing text, with the families as registered.
fn bench_help() -> String {
    let families: Vec<String> = bench::FAMILIES
        .iter()
        .map(|family| format!("  {:<9}{}", family.name, family.about))
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
  thiscpu bench                          every family, about a minute
  thiscpu bench getcpu --cases 'current_cpu*,vdso'
  thiscpu bench --quick --json out.json --svg charts/
  thiscpu bench --threads 1,2 --rounds 21 --seconds 120
  thiscpu bench --list",
        families.join("\n")
    )
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// Families to run (default: all).
    #[arg(value_name = "FAMILY")]
    families: Vec<String>,

    /// List the families and their cases, then exit.
    #[arg(long)]
    list: bool,

    /// A smoke run of about a second (3 short rounds).
    #[arg(long)]
    quick: bool,

    /// Total time budget in seconds for the whole run [default: 60, or 1 with --quick].
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
    #[arg(long, value_name = "FILTER", value_parser = bench::model::CaseFilter::parse)]
    cases: Option<bench::model::CaseFilter>,

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
}

/// A parsed `--threads` list (a newtype, so that clap takes it as one value).
#[derive(Clone, Debug)]
struct ThreadList(Vec<usize>);

fn parse_threads(text: &str) -> Result<ThreadList, String> {
    bench::parse_threads(text).map(ThreadList)
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

fn bench_options(args: BenchArgs) -> Result<bench::Options, Error> {
    let mut families = Vec::new();
    for name in &args.families {
        let family = bench::family(name).ok_or_else(|| {
            let known: Vec<&str> = bench::FAMILIES.iter().map(|f| f.name).collect();
            Error::input(format!(
                "unknown benchmark family '{name}' (families: {})",
                known.join(", ")
            ))
        })?;
        if !families
            .iter()
            .any(|f: &&bench::model::Family| f.name == family.name)
        {
            families.push(family);
        }
    }
    if families.is_empty() {
        families = bench::FAMILIES.to_vec();
    }
    Ok(bench::Options {
        families,
        quick: args.quick,
        seconds: args.seconds,
        rounds: args.rounds,
        threads: args.threads.map(|list| list.0),
        cases: args.cases,
        json: args.json,
        svg: args.svg,
        markdown: args.export_markdown,
    })
}

/// The bare command: one line, where this thread runs and who said so.
fn where_am_i() -> Result<(), Error> {
    let here = thiscpu::getcpu();
    println!(
        "cpu {} node {} (from {})",
        here.cpu,
        here.node,
        thiscpu::source().this_thread.name()
    );
    Ok(())
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

fn main() {
    // Die quietly on a closed pipe (`thiscpu info | head -1`) like other Unix tools, instead
    // of failing a write.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // A child process of `bench rseq-mode`, started by this program itself.
    if let Ok(work) = std::env::var(bench::rseq_mode::CHILD_ENV) {
        std::process::exit(bench::rseq_mode::child_main(&work));
    }
    let command = Cli::command().mut_subcommand("bench", |bench| bench.after_help(bench_help()));
    let parsed = command
        .try_get_matches()
        .and_then(|matches| Cli::from_arg_matches(&matches));
    let cli = match parsed {
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
    };
    let outcome = match cli.command {
        None => where_am_i(),
        Some(Command::Info { json }) => info::run(json.as_deref()),
        Some(Command::Bench(args)) if args.list => bench_options(args).map(|options| {
            println!("{}", bench::list(&options.families));
        }),
        Some(Command::Bench(args)) => bench_options(args).and_then(bench::run),
        Some(Command::Compare {
            before,
            after,
            threshold,
            export_markdown,
        }) => report::compare::run(&before, &after, threshold, export_markdown.as_deref()),
        Some(Command::Stress(args)) => stress::run(args),
    };
    if let Err(error) = outcome {
        eprintln!("thiscpu: {error}");
        std::process::exit(error.status());
    }
}
