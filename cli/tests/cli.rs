//! End-to-end tests of the `thiscpu` command: reports against the schema, charts as XML,
//! comparisons, help, and one-line errors with exit status 2 for bad input.
//!
//! Benchmarks run with `--quick` (a few seconds): these tests check shapes and plumbing,
//! never timings.
//!
//! Linux only, like the command.
#![cfg(target_os = "linux")]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Every case the getcpu family defines: each must be measured or listed as skipped.
const GETCPU_CASES: &[&str] = &[
    "syscall",
    "vdso-getcpu",
    "glibc-sched_getcpu",
    "rdtscp",
    "rdpid",
    "current_cpu",
    "current_cpu-noinline",
    "getcpu",
    "mm_cid",
    "c-cpu_id",
    "c-cpu-node",
    "empty-loop",
];

fn thiscpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thiscpu"))
        .args(args)
        .output()
        .expect("run thiscpu")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A fresh scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch folder");
    dir
}

fn data(name: &str) -> String {
    format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn succeed(args: &[&str]) -> String {
    let output = thiscpu(args);
    assert!(
        output.status.success(),
        "thiscpu {args:?} failed: {}\n{}",
        output.status,
        text(&output.stderr)
    );
    text(&output.stdout)
}

fn schema_errors(instance: &Value) -> Vec<String> {
    let schema_path = format!("{}/docs/bench-schema.json", env!("CARGO_MANIFEST_DIR"));
    let schema: Value =
        serde_json::from_str(&std::fs::read_to_string(schema_path).expect("read schema"))
            .expect("schema is JSON");
    let validator = jsonschema::validator_for(&schema).expect("schema is a valid JSON Schema");
    validator
        .iter_errors(instance)
        .map(|error| format!("{} at {}", error, error.instance_path()))
        .collect()
}

#[test]
fn quick_bench_json_matches_the_schema_and_lists_every_case() {
    let dir = scratch("bench-json");
    let json = dir.join("getcpu.json");
    let json = json.to_str().unwrap();
    let stdout = succeed(&["bench", "--quick", "--json", json]);
    assert!(stdout.contains("getcpu"), "{stdout}");

    let report: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let errors = schema_errors(&report);
    assert!(
        errors.is_empty(),
        "report does not match the schema: {errors:#?}"
    );

    let results = report["results"].as_array().unwrap();
    let skipped = report["skipped"].as_array().unwrap();
    for case in GETCPU_CASES {
        let measured = results
            .iter()
            .filter(|r| r["bench"] == "getcpu" && r["case"] == *case)
            .count();
        let left_out = skipped
            .iter()
            .filter(|s| s["bench"] == "getcpu" && s["case"] == *case)
            .count();
        assert_eq!(
            measured + left_out,
            1,
            "{case}: measured {measured}, skipped {left_out}"
        );
        if left_out == 1 {
            assert!(
                stdout.contains(&format!("{case}: ")),
                "reason for {case} not shown"
            );
        }
    }
    for result in results {
        let rounds = result["rounds"].as_array().unwrap();
        assert_eq!(rounds.len(), 3, "--quick runs 3 rounds");
        let value = |key: &str| result[key].as_f64().unwrap();
        assert!(value("min") <= value("median") && value("median") <= value("max"));
        if result["bench"] == "getcpu" {
            assert!(value("min") > 0.0, "{result}");
            assert_eq!(result["threads"], 1);
            assert_eq!(result["unit"], "ns/op");
        }
    }

    // The machine block agrees with the library in this (same-environment) process.
    let source = thiscpu::source();
    let rseq = &report["machine"]["rseq"];
    assert_eq!(rseq["registered_by"], source.registrar.name());
    assert_eq!(rseq["feature_size"], source.kernel_feature_size);
    assert_eq!(rseq["node_id"], source.node_id);
    assert_eq!(rseq["mm_cid"], source.mm_cid);
    assert_eq!(
        report["machine"]["cpus_possible"],
        thiscpu::topology::possible_cpus()
    );

    // A report compared with itself: every row present on both sides, nothing one-sided.
    let comparison = succeed(&["compare", json, json]);
    assert!(comparison.contains("current_cpu"), "{comparison}");
    assert!(!comparison.contains("only in"), "{comparison}");

    // Read back, the report prints what the run printed.
    let replayed = succeed(&["report", json]);
    let printed_table = |text: &str| -> Vec<String> {
        let start = text.find("getcpu — ").expect("the getcpu table");
        text[start..].lines().take(14).map(str::to_owned).collect()
    };
    assert_eq!(printed_table(&replayed), printed_table(&stdout));

    // A Markdown file quoting it is filled in, then found current, then found stale.
    let markdown = dir.join("quotes.md");
    std::fs::write(
        &markdown,
        "# Runs\n<!-- bench-run getcpu.json -->\n<!-- end bench -->\ntext\n\
         <!-- bench-family getcpu.json getcpu -->\nold table\n<!-- end bench -->\n",
    )
    .unwrap();
    let markdown = markdown.to_str().unwrap();
    succeed(&["report", "--readme", markdown]);
    let quoted = std::fs::read_to_string(markdown).unwrap();
    assert!(!quoted.contains("old table"), "{quoted}");
    assert!(quoted.contains("Recorded in [`getcpu.json`]"), "{quoted}");
    assert!(
        quoted.contains("by `thiscpu bench --quick --json"),
        "{quoted}"
    );
    assert!(
        quoted.contains(&printed_table(&stdout).join("\n")),
        "{quoted}"
    );
    succeed(&["report", "--readme", markdown, "--check"]);

    // Several files at once, one of them in a folder of its own (report paths are relative to
    // each file), with chosen results as one table.
    std::fs::create_dir_all(dir.join("docs")).unwrap();
    let rows = dir.join("docs/rows.md");
    std::fs::write(
        &rows,
        "<!-- bench-rows ../getcpu.json getcpu/current_cpu@1 getcpu/syscall@1 -->\n\
         <!-- end bench -->\n",
    )
    .unwrap();
    let rows = rows.to_str().unwrap();
    succeed(&["report", "--readme", markdown, rows]);
    let table = std::fs::read_to_string(rows).unwrap();
    assert!(table.contains("\n| getcpu/current_cpu | "), "{table}");
    assert!(table.contains("\n| getcpu/syscall | "), "{table}");
    assert!(
        table.contains("[`../getcpu.json`](../getcpu.json)"),
        "{table}"
    );
    succeed(&["report", "--readme", markdown, rows, "--check"]);

    // A stale block in the second file fails the check, naming that file.
    std::fs::write(
        rows,
        table.replace("getcpu/syscall |", "getcpu/syscall (old) |"),
    )
    .unwrap();
    let stale = thiscpu(&["report", "--readme", markdown, rows, "--check"]);
    assert_eq!(stale.status.code(), Some(1), "{}", text(&stale.stderr));
    assert!(
        text(&stale.stderr).contains("rows.md: its bench blocks differ"),
        "{}",
        text(&stale.stderr)
    );

    std::fs::write(markdown, quoted.replace("current_cpu", "current-cpu")).unwrap();
    let stale = thiscpu(&["report", "--readme", markdown, "--check"]);
    assert_eq!(stale.status.code(), Some(1), "{}", text(&stale.stderr));
    assert!(text(&stale.stderr).contains("differ from the reports"));
}

#[test]
fn threads_and_case_filters_shape_the_run() {
    let dir = scratch("bench-threads");
    let json = dir.join("out.json");
    let json = json.to_str().unwrap();
    succeed(&[
        "bench",
        "getcpu",
        "--quick",
        "--cases",
        "empty-loop,current_cpu-*",
        "--threads",
        "1,2",
        "--rounds",
        "2",
        "--json",
        json,
    ]);
    let report: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    assert!(schema_errors(&report).is_empty());
    let mut rows: Vec<(String, u64)> = report["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert_eq!(r["rounds"].as_array().unwrap().len(), 2);
            (
                r["case"].as_str().unwrap().to_owned(),
                r["threads"].as_u64().unwrap(),
            )
        })
        .collect();
    rows.sort();
    assert_eq!(
        rows,
        [
            ("current_cpu-noinline".to_owned(), 1),
            ("current_cpu-noinline".to_owned(), 2),
            ("empty-loop".to_owned(), 1),
            ("empty-loop".to_owned(), 2),
        ]
    );
}

