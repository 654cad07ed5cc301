//! Per-CPU instruments built while the SDK collects: an observable callback that builds a
//! per-CPU counter runs with the pipeline's lock held, and a build on another thread takes that
//! lock inside the SDK. Neither may wait for the other.

use opentelemetry::metrics::{MeterProvider, ObservableGauge};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use thiscpu_opentelemetry::PerCpuMeterExt;

/// How long the scenario may take; it needs well under a second where nothing waits.
const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn a_callback_and_another_meter_build_per_cpu_counters_during_collections() {
    const BUILDS: usize = 300;
    let reader = PeriodicReader::builder(InMemoryMetricExporter::default()).build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    let observing = provider.meter("builds-during-collection-observing");
    let building = provider.meter("builds-during-collection-building");
    let existing = observing.percpu_u64_counter("existing").build();
    existing.add(1, &[]);

    let callbacks = Arc::new(AtomicUsize::new(0));
    let builds = Arc::new(AtomicUsize::new(0));
    let _gauge: ObservableGauge<u64> = {
        let (meter, callbacks) = (observing.clone(), callbacks.clone());
        observing
            .u64_observable_gauge("gauge")
            .with_callback(move |observer| {
                // Built again inside the collection: it exists, so this only finds it.
                meter.percpu_u64_counter("existing").build().add(1, &[]);
                callbacks.fetch_add(1, Ordering::Relaxed);
                observer.observe(1, &[]);
            })
            .build()
    };

    let (finished, outcome) = mpsc::channel();
    let done = Arc::new(AtomicBool::new(false));
    {
        let (builds, done, finished) = (builds.clone(), done.clone(), finished.clone());
        std::thread::spawn(move || {
            for i in 0..BUILDS {
                building
                    .percpu_u64_counter(format!("new-{i}"))
                    .build()
                    .add(1, &[]);
                builds.fetch_add(1, Ordering::Relaxed);
            }
            done.store(true, Ordering::Relaxed);
            let _ = finished.send("builder");
        });
    }
    {
        let (provider, done) = (provider.clone(), done.clone());
        std::thread::spawn(move || {
            let mut collections = 0;
            while !done.load(Ordering::Relaxed) || collections == 0 {
                provider.force_flush().expect("collect and export");
                collections += 1;
            }
            let _ = finished.send("collector");
        });
    }
    let start = Instant::now();
    for _ in 0..2 {
        let left = LIMIT.saturating_sub(start.elapsed());
        outcome.recv_timeout(left).unwrap_or_else(|_| {
            panic!(
                "hung: {} of {BUILDS} builds and {} callbacks after {LIMIT:?}",
                builds.load(Ordering::Relaxed),
                callbacks.load(Ordering::Relaxed)
            )
        });
    }
    assert_eq!(builds.load(Ordering::Relaxed), BUILDS);
    assert!(
        callbacks.load(Ordering::Relaxed) > 0,
        "no collection ran the callback"
    );
}
