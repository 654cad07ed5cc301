//! Where a report goes: standard output (`-`), or a file replaced atomically. The file's
//! contents are written to a temporary file in the same folder, then renamed over the target,
//! so that a reader sees the old file or the whole new one, and a run that fails or is
//! interrupted leaves no truncated file behind.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The version of every JSON document the command writes. Raised when a field changes meaning
/// or goes away; new fields do not raise it.
pub const SCHEMA_VERSION: u32 = 1;

/// An output opened before the work starts, so that a bad path fails at once.
#[derive(Debug)]
pub struct Output {
    target: Target,
}

#[derive(Debug)]
enum Target {
    Stdout,
    File {
        path: PathBuf,
        temporary: PathBuf,
        file: Option<std::fs::File>,
    },
}

impl Output {
    /// `-` is standard output; anything else a file, created (as a temporary) now.
    pub fn open(path: &Path) -> Result<Output> {
        if path == Path::new("-") {
            return Ok(Output {
                target: Target::Stdout,
            });
        }
        let name = path
            .file_name()
            .ok_or_else(|| Error::input(format!("{} names no file", path.display())))?;
        let mut temporary_name = std::ffi::OsString::from(".");
        temporary_name.push(name);
        temporary_name.push(format!(".{}.partial", std::process::id()));
        let temporary = path.with_file_name(temporary_name);
        let file = std::fs::File::create(&temporary).map_err(|e| Error::write(path, e))?;
        Ok(Output {
            target: Target::File {
                path: path.to_owned(),
                temporary,
                file: Some(file),
            },
        })
    }

    /// Whether this is standard output.
    pub fn is_stdout(&self) -> bool {
        matches!(self.target, Target::Stdout)
    }

    /// The file's path, `None` for standard output.
    pub fn path(&self) -> Option<&Path> {
        match &self.target {
            Target::Stdout => None,
            Target::File { path, .. } => Some(path),
        }
    }

    /// Writes `contents` and, for a file, puts it in place.
    pub fn commit(mut self, contents: &[u8]) -> Result<()> {
        match &mut self.target {
            Target::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(contents)
                    .and_then(|()| out.flush())
                    .map_err(|e| Error::write(Path::new("standard output"), e))
            }
            Target::File {
                path,
                temporary,
                file,
            } => {
                let mut written = file.take().expect("an output is committed once");
                written
                    .write_all(contents)
                    .and_then(|()| written.sync_all())
                    .and_then(|()| std::fs::rename(&*temporary, &*path))
                    .map_err(|e| Error::write(path, e))?;
                // In place: nothing for the drop to remove.
                *temporary = PathBuf::new();
                Ok(())
            }
        }
    }

    /// Encodes `value` as pretty JSON with a final newline and commits it.
    pub fn commit_json(self, value: &impl serde::Serialize) -> Result<()> {
        let mut text = serde_json::to_vec_pretty(value)
            .map_err(|e| Error::failed(format!("cannot encode JSON: {e}")))?;
        text.push(b'\n');
        self.commit(&text)
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        if let Target::File { temporary, .. } = &self.target
            && !temporary.as_os_str().is_empty()
        {
            let _ = std::fs::remove_file(temporary);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("thiscpu-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_file_appears_whole_or_not_at_all() {
        let dir = scratch("whole");
        let path = dir.join("out.json");
        std::fs::write(&path, "old").unwrap();
        let output = Output::open(&path).unwrap();
        // Until committed, the old file is untouched.
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        output.commit(b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        // Abandoned (a failed run): the old file stays, no temporary is left.
        drop(Output::open(&path).unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "{left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_dash_is_standard_output() {
        let output = Output::open(Path::new("-")).unwrap();
        assert!(output.is_stdout());
        assert!(output.path().is_none());
    }
}
