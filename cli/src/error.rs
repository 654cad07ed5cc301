//! The command's one error type: a one-line message and the exit status it leads to.

use std::fmt;
use std::path::Path;

/// Exit status for bad input: a bad argument, an unreadable or invalid file, an unwritable
/// output path.
pub const BAD_INPUT: i32 = 2;
/// Exit status for a benchmark that failed its own check (e.g. a counter that lost counts).
pub const FAILED: i32 = 1;

/// An error reported as `thiscpu: <message>` on one line of standard error.
#[derive(Debug)]
pub struct Error {
    message: String,
    status: i32,
}

impl Error {
    /// Bad input from the user: exit status 2.
    pub fn input(message: impl Into<String>) -> Self {
        Error {
            message: one_line(message.into()),
            status: BAD_INPUT,
        }
    }

    /// A run that went wrong: exit status 1.
    pub fn failed(message: impl Into<String>) -> Self {
        Error {
            message: one_line(message.into()),
            status: FAILED,
        }
    }

    /// An output file or folder that cannot be created or written.
    pub fn write(path: &Path, error: std::io::Error) -> Self {
        Error::input(format!(
            "cannot write {}: {}",
            path.display(),
            plain(&error)
        ))
    }

    /// An input file that cannot be read.
    pub fn read(path: &Path, error: std::io::Error) -> Self {
        Error::input(format!("cannot read {}: {}", path.display(), plain(&error)))
    }

    /// The exit status this error leads to.
    pub fn status(&self) -> i32 {
        self.status
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// `Permission denied` rather than `Permission denied (os error 13)`.
pub fn plain(error: &std::io::Error) -> String {
    let text = error.to_string();
    match text.find(" (os error") {
        Some(cut) => text[..cut].to_owned(),
        None => text,
    }
}

/// Messages end up on one line whatever produced them.
fn one_line(message: String) -> String {
    if message.contains('\n') {
        message.split_whitespace().collect::<Vec<_>>().join(" ")
    } else {
        message
    }
}

/// Results of the command's operations.
pub type Result<T> = std::result::Result<T, Error>;
