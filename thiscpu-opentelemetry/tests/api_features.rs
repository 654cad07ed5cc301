//! Depending on this crate must not change what the application's other OpenTelemetry code
//! means: with the API's `experimental_metrics_bound_instruments` on, the SDK's own counters
//! get a `bind` whose handles drop every add unless the SDK's feature of the same name is on
//! too. So this crate must not turn on any experimental feature of the API.

use std::process::Command;

/// The features of the `opentelemetry` crate when this crate alone is built, as Cargo resolves
/// them for a program that depends on it (normal dependencies only: not the tests' ones, nor
/// those of other crates of the workspace).
fn api_features() -> Vec<String> {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let output = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--manifest-path", manifest])
        .args(["-p", env!("CARGO_PKG_NAME"), "-e", "normal", "--depth", "1"])
        .args(["--prefix", "none", "--format", "{p}|{f}"])
        .output()
        .expect("cargo tree runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = stdout
        .lines()
        .find(|line| line.starts_with("opentelemetry v"))
        .unwrap_or_else(|| panic!("no opentelemetry in:\n{stdout}"));
    let (_, features) = line.split_once('|').expect("a feature list");
    features
        .split(',')
        .filter(|f| !f.is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_api_gets_no_experimental_feature_from_this_crate() {
    // The feature resolution is the same on every machine; a test executable copied into an
    // emulated guest, which has no Cargo, or run under wine, which cannot start the build
    // machine's, leaves the check to the build machine's run.
    if !cfg!(target_os = "linux") || !std::path::Path::new(env!("CARGO")).exists() {
        eprintln!("skipped: no Cargo at {} to resolve features", env!("CARGO"));
        return;
    }
    let features = api_features();
    assert!(
        features.iter().any(|f| f == "metrics"),
        "the metrics API is on: {features:?}"
    );
    let experimental: Vec<&String> = features
        .iter()
        .filter(|f| f.starts_with("experimental"))
        .collect();
    assert!(
        experimental.is_empty(),
        "experimental API features turned on by this crate: {experimental:?}"
    );
}
