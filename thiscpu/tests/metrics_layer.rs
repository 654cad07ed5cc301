//! `PerCpuLayer` in front of the real Prometheus exporter (metrics-exporter-prometheus): exact
//! totals from many threads after a flush, the background publication, shutdown, idle counters
//! and what passes through.
#![cfg(feature = "metrics-layer")]

use metrics::{Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use metrics_util::layers::Layer;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use thiscpu::metrics::{PerCpuLayer, PerCpuLayered};

fn threads() -> usize {
    2 * std::thread::available_parallelism().map_or(2, |n| n.get()) + 2
}

/// The value of the sample line `series` (name and labels as rendered) in `text`, if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().expect("a number"))
        })
}

fn exporter() -> (PrometheusRecorder, PrometheusHandle) {
    let recorder = PrometheusBuilder::new()
        .set_buckets(&[1.0, 10.0])
        .unwrap()
        .build_recorder();
    let handle = recorder.handle();
    (recorder, handle)
}

fn count_on_threads(
    layered: &PerCpuLayered<PrometheusRecorder>,
    n: usize,
    work: impl Fn(usize) + Sync,
) {
    let start = Barrier::new(n);
    std::thread::scope(|s| {
        for t in 0..n {
            let (start, work) = (&start, &work);
            s.spawn(move || {
                metrics::with_local_recorder(layered, || {
                    start.wait();
                    work(t);
                })
            });
        }
    });
}

#[test]
fn prometheus_shows_exact_totals_after_a_flush() {
    let (recorder, handle) = exporter();
    let layered = PerCpuLayer::new().on_demand_only().layer(recorder);
    let publisher = layered.publisher();
    let n = threads();
    const EACH: u64 = 50_000;
    count_on_threads(&layered, n, |t| {
        let held = metrics::counter!("held_total");
        for i in 0..EACH {
            metrics::counter!("requests_total", "route" => "/").increment(1);
            metrics::counter!("bytes_total").increment(i % 5);
            held.increment(2);
        }
        if t == 0 {
            metrics::counter!("zero_total").increment(0);
        }
    });
    // Nothing reaches the exporter before a publication.
    assert_eq!(sample(&handle.render(), "held_total"), None);
    publisher.flush();
    let text = handle.render();
    let n = n as u64;
    assert_eq!(
        sample(&text, "requests_total{route=\"/\"}"),
        Some((n * EACH) as f64),
        "{text}"
    );
    let bytes: u64 = (0..EACH).map(|i| i % 5).sum();
    assert_eq!(sample(&text, "bytes_total"), Some((n * bytes) as f64));
    assert_eq!(sample(&text, "held_total"), Some((n * EACH * 2) as f64));
    assert_eq!(sample(&text, "zero_total"), Some(0.0));
    assert!(text.contains("# TYPE requests_total counter"), "{text}");

    // More counting, another flush: the exporter's counter follows the total.
    count_on_threads(&layered, 2, |_| {
        metrics::counter!("held_total").increment(5)
    });
    publisher.flush();
    assert_eq!(
        sample(&handle.render(), "held_total"),
        Some((n * EACH * 2 + 10) as f64)
    );
}

#[test]
fn the_background_thread_publishes_and_stops_at_shutdown() {
    let (recorder, handle) = exporter();
    let layered = PerCpuLayer::new()
        .interval(Duration::from_millis(10))
        .layer(recorder);
    let publisher = layered.publisher();
    metrics::with_local_recorder(&layered, || metrics::counter!("ticks").increment(7));
    // Published by the thread alone; waits far longer than the interval before failing.
    let deadline = Instant::now() + Duration::from_secs(20);
    while sample(&handle.render(), "ticks") != Some(7.0) {
        assert!(Instant::now() < deadline, "never published");
        std::thread::sleep(Duration::from_millis(5));
    }
    metrics::with_local_recorder(&layered, || metrics::counter!("ticks").increment(1));
    publisher.shutdown();
    assert_eq!(sample(&handle.render(), "ticks"), Some(8.0));
    // After shutdown only flushes publish.
    metrics::with_local_recorder(&layered, || metrics::counter!("ticks").increment(1));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(sample(&handle.render(), "ticks"), Some(8.0));
    publisher.flush();
    assert_eq!(sample(&handle.render(), "ticks"), Some(9.0));
}

