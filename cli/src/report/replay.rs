//! A recorded run read back: the tables `thiscpu bench` printed, rebuilt from its JSON
//! report by the same code that printed them.
//!
//! Documentation quotes kept runs this way rather than pasted text, so that a figure can be
//! traced to a file in the repository, and the quotes follow when the tables change shape.
//! Reports written before every round's share of time on CPU was kept give only each case's
//! median, so for them the "workers were on their CPUs" note is a median of medians.

use crate::bench::model::{Family, Measured, RunInfo, Skipped, Unit};
use crate::error::{Error, Result};
use crate::machine::Machine;
use crate::report::json::Report;
use crate::report::table;
use std::path::Path;
use std::time::Duration;

/// A report, with its rows turned back into the runner's results.
#[derive(Debug)]
pub struct Replay {
    machine: Machine,
    info: RunInfo,
    command: Vec<String>,
    unix_time: u64,
    families: Vec<FamilyResults>,
}

#[derive(Debug)]
struct FamilyResults {
    family: &'static Family,
    results: Vec<Measured>,
    skipped: Vec<Skipped>,
}

impl Replay {
    /// Reads a report written by `thiscpu bench --json`.
    pub fn read(path: &Path) -> Result<Replay> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::read(path, e))?;
        Replay::parse(&text).map_err(|e| Error::input(format!("{}: {e}", path.display())))
    }

    /// A report's text, already read.
    pub fn parse(text: &str) -> Result<Replay> {
        let report = serde_json::from_str(text)
            .map_err(|e| Error::input(format!("not a thiscpu bench report: {e}")))?;
        Replay::of(report)
    }

    fn of(report: Report) -> Result<Replay> {
        let run = report.run.ok_or_else(|| {
            Error::input("the report has no run description (written by an older thiscpu)")
        })?;
        let mut families: Vec<FamilyResults> = Vec::new();
        for row in report.results {
            let at = slot(&mut families, &row.bench)?;
            let family = families[at].family;
            let unit = Unit::from_label(&row.unit).ok_or_else(|| {
                Error::input(format!(
                    "{}/{}: unknown unit '{}'",
                    row.bench, row.case, row.unit
                ))
            })?;
            families[at].results.push(Measured {
                bench: family.name,
                case: case_name(family, &row.case)?,
                how: row.how.unwrap_or_default(),
                threads: row.threads as usize,
                cpus: row.cpus,
                unit,
                rounds: row.rounds,
                ops: row.ops.unwrap_or(0),
                on_cpu: if row.on_cpu_rounds.is_empty() {
                    row.on_cpu.into_iter().collect()
                } else {
                    row.on_cpu_rounds
                },
            });
        }
        for row in report.skipped {
            let at = slot(&mut families, &row.bench)?;
            let family = families[at].family;
            families[at].skipped.push(Skipped {
                bench: family.name,
                case: case_name(family, &row.case)?,
                reason: row.reason,
            });
        }
        Ok(Replay {
            machine: report.machine,
            info: RunInfo {
                rounds: run.rounds,
                round: Duration::try_from_secs_f64(run.round_seconds)
                    .map_err(|_| Error::input("the report's round length is not a duration"))?,
                budget_seconds: run.budget_seconds,
                quick: run.quick,
                cpus: run.cpus,
            },
            command: run.command,
            unix_time: run.unix_time,
            families,
        })
    }

    /// The lines the run printed before its first family.
    pub fn header(&self) -> String {
        table::fit(&table::run_header(&self.machine, &self.info))
    }

    /// What the run printed for `family`: its table, the cases left out, and the family's
    /// own report, without the project's targets; `None` when the run did not measure it.
    pub fn family(&self, name: &str) -> Option<String> {
        self.family_with(name, false)
    }

    /// [`Replay::family`], with the project's targets when `targets` is set.
    pub fn family_with(&self, name: &str, targets: bool) -> Option<String> {
        let found = self.families.iter().find(|f| f.family.name == name)?;
        let mut out = table::family(found.family, &found.results, &found.skipped);
        let mut extra = (found.family.report)(&found.results);
        if !targets {
            extra = table::without_targets(&extra);
        }
        if !extra.is_empty() {
            out.push_str("\n\n");
            out.push_str(&extra);
        }
        Some(table::fit(&out))
    }

    /// The results of one case at one thread count, `None` when the run did not measure it.
    pub fn result(&self, family: &str, case: &str, threads: usize) -> Option<&Measured> {
        self.families
            .iter()
            .find(|f| f.family.name == family)?
            .results
            .iter()
            .find(|m| m.case == case && m.threads == threads)
    }

    /// Everything the run printed, in its order (with the targets when `targets` is set).
    pub fn text(&self, targets: bool) -> String {
        let mut out = self.header();
        for found in &self.families {
            out.push_str("\n\n");
            out.push_str(
                &self
                    .family_with(found.family.name, targets)
                    .unwrap_or_default(),
            );
        }
        out
    }

    /// The command that made the report, as a user would type it (`thiscpu bench ...`), or
    /// `None` for reports that did not record it.
    pub fn command(&self) -> Option<String> {
        let (program, args) = self.command.split_first()?;
        let program = Path::new(program).file_name().map_or_else(
            || program.clone(),
            |name| name.to_string_lossy().into_owned(),
        );
        Some(
            std::iter::once(program)
                .chain(args.iter().cloned())
                .collect::<Vec<_>>()
                .join(" "),
        )
    }

    /// The day the report was written, `YYYY-MM-DD` (UTC).
    pub fn date(&self) -> String {
        let (year, month, day) = civil_date(self.unix_time / 86_400);
        format!("{year:04}-{month:02}-{day:02}")
    }
}

