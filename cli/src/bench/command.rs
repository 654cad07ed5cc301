//! `thiscpu bench`: plans the families asked for, has the runner measure them, and writes the
//! tables, Markdown, JSON and charts.

use super::model::{CaseFilter, Family, Measured, RunInfo, Skipped};
use super::runner::{self, Plan};
use crate::error::{Error, Result};
use crate::machine::Machine;
use crate::report;
use crate::report::output::Output;
use std::path::PathBuf;
use std::time::Duration;

/// What `thiscpu bench` was asked to do.
#[derive(Debug)]
pub struct Options {
    /// Families to run, in order (all when the user named none).
    pub families: Vec<&'static Family>,
    /// A few seconds in all, for smoke tests.
    pub quick: bool,
    /// Total time budget in seconds.
    pub seconds: Option<f64>,
    /// Rounds per (case, thread count).
    pub rounds: Option<u32>,
    /// Thread counts, instead of each family's default.
    pub threads: Option<Vec<usize>>,
    /// Which cases to run.
    pub cases: Option<CaseFilter>,
    /// Where to write the JSON report.
    pub json: Option<PathBuf>,
    /// Where to write one SVG chart per family.
    pub svg: Option<PathBuf>,
    /// Where to write the tables as Markdown.
    pub markdown: Option<PathBuf>,
    /// Whether to print the project's own performance targets and whether they were met.
    pub targets: bool,
}

/// Default total time: about a minute for a whole run.
const DEFAULT_SECONDS: f64 = 60.0;
/// Default rounds: odd, so that the median is one of them.
const DEFAULT_ROUNDS: u32 = 21;
const QUICK_SECONDS: f64 = 1.0;
const QUICK_ROUNDS: u32 = 3;
/// No round is shorter than this, whatever the budget.
const MIN_ROUND: Duration = Duration::from_millis(2);

/// Runs `thiscpu bench`.
pub fn run(options: Options) -> Result<()> {
    let rounds = options.rounds.unwrap_or(if options.quick {
        QUICK_ROUNDS
    } else {
        DEFAULT_ROUNDS
    });
    let budget = options.seconds.unwrap_or(if options.quick {
        QUICK_SECONDS
    } else {
        DEFAULT_SECONDS
    });

    let plans = plan(&options)?;
    let measurements = measurement_count(&plans) * rounds as usize;
    // Families whose every case this machine leaves out (rseq-mode on a kernel without the
    // optimized mode) still print why; only a run with nothing at all to report fails.
    if plans.is_empty() {
        return Err(Error::input("no case to run on this machine"));
    }

    // Open every output before measuring, so that a bad path fails in a moment, not after a
    // minute of benchmarks.
    let outputs = Outputs::open(&options, &plans)?;
    let console = Console {
        to_stderr: outputs.text_on_stderr(),
    };

    let round = Duration::from_secs_f64(budget / measurements.max(1) as f64).max(MIN_ROUND);
    let info = RunInfo {
        rounds,
        round,
        budget_seconds: budget,
        quick: options.quick,
        cpus: runner::worker_cpus(),
    };
    let machine = Machine::describe();
    console.say(&report::table::run_header(&machine, &info));
    if let Some(note) = shared_cpus_note(&plans, &info) {
        console.say(&note);
    }

    let results = measure_families(&plans, &machine, &info, options.targets, &console)?;
    outputs.write(&results, &plans, &machine, &info, &console)
}

/// Where the printed text goes.
struct Console {
    /// With the JSON or the Markdown on standard output, the text goes to standard error.
    to_stderr: bool,
}

impl Console {
    fn say(&self, text: &str) {
        let text = report::table::fit(text);
        if self.to_stderr {
            eprintln!("{text}");
        } else {
            println!("{text}");
        }
    }
}

/// How many (case, thread count) pairs the plans measure, each for every round.
fn measurement_count(plans: &[Plan]) -> usize {
    plans
        .iter()
        .flat_map(|plan| {
            plan.cases
                .iter()
                .map(|(_, workload)| runner::threads_of(plan, workload.as_ref()).len())
        })
        .sum()
}

/// The warning printed when some case runs more threads than there are CPUs to pin them to.
fn shared_cpus_note(plans: &[Plan], info: &RunInfo) -> Option<String> {
    let most_threads = plans
        .iter()
        .flat_map(|plan| {
            plan.cases
                .iter()
                .flat_map(|(_, workload)| runner::threads_of(plan, workload.as_ref()))
        })
        .max()?;
    (most_threads > info.cpus.len()).then(|| {
        format!(
            "note: up to {most_threads} threads on {} CPU{}: some workers share a CPU",
            info.cpus.len(),
            if info.cpus.len() == 1 { "" } else { "s" }
        )
    })
}

/// Everything a run measured, for the files written after it.
struct RunResults {
    measured: Vec<Measured>,
    skipped: Vec<Skipped>,
    markdown: String,
}

