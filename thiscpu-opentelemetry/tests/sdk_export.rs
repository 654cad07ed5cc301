//! Per-CPU counters exported through the SDK's in-memory exporter: a collector flushing every
//! few milliseconds while eight threads add (unbound adds in several attribute orders, bound
//! handles, OpenTelemetry's own `Counter` type), under delta and cumulative temporality; and
//! the SDK's own counters beside them for attribute sets and overflow.

use opentelemetry::KeyValue;
use opentelemetry::metrics::MeterProvider;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider,
    Temporality,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use thiscpu_opentelemetry::PerCpuMeterExt;

const THREADS: usize = 8;
const ADDS_PER_THREAD: u64 = 20_000;

/// A series as the tests compare them: `key=value` pairs sorted by key.
type Series = Vec<String>;

fn series_of<'a>(attributes: impl Iterator<Item = &'a KeyValue>) -> Series {
    let mut pairs: Series = attributes
        .map(|kv| format!("{}={}", kv.key, kv.value))
        .collect();
    pairs.sort();
    pairs
}

fn provider(temporality: Temporality) -> (SdkMeterProvider, InMemoryMetricExporter) {
    let exporter = InMemoryMetricExporterBuilder::new()
        .with_temporality(temporality)
        .build();
    // The collector below flushes; the reader's own period never comes.
    let reader = PeriodicReader::builder(exporter.clone())
        .with_interval(Duration::from_secs(3600))
        .build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    (provider, exporter)
}

/// Each export of the metric `name`: its points, series to value.
fn exports(exporter: &InMemoryMetricExporter, name: &str) -> Vec<BTreeMap<Series, i128>> {
    let mut out = Vec::new();
    for resource in exporter.get_finished_metrics().expect("exported metrics") {
        for scope in resource.scope_metrics() {
            for metric in scope.metrics().filter(|m| m.name() == name) {
                let mut points = BTreeMap::new();
                match metric.data() {
                    AggregatedMetrics::U64(MetricData::Sum(sum)) => {
                        for p in sum.data_points() {
                            points.insert(series_of(p.attributes()), i128::from(p.value()));
                        }
                    }
                    AggregatedMetrics::I64(MetricData::Sum(sum)) => {
                        for p in sum.data_points() {
                            points.insert(series_of(p.attributes()), i128::from(p.value()));
                        }
                    }
                    other => panic!("{name}: not a sum: {other:?}"),
                }
                out.push(points);
            }
        }
    }
    out
}

/// Eight threads add to one per-CPU counter (and one up-down counter) while a collector
/// flushes every 3 ms; each thread waits, half way, for a flush to have happened meanwhile.
/// Returns what was added, per series.
fn add_while_collecting(provider: &SdkMeterProvider) -> (BTreeMap<Series, i128>, usize) {
    let meter = provider.meter("test");
    let requests = meter.percpu_u64_counter("requests").build();
    let in_flight = meter.percpu_i64_up_down_counter("in_flight").build();
    let done = AtomicBool::new(false);
    let flushes = AtomicUsize::new(0);
    let mut expected: BTreeMap<Series, i128> = BTreeMap::new();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Acquire) {
                provider.force_flush().expect("flush");
                flushes.fetch_add(1, Ordering::Release);
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let requests = requests.clone();
                let in_flight = in_flight.clone();
                let flushes = &flushes;
                s.spawn(move || {
                    let mut added: BTreeMap<Series, i128> = BTreeMap::new();
                    let otel = requests.counter();
                    let bound = requests.bind(&[KeyValue::new("kind", "bound")]);
                    // A second bind of the same set: the same series.
                    let rebound = requests.bind(&[KeyValue::new("kind", "bound")]);
                    let flushes_at_start = flushes.load(Ordering::Acquire);
                    for i in 0..ADDS_PER_THREAD {
                        if i == ADDS_PER_THREAD / 2 {
                            while flushes.load(Ordering::Acquire) < flushes_at_start + 2 {
                                std::thread::yield_now();
                            }
                        }
                        let route = KeyValue::new("route", ["/", "/a", "/b"][(i % 3) as usize]);
                        let status = KeyValue::new("status", [200, 404][(i % 2) as usize]);
                        let value = 1 + (i % 5);
                        let series = match (t + i as usize) % 5 {
                            0 => {
                                requests.add(value, &[route.clone(), status.clone()]);
                                series_of([&route, &status].into_iter())
                            }
                            1 => {
                                // Another order, and a key repeated: the same series.
                                requests
                                    .add(value, &[status.clone(), route.clone(), status.clone()]);
                                series_of([&route, &status].into_iter())
                            }
                            2 => {
                                otel.add(value, &[route.clone(), status.clone()]);
                                series_of([&route, &status].into_iter())
                            }
                            3 => {
                                bound.add(value);
                                vec!["kind=bound".to_owned()]
                            }
                            _ => {
                                rebound.add(value);
                                vec!["kind=bound".to_owned()]
                            }
                        };
                        *added.entry(series).or_default() += i128::from(value);
                        // Up and down again, with one left up per thread at the end.
                        in_flight.add(1, &[]);
                        if i + 1 < ADDS_PER_THREAD {
                            in_flight.add(-1, &[]);
                        }
                    }
                    added
                })
            })
            .collect();
        for worker in workers {
            for (series, value) in worker.join().expect("worker") {
                *expected.entry(series).or_default() += value;
            }
        }
        done.store(true, Ordering::Release);
    });
    provider.force_flush().expect("final flush");
    (expected, flushes.load(Ordering::Acquire))
}

