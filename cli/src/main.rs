//! The `thiscpu` command: which CPU am I on, how fast can a program ask, and how do two runs
//! compare. Dispatch only: the command line is parsed in `args`, the work is in the modules.

mod args;
mod bench;
mod error;
mod info;
mod machine;
mod report;
mod stress;

use args::Command;
use error::Error;

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

/// `thiscpu report`: a recorded report printed again, and/or a README's blocks refreshed.
fn report_command(
    file: Option<&std::path::Path>,
    readme: Option<&std::path::Path>,
    check: bool,
) -> Result<(), Error> {
    if let Some(file) = file {
        println!("{}", report::replay::Replay::read(file)?.text());
    }
    if let Some(readme) = readme {
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
        }) => report_command(file.as_deref(), readme.as_deref(), check),
        Some(Command::Stress(options)) => stress::run(options),
    };
    if let Err(error) = outcome {
        eprintln!("thiscpu: {error}");
        std::process::exit(error.status());
    }
}