#[test]
fn svg_chart_is_well_formed_svg() {
    let dir = scratch("bench-svg");
    let charts = dir.join("charts");
    succeed(&[
        "bench",
        "getcpu",
        "--quick",
        "--cases",
        "syscall,current_cp?,empty-loop",
        "--svg",
        charts.to_str().unwrap(),
    ]);
    let svg = std::fs::read_to_string(charts.join("getcpu.svg")).expect("getcpu.svg written");
    let document = roxmltree::Document::parse(&svg).expect("the chart is well-formed XML");
    let root = document.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        root.tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );
    assert!(root.attribute("viewBox").is_some());
    let texts: Vec<String> = root
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(|t| t.trim().to_owned())
        .collect();
    for case in ["syscall", "current_cpu", "empty-loop"] {
        assert!(
            texts.iter().any(|t| t == case),
            "no label {case} in {texts:?}"
        );
    }
    // One bar per case (the glob `current_cp?` names current_cpu alone), plus the background.
    let rects = root
        .descendants()
        .filter(|n| n.has_tag_name("rect"))
        .count();
    assert_eq!(rects, 4);
}

#[test]
fn compare_shows_changes_and_one_sided_cases() {
    let stdout = succeed(&["compare", &data("before.json"), &data("after.json")]);
    let line = |needle: &str| -> String {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(needle))
            .unwrap_or_else(|| panic!("no line for {needle} in\n{stdout}"))
            .to_owned()
    };
    let syscall = line("syscall");
    assert!(syscall.contains("-100 "), "{syscall}");
    assert!(syscall.contains("-50.0 % better"), "{syscall}");
    let current = line("current_cpu");
    assert!(current.contains("+4.00 % within spread"), "{current}");
    let percpu = line("percpu");
    assert!(percpu.contains("+20.0 % better"), "{percpu}");
    assert!(
        stdout.contains("only in before")
            && stdout.contains("getcpu/rdpid ×1 (left out there: CPU lacks RDPID)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("only in after") && stdout.contains("getcpu/mm_cid ×1"),
        "{stdout}"
    );
    // Fixtures must themselves match the schema that compare reads.
    for name in ["before.json", "after.json"] {
        let report: Value =
            serde_json::from_str(&std::fs::read_to_string(data(name)).unwrap()).unwrap();
        assert!(schema_errors(&report).is_empty(), "{name}");
    }
}