/// Where `name`'s results go in `families`, added in the report's order when first met.
fn slot(families: &mut Vec<FamilyResults>, name: &str) -> Result<usize> {
    if let Some(at) = families.iter().position(|f| f.family.name == name) {
        return Ok(at);
    }
    let family = crate::bench::family(name)
        .ok_or_else(|| Error::input(format!("unknown benchmark family '{name}'")))?;
    families.push(FamilyResults {
        family,
        results: Vec::new(),
        skipped: Vec::new(),
    });
    Ok(families.len() - 1)
}

/// The `&'static` name the family itself uses for `case`.
fn case_name(family: &'static Family, case: &str) -> Result<&'static str> {
    family
        .case_names
        .iter()
        .copied()
        .find(|&known| known == case)
        .ok_or_else(|| Error::input(format!("unknown case '{}/{case}'", family.name)))
}

/// Year, month and day of the proleptic Gregorian calendar for a count of days since
/// 1970-01-01 (Howard Hinnant's days-to-civil algorithm, on 400-year eras).
fn civil_date(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORDED: &str = include_str!("../../../results/bench.json");

    #[test]
    fn civil_dates_across_leap_days_and_centuries() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(59), (1970, 3, 1));
        assert_eq!(civil_date(11_016), (2000, 2, 29));
        assert_eq!(civil_date(11_017), (2000, 3, 1));
        // 2026-12-03 is day 20,790.
        assert_eq!(civil_date(20_790), (2026, 12, 3));
        assert_eq!(civil_date(47_540), (2100, 2, 28));
        assert_eq!(civil_date(47_541), (2100, 3, 1));
    }

    #[test]
    fn a_recorded_report_prints_its_families_again() {
        // Compiled in: the test runs where the repository is not (an emulated guest).
        let replay = Replay::parse(RECORDED).expect("the recorded report reads back");
        let text = replay.text(true);
        assert!(text.starts_with("thiscpu bench · "), "{text}");
        let getcpu = replay.family("getcpu").expect("the report has getcpu");
        assert!(getcpu.contains("current_cpu"), "{getcpu}");
        assert!(replay.family("no-such-family").is_none());
        let command = replay.command().expect("the report records its command");
        assert!(command.starts_with("thiscpu bench"), "{command}");
    }

    #[test]
    fn reports_without_a_run_or_with_unknown_names_are_refused() {
        let old = include_str!("../../tests/data/before.json");
        let error = Replay::parse(old).unwrap_err().to_string();
        assert!(error.contains("no run description"), "{error}");
        let mut report: Report = serde_json::from_str(RECORDED).unwrap();
        report.results[0].case = "no-such-case".to_owned();
        let error = Replay::of(report).unwrap_err().to_string();
        assert!(error.contains("unknown case"), "{error}");
    }
}
