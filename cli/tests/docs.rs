//! The repository's Markdown files (README.md, docs/) against the repository: every relative
//! link names a file that exists and, with `#anchor`, a heading of it; every file holding Rust
//! snippets is compiled as doctests by a crate; every file quoting recorded runs is current
//! (`thiscpu report --readme FILE --check`); the README's dependency line and commands agree
//! with the workspace's manifest and CI.
//!
//! These read the files where they are, so they need the repository: a test executable run
//! elsewhere (the emulated guests get the package's folder only) says so and checks nothing.
//! The quoted runs are also checked by a unit test with the files compiled in
//! (`report::readme`), which runs everywhere.
#![cfg(target_os = "linux")]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace's root, or `None` where this executable runs without the repository.
fn repository() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()?
        .to_path_buf();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).ok()?;
    if manifest.contains("[workspace]") {
        Some(root)
    } else {
        eprintln!("the repository is not here: nothing to check");
        None
    }
}

/// Every Markdown file of the repository (build outputs and git's own files aside), as paths
/// from its root, sorted.
fn markdown_files(root: &Path) -> Vec<String> {
    fn walk(root: &Path, folder: &Path, found: &mut Vec<String>) {
        let entries = std::fs::read_dir(root.join(folder)).expect("read a folder");
        for entry in entries {
            let entry = entry.expect("a folder entry");
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = folder.join(&name);
            if entry.file_type().expect("a file type").is_dir() {
                if name != "target" && name != ".git" {
                    walk(root, &path, found);
                }
            } else if name.ends_with(".md") {
                found.push(path.to_string_lossy().into_owned());
            }
        }
    }
    let mut found = Vec::new();
    walk(root, Path::new(""), &mut found);
    found.sort();
    found
}

/// The lines of a Markdown text outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            lines.push(line);
        }
    }
    lines
}

/// The anchors GitHub gives a file's headings: lower case, punctuation but `-` and `_` dropped,
/// spaces made `-`, and `-1`, `-2` ... after a repeated one.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = Vec::new();
    for line in prose(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let count = seen.entry(slug.clone()).or_insert(0);
        anchors.push(if *count == 0 {
            slug.clone()
        } else {
            format!("{slug}-{count}")
        });
        *count += 1;
    }
    anchors
}

/// The targets of a text's inline links, `[text](target)`, outside code blocks and spans.
fn links(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for line in prose(text) {
        // Code spans removed: `[a](b)` inside backticks is not a link.
        let mut outside = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                outside.push_str(part);
            }
        }
        let mut rest = outside.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            targets.push(rest[..end].to_owned());
            rest = &rest[end..];
        }
    }
    targets
}

/// `relative` resolved against the folder of `file` (both from the repository's root).
fn resolve(file: &str, relative: &str) -> String {
    let mut parts: Vec<&str> = file.split('/').collect();
    parts.pop();
    for part in relative.split('/') {
        match part {
            ".." => {
                parts.pop();
            }
            "." | "" => {}
            part => parts.push(part),
        }
    }
    parts.join("/")
}

/// Every broken relative link of the files, as `file: target (why)`.
fn broken_links(root: &Path, files: &[String]) -> Vec<String> {
    let mut broken = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(root.join(file)).expect("read a Markdown file");
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let linked = if path.is_empty() {
                file.clone()
            } else {
                resolve(file, path)
            };
            if !root.join(&linked).exists() {
                broken.push(format!("{file}: {target} ({linked} does not exist)"));
                continue;
            }
            if anchor.is_empty() {
                continue;
            }
            if !linked.ends_with(".md") {
                broken.push(format!(
                    "{file}: {target} (an anchor into a file that is not Markdown)"
                ));
                continue;
            }
            let linked_text = std::fs::read_to_string(root.join(&linked)).expect("read a file");
            if !anchors(&linked_text).iter().any(|a| a == anchor) {
                broken.push(format!(
                    "{file}: {target} ({linked} has no heading #{anchor})"
                ));
            }
        }
    }
    broken
}

#[test]
fn anchors_and_links_are_read_as_github_does() {
    let text = "# The `metrics` backend (feature `metrics`)\n```sh\n# not a heading\n```\n\
                ## Exporting, way 2: x\n## A\n## A\n#not-a-heading\n";
    assert_eq!(
        anchors(text),
        [
            "the-metrics-backend-feature-metrics",
            "exporting-way-2-x",
            "a",
            "a-1"
        ]
    );
    let text = "see [a](docs/a.md#x) and [`b`](../b.json), not `[c](c.md)`\n```\n[d](d.md)\n```\n";
    assert_eq!(links(text), ["docs/a.md#x", "../b.json"]);
    assert_eq!(
        resolve("docs/guide.md", "../results/bench.json"),
        "results/bench.json"
    );
    assert_eq!(resolve("README.md", "docs/guide.md"), "docs/guide.md");
}