#[test]
fn bad_input_is_one_line_and_exit_status_2() {
    let dir = scratch("bad-input");
    let not_json = dir.join("not.json");
    std::fs::write(&not_json, "{ this is not json").unwrap();
    let wrong_shape = dir.join("shape.json");
    std::fs::write(&wrong_shape, r#"{"machine": {}, "results": 3}"#).unwrap();
    let a_file = dir.join("plain-file");
    std::fs::write(&a_file, "").unwrap();
    let under_file = a_file.join("charts");
    let missing = dir.join("missing.json");
    let no_dir = dir.join("no/such/dir/out.json");
    let older_report = data("before.json");

    let cases: Vec<Vec<&str>> = vec![
        vec!["frobnicate"],
        vec!["bench", "--frobnicate"],
        vec!["info", "--jsno"],
        vec!["bench", "--seconds", "abc"],
        vec!["bench", "--seconds", "0"],
        vec!["bench", "--rounds", "many"],
        vec!["bench", "--rounds", "0"],
        vec!["bench", "--threads", "0"],
        vec!["bench", "--threads", "1,x"],
        vec!["bench", "nosuchfamily"],
        vec!["bench", "--quick", "--cases", "nosuchcase"],
        vec!["bench", "--quick", "--json", no_dir.to_str().unwrap()],
        vec!["bench", "--quick", "--svg", under_file.to_str().unwrap()],
        vec![
            "compare",
            missing.to_str().unwrap(),
            missing.to_str().unwrap(),
        ],
        vec![
            "compare",
            not_json.to_str().unwrap(),
            not_json.to_str().unwrap(),
        ],
        vec![
            "compare",
            wrong_shape.to_str().unwrap(),
            wrong_shape.to_str().unwrap(),
        ],
        vec!["compare", not_json.to_str().unwrap()],
        vec!["report"],
        vec!["report", "--check", missing.to_str().unwrap()],
        vec!["report", missing.to_str().unwrap()],
        vec!["report", not_json.to_str().unwrap()],
        vec!["report", "--readme", missing.to_str().unwrap()],
        vec!["report", &older_report],
    ];
    for args in cases {
        let output = thiscpu(&args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?} printed:\n{stderr}");
        assert!(stderr.starts_with("thiscpu: "), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            output.stdout.is_empty(),
            "{args:?} printed to stdout: {}",
            text(&output.stdout)
        );
    }
}

#[test]
fn errors_name_the_problem() {
    let stderr = text(&thiscpu(&["bench", "--seconds", "abc"]).stderr);
    assert!(
        stderr.contains("--seconds") && stderr.contains("abc"),
        "{stderr}"
    );
    let stderr = text(&thiscpu(&["bench", "nosuchfamily"]).stderr);
    assert!(
        stderr.contains("nosuchfamily") && stderr.contains("getcpu"),
        "{stderr}"
    );
    let stderr = text(&thiscpu(&["compare", "before.json"]).stderr);
    assert!(stderr.contains("<AFTER>"), "{stderr}");
    // A negative number is a bad value, not an unknown flag.
    for (args, shown) in [
        (&["bench", "--seconds", "-1"][..], "'-1' for '--seconds"),
        (&["bench", "--rounds", "-3"], "'-3' for '--rounds"),
        (&["bench", "--threads", "-2"], "'-2' for '--threads"),
    ] {
        let output = thiscpu(args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("invalid value") && stderr.contains(shown),
            "{args:?}: {stderr}"
        );
    }
    let stderr = text(&thiscpu(&["compare", "/no/such/before.json", "x"]).stderr);
    assert!(stderr.contains("/no/such/before.json"), "{stderr}");
}

#[test]
fn info_json_agrees_with_the_library() {
    let stdout = succeed(&["info", "--json"]);
    let info: Value = serde_json::from_str(&stdout).expect("info --json is JSON");
    let source = thiscpu::source();
    // Machine ids beside display names.
    assert_eq!(info["chosen"]["name"], source.this_thread.name());
    assert_eq!(info["fallback"]["name"], source.fallback.name());
    let id = |source: thiscpu::CpuSource| match source {
        thiscpu::CpuSource::RseqGlibc => "rseq_glibc",
        thiscpu::CpuSource::RseqThiscpu => "rseq_thiscpu",
        thiscpu::CpuSource::Rdpid => "rdpid",
        thiscpu::CpuSource::Vdso => "vdso",
        _ => "syscall",
    };
    assert_eq!(info["chosen"]["id"], id(source.this_thread), "{info}");
    assert_eq!(info["fallback"]["id"], id(source.fallback), "{info}");
    assert_eq!(info["rseq"]["registered_by"], source.registrar.name());
    assert_eq!(
        info["rseq"]["kernel_feature_size"],
        source.kernel_feature_size
    );
    assert_eq!(info["rseq"]["usable_size"], source.usable_size);
    assert_eq!(info["rseq"]["kernel_align"], source.kernel_align);
    assert_eq!(info["rseq"]["registered_size"], source.registered_size);
    assert_eq!(
        info["rseq"]["mode"].as_str(),
        source.mode.map(thiscpu::RseqMode::name)
    );
    assert_eq!(
        info["rseq"]["optimized_size"].as_u64(),
        source.optimized_size.map(u64::from)
    );
    assert_eq!(info["rseq"]["node_id"], source.node_id);
    assert_eq!(info["rseq"]["mm_cid"], source.mm_cid);
    // One name for one fact: what `rseq`, `cpus`, `chosen` and `fallback` say is not
    // repeated under `machine`.
    let machine: Vec<&str> = info["machine"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(machine, ["arch", "cpu_model", "glibc", "kernel"], "{info}");
    let names: Vec<&str> = info["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["rseq", "rdpid", "rdtscp", "vdso", "syscall"]);
    let possible = thiscpu::topology::possible_cpus();
    assert_eq!(info["cpus"]["possible"], possible);
    assert_eq!(
        info["cpus"]["node_of_cpu"].as_array().unwrap().len(),
        possible
    );
    assert!(info["now"]["cpu"].as_u64().unwrap() < possible as u64);

    let human = succeed(&["info"]);
    assert!(human.contains(source.this_thread.name()), "{human}");
}

/// `thiscpu info --json` with extra environment variables.
fn info_json_with(env: &[(&str, &str)]) -> Value {
    let output = Command::new(env!("CARGO_BIN_EXE_thiscpu"))
        .args(["info", "--json"])
        .envs(env.iter().copied())
        .env_remove("THISCPU_RSEQ")
        .output()
        .expect("run thiscpu info");
    assert!(output.status.success(), "{}", text(&output.stderr));
    serde_json::from_str(&text(&output.stdout)).expect("info --json is JSON")
}

/// `AT_RSEQ_FEATURE_SIZE` and `AT_RSEQ_ALIGN`, read here rather than through thiscpu.
fn kernel_rseq_auxv() -> (u64, u64) {
    // SAFETY: getauxval has no precondition; it returns 0 for absent entries.
    unsafe { (libc::getauxval(27), libc::getauxval(28)) }
}

#[test]
fn info_reports_each_registration_mode_and_when_the_kernel_offers_more() {
    let (feature_size, align) = kernel_rseq_auxv();
    // The optimized length thiscpu's 64-byte own area can take on this kernel, if any.
    let rounded = feature_size.div_ceil(align.max(1)) * align;
    let optimized = (feature_size > 32 && align.is_power_of_two() && align <= 64 && rounded <= 64)
        .then_some(rounded);
    let own = info_json_with(&[("GLIBC_TUNABLES", "glibc.pthread.rseq=0")]);
    let rseq = &own["rseq"];
    if rseq["registered_by"] != "thiscpu" {
        eprintln!("no own registration here: {rseq}");
        return;
    }
    assert_eq!(rseq["kernel_feature_size"], feature_size, "{rseq}");
    assert_eq!(rseq["optimized_size"].as_u64(), optimized, "{rseq}");
    assert_eq!(rseq["registered_size"], optimized.unwrap_or(32), "{rseq}");
    let mode = if optimized.is_some() {
        "optimized"
    } else {
        "legacy"
    };
    assert_eq!(rseq["mode"], mode, "{rseq}");
    assert_eq!(rseq["mode_advice"], Value::Null, "{rseq}");

    // Forced legacy: the advice names the knob where the kernel offers more.
    let legacy = info_json_with(&[
        ("GLIBC_TUNABLES", "glibc.pthread.rseq=0"),
        ("THISCPU_RSEQ_AREA", "legacy"),
    ]);
    let rseq = &legacy["rseq"];
    assert_eq!(
        (&rseq["registered_size"], &rseq["mode"]),
        (&32.into(), &"legacy".into())
    );
    let advice = rseq["mode_advice"].as_str();
    assert_eq!(advice.is_some(), optimized.is_some(), "{rseq}");
    if let Some(advice) = advice {
        assert!(advice.contains("THISCPU_RSEQ_AREA=legacy"), "{advice}");
    }

    // glibc's registration: legacy unless glibc reports more than 32 bytes; where the kernel
    // offers more, the advice names the tunable.
    let glibc = info_json_with(&[]);
    let rseq = &glibc["rseq"];
    if rseq["registered_by"] == "glibc" {
        let reported = rseq["glibc_rseq_size"].as_u64().unwrap();
        let glibc_legacy = reported <= 32;
        assert_eq!(rseq["registered_size"], reported.max(32), "{rseq}");
        assert_eq!(
            rseq["mode"],
            if glibc_legacy { "legacy" } else { "optimized" },
            "{rseq}"
        );
        let advice = rseq["mode_advice"].as_str();
        assert_eq!(
            advice.is_some(),
            glibc_legacy && optimized.is_some(),
            "{rseq}"
        );
        if let Some(advice) = advice {
            assert!(
                advice.contains("GLIBC_TUNABLES=glibc.pthread.rseq=0"),
                "{advice}"
            );
        }
        let human = succeed(&["info"]);
        let mode_line = human.lines().find(|l| l.starts_with("mode")).unwrap_or("");
        assert_eq!(
            mode_line.starts_with("mode     legacy") && mode_line.contains("glibc's"),
            glibc_legacy,
            "{human}"
        );
        // Legacy is not a shortcoming where the kernel has no other mode, and says so.
        assert_eq!(
            mode_line.contains("the only mode this kernel has"),
            glibc_legacy && feature_size <= 32,
            "{human}"
        );
    }
}

#[test]
fn rseq_mode_compares_in_children_or_says_why_it_cannot() {
    let dir = scratch("bench-rseq-mode");
    let json = dir.join("rseq-mode.json");
    let json = json.to_str().unwrap();
    let stdout = succeed(&["bench", "--quick", "rseq-mode", "--json", json]);
    let report: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let errors = schema_errors(&report);
    assert!(errors.is_empty(), "{errors:#?}");
    let results = report["results"].as_array().unwrap();
    let skipped = report["skipped"].as_array().unwrap();
    let cases = [
        "yield-legacy",
        "yield-optimized",
        "getppid-legacy",
        "getppid-optimized",
    ];
    let (feature_size, align) = kernel_rseq_auxv();
    let offered = feature_size > 32 && align <= 64 && feature_size.div_ceil(align) * align <= 64;
    if offered {
        // Each case measured in a child that confirmed its mode, and the ratios printed.
        let measured: Vec<&str> = results
            .iter()
            .map(|r| r["case"].as_str().unwrap())
            .collect();
        assert_eq!(measured, cases, "{stdout}");
        for result in results {
            assert!(result["median"].as_f64().unwrap() > 0.0, "{result}");
            assert!(
                result["how"].as_str().unwrap_or_default().contains("child"),
                "{result}"
            );
        }
        assert!(stdout.contains("legacy / optimized"), "{stdout}");
        assert!(stdout.contains("yield"), "{stdout}");
    } else {
        assert!(results.is_empty(), "{stdout}");
        let left_out: Vec<&str> = skipped
            .iter()
            .map(|s| s["case"].as_str().unwrap())
            .collect();
        assert_eq!(left_out, cases, "{stdout}");
        for skip in skipped {
            assert!(
                skip["reason"]
                    .as_str()
                    .unwrap()
                    .starts_with("cannot compare"),
                "{skip}"
            );
        }
        assert!(stdout.contains("cannot compare"), "{stdout}");
    }
}

#[test]
fn help_explains_with_examples() {
    for args in [
        vec!["--help"],
        vec!["bench", "--help"],
        vec!["info", "--help"],
        vec!["compare", "--help"],
    ] {
        let stdout = succeed(&args);
        assert!(stdout.contains("Example"), "{args:?}:\n{stdout}");
    }
    let bench_help = succeed(&["bench", "--help"]);
    for word in [
        "--quick",
        "--json",
        "--svg",
        "--threads",
        "--cases",
        "interleaved",
    ] {
        assert!(bench_help.contains(word), "{word} not in bench --help");
    }
    // Thread start-up, calibration and the memory cases take several seconds beyond the
    // quick run's 1 s of timed rounds: the help must not promise a second for the whole run.
    let quick = bench_help
        .lines()
        .skip_while(|line| !line.trim_start().starts_with("--quick"))
        .take_while(|line| !line.trim_start().starts_with("--seconds"))
        .collect::<Vec<_>>()
        .join(" ");
    assert!(quick.contains("on top") || quick.contains("6 s"), "{quick}");
    assert!(!quick.contains("about a second"), "{quick}");
}

#[test]
fn list_names_every_case() {
    let stdout = succeed(&["bench", "--list"]);
    for case in GETCPU_CASES {
        assert!(
            stdout
                .lines()
                .any(|l| l.split_whitespace().next() == Some(case)),
            "{case} not listed:\n{stdout}"
        );
    }
}

/// The column where the description starts in an indented `NAME  description` line, after
/// checking that at least two spaces separate the two.
fn description_column(line: &str, name: &str) -> usize {
    let rest = line
        .strip_prefix("  ")
        .and_then(|rest| rest.strip_prefix(name))
        .unwrap_or_else(|| panic!("{line:?} does not start with {name:?}"));
    assert!(
        rest.starts_with("  "),
        "no separator after {name:?}: {line:?}"
    );
    let description = rest.trim_start();
    assert!(!description.is_empty(), "no description: {line:?}");
    line.len() - description.len()
}

#[test]
fn help_and_list_separate_and_align_names_and_descriptions() {
    let list = succeed(&["bench", "--list"]);
    let families: Vec<&str> = list
        .lines()
        .filter_map(|line| line.split_once(" — ").map(|(name, _)| name))
        .collect();
    assert!(families.contains(&"rseq-mode"), "{list}");

    let help = succeed(&["bench", "--help"]);
    let block: Vec<&str> = help
        .lines()
        .skip_while(|line| !line.starts_with("Families"))
        .skip(1)
        .take_while(|line| !line.is_empty())
        .collect();
    assert_eq!(block.len(), families.len(), "{help}");
    let columns: Vec<usize> = block
        .iter()
        .zip(&families)
        .map(|(line, name)| description_column(line, name))
        .collect();
    assert!(columns.windows(2).all(|w| w[0] == w[1]), "{help}");

    let mut list_columns = Vec::new();
    for line in list.lines() {
        if line.starts_with(' ') && !line.trim_start().starts_with("left out:") {
            let name = line.split_whitespace().next().unwrap();
            list_columns.push(description_column(line, name));
        }
    }
    assert!(list_columns.len() > families.len(), "{list}");
    assert!(
        list_columns.windows(2).all(|w| w[0] == w[1]),
        "descriptions not in one column:\n{list}"
    );
}

#[test]
fn counter_cases_say_what_they_do_before_naming_a_crate() {
    let list = succeed(&["bench", "--list"]);
    let line = list
        .lines()
        .find(|line| line.split_whitespace().next() == Some("thread-slot-atomic"))
        .unwrap_or_else(|| panic!("thread-slot-atomic not listed:\n{list}"));
    let description = line
        .trim_start()
        .trim_start_matches("thread-slot-atomic")
        .trim();
    for words in ["atomic", "each thread", "slot", "sum"] {
        assert!(description.contains(words), "{words:?} missing: {line}");
    }
    // A crate's name means nothing to a newcomer: it may come after the explanation, as such.
    if let Some(at) = description.find("contatori") {
        assert!(at > 0 && description.contains("crate"), "{line}");
    }
}

#[test]
fn bare_command_says_where_it_runs() {
    let stdout = succeed(&[]);
    assert!(
        stdout.starts_with("cpu ") && stdout.contains(" node "),
        "{stdout}"
    );
}

#[test]
fn json_means_a_file_or_standard_output_for_every_command() {
    let dir = scratch("json-everywhere");
    let parse = |text: &str, what: &str| -> Value {
        let value: Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: {e}\n{text}"));
        assert_eq!(value["schema_version"], 1, "{what}: {value}");
        value
    };
    // `-` and a bare --json print JSON alone.
    for args in [&["info", "--json", "-"][..], &["info", "--json"]] {
        parse(&succeed(args), &format!("{args:?}"));
    }
    // A file gets the JSON; the text still goes to standard output.
    let info_file = dir.join("info.json");
    let stdout = succeed(&["info", "--json", info_file.to_str().unwrap()]);
    assert!(stdout.contains("machine"), "{stdout}");
    assert!(serde_json::from_str::<Value>(&stdout).is_err(), "{stdout}");
    parse(&std::fs::read_to_string(&info_file).unwrap(), "info file");

    let stress_file = dir.join("stress.json");
    let stdout = succeed(&[
        "stress",
        "--seconds",
        "0.2",
        "--threads",
        "2",
        "--json",
        stress_file.to_str().unwrap(),
    ]);
    assert!(stdout.contains("exact"), "{stdout}");
    let stress = parse(
        &std::fs::read_to_string(&stress_file).unwrap(),
        "stress file",
    );
    assert_eq!(stress["exact"], true, "{stress}");

    // bench with `-`: the JSON alone on standard output, the tables on standard error.
    let output = thiscpu(&[
        "bench",
        "--quick",
        "getcpu",
        "--cases",
        "empty-loop",
        "--json",
        "-",
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let report = parse(&text(&output.stdout), "bench -");
    assert!(schema_errors(&report).is_empty(), "{report}");
    assert!(text(&output.stderr).contains("empty-loop"));
}

#[test]
fn a_failed_run_leaves_the_previous_json_whole() {
    let dir = scratch("json-atomic");
    let json = dir.join("out.json");
    std::fs::write(&json, "previous report").unwrap();
    let a_file = dir.join("plain-file");
    std::fs::write(&a_file, "").unwrap();
    // The JSON output is opened first; the SVG folder then cannot be made, and the run stops.
    let output = thiscpu(&[
        "bench",
        "--quick",
        "--json",
        json.to_str().unwrap(),
        "--svg",
        a_file.join("charts").to_str().unwrap(),
    ]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
    assert_eq!(std::fs::read_to_string(&json).unwrap(), "previous report");
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["out.json", "plain-file"]);
}

#[test]
fn compare_threshold_fails_on_a_regression_outside_the_spread() {
    let (before, after) = (data("before.json"), data("after.json"));
    // Forwards: syscall and percpu improved, current_cpu is 4 % slower but within its spread.
    let output = thiscpu(&["compare", "--threshold", "1", &before, &after]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    // Backwards: syscall doubled (ns/op), percpu fell from 12 to 10 Mops/s.
    let output = thiscpu(&["compare", "--threshold", "5", &after, &before]);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("getcpu/syscall ×1") && stderr.contains("counter/percpu ×2"),
        "{stderr}"
    );
    assert!(!stderr.contains("current_cpu"), "{stderr}");
    // The table is printed either way.
    assert!(text(&output.stdout).contains("worse"));
    // A threshold above the change lets it pass.
    let output = thiscpu(&["compare", "--threshold", "150", &after, &before]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let output = thiscpu(&["compare", "--threshold", "-5", &after, &before]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
}

#[test]
fn tables_export_as_markdown_with_mean_and_deviation() {
    let dir = scratch("markdown");
    let markdown = dir.join("bench.md");
    let json = dir.join("bench.json");
    let stdout = succeed(&[
        "bench",
        "--quick",
        "getcpu",
        "--cases",
        "empty-loop,syscall",
        "--json",
        json.to_str().unwrap(),
        "--export-markdown",
        markdown.to_str().unwrap(),
    ]);
    assert!(stdout.contains("mean ± sd"), "{stdout}");
    let text_md = std::fs::read_to_string(&markdown).unwrap();
    assert!(text_md.starts_with("# thiscpu bench"), "{text_md}");
    assert!(text_md.contains("## getcpu"), "{text_md}");
    let header = text_md
        .lines()
        .find(|line| line.starts_with("| case"))
        .unwrap_or_else(|| panic!("no table header in\n{text_md}"));
    assert!(header.contains("mean ± sd"), "{header}");
    assert!(
        text_md.lines().any(|line| line.starts_with("|--")),
        "{text_md}"
    );
    assert!(
        text_md.lines().any(|line| line.starts_with("| empty-loop")),
        "{text_md}"
    );

    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for row in report["results"].as_array().unwrap() {
        let rounds: Vec<f64> = row["rounds"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let mean = rounds.iter().sum::<f64>() / rounds.len() as f64;
        assert!((row["mean"].as_f64().unwrap() - mean).abs() <= 1e-9 * mean.abs().max(1.0));
        assert!(row["stddev"].as_f64().unwrap() >= 0.0, "{row}");
    }

    let compared = succeed(&[
        "compare",
        &data("before.json"),
        &data("after.json"),
        "--export-markdown",
        "-",
    ]);
    assert!(compared.starts_with("# thiscpu compare"), "{compared}");
    assert!(compared.contains("\n- before: "), "{compared}");
    assert!(compared.contains("## getcpu"), "{compared}");
    assert!(compared.contains("| syscall"), "{compared}");
}

/// The child process behind the `…-rseq-off` cases, driven as `bench` drives it: `prepare`,
/// `run` on a worker, `verify`. It must run with rseq off, and its verdict must pass the
/// workload's exactness check through, so that a lost update in the portable path fails the
/// run like any other.
#[test]
fn the_rseq_off_child_counts_exactly_and_reports_a_miscount() {
    use std::io::Write;
    let serve = |env_rseq: Option<&str>, commands: &str| -> Output {
        let mut command = Command::new(env!("CARGO_BIN_EXE_thiscpu"));
        command
            .env("THISCPU_BENCH_RSEQ_OFF_CHILD", "counter/thiscpu-counter")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        match env_rseq {
            Some(value) => command.env("THISCPU_RSEQ", value),
            None => command.env_remove("THISCPU_RSEQ"),
        };
        let mut child = command.spawn().expect("start the child");
        let mut input = child.stdin.take().expect("stdin");
        // A child that refuses exits without reading its commands; the pipe then breaks, and
        // its exit status and standard error are the answer to check.
        match input.write_all(commands.as_bytes()) {
            Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
                panic!("send commands: {error}")
            }
            _ => {}
        }
        drop(input);
        child.wait_with_output().expect("child output")
    };
    let cpu = thiscpu::current_cpu();
    let commands = |verify: u64| format!("prepare 1\nrun 0 1000 {cpu}\nverify {verify}\n");

    let exact = serve(Some("off"), &commands(1000));
    assert!(exact.status.success(), "{}", text(&exact.stderr));
    let answers = text(&exact.stdout);
    let lines: Vec<&str> = answers.lines().collect();
    assert_eq!(lines.len(), 3, "{answers}");
    assert_eq!(lines[0], "prepared");
    let ran: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(&ran[..2], ["ran", "0"], "{answers}");
    assert!(
        ran[2].parse::<u64>().is_ok() && ran[3].parse::<u64>().is_ok(),
        "{answers}"
    );
    assert_eq!(lines[2], "verified", "{answers}");

    // Told of one operation more than it made, the workload's check must fail.
    let miscount = serve(Some("off"), &commands(1001));
    assert!(miscount.status.success(), "{}", text(&miscount.stderr));
    let verdict = text(&miscount.stdout);
    assert!(
        verdict
            .lines()
            .last()
            .is_some_and(|line| line.starts_with("failed ")),
        "{verdict}"
    );

    // Without THISCPU_RSEQ=off the child refuses to measure rather than measure the fast path.
    let refused = serve(None, &commands(1000));
    if thiscpu::source().unavailable.is_none() {
        assert!(!refused.status.success());
        assert!(
            text(&refused.stderr).contains("not turned off"),
            "{}",
            text(&refused.stderr)
        );
    }
}

/// The child process behind `bench alloc`'s whole-program cases: its global allocator is the
/// one `THISCPU_BENCH_ALLOC_CHILD` names, it runs the task and answers with one JSON line; a
/// malformed request is one line on standard error and exit status 2, never a panic.
#[test]
fn the_alloc_child_answers_in_one_json_line_and_refuses_bad_requests() {
    let child = |spec: &str| {
        Command::new(env!("CARGO_BIN_EXE_thiscpu"))
            .env("THISCPU_BENCH_ALLOC_CHILD", spec)
            .output()
            .expect("run the child")
    };
    // The peers are built into the command on x86_64 only.
    let third = if cfg!(target_arch = "x86_64") {
        ("jemalloc/threads/quick", "jemalloc", "threads")
    } else {
        ("glibc/threads/quick", "glibc", "threads")
    };
    for (spec, allocator, task) in [
        ("glibc/json/quick", "glibc", "json"),
        ("thiscpu/strings/quick", "thiscpu", "strings"),
        ("thiscpu/larson/quick", "thiscpu", "larson"),
        ("glibc/bignum/quick", "glibc", "bignum"),
        ("thiscpu/sharing/quick", "thiscpu", "sharing"),
        ("thiscpu/mixed/quick", "thiscpu", "mixed"),
        third,
    ] {
        let output = child(spec);
        assert!(output.status.success(), "{spec}: {}", text(&output.stderr));
        let stdout = text(&output.stdout);
        assert_eq!(stdout.lines().count(), 1, "{spec}: {stdout}");
        let report: Value = serde_json::from_str(&stdout).expect("one JSON line");
        assert_eq!(report["allocator"], allocator, "{report}");
        assert_eq!(report["task"], task, "{report}");
        assert_eq!(report["size"], "quick", "{report}");
        assert!(report["ms_per_run"].as_f64().unwrap() > 0.0, "{report}");
        assert!(report["peak_bytes"].as_u64().unwrap() > 0, "{report}");
        assert!(report["start_bytes"].as_u64().unwrap() > 0, "{report}");
        if allocator == "thiscpu" && thiscpu::source().unavailable.is_none() {
            assert_eq!(report["thiscpu_caching"], true, "{report}");
        }
    }
    for bad in [
        "ptmalloc/json/quick",
        "glibc/xml/quick",
        "glibc/json/huge",
        "glibc/json",
        "",
    ] {
        let output = child(bad);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{bad:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{bad:?}: {stderr}");
        assert!(stderr.starts_with("thiscpu: "), "{bad:?}: {stderr}");
        assert!(stderr.contains("ALLOCATOR/TASK/SIZE"), "{bad:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{bad:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{bad:?}");
    }
}

/// tcmalloc's cases are served by a child in which glibc leaves rseq to tcmalloc; that child
/// refuses to measure a case it does not know, in one line, without a panic.
#[test]
fn the_tcmalloc_child_serves_its_cases_and_refuses_unknown_ones() {
    use std::io::Write;
    if !cfg!(all(target_arch = "x86_64", feature = "tcmalloc")) {
        return; // tcmalloc is built into the command on x86_64, with the feature, only
    }
    let serve = |case: &str, commands: &str| -> Output {
        let mut child = Command::new(env!("CARGO_BIN_EXE_thiscpu"))
            .env("THISCPU_BENCH_ALLOC_TCMALLOC_CHILD", case)
            .env("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
            .env("THISCPU_RSEQ", "off")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start the child");
        let mut input = child.stdin.take().expect("stdin");
        // A child that refuses exits without reading its commands; the pipe then breaks, and
        // its exit status and standard error are the answer to check.
        match input.write_all(commands.as_bytes()) {
            Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
                panic!("send commands: {error}")
            }
            _ => {}
        }
        drop(input);
        child.wait_with_output().expect("child output")
    };
    let cpu = thiscpu::current_cpu();
    let served = serve(
        "alloc/pair64/tcmalloc",
        &format!("prepare 1\nrun 0 1000 {cpu}\nverify 1000\n"),
    );
    let stderr = text(&served.stderr);
    // Where the kernel has no rseq, tcmalloc has no per-CPU caches and the child says so.
    if stderr.contains("per-CPU caches are not in use") {
        assert_eq!(served.status.code(), Some(1), "{stderr}");
    } else {
        assert!(served.status.success(), "{stderr}");
        let answers = text(&served.stdout);
        let lines: Vec<&str> = answers.lines().collect();
        assert_eq!(lines.first(), Some(&"prepared"), "{answers}");
        assert!(lines[1].starts_with("ran 0 "), "{answers}");
        assert_eq!(lines.last(), Some(&"verified"), "{answers}");
    }
    let unknown = serve("alloc/pair17/tcmalloc", "prepare 1\n");
    let stderr = text(&unknown.stderr);
    assert_eq!(unknown.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("pair17"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `bench alloc --quick`: every case measured or left out with a reason, the cases whose
/// shape sets their threads measured once, and the four parts' tables printed.
#[test]
fn alloc_family_measures_every_allocator_and_prints_its_parts() {
    let dir = scratch("bench-alloc");
    let json = dir.join("alloc.json");
    let json = json.to_str().unwrap();
    let stdout = succeed(&["bench", "alloc", "--quick", "--json", json]);
    let report: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let errors = schema_errors(&report);
    assert!(errors.is_empty(), "{errors:#?}");
    let results = report["results"].as_array().unwrap();
    let skipped = report["skipped"].as_array().unwrap();
    let allocators = ["glibc", "mimalloc", "jemalloc", "tcmalloc", "thiscpu"];
    let prefixes = [
        ("pair16", "ns/op", 2),
        ("pair4096", "ns/op", 2),
        ("remote", "ns/op", 1),
        ("threads1k", "bytes", 1),
        ("json", "ms", 1),
        ("json-rss", "bytes", 1),
        ("strings", "ms", 1),
        ("strings-rss", "bytes", 1),
        ("larson", "ms", 1),
        ("larson-rss", "bytes", 1),
        ("bignum", "ms", 1),
        ("bignum-rss", "bytes", 1),
        ("sharing", "ms", 1),
        ("sharing-rss", "bytes", 1),
        ("mixed", "ms", 1),
        ("mixed-rss", "bytes", 1),
    ];
    for (prefix, unit, runs) in prefixes {
        for allocator in allocators {
            let case = format!("{prefix}/{allocator}");
            let rows: Vec<&Value> = results.iter().filter(|r| r["case"] == case).collect();
            let left_out = skipped.iter().any(|s| s["case"] == case);
            assert!(
                rows.len() == runs || (rows.is_empty() && left_out),
                "{case}: {} rows\n{stdout}",
                rows.len()
            );
            for row in rows {
                assert_eq!(row["unit"], unit, "{row}");
                // bignum's peak grows by tens of KiB, less than the kernel's per-CPU RSS
                // counters resolve, and reads 0 in some runs (see docs/allocator.md).
                if prefix != "bignum-rss" {
                    assert!(row["median"].as_f64().unwrap() > 0.0, "{row}");
                }
                if runs == 1 {
                    assert_eq!(row["threads"], 1, "{row}");
                }
            }
        }
    }
    for part in [
        "alloc + dealloc pairs",
        "allocated on one CPU, freed on another",
        "1,000 threads",
        "program-shaped tasks",
    ] {
        assert!(stdout.contains(part), "{part} not printed:\n{stdout}");
    }
    assert!(
        !stdout.contains("targets"),
        "targets only with --targets:\n{stdout}"
    );
    let replayed = succeed(&["report", json, "--targets"]);
    assert!(replayed.contains("glibc ÷ thiscpu"), "{replayed}");
    // The peers are built into the command on x86_64 Linux only; elsewhere the targets
    // against them say that they were not judged.
    let peers_measured = results.iter().any(|r| r["case"] == "pair16/mimalloc");
    assert_eq!(
        peers_measured,
        cfg!(all(target_os = "linux", target_arch = "x86_64")),
        "{stdout}"
    );
    let not_judged = "targets against mimalloc, jemalloc and tcmalloc: not judged";
    if peers_measured {
        assert!(replayed.contains("thiscpu ÷ best peer"), "{replayed}");
        assert!(replayed.contains("(target ≤ 0.5×)"), "{replayed}");
        assert!(!replayed.contains(not_judged), "{replayed}");
    } else {
        assert!(replayed.contains(not_judged), "{replayed}");
        assert!(!replayed.contains("best peer,"), "{replayed}");
    }
    for line in stdout.lines() {
        assert!(
            line.chars().count() <= 120,
            "wider than 120 columns: {line}"
        );
    }
}
