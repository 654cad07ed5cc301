//! Per-CPU metrics for a [`prometheus_client`] registry (feature `prometheus-client`): a
//! [`Counter`] and a [`Histogram`] that register like the crate's own and encode as a
//! Prometheus counter and histogram, but update one CPU's words with restartable sequences
//! instead of shared atomics.
//!
//! # Which `prometheus-client`
//! The metrics implement the traits of `prometheus-client` 0.26 (thiscpu depends on
//! `prometheus-client = "0.26"`). A registry from another semver-incompatible release (0.25,
//! 0.27) has traits of the same names that these types do not implement, and `register` then
//! fails to compile with "the trait bound ... is not satisfied". Either depend on the same
//! `0.26` yourself, or use the crate as thiscpu re-exports it, [`prometheus_client`] in this
//! module, which cannot disagree:
//!
//! ```
//! use thiscpu::prometheus::prometheus_client::registry::Registry;
//!
//! let requests = thiscpu::prometheus::Counter::new();
//! let latency = thiscpu::prometheus::Histogram::new([0.01, 0.1, 1.0]);
//! let mut registry = Registry::default();
//! registry.register("requests", "Requests served", requests.clone());
//! registry.register("latency_seconds", "Time to serve a request", latency.clone());
//!
//! requests.inc();
//! latency.observe(0.05);
//!
//! let mut text = String::new();
//! thiscpu::prometheus::prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
//! assert!(text.contains("# TYPE requests counter\nrequests_total 1\n"));
//! assert!(text.contains("latency_seconds_bucket{le=\"0.1\"} 1\n"));
//! ```
//!
//! # Labels
//! A [`Family`](prometheus_client::metrics::family::Family) makes one metric per label set.
//! Counters have a `Default`, so `Family::default()` works. A histogram has none (its buckets
//! are a choice, as in `prometheus_client`), so a family of them is made with
//! `new_with_constructor`, and the family's third type parameter is the constructor's type:
//! write `fn() -> Histogram` where the family is named (a struct field, a `static`), and a
//! closure that captures nothing coerces to it.
//!
//! `get_or_create` (or `get_or_create_owned`) on every request is correct, and the increment
//! itself stays per-CPU, but the lookup is the family's: it hashes the label set and takes a
//! shared read lock, an atomic read-modify-write on one word every CPU writes, which is the
//! contention per-CPU counters exist to avoid. Where a label set is known in advance (a route,
//! a status class), look it up once and keep the handle: clones of a metric update the same
//! per-CPU words that the family encodes.
//!
//! ```
//! use thiscpu::prometheus::prometheus_client::encoding::EncodeLabelSet;
//! use thiscpu::prometheus::prometheus_client::metrics::family::Family;
//! use thiscpu::prometheus::prometheus_client::registry::Registry;
//! use thiscpu::prometheus::{Counter, Histogram};
//!
//! #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
//! struct Route {
//!     path: &'static str,
//! }
//!
//! struct Metrics {
//!     requests: Family<Route, Counter>,
//!     latency: Family<Route, Histogram, fn() -> Histogram>,
//! }
//!
//! let metrics = Metrics {
//!     requests: Family::default(),
//!     latency: Family::new_with_constructor(|| Histogram::new([0.01, 0.1, 1.0])),
//! };
//! let mut registry = Registry::default();
//! registry.register("requests", "Requests served", metrics.requests.clone());
//! registry.register("latency_seconds", "Time to serve", metrics.latency.clone());
//!
//! // Per request, through the family's lock:
//! metrics.requests.get_or_create(&Route { path: "/" }).inc();
//! metrics.latency.get_or_create(&Route { path: "/" }).observe(0.05);
//! // On a hot path, resolved once:
//! let health = metrics.requests.get_or_create_owned(&Route { path: "/health" });
//! std::thread::scope(|s| {
//!     for _ in 0..4 {
//!         s.spawn(|| (0..1000).for_each(|_| health.inc()));
//!     }
//! });
//!
//! let mut text = String::new();
//! thiscpu::prometheus::prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
//! assert!(text.contains("requests_total{path=\"/\"} 1\n"), "{text}");
//! assert!(text.contains("requests_total{path=\"/health\"} 4000\n"), "{text}");
//! assert!(text.contains("latency_seconds_bucket{le=\"0.1\",path=\"/\"} 1\n"), "{text}");
//! ```
//!
//! # Differences from `prometheus_client`'s own metrics
//! Documented on each type: [`Counter`] (no previous value from `inc`, `u64` only, no
//! exemplars) and [`Histogram`] (bounds sorted, classic buckets only, snapshots not atomic).

/// The `prometheus-client` release these metrics are built against (0.26), for registries and
/// label sets that must match it.
pub use ::prometheus_client;

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
///
/// A [`crate::Counter`] that the program already counts with is registered by wrapping it, not
/// by counting a second time: `From<Arc<thiscpu::Counter>>` (keep a clone of the `Arc`) or
/// `From<thiscpu::Counter>` (then count through this handle).
///
/// ```
/// use std::sync::Arc;
/// use thiscpu::prometheus::prometheus_client::registry::Registry;
///
/// let served = Arc::new(thiscpu::Counter::new()); // counted by the program's own code
/// let mut registry = Registry::default();
/// registry.register(
///     "served",
///     "Requests served",
///     thiscpu::prometheus::Counter::from(Arc::clone(&served)),
/// );
/// served.add(3);
/// let mut text = String::new();
/// thiscpu::prometheus::prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
/// assert!(text.contains("served_total 3\n"), "{text}");
/// ```
///
/// # Differences from `prometheus_client::metrics::counter::Counter`
/// - [`inc`](Counter::inc) and [`inc_by`](Counter::inc_by) return `()`, not the previous
///   value: the add touches only the current CPU's word, and the previous total would take a
///   read of every CPU's word, which costs what the per-CPU add saves and would still not be
///   the value just before this add while other CPUs count. Read [`get`](Counter::get) when
///   a total is needed.
/// - The value is a `u64`: there is no `f64` counter and no choice of atomic type.
/// - No exemplars: it encodes as a plain counter (as `Counter` without `CounterWithExemplar`).
/// - Encoding reads each CPU's word with one atomic load: a value each word had during the
///   encoding, exact once increments have stopped, where `prometheus_client` reads one word.
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

