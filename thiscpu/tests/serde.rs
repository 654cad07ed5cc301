//! The `serde` feature: the plain data types go to JSON and come back equal, with machine ids
//! (snake_case) for the enums and `+Inf`/`-Inf` where a float is infinite.
#![cfg(feature = "serde")]

use serde_json::{Value, json};
use thiscpu::{CpuNode, CpuSource, Histogram, Registrar, RseqMode, Source, Unavailable};

fn round_trip<T: serde::Serialize + serde::de::DeserializeOwned>(value: &T) -> (T, Value) {
    let text = serde_json::to_string(value).expect("serialize");
    let back: T = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (back, serde_json::from_str(&text).unwrap())
}

#[test]
fn cpu_node_round_trips() {
    let here = thiscpu::getcpu();
    let (back, value) = round_trip(&here);
    assert_eq!(back, here);
    assert_eq!(value, json!({"cpu": here.cpu, "node": here.node}));
    let _: CpuNode = back;
}

#[test]
fn source_round_trips_with_machine_ids() {
    let source = thiscpu::source();
    let (back, value): (Source, Value) = round_trip(&source);
    // Source has no PartialEq: compare what it serializes to, and the fields one by one.
    assert_eq!(serde_json::to_value(back).unwrap(), value);
    assert_eq!(back.registrar, source.registrar);
    assert_eq!(back.this_thread, source.this_thread);
    assert_eq!(back.fallback, source.fallback);
    assert_eq!(back.mode, source.mode);
    assert_eq!(back.unavailable, source.unavailable);
    let registrar = match source.registrar {
        Registrar::Glibc => "glibc",
        Registrar::Thiscpu => "thiscpu",
        Registrar::None => "none",
    };
    assert_eq!(value["registrar"], registrar, "{value}");

    for (source, id) in [
        (CpuSource::RseqGlibc, "rseq_glibc"),
        (CpuSource::RseqThiscpu, "rseq_thiscpu"),
        (CpuSource::Rdpid, "rdpid"),
        (CpuSource::Vdso, "vdso"),
        (CpuSource::Syscall, "syscall"),
    ] {
        let (back, value) = round_trip(&source);
        assert_eq!((back, value), (source, json!(id)));
    }
    for mode in [RseqMode::Legacy, RseqMode::Optimized] {
        assert_eq!(round_trip(&mode).0, mode);
    }
    for why in [
        Unavailable::TurnedOff,
        Unavailable::NoSyscall,
        Unavailable::Refused(1),
        Unavailable::RegisteredElsewhere,
    ] {
        assert_eq!(round_trip(&why).0, why);
    }
    assert_eq!(
        round_trip(&Unavailable::Refused(1)).1,
        json!({"refused": 1})
    );
}

#[test]
fn dense_stats_round_trip() {
    let counter = thiscpu::Counter::new();
    let stats = thiscpu::dense::stats();
    let (back, value) = round_trip(&stats);
    assert_eq!(back, stats);
    assert_eq!(value["rows"], stats.rows, "{value}");
    drop(counter);
}

#[test]
fn histogram_snapshots_round_trip_with_infinities() {
    let histogram = Histogram::new(&[1.0, 10.0]).unwrap();
    // Empty: the extremes are infinite, which JSON writes as Prometheus does.
    let empty = histogram.snapshot();
    let (back, value) = round_trip(&empty);
    assert_eq!(back, empty);
    assert_eq!(value["min"], "+Inf", "{value}");
    assert_eq!(value["max"], "-Inf", "{value}");
    assert_eq!(value["buckets"][2]["le"], "+Inf", "{value}");

    histogram.observe(0.5);
    histogram.observe(5.0);
    histogram.observe(50.0);
    let full = histogram.snapshot();
    let (back, value) = round_trip(&full);
    assert_eq!(back, full);
    assert_eq!(value["count"], 3);
    assert_eq!(value["sum"], 55.5);
    assert_eq!(value["buckets"][1], json!({"le": 10.0, "count": 1}));
}

#[cfg(feature = "metrics")]
#[test]
fn metrics_snapshots_serialize_with_labels() {
    let recorder = thiscpu::metrics::PerCpuRecorder::new();
    metrics::with_local_recorder(&recorder, || {
        metrics::counter!("hits", "cache" => "l1").increment(7);
        metrics::gauge!("load").set(0.5);
        metrics::describe_counter!("hits", metrics::Unit::Count, "Cache hits");
    });
    let value = serde_json::to_value(recorder.snapshot()).unwrap();
    assert_eq!(
        value["counters"],
        json!([{"name": "hits", "labels": {"cache": "l1"}, "value": 7}]),
        "{value}"
    );
    assert_eq!(
        value["gauges"],
        json!([{"name": "load", "labels": {}, "value": 0.5}])
    );
    assert_eq!(
        value["descriptions"],
        json!([{"kind": "counter", "name": "hits", "unit": "count", "text": "Cache hits"}])
    );
}
