//! Per-CPU metrics for a [`prometheus_client`] registry (feature `prometheus-client`): a
//! [`Counter`] and a [`Histogram`] that register like the crate's own and encode as a
//! Prometheus counter and histogram, but update one CPU's words with restartable sequences
//! instead of shared atomics.
//!
//! ```
//! use prometheus_client::registry::Registry;
//!
//! let requests = thiscpu::prometheus::Counter::new();
//! let latency = thiscpu::prometheus::Histogram::new(&[0.01, 0.1, 1.0]).unwrap();
//! let mut registry = Registry::default();
//! registry.register("requests", "Requests served", requests.clone());
//! registry.register("latency_seconds", "Time to serve a request", latency.clone());
//!
//! requests.inc();
//! latency.observe(0.05);
//!
//! let mut text = String::new();
//! prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
//! assert!(text.contains("# TYPE requests counter\nrequests_total 1\n"));
//! assert!(text.contains("latency_seconds_bucket{le=\"0.1\"} 1\n"));
//! ```

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};
use std::sync::Arc;

use crate::histogram::InvalidBuckets;

/// A per-CPU counter for a `prometheus_client` registry: a shared handle on a
/// [`crate::Counter`], so `inc` is one restartable add on the current CPU's word. Clones count
/// into the same counter (register one clone, keep another).
///
/// ```
/// let c = thiscpu::prometheus::Counter::new();
/// c.clone().inc_by(41);
/// c.inc();
/// assert_eq!(c.get(), 42);
/// ```
#[derive(Clone, Default)]
pub struct Counter {
    inner: Arc<crate::counter::Counter>,
}

impl Counter {
    /// A counter at zero.
    pub fn new() -> Self {
        Counter::default()
    }

    /// Adds 1.
    #[inline]
    pub fn inc(&self) {
        self.inner.add(1);
    }

    /// Adds `n`.
    #[inline]
    pub fn inc_by(&self, n: u64) {
        self.inner.add(n);
    }

    /// The total, as [`crate::Counter::sum`] reads it.
    #[must_use]
    pub fn get(&self) -> u64 {
        self.inner.sum()
    }
}

impl core::fmt::Debug for Counter {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Counter")
            .field("value", &self.get())
            .finish()
    }
}

impl TypedMetric for Counter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for Counter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A per-CPU histogram for a `prometheus_client` registry: a shared handle on a
/// [`crate::Histogram`] with fixed buckets, so `observe` is a restartable add to the bucket's
/// count and a restartable compare-and-store of the sum on the current CPU, exact per bucket.
/// Clones observe into the same histogram.
///
/// ```
/// let h = thiscpu::prometheus::Histogram::new(&[1.0, 2.0]).unwrap();
/// h.observe(1.5);
/// assert_eq!(h.snapshot().cumulative(), [(1.0, 0), (2.0, 1), (f64::INFINITY, 1)]);
/// ```
#[derive(Clone)]
pub struct Histogram {
    inner: Arc<crate::histogram::Histogram>,
}

impl Histogram {
    /// A histogram with these bucket upper bounds (strictly increasing; `+Inf` is implied).
    ///
    /// # Errors
    /// When a bound is NaN or the bounds do not increase.
    pub fn new(bounds: &[f64]) -> Result<Self, InvalidBuckets> {
        Ok(Histogram {
            inner: Arc::new(crate::histogram::Histogram::new(bounds)?),
        })
    }

    /// Records one observation.
    #[inline]
    pub fn observe(&self, value: f64) {
        self.inner.observe(value);
    }

    /// The buckets, count and sum now.
    #[must_use]
    pub fn snapshot(&self) -> crate::histogram::HistogramSnapshot {
        self.inner.snapshot()
    }
}

impl core::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_tuple("Histogram").field(&self.inner).finish()
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let snapshot = self.inner.snapshot();
        let buckets: Vec<(f64, u64)> = snapshot.buckets.iter().map(|b| (b.le, b.count)).collect();
        encoder.encode_histogram::<NoLabelSet>(snapshot.sum, snapshot.count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}