#[test]
fn every_relative_link_resolves() {
    let Some(root) = repository() else { return };
    let files = markdown_files(&root);
    assert!(
        files.iter().any(|f| f == "README.md") && files.iter().any(|f| f == "docs/guide.md"),
        "{files:?}"
    );
    let broken = broken_links(&root, &files);
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn a_broken_link_or_anchor_is_found() {
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("docs-links");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(scratch.join("docs")).unwrap();
    std::fs::write(scratch.join("docs/a.md"), "# A page\n## Its part\n").unwrap();
    std::fs::write(
        scratch.join("README.md"),
        "[ok](docs/a.md#its-part) [gone](docs/b.md) [no anchor](docs/a.md#other) [self](#a)\n",
    )
    .unwrap();
    let files = ["README.md".to_owned(), "docs/a.md".to_owned()];
    let broken = broken_links(&scratch, &files);
    assert_eq!(broken.len(), 3, "{broken:#?}");
    assert!(
        broken[0].contains("docs/b.md does not exist"),
        "{broken:#?}"
    );
    assert!(broken[1].contains("no heading #other"), "{broken:#?}");
    assert!(
        broken[2].contains("README.md has no heading #a"),
        "{broken:#?}"
    );
}

/// The Markdown files that a crate of the workspace includes as doctests, as paths from the
/// repository's root (`#[doc = include_str!("../../docs/guide.md")]` in `thiscpu/src/lib.rs`).
fn doctested(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    for crate_root in ["thiscpu/src/lib.rs", "thiscpu-opentelemetry/src/lib.rs"] {
        let source = std::fs::read_to_string(root.join(crate_root)).expect("read a crate root");
        for line in source.lines() {
            let Some(rest) = line.trim().strip_prefix("#[doc = include_str!(\"") else {
                continue;
            };
            let Some((path, _)) = rest.split_once('"') else {
                continue;
            };
            if path.ends_with(".md") {
                files.push(resolve(crate_root, path));
            }
        }
    }
    files
}

#[test]
fn every_file_with_rust_snippets_is_compiled_as_doctests() {
    let Some(root) = repository() else { return };
    let included = doctested(&root);
    assert!(
        included.iter().any(|f| f == "README.md") && included.iter().any(|f| f == "docs/guide.md"),
        "{included:?}"
    );
    for file in markdown_files(&root) {
        let text = std::fs::read_to_string(root.join(&file)).unwrap();
        let snippets = text
            .lines()
            .filter(|line| line.trim_start().starts_with("```rust"))
            .count();
        assert!(
            snippets == 0 || included.contains(&file),
            "{file} holds {snippets} Rust snippet(s) that no crate compiles: include it as \
             thiscpu/src/lib.rs includes README.md"
        );
    }
}

#[test]
fn every_file_quoting_recorded_runs_is_current() {
    let Some(root) = repository() else { return };
    let mut quoting = Vec::new();
    for file in markdown_files(&root) {
        let text = std::fs::read_to_string(root.join(&file)).unwrap();
        if text
            .lines()
            .any(|line| line.trim().starts_with("<!-- bench-"))
        {
            quoting.push(file);
        }
    }
    for expected in ["README.md", "docs/results.md", "docs/opentelemetry.md"] {
        assert!(
            quoting.iter().any(|f| f == expected),
            "{expected}: {quoting:?}"
        );
    }
    let output = Command::new(env!("CARGO_BIN_EXE_thiscpu"))
        .current_dir(&root)
        .args(["report", "--check", "--readme"])
        .args(&quoting)
        .output()
        .expect("run thiscpu");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_readme_agrees_with_the_manifest_and_ci() {
    let Some(root) = repository() else { return };
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    let rust_version = manifest
        .lines()
        .find_map(|line| line.strip_prefix("rust-version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("the workspace's rust-version");
    // Dependency lines that name folders of this repository, and no release tag or repository
    // address that this repository does not have.
    for line in [
        "thiscpu = { path = \"../thiscpu/thiscpu\" }",
        "thiscpu-opentelemetry = { path = \"../thiscpu/thiscpu-opentelemetry\" }",
    ] {
        assert!(readme.contains(line), "the README does not say `{line}`");
        let folder = line
            .split('"')
            .nth(1)
            .unwrap()
            .trim_start_matches("../thiscpu/");
        assert!(
            root.join(folder).join("Cargo.toml").exists(),
            "no crate in {folder}"
        );
    }
    for (at, _) in readme.match_indices("tag = \"") {
        let tag = readme[at + 7..].split('"').next().unwrap();
        let tags = std::process::Command::new("git")
            .args(["tag", "--list", tag])
            .current_dir(&root)
            .output()
            .expect("run git");
        assert!(
            !String::from_utf8_lossy(&tags.stdout).trim().is_empty(),
            "the README names the tag {tag}, which the repository does not have"
        );
    }
    assert!(
        !readme.contains("github.com"),
        "the README names a repository address"
    );
    let needs = format!("It needs Rust {rust_version} or later");
    assert!(readme.contains(&needs), "the README does not say `{needs}`");
    // The two commands the README gives from the repository, and CI running the same tests.
    for command in ["cargo run --release -- bench", "cargo test --workspace"] {
        assert!(
            readme.contains(command),
            "the README does not give `{command}`"
        );
    }
    assert!(
        ci.contains("cargo test --workspace"),
        ".ci/run does not run the README's `cargo test --workspace`"
    );
}