#[test]
fn delta_exports_add_up_to_every_add_exactly() {
    let (provider, exporter) = provider(Temporality::Delta);
    let (expected, flushes) = add_while_collecting(&provider);
    let exports = exports(&exporter, "requests");
    assert!(
        exports.len() >= 3,
        "{} exports, {flushes} flushes",
        exports.len()
    );
    let mut summed: BTreeMap<Series, i128> = BTreeMap::new();
    for export in &exports {
        for (series, delta) in export {
            *summed.entry(series.clone()).or_default() += delta;
        }
    }
    assert_eq!(summed, expected);
    // The SDK keeps up-down counters cumulative under a delta preference (as the
    // specification says): the last export holds the total, one left up per thread.
    assert_eq!(last_in_flight(&exporter), Some(THREADS as i128));
}

fn last_in_flight(exporter: &InMemoryMetricExporter) -> Option<i128> {
    let in_flight = exports(exporter, "in_flight");
    in_flight.last().and_then(|e| e.get(&Vec::new()).copied())
}

#[test]
fn cumulative_exports_grow_and_end_at_every_add_exactly() {
    let (provider, exporter) = provider(Temporality::Cumulative);
    let (expected, _) = add_while_collecting(&provider);
    let requests = exports(&exporter, "requests");
    assert!(requests.len() >= 3, "{} exports", requests.len());
    for pair in requests.windows(2) {
        for (series, earlier) in &pair[0] {
            let later = pair[1].get(series).copied().unwrap_or(0);
            assert!(
                later >= *earlier,
                "{series:?} went from {earlier} to {later}"
            );
        }
    }
    assert_eq!(requests.last(), Some(&expected));
    assert_eq!(last_in_flight(&exporter), Some(THREADS as i128));
}

/// The SDK's counter and a per-CPU counter given the same adds export the same points: attribute
/// sets in any order and with repeated keys, the set with no attribute, and 2,100 distinct sets
/// beyond the limit of 2,000 (the last 102 sets) go to the overflow series.
#[test]
fn attribute_sets_and_overflow_match_the_sdk() {
    for temporality in [Temporality::Cumulative, Temporality::Delta] {
        let (provider, exporter) = provider(temporality);
        let meter = provider.meter("test");
        let sdk = meter.u64_counter("sdk").build();
        let percpu = meter.percpu_u64_counter("percpu").build();
        let a = KeyValue::new("a", "x");
        let b = KeyValue::new("b", 2);
        let sets: Vec<Vec<KeyValue>> = vec![
            vec![a.clone(), b.clone()],
            vec![b.clone(), a.clone()],
            vec![a.clone(), b.clone(), a.clone()],
            vec![],
            vec![b.clone()],
        ];
        for (i, set) in sets.iter().enumerate() {
            sdk.add(i as u64 + 1, set);
            percpu.add(i as u64 + 1, set);
        }
        for v in 0..2100 {
            let set = [KeyValue::new("user", v)];
            sdk.add(1, &set);
            percpu.add(1, &set);
        }
        provider.force_flush().expect("flush");
        let sdk_points = exports(&exporter, "sdk");
        let percpu_points = exports(&exporter, "percpu");
        assert_eq!(percpu_points, sdk_points, "{temporality:?}");
        let last = percpu_points.last().expect("one export");
        assert_eq!(
            last.get(&vec!["a=x".to_owned(), "b=2".to_owned()]),
            Some(&6)
        );
        assert_eq!(
            last.get(&vec!["otel.metric.overflow=true".to_owned()]),
            Some(&(2100 + 2 - 2000))
        );
    }
}