#[test]
fn dropping_the_last_handle_publishes() {
    let (recorder, handle) = exporter();
    let layered = PerCpuLayer::new().layer(recorder);
    let publisher = layered.publisher();
    metrics::with_local_recorder(&layered, || metrics::counter!("at_exit").increment(3));
    drop(layered);
    assert_eq!(sample(&handle.render(), "at_exit"), None);
    drop(publisher);
    assert_eq!(sample(&handle.render(), "at_exit"), Some(3.0));
}

#[test]
fn gauges_histograms_and_descriptions_pass_through() {
    let (recorder, handle) = exporter();
    let layered = PerCpuLayer::new().on_demand_only().layer(recorder);
    metrics::with_local_recorder(&layered, || {
        metrics::describe_counter!("described", "what it counts");
        metrics::counter!("described").increment(1);
        metrics::gauge!("depth").set(4.0);
        for v in [0.5, 5.0, 50.0] {
            metrics::histogram!("latency").record(v);
        }
    });
    layered.publisher().flush();
    let text = handle.render();
    assert!(text.contains("# HELP described what it counts"), "{text}");
    assert_eq!(sample(&text, "described"), Some(1.0));
    assert_eq!(sample(&text, "depth"), Some(4.0));
    assert_eq!(
        sample(&text, "latency_bucket{le=\"1\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(sample(&text, "latency_bucket{le=\"10\"}"), Some(2.0));
    assert_eq!(sample(&text, "latency_count"), Some(3.0));
    assert_eq!(sample(&text, "latency_sum"), Some(55.5));
}

/// An inner recorder that counts how often counters are registered and set.
#[derive(Clone, Default)]
struct Registrations(Arc<AtomicUsize>);

impl Recorder for Registrations {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> metrics::Counter {
        self.0.fetch_add(1, Ordering::Relaxed);
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

#[test]
fn idle_counters_are_not_published_again() {
    let seen = Registrations::default();
    let layered = PerCpuLayer::new().on_demand_only().layer(seen.clone());
    let publisher = layered.publisher();
    metrics::with_local_recorder(&layered, || {
        metrics::counter!("busy").increment(1);
        metrics::counter!("idle").increment(1);
    });
    publisher.flush();
    assert_eq!(seen.0.load(Ordering::Relaxed), 2);
    publisher.flush();
    assert_eq!(seen.0.load(Ordering::Relaxed), 2, "nothing changed");
    metrics::with_local_recorder(&layered, || metrics::counter!("busy").increment(1));
    publisher.flush();
    assert_eq!(seen.0.load(Ordering::Relaxed), 3, "only the busy counter");
}

#[test]
fn an_exporter_that_dropped_an_idle_counter_gets_it_back_whole() {
    let recorder = PrometheusBuilder::new()
        .idle_timeout(
            metrics_util::MetricKindMask::COUNTER,
            Some(Duration::from_millis(50)),
        )
        .build_recorder();
    let handle = recorder.handle();
    let layered = PerCpuLayer::new().on_demand_only().layer(recorder);
    let publisher = layered.publisher();
    metrics::with_local_recorder(&layered, || metrics::counter!("sleepy").increment(4));
    publisher.flush();
    assert_eq!(sample(&handle.render(), "sleepy"), Some(4.0));
    std::thread::sleep(Duration::from_millis(200));
    publisher.flush(); // unchanged: not published, so the exporter lets it expire
    assert_eq!(sample(&handle.render(), "sleepy"), None);
    metrics::with_local_recorder(&layered, || metrics::counter!("sleepy").increment(1));
    publisher.flush();
    assert_eq!(sample(&handle.render(), "sleepy"), Some(5.0));
}