impl From<Arc<crate::counter::Counter>> for Counter {
    /// Shares the counter: this handle and every clone of the `Arc` count into the same words.
    fn from(inner: Arc<crate::counter::Counter>) -> Self {
        Counter { inner }
    }
}

impl From<crate::counter::Counter> for Counter {
    fn from(counter: crate::counter::Counter) -> Self {
        Counter {
            inner: Arc::new(counter),
        }
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
/// [`new`](Histogram::new) takes the bounds as `prometheus_client`'s does, any iterator of
/// `f64` (an array, a `Vec`, `exponential_buckets(..)`), and cannot fail:
///
/// ```
/// use thiscpu::prometheus::prometheus_client::metrics::histogram::exponential_buckets;
///
/// let h = thiscpu::prometheus::Histogram::new(exponential_buckets(1.0, 2.0, 3)); // 1, 2, 4
/// h.observe(1.5);
/// assert_eq!(
///     h.snapshot().cumulative(),
///     [(1.0, 0), (2.0, 1), (4.0, 1), (f64::INFINITY, 1)]
/// );
/// ```
///
/// # Differences from `prometheus_client::metrics::histogram::Histogram`
/// - Bounds are sorted and repeated ones merged: the per-CPU buckets are found by a search
///   over increasing bounds. `prometheus_client` keeps the order given, and with unsorted
///   bounds counts a value in the first bound at or above it in that order. Non-finite bounds
///   (`±Inf`, NaN) are dropped by both, and the `+Inf` bucket is always there.
///   [`try_new`](Histogram::try_new) refuses such bounds instead.
/// - Classic buckets only: no native (sparse) histograms, no exemplars.
/// - An encoding reads each CPU's counts and sum word by word while observations may run, so
///   counts, count and sum can be from slightly different moments (each is exact once writers
///   stop); `prometheus_client` reads them under its lock. The sum adds each CPU's own sum,
///   so its floating-point rounding can differ from one sum in observation order.
/// - Memory: `(bounds + 4)` words per possible CPU, each row rounded up to 128 bytes.
/// - No `Default`, as in `prometheus_client`: a [`Family`] of these histograms is made with
///   `new_with_constructor` (see the [module](self) docs).
///
/// A [`crate::Histogram`] the program already observes into registers through
/// `From<Arc<thiscpu::Histogram>>`.
///
/// [`Family`]: prometheus_client::metrics::family::Family
#[derive(Clone)]
pub struct Histogram {
    inner: Arc<crate::histogram::Histogram>,
}

impl Histogram {
    /// A histogram with these bucket upper bounds, as `prometheus_client`'s `Histogram::new`
    /// takes them: non-finite bounds (`±Inf`, NaN) are dropped, the `+Inf` bucket is implied,
    /// and the rest are sorted with repeats merged.
    ///
    /// ```
    /// let h = thiscpu::prometheus::Histogram::new([2.0, f64::NAN, 1.0, 2.0, f64::INFINITY]);
    /// let bounds: Vec<f64> = h.snapshot().buckets.iter().map(|b| b.le).collect();
    /// assert_eq!(bounds, [1.0, 2.0, f64::INFINITY]);
    /// ```
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        let mut finite: Vec<f64> = bounds.into_iter().filter(|b| b.is_finite()).collect();
        finite.sort_by(f64::total_cmp);
        // `==` rather than the total order, so that -0.0 and 0.0 make one bucket.
        finite.dedup_by(|later, earlier| later == earlier);
        Histogram::try_new(finite).expect("finite bounds, sorted without repeats, are valid")
    }

    /// A histogram with these bucket upper bounds, strictly increasing (a last `+Inf` may be
    /// given, and is implied otherwise).
    ///
    /// # Errors
    /// When a bound is NaN or the bounds are not strictly increasing, where
    /// [`new`](Histogram::new) would repair them.
    ///
    /// ```
    /// use thiscpu::histogram::InvalidBuckets;
    /// use thiscpu::prometheus::Histogram;
    /// assert!(Histogram::try_new([1.0, 2.0, f64::INFINITY]).is_ok());
    /// assert_eq!(Histogram::try_new([2.0, 1.0]).err(), Some(InvalidBuckets::NotIncreasing));
    /// assert_eq!(Histogram::try_new([f64::NAN]).err(), Some(InvalidBuckets::NotANumber));
    /// ```
    pub fn try_new(bounds: impl IntoIterator<Item = f64>) -> Result<Self, InvalidBuckets> {
        let bounds: Vec<f64> = bounds.into_iter().collect();
        Ok(Histogram {
            inner: Arc::new(crate::histogram::Histogram::new(&bounds)?),
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

impl From<Arc<crate::histogram::Histogram>> for Histogram {
    /// Shares the histogram: one that the program already observes into registers without
    /// observing twice.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// let sizes = Arc::new(thiscpu::Histogram::new(&[64.0, 1024.0]).unwrap());
    /// let exported = thiscpu::prometheus::Histogram::from(Arc::clone(&sizes));
    /// sizes.observe(100.0);
    /// assert_eq!(exported.snapshot().count, 1);
    /// ```
    fn from(inner: Arc<crate::histogram::Histogram>) -> Self {
        Histogram { inner }
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
