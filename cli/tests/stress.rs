//! `thiscpu stress`: a short run is exact and says so in its JSON; bad input exits with
//! status 2 and a one-line message.

use serde_json::Value;
use std::process::{Command, Output};

fn thiscpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thiscpu"))
        .args(args)
        .output()
        .expect("run thiscpu")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_short_run_is_exact() {
    let output = thiscpu(&["stress", "--seconds", "1", "--threads", "4", "--json"]);
    let stdout = text(&output.stdout);
    assert!(
        output.status.success(),
        "thiscpu stress failed: {}\n{stdout}\n{}",
        output.status,
        text(&output.stderr)
    );
    let report: Value = serde_json::from_str(&stdout).expect("stress --json prints JSON");
    assert_eq!(report["lost"], 0, "{report}");
    assert_eq!(report["exact"], true, "{report}");
    for part in ["counter", "pool"] {
        let part = &report[part];
        assert_eq!(part["lost"], 0, "{report}");
        assert_eq!(part["exact"], true, "{report}");
        assert_eq!(part["workers"], 4, "{report}");
        assert!(part["operations"].as_u64().unwrap() > 0, "{report}");
    }
    let counter = &report["counter"];
    assert_eq!(counter["operations"], counter["counted"], "{report}");
    assert!(report["source"]["registrar"].is_string(), "{report}");
}

#[test]
fn text_names_every_figure() {
    let output = thiscpu(&["stress", "--seconds", "0.2"]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", text(&output.stderr));
    for figure in [
        "operations",
        "lost",
        "aborts",
        "migrations",
        "signals sent",
        "signals handled",
        "threads created",
        "double hand-outs",
        "drains",
        "rseq registered by",
    ] {
        assert!(stdout.contains(figure), "no {figure:?} in\n{stdout}");
    }
}

#[test]
fn bad_input_exits_2() {
    for args in [
        &["stress", "--seconds", "0"][..],
        &["stress", "--seconds", "-1"],
        &["stress", "--seconds", "soon"],
        &["stress", "--threads", "0"],
        &["stress", "--threads", "many"],
        &["stress", "--frobnicate"],
        &["stress", "extra"],
    ] {
        let output = thiscpu(args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("thiscpu: "), "{args:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{args:?}");
    }
}