/// Measures each family in turn and prints its table as soon as it is done.
fn measure_families(
    plans: &[Plan],
    machine: &Machine,
    info: &RunInfo,
    targets: bool,
    console: &Console,
) -> Result<RunResults> {
    let mut measured = Vec::new();
    let mut skipped = Vec::new();
    let mut markdown = format!(
        "# thiscpu bench\n\n{}\n\n{} rounds of {:.3} s per case{}\n",
        machine.summary(),
        info.rounds,
        info.round.as_secs_f64(),
        if info.quick { " (--quick)" } else { "" }
    );
    for plan in plans {
        let results = runner::run_family(plan, info)?;
        console.say("");
        console.say(&report::table::family(plan.family, &results, &plan.skipped));
        let mut extra = (plan.family.report)(&results);
        if !targets {
            extra = report::table::without_targets(&extra);
        }
        if !extra.is_empty() {
            console.say(&extra);
        }
        markdown.push('\n');
        markdown.push_str(&report::table::family_markdown(
            plan.family,
            &results,
            &plan.skipped,
        ));
        measured.extend(results);
        skipped.extend(plan.skipped.iter().cloned());
    }
    Ok(RunResults {
        measured,
        skipped,
        markdown,
    })
}

/// The files asked for, opened before the run.
struct Outputs {
    json: Option<Output>,
    markdown: Option<Output>,
    /// One chart per family with cases to measure, in the order of the plans.
    svg: Vec<(PathBuf, std::fs::File)>,
}

impl Outputs {
    fn open(options: &Options, plans: &[Plan]) -> Result<Outputs> {
        let json = options.json.as_deref().map(Output::open).transpose()?;
        let markdown = options.markdown.as_deref().map(Output::open).transpose()?;
        if json.as_ref().is_some_and(Output::is_stdout)
            && markdown.as_ref().is_some_and(Output::is_stdout)
        {
            return Err(Error::input(
                "--json - and --export-markdown - cannot both use standard output",
            ));
        }
        let svg = match &options.svg {
            Some(dir) => {
                std::fs::create_dir_all(dir).map_err(|e| Error::write(dir, e))?;
                let mut files = Vec::new();
                for plan in plans.iter().filter(|plan| !plan.cases.is_empty()) {
                    let path = dir.join(format!("{}.svg", plan.family.name));
                    let file = std::fs::File::create(&path).map_err(|e| Error::write(&path, e))?;
                    files.push((path, file));
                }
                files
            }
            None => Vec::new(),
        };
        Ok(Outputs {
            json,
            markdown,
            svg,
        })
    }

    fn text_on_stderr(&self) -> bool {
        self.json
            .iter()
            .chain(&self.markdown)
            .any(Output::is_stdout)
    }

    fn write(
        self,
        results: &RunResults,
        plans: &[Plan],
        machine: &Machine,
        info: &RunInfo,
        console: &Console,
    ) -> Result<()> {
        let document =
            report::json::Report::build(machine, info, &results.measured, &results.skipped);
        if let Some(output) = self.markdown {
            let path = output.path().map(|path| path.display().to_string());
            output.commit(results.markdown.as_bytes())?;
            if let Some(path) = path {
                console.say(&format!("wrote {path}"));
            }
        }
        if let Some(output) = self.json {
            let path = output.path().map(|path| path.display().to_string());
            output.commit_json(&document)?;
            if let Some(path) = path {
                console.say(&format!("\nwrote {path}"));
            }
        }
        let charted = plans.iter().filter(|plan| !plan.cases.is_empty());
        for ((path, file), plan) in self.svg.into_iter().zip(charted) {
            let family_results: Vec<&Measured> = results
                .measured
                .iter()
                .filter(|m| m.bench == plan.family.name)
                .collect();
            report::svg::write(&path, file, plan.family, &family_results, machine, info)?;
            console.say(&format!("wrote {}", path.display()));
        }
        Ok(())
    }
}

/// Builds each family's cases and applies `--cases` and `--threads`.
fn plan(options: &Options) -> Result<Vec<Plan>> {
    let mut plans = Vec::new();
    for &family in &options.families {
        let selected = |case: &str| {
            options
                .cases
                .as_ref()
                .is_none_or(|filter| filter.matches(family.name, case))
        };
        let mut cases = Vec::new();
        let mut skipped = Vec::new();
        for mut case in (family.cases)() {
            if !selected(case.name) {
                continue;
            }
            match std::mem::replace(&mut case.workload, Err(String::new())) {
                Ok(workload) => cases.push((case, workload)),
                Err(reason) => skipped.push(Skipped {
                    bench: family.name,
                    case: case.name,
                    reason,
                }),
            }
        }
        if cases.is_empty() && skipped.is_empty() {
            continue;
        }
        let threads = options
            .threads
            .clone()
            .unwrap_or_else(|| family.default_threads.to_vec());
        plans.push(Plan {
            family,
            cases,
            threads,
            skipped,
        });
    }
    if plans.is_empty()
        && let Some(filter) = &options.cases
    {
        let known: Vec<&str> = options
            .families
            .iter()
            .flat_map(|family| family.case_names.iter().copied())
            .collect();
        return Err(Error::input(format!(
            "no case matches --cases {} (cases: {})",
            filter.patterns().join(","),
            known.join(", ")
        )));
    }
    Ok(plans)
}
