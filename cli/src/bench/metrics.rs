//! The `metrics-*` cases of the `counter` family: what one
//! `metrics::counter!(KEY).increment(1)` costs when the installed recorder keeps counters in
//! shared `AtomicU64`s, and when it is `thiscpu::metrics::PerCpuRecorder`.
//!
//! Each operation is the whole statement an application writes: the macro finds the recorder,
//! the recorder looks the key up and returns a handle, the handle increments, the handle is
//! dropped. The recorder is set as the worker thread's local recorder for each chunk of
//! operations.
//!
//! - `metrics-atomic`: a recorder shaped like `metrics-util`'s atomic registry (which the
//!   Prometheus exporter builds on): a read-locked map from key to `Arc<AtomicU64>`, and the
//!   `Arc` cloned into each handle; the increment is `metrics`' own `fetch_add` on the shared
//!   word.
//! - `metrics-thiscpu`: `PerCpuRecorder`, whose handles come from a per-thread cache and whose
//!   increment is one restartable sequence on the current CPU's word.

use crate::bench::{Case, Unit, Workload};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use thiscpu::metrics::PerCpuRecorder;

/// The key every operation increments.
const KEY: &str = "bench_requests";

/// Both cases, in nanoseconds of CPU time per increment.
pub(super) fn cases() -> Vec<Case> {
    vec![
        Case::new(
            "metrics-atomic",
            "metrics::counter!().increment(1), AtomicU64 registry",
            Unit::NsPerOp,
            MetricsCase::new(AtomicRecorder::default()),
        ),
        Case::new(
            "metrics-thiscpu",
            "metrics::counter!().increment(1), PerCpuRecorder",
            Unit::NsPerOp,
            MetricsCase::new(PerCpuRecorder::new()),
        ),
    ]
}

/// A recorder whose count of `KEY` can be read back.
trait Readable: Recorder + Send + Sync {
    fn value(&self) -> u64;
}

impl Readable for PerCpuRecorder {
    fn value(&self) -> u64 {
        self.snapshot().counter(KEY).unwrap_or(0)
    }
}

/// One case: increments of `KEY` through `recorder`, checked against the operations run.
struct MetricsCase<R> {
    recorder: R,
    /// The count when the measurement began.
    base: AtomicU64,
}

impl<R: Readable> MetricsCase<R> {
    fn new(recorder: R) -> Self {
        MetricsCase {
            recorder,
            base: AtomicU64::new(0),
        }
    }
}

impl<R: Readable> Workload for MetricsCase<R> {
    fn prepare(&self, _threads: usize) {
        self.base.store(self.recorder.value(), Ordering::Relaxed);
    }

    fn run(&self, _worker: usize, ops: u64) {
        metrics::with_local_recorder(&self.recorder, || {
            for _ in 0..ops {
                metrics::counter!(KEY).increment(1);
            }
        });
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        let (now, base) = (self.recorder.value(), self.base.load(Ordering::Relaxed));
        match now.checked_sub(base) {
            Some(counted) if counted == ops => Ok(()),
            Some(counted) => Err(format!("counted {counted} increments of {ops}")),
            None => Err(format!("the counter went down from {base} to {now}")),
        }
    }
}

/// The baseline recorder: counters are shared `AtomicU64`s in a read-locked map, each handle a
/// clone of the counter's `Arc`; gauges and histograms are not measured here and do nothing.
#[derive(Default)]
struct AtomicRecorder {
    counters: RwLock<HashMap<Key, Arc<AtomicU64>, BuildHasherDefault<KeyHasher>>>,
}

impl Readable for AtomicRecorder {
    fn value(&self) -> u64 {
        let counters = self.counters.read().unwrap_or_else(PoisonError::into_inner);
        counters
            .get(&Key::from_static_name(KEY))
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

impl Recorder for AtomicRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<metrics::Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<metrics::Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<metrics::Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let found = self
            .counters
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned();
        let counter = found.unwrap_or_else(|| {
            self.counters
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(key.clone())
                .or_default()
                .clone()
        });
        Counter::from_arc(counter)
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// Passes a `Key`'s precomputed hash through, as `metrics-util`'s registry does.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 ^= value;
    }
}
