//! Instruments of one identity (meter, name, kind, unit, description) feed one stream: each
//! scenario runs once with the SDK's own instruments and once with per-CPU ones, each in a
//! provider of its own, and both must export the same metrics.

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Meter, MeterProvider};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider,
};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;
use thiscpu_opentelemetry::PerCpuMeterExt;

/// One exported metric: scope, name, description, unit, and its points (`key=value` pairs
/// sorted, to value).
type Metric = (String, String, String, String, BTreeMap<Vec<String>, i128>);

/// The instruments a scenario builds: the SDK's, or the per-CPU ones.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Sdk,
    PerCpu,
}

/// A counter of either kind; `build` is called afresh for each use, as a handler would.
struct Counter<'a> {
    meter: &'a Meter,
    kind: Kind,
    name: Cow<'static, str>,
    description: Option<&'static str>,
    unit: Option<&'static str>,
}

impl<'a> Counter<'a> {
    fn new(meter: &'a Meter, kind: Kind, name: impl Into<Cow<'static, str>>) -> Self {
        Counter {
            meter,
            kind,
            name: name.into(),
            description: None,
            unit: None,
        }
    }

    fn description(mut self, description: &'static str) -> Self {
        self.description = Some(description);
        self
    }

    fn unit(mut self, unit: &'static str) -> Self {
        self.unit = Some(unit);
        self
    }

    /// Builds the counter and adds `value` through it.
    fn add(&self, value: u64, attributes: &[KeyValue]) {
        match self.kind {
            Kind::Sdk => {
                let mut b = self.meter.u64_counter(self.name.clone());
                if let Some(d) = self.description {
                    b = b.with_description(d);
                }
                if let Some(u) = self.unit {
                    b = b.with_unit(u);
                }
                b.build().add(value, attributes);
            }
            Kind::PerCpu => {
                let mut b = self.meter.percpu_u64_counter(self.name.clone());
                if let Some(d) = self.description {
                    b = b.with_description(d);
                }
                if let Some(u) = self.unit {
                    b = b.with_unit(u);
                }
                b.build().add(value, attributes);
            }
        }
    }

    /// Builds an up-down counter of the same name and adds `value` through it.
    fn add_up_down(&self, value: i64, attributes: &[KeyValue]) {
        match self.kind {
            Kind::Sdk => self
                .meter
                .i64_up_down_counter(self.name.clone())
                .build()
                .add(value, attributes),
            Kind::PerCpu => self
                .meter
                .percpu_i64_up_down_counter(self.name.clone())
                .build()
                .add(value, attributes),
        }
    }
}

/// Runs `scenario` with a fresh provider and returns what one cumulative export holds.
fn export(kind: Kind, scenario: impl Fn(&SdkMeterProvider, Kind)) -> Vec<Metric> {
    let exporter: InMemoryMetricExporter = InMemoryMetricExporterBuilder::new().build();
    let reader = PeriodicReader::builder(exporter.clone())
        .with_interval(Duration::from_secs(3600))
        .build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    scenario(&provider, kind);
    provider.force_flush().expect("flush");
    let mut out = Vec::new();
    for resource in exporter.get_finished_metrics().expect("exported metrics") {
        for scope in resource.scope_metrics() {
            for metric in scope.metrics() {
                let mut points = BTreeMap::new();
                let mut put = |attributes: Vec<String>, value: i128| {
                    points.insert(attributes, value);
                };
                let series = |attributes: &mut dyn Iterator<Item = &KeyValue>| {
                    let mut pairs: Vec<String> = attributes
                        .map(|kv| format!("{}={}", kv.key, kv.value))
                        .collect();
                    pairs.sort();
                    pairs
                };
                match metric.data() {
                    AggregatedMetrics::U64(MetricData::Sum(sum)) => sum
                        .data_points()
                        .for_each(|p| put(series(&mut p.attributes()), p.value().into())),
                    AggregatedMetrics::I64(MetricData::Sum(sum)) => sum
                        .data_points()
                        .for_each(|p| put(series(&mut p.attributes()), p.value().into())),
                    other => panic!("not a sum: {other:?}"),
                }
                out.push((
                    scope.scope().name().to_owned(),
                    metric.name().to_owned(),
                    metric.description().to_owned(),
                    metric.unit().to_owned(),
                    points,
                ));
            }
        }
    }
    out.sort();
    out
}

/// The scenario's export with per-CPU instruments, checked equal to the SDK's.
fn export_as_the_sdk_does(scenario: impl Fn(&SdkMeterProvider, Kind)) -> Vec<Metric> {
    let sdk = export(Kind::Sdk, &scenario);
    let percpu = export(Kind::PerCpu, &scenario);
    assert_eq!(percpu, sdk, "per-CPU export (left) differs from the SDK's");
    percpu
}

