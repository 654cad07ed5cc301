//! The `thiscpu` command: which CPU am I on, how fast can a program ask, and how do two runs
//! compare. Dispatch only: the command line is parsed in `args`, the work is in the modules.
//!
//! Linux only: its benchmarks and stress tests measure and move threads with Linux's
//! interfaces. Built for another system it says so and exits with status 1; the library and
//! its integrations do not depend on it.

#[cfg(target_os = "linux")]
mod args;
#[cfg(target_os = "linux")]
mod bench;
#[cfg(target_os = "linux")]
mod error;
#[cfg(target_os = "linux")]
mod info;
#[cfg(target_os = "linux")]
mod machine;
#[cfg(target_os = "linux")]
mod report;
#[cfg(target_os = "linux")]
mod stress;

#[cfg(target_os = "linux")]
use args::Command;
#[cfg(target_os = "linux")]
use error::Error;

/// The bare command: one line, where this thread runs and who said so.
#[cfg(target_os = "linux")]
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

/// `thiscpu report`: a recorded report printed again, and/or the blocks of Markdown files
/// refreshed, one file after the other (the first that fails stops the command).
#[cfg(target_os = "linux")]
fn report_command(
    file: Option<&std::path::Path>,
    readmes: &[std::path::PathBuf],
    check: bool,
    targets: bool,
) -> Result<(), Error> {
    if let Some(file) = file {
        println!("{}", report::replay::Replay::read(file)?.text(targets));
    }
    for readme in readmes {
        let refreshed = report::readme::refresh(readme, check)?;
        let state = match (refreshed.changed, check) {
            (false, _) => "current",
            (true, false) => "rewritten",
            (true, true) => unreachable!("a check that finds a change fails"),
        };
        eprintln!(
            "{}: {} bench block{} {state}",
            readme.display(),
            refreshed.blocks,
            if refreshed.blocks == 1 { "" } else { "s" }
        );
    }
    Ok(())
}

#[cfg(target_os = "linux")]
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
    // A child process of `bench alloc`, whose global allocator is the one it measures.
    if let Ok(spec) = std::env::var(bench::alloc::switch::CHILD_ENV) {
        std::process::exit(bench::alloc::child::child_main(&spec));
    }
    // A child process of `bench alloc` that serves tcmalloc's cases, where tcmalloc holds rseq.
    if let Ok(spec) = std::env::var(bench::alloc::TCMALLOC_CHILD.var) {
        std::process::exit(bench::rseq_off::serve_main(
            &spec,
            bench::alloc::TCMALLOC_CHILD,
            bench::alloc::tcmalloc_ready,
        ));
    }
    // A child process of a case mirrored with rseq off, started by this program itself.
    if let Ok(case) = std::env::var(bench::rseq_off::CHILD_ENV) {
        std::process::exit(bench::rseq_off::child_main(&case));
    }
    let cli = args::parse();
    let outcome = match cli.command {
        None => where_am_i(),
        Some(Command::Info { json }) => info::run(json.as_deref()),
        Some(Command::Bench(options)) if options.list => {
            args::bench_options(options).map(|options| {
                println!("{}", bench::list(&options.families));
            })
        }
        Some(Command::Bench(options)) => args::bench_options(options).and_then(bench::command::run),
        Some(Command::Compare {
            before,
            after,
            threshold,
            export_markdown,
        }) => report::compare::run(&before, &after, threshold, export_markdown.as_deref()),
        Some(Command::Report {
            file,
            readme,
            check,
            targets,
        }) => report_command(file.as_deref(), &readme, check, targets),
        Some(Command::Stress(options)) => stress::run(options),
    };
    if let Err(error) = outcome {
        eprintln!("thiscpu: {error}");
        std::process::exit(error.status());
    }
}

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("the thiscpu command supports Linux only; the thiscpu library runs everywhere");
    std::process::exit(1);
}
