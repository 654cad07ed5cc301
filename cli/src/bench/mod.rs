//! Benchmark families, and the runner they share.
//!
//! A *family* (`getcpu`, ...) is one file in this folder that exports a [`Family`]; the
//! `families!` line at the bottom of this file lists them. A family offers *cases*, each a
//! [`Workload`](model::Workload) measured in one [`Unit`](model::Unit); these types live in
//! [`model`], which reports read. The [`runner`] measures every (case, thread count) pair in
//! interleaved rounds (A B C A B C ...), each round for the same fixed time, with every worker
//! thread pinned to its own CPU and all workers released together by a barrier. A round yields
//! one number per pair; the report gives min, median and max over the rounds. [`command`] is
//! `thiscpu bench` itself: it plans the run, has the runner measure it, and writes the reports.
//!
//! # Adding a family
//! Write `bench/NAME.rs` exporting `pub static FAMILY: Family`, and add `NAME` to the
//! `families!` line. Everything else (the command line, `--cases`, `--threads`, tables, JSON,
//! SVG, `compare`) follows. A sketch:
//!
//! ```text
//! use super::model::{Case, Family, Loop, Measured, Unit};
//!
//! pub static FAMILY: Family = Family {
//!     name: "counter",
//!     about: "nanoseconds per increment of per-CPU counters",
//!     case_names: &["percpu", "atomic"],
//!     default_threads: &[1, 2],
//!     baseline: Some("atomic"),
//!     cases,
//!     report: |_: &[Measured]| String::new(),
//! };
//!
//! fn cases() -> Vec<Case> {
//!     vec![Case::new("percpu", "thiscpu Counter::add", Unit::NsPerOp, PercpuWorkload::new())]
//! }
//! ```
//!
//! A workload with state implements [`Workload`](model::Workload): `prepare` resets it before each round,
//! `run(worker, ops)` does `ops` operations, `verify(ops)` checks exactness afterwards (a
//! counter's sum must equal the increments performed); an error from `verify` stops the run
//! with exit status 1. A workload may also size itself once the run's layout is known
//! (`start`), fix its own thread count (`fixed_threads`: a producer with a consumer of its own)
//! or its chunk of work (`fixed_chunk`, for one that measures in `prepare`).

pub mod command;
pub mod model;
pub mod reference;
pub mod rseq_off;
pub mod runner;

use model::Family;

/// Declares the families: each name is a module in this folder that exports `FAMILY`.
/// Adding a family is one file and one name here.
macro_rules! families {
    ($($family:ident),* $(,)?) => {
        $(pub mod $family;)*

        /// Every benchmark family, in the order `thiscpu bench` runs them.
        pub static FAMILIES: &[&Family] = &[$(&$family::FAMILY),*];
    };
}

families![
    getcpu, counter, metrics, bpf, memory, mask, pool, sharded, rwlock, rseq_mode, otel, alloc
];

/// The text of `thiscpu bench --list`: every family and case, and why a case is left out here.
pub fn list(families: &[&'static Family]) -> String {
    // One width for every family, so that the descriptions start in one column throughout.
    let width = families
        .iter()
        .flat_map(|family| family.case_names.iter().map(|name| name.chars().count()))
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for family in families {
        out.push_str(&format!("{} — {}\n", family.name, family.about));
        let mut left_out: Vec<(String, Vec<&str>)> = Vec::new();
        for case in (family.cases)() {
            match &case.workload {
                Ok(_) => out.push_str(&format!("  {:<width$}  {}\n", case.name, case.how)),
                Err(reason) => {
                    out.push_str(&format!(
                        "  {:<width$}  (left out here: see below)\n",
                        case.name
                    ));
                    group_by_reason(&mut left_out, reason, case.name);
                }
            }
        }
        for (reason, cases) in left_out {
            out.push_str(&format!("  left out: {}: {reason}\n", cases.join(", ")));
        }
    }
    out.trim_end().to_owned()
}

/// Adds `case` to the group of cases left out for `reason`, so that each reason is said once.
pub fn group_by_reason<'a>(groups: &mut Vec<(String, Vec<&'a str>)>, reason: &str, case: &'a str) {
    match groups.iter_mut().find(|(known, _)| known == reason) {
        Some((_, cases)) => cases.push(case),
        None => groups.push((reason.to_owned(), vec![case])),
    }
}

/// The family called `name`.
pub fn family(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|family| family.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_unique_case_names() {
        for family in FAMILIES {
            let mut names = family.case_names.to_vec();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), family.case_names.len(), "{}", family.name);
            for case in (family.cases)() {
                assert!(family.case_names.contains(&case.name), "{}", case.name);
            }
        }
    }
}