fn metric(scope: &str, name: &str, points: &[(&[&str], i128)]) -> Metric {
    metric_with(scope, name, "", "", points)
}

fn metric_with(
    scope: &str,
    name: &str,
    description: &str,
    unit: &str,
    points: &[(&[&str], i128)],
) -> Metric {
    (
        scope.to_owned(),
        name.to_owned(),
        description.to_owned(),
        unit.to_owned(),
        points
            .iter()
            .map(|(series, value)| (series.iter().map(|s| (*s).to_owned()).collect(), *value))
            .collect(),
    )
}

#[test]
fn counters_built_in_two_places_feed_one_stream() {
    let found = export_as_the_sdk_does(|provider, kind| {
        // Two modules, each with a meter of the same scope and a counter of the same name.
        let first = provider.meter("app");
        let second = provider.meter("app");
        let route = [KeyValue::new("route", "/")];
        Counter::new(&first, kind, "requests").add(1, &route);
        Counter::new(&second, kind, "requests").add(10, &route);
    });
    assert_eq!(
        found,
        vec![metric("app", "requests", &[(&["route=/"], 11)])]
    );
}

#[test]
fn a_counter_built_on_every_call_counts_every_call() {
    let found = export_as_the_sdk_does(|provider, kind| {
        let meter = provider.meter("app");
        for _ in 0..100 {
            Counter::new(&meter, kind, "requests").add(1, &[]);
        }
        // A meter taken on every call too.
        for _ in 0..100 {
            Counter::new(&provider.meter("app"), kind, "handled").add(1, &[]);
        }
    });
    assert_eq!(
        found,
        vec![
            metric("app", "handled", &[(&[], 100)]),
            metric("app", "requests", &[(&[], 100)]),
        ]
    );
}

#[test]
fn up_down_counters_built_in_two_places_feed_one_stream() {
    let found = export_as_the_sdk_does(|provider, kind| {
        let meter = provider.meter("app");
        Counter::new(&meter, kind, "in_flight").add_up_down(5, &[]);
        Counter::new(&meter, kind, "in_flight").add_up_down(-2, &[]);
    });
    assert_eq!(found, vec![metric("app", "in_flight", &[(&[], 3)])]);
}

#[test]
fn meters_of_other_scopes_keep_their_own_streams() {
    let found = export_as_the_sdk_does(|provider, kind| {
        Counter::new(&provider.meter("a"), kind, "requests").add(1, &[]);
        Counter::new(&provider.meter("b"), kind, "requests").add(10, &[]);
        Counter::new(&provider.meter("a"), kind, "requests").add(100, &[]);
    });
    assert_eq!(
        found,
        vec![
            metric("a", "requests", &[(&[], 101)]),
            metric("b", "requests", &[(&[], 10)]),
        ]
    );
}

/// As the SDK: names differ in case only is one instrument (the first name seen is exported);
/// another description, unit or kind is another stream of the same name.
#[test]
fn name_case_description_unit_and_kind_decide_identity_as_in_the_sdk() {
    let found = export_as_the_sdk_does(|provider, kind| {
        let meter = provider.meter("app");
        Counter::new(&meter, kind, "requests").add(1, &[]);
        Counter::new(&meter, kind, "Requests").add(2, &[]);
        Counter::new(&meter, kind, "requests")
            .description("served")
            .add(4, &[]);
        Counter::new(&meter, kind, "requests")
            .description("served")
            .add(8, &[]);
        Counter::new(&meter, kind, "requests")
            .unit("1")
            .add(16, &[]);
        Counter::new(&meter, kind, "requests").add_up_down(32, &[]);
    });
    assert_eq!(
        found,
        vec![
            metric("app", "requests", &[(&[], 3)]),
            metric("app", "requests", &[(&[], 32)]),
            metric_with("app", "requests", "", "1", &[(&[], 16)]),
            metric_with("app", "requests", "served", "", &[(&[], 12)]),
        ]
    );
}

/// Providers are apart even for meters and instruments of the same names.
#[test]
fn providers_keep_their_own_streams() {
    let first = export(Kind::PerCpu, |provider, kind| {
        Counter::new(&provider.meter("app"), kind, "requests").add(1, &[]);
    });
    let second = export(Kind::PerCpu, |provider, kind| {
        Counter::new(&provider.meter("app"), kind, "requests").add(2, &[]);
    });
    assert_eq!(first, vec![metric("app", "requests", &[(&[], 1)])]);
    assert_eq!(second, vec![metric("app", "requests", &[(&[], 2)])]);
}
