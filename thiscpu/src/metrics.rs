//! A backend for the [`metrics`] facade (feature `metrics`): counters that
//! `metrics::counter!(...).increment(n)` updates with one restartable sequence on the current
//! CPU's slot, instead of an atomic add on one shared word.
//!
//! - [`PerCpuCounter`]: a [`Counter`] that implements
//!   [`metrics::CounterFn`], for `metrics::Counter::from_arc`.
//! - [`PerCpuRecorder`]: a [`metrics::Recorder`] that gives every counter key a
//!   `PerCpuCounter`, every gauge an atomic `f64`, every histogram a per-CPU
//!   [`Histogram`] with fixed buckets; [`PerCpuRecorder::snapshot`] reads
//!   them all back. Install it once and every `metrics::counter!` in the program (and its
//!   libraries) becomes per-CPU.
//! - `PerCpuLayer` (feature `metrics-layer`): per-CPU counters in front of another recorder,
//!   such as an exporter's, which receives their totals.
//!
//! ```
//! let recorder = thiscpu::metrics::PerCpuRecorder::new();
//! metrics::with_local_recorder(&recorder, || {
//!     std::thread::scope(|s| {
//!         for _ in 0..4 {
//!             s.spawn(|| {
//!                 // A recorder installed with `install` is seen by every thread; a local one
//!                 // only by the thread that set it.
//!                 metrics::with_local_recorder(&recorder, || {
//!                     for _ in 0..1000 {
//!                         metrics::counter!("requests", "route" => "/").increment(1);
//!                     }
//!                 })
//!             });
//!         }
//!     });
//!     metrics::gauge!("queue_depth").set(3.0);
//!     metrics::histogram!("latency_seconds").record(0.25);
//! });
//! let snapshot = recorder.snapshot();
//! let key = metrics::Key::from_parts("requests", vec![metrics::Label::new("route", "/")]);
//! assert_eq!(snapshot.counter(key), Some(4000));
//! assert_eq!(snapshot.gauge("queue_depth"), Some(3.0));
//! let latency = snapshot.histogram("latency_seconds").unwrap();
//! assert_eq!(latency.count, 1);
//! // Prometheus' default buckets: 0.25 falls in `le = 0.25`.
//! assert_eq!(latency.cumulative()[5], (0.25, 1));
//! ```
//!
//! # What it costs
//! `counter!(...)` looks its key up on every call. Shared by all threads, that lookup would
//! take a lock and clone one reference count, two atomic writes on lines that every CPU
//! bounces: the contention that per-CPU counters exist to avoid. So each thread keeps its own
//! handle per key (up to [`THREAD_CACHE_KEYS`] keys per recorder), and a registration in a
//! thread that has seen the key before touches only that thread's memory. Holding the
//! `metrics::Counter` that `counter!` returns and calling `increment` on it skips the lookup
//! altogether and is faster still.
//!
//! Each counter key takes a [`Counter`]'s memory (8 bytes per CPU that
//! incremented it), and each thread that registered the key a 256-byte handle. Keys made from
//! unbounded label values (user ids, paths) multiply both. A thread's handles live until the
//! thread exits, or until it next registers a counter with a new recorder after their own
//! recorder was dropped: only then is a dropped recorder's memory all returned.
//!
//! # Which `metrics`
//! The recorder and counters implement the traits of `metrics` 0.24, and `PerCpuLayer` the
//! `Layer` of `metrics-util` 0.20 (thiscpu depends on `metrics = "0.24"` and, with feature
//! `metrics-layer`, `metrics-util = "0.20"`). A program whose own `metrics` is another
//! semver-incompatible release has a second, separate facade: its `counter!` never reaches a
//! recorder installed through thiscpu's, and the traits do not match ("the trait `Recorder`
//! is not implemented"). Either depend on the same releases, or use them as re-exported here,
//! [`metrics`] and (feature `metrics-layer`) `metrics_util`, which cannot
//! disagree:
//!
//! ```
//! use thiscpu::metrics::metrics;
//!
//! let recorder = thiscpu::metrics::PerCpuRecorder::new();
//! metrics::with_local_recorder(&recorder, || metrics::counter!("jobs").increment(2));
//! assert_eq!(recorder.snapshot().counter("jobs"), Some(2));
//! ```

/// The `metrics` facade release this backend implements (0.24), for `counter!` and
/// `set_global_recorder` that reach it.
pub use ::metrics;
/// The `metrics-util` release whose `Layer` [`PerCpuLayer`] implements (0.20).
#[cfg(feature = "metrics-layer")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics-layer")))]
pub use ::metrics_util;

#[cfg(feature = "metrics-layer")]
mod layer;
#[cfg(feature = "metrics-layer")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics-layer")))]
pub use layer::{PerCpuLayer, PerCpuLayered, Publisher};

use crate::counter::Counter;
use crate::histogram::Histogram;
pub use crate::histogram::{Bucket, HistogramSnapshot, InvalidBuckets};
use crate::percpu::CachePadded;
use metrics::{
    CounterFn, Gauge, HistogramFn, Key, KeyName, Metadata, Recorder, SetRecorderError,
    SharedString, Unit,
};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// The word a gauge lives in: `metrics`' own atomic, which implements its `GaugeFn` (the
/// standard library's `AtomicU64` on 64-bit targets, `portable-atomic`'s on 32-bit ones).
type GaugeWord = metrics::atomics::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};

/// A per-CPU `metrics` counter: [`increment`](CounterFn::increment) is one
/// [`Counter::add`], a restartable sequence on the current CPU's slot;
/// [`absolute`](CounterFn::absolute) raises the value to at least its argument.
///
/// The value is `increments + offset`, where `increments` is the exact per-CPU sum of every
/// `increment` and `offset` a separate word that only `absolute` raises (with `fetch_max`).
/// What holds, also while threads call both concurrently (values below 2^64):
/// - **No increment is lost**: every `increment(n)` that returned has added `n` to the value,
///   whatever `absolute` calls ran before, during or after it.
/// - **Monotonic**: the value never decreases; one thread's successive
///   [`value`](PerCpuCounter::value) reads never go down, nor does a read that happens after
///   another (by a join, a lock, a channel) return less.
/// - **`absolute(v)` reaches `v`**: once it returns, `value()` is at least `v`.
/// - **`absolute(v)` adds no more than needed**: it raises the offset to `v - s`, where `s` is a
///   sum of the increments it reads, at least every increment that returned before it started.
///   An increment that runs concurrently with it may end up counted on top of `v` rather than
///   under it, so the value can exceed `max(previous, v)` by increments that raced with the
///   call; it never exceeds it by more.
///
/// Reads are not linearizable snapshots: [`value`](PerCpuCounter::value) reads the offset and
/// then every CPU's slot, one at a time.
///
/// ```
/// use metrics::CounterFn;
/// use std::sync::Arc;
///
/// let requests = Arc::new(thiscpu::metrics::PerCpuCounter::new());
/// let handle = metrics::Counter::from_arc(requests.clone());
/// handle.increment(5);
/// handle.absolute(100); // catch up with an external count
/// handle.increment(1);
/// handle.absolute(50); // older, smaller: no effect
/// assert_eq!(requests.value(), 101);
/// assert_eq!(requests.increments(), 6);
/// ```
pub struct PerCpuCounter {
    increments: Counter,
    offset: AtomicU64,
}

impl PerCpuCounter {
    /// A counter at zero.
    ///
    /// ```
    /// assert_eq!(thiscpu::metrics::PerCpuCounter::new().value(), 0);
    /// ```
    pub fn new() -> Self {
        PerCpuCounter {
            increments: Counter::new(),
            offset: AtomicU64::new(0),
        }
    }

    /// The counter's value: the sum of all increments plus what `absolute` added.
    ///
    /// ```
    /// use metrics::CounterFn;
    /// let c = thiscpu::metrics::PerCpuCounter::new();
    /// c.increment(2);
    /// c.absolute(10);
    /// assert_eq!(c.value(), 10);
    /// ```
    pub fn value(&self) -> u64 {
        // Offset first, then the slots: both only grow, so each read is at least what any read
        // that happened before it saw (coherence of every word read), which is all that the
        // monotonicity above needs; relaxed loads give that.
        let offset = self.offset.load(Ordering::Relaxed);
        offset.wrapping_add(self.increments.sum())
    }

    /// The sum of the increments alone, without what `absolute` added.
    ///
    /// ```
    /// use metrics::CounterFn;
    /// let c = thiscpu::metrics::PerCpuCounter::new();
    /// c.increment(2);
    /// c.absolute(10);
    /// assert_eq!(c.increments(), 2);
    /// ```
    pub fn increments(&self) -> u64 {
        self.increments.sum()
    }
}

impl CounterFn for PerCpuCounter {
    #[inline]
    fn increment(&self, value: u64) {
        self.increments.add(value);
    }

    fn absolute(&self, value: u64) {
        // `counted` is at least the sum of the increments that returned before this call
        // started (each slot only grows, and is read after them), and at most the sum now. So
        // the value is `increments_now + offset >= counted + (value - counted) = value` once
        // the `fetch_max` below is done, and the offset grows by no more than what `value`
        // lacked when the sum was read.
        let counted = self.increments.sum();
        let needed = value.saturating_sub(counted);
        if needed > self.offset.load(Ordering::Relaxed) {
            self.offset.fetch_max(needed, Ordering::Relaxed);
        }
    }
}

impl Default for PerCpuCounter {
    fn default() -> Self {
        PerCpuCounter::new()
    }
}

impl core::fmt::Debug for PerCpuCounter {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PerCpuCounter")
            .field("value", &self.value())
            .finish()
    }
}

/// The most counter keys for which one thread keeps its own handle, per recorder. Keys past
/// the limit still work; each `counter!` on them goes through the shared table.
pub const THREAD_CACHE_KEYS: usize = 1024;

/// A [`metrics::Recorder`] backed by thiscpu: counters are [`PerCpuCounter`]s, gauges atomic
/// `f64`s, histograms per-CPU [`Histogram`]s with fixed buckets.
///
/// Clones share the same metrics, so one clone can be installed (which moves it into the
/// facade for good) while another reads [`snapshot`](PerCpuRecorder::snapshot)s.
///
/// - Counters keep every increment exactly (see [`PerCpuCounter`] for `absolute`).
/// - Gauges follow `metrics`' own `AtomicU64` gauge: `set` stores, `increment` and `decrement`
///   are compare-and-swap loops on the `f64`'s bits.
/// - Histograms count each value in one bucket of fixed upper bounds (Prometheus' defaults,
///   [`DEFAULT_BUCKETS`](crate::histogram::DEFAULT_BUCKETS), or those given to
///   [`with_buckets`](PerCpuRecorder::with_buckets)), exactly, and keep the sum, minimum and
///   maximum: each `record` is a restartable add and compare-and-store on the current CPU's
///   row of the histogram; snapshots add the rows up. No quantiles.
/// - Descriptions (`describe_counter!` and the like) are kept, the first one per name and
///   kind, and returned with every snapshot.
/// - Metadata (target, level) is ignored: every metric is recorded.
///
/// ```
/// let recorder = thiscpu::metrics::PerCpuRecorder::new();
/// // In a program: `recorder.install().expect("no other recorder")`, once, at start.
/// metrics::with_local_recorder(&recorder, || {
///     metrics::describe_counter!("bytes_sent", metrics::Unit::Bytes, "Bytes written to clients");
///     metrics::counter!("bytes_sent").increment(512);
///     metrics::counter!("bytes_sent").increment(512);
/// });
/// let snapshot = recorder.snapshot();
/// assert_eq!(snapshot.counter("bytes_sent"), Some(1024));
/// assert_eq!(snapshot.descriptions[0].unit, Some(metrics::Unit::Bytes));
/// ```
#[derive(Clone)]
pub struct PerCpuRecorder {
    shared: Arc<Shared>,
}

type KeyMap<T> = HashMap<Key, T, BuildHasherDefault<KeyHasher>>;

struct Shared {
    /// Tells this recorder's entries apart in the per-thread caches; never reused.
    id: u64,
    counters: RwLock<KeyMap<Arc<PerCpuCounter>>>,
    gauges: RwLock<KeyMap<Arc<GaugeWord>>>,
    histograms: RwLock<KeyMap<Arc<MetricsHistogram>>>,
    descriptions: Mutex<Vec<Description>>,
    /// Bucket bounds of every histogram, checked by `Histogram::new`.
    buckets: Box<[f64]>,
}

impl PerCpuRecorder {
    /// A recorder with no metrics yet.
    ///
    /// ```
    /// let recorder = thiscpu::metrics::PerCpuRecorder::new();
    /// assert!(recorder.snapshot().counters.is_empty());
    /// ```
    pub fn new() -> Self {
        PerCpuRecorder::with_checked_buckets(&crate::histogram::DEFAULT_BUCKETS)
    }

    /// A recorder whose histograms count values in buckets with these upper bounds (strictly
    /// increasing; a last `+Inf` bucket is implied).
    ///
    /// # Errors
    /// When a bound is NaN or the bounds do not increase.
    ///
    /// ```
    /// let recorder = thiscpu::metrics::PerCpuRecorder::with_buckets(&[1.0, 10.0, 100.0]).unwrap();
    /// metrics::with_local_recorder(&recorder, || {
    ///     for size in [3.0, 30.0, 30.0, 300.0] {
    ///         metrics::histogram!("batch_size").record(size);
    ///     }
    /// });
    /// let batch = recorder.snapshot().histogram("batch_size").unwrap();
    /// let counts: Vec<u64> = batch.buckets.iter().map(|b| b.count).collect();
    /// assert_eq!(counts, [0, 1, 2, 1]);
    /// assert!(thiscpu::metrics::PerCpuRecorder::with_buckets(&[2.0, 1.0]).is_err());
    /// ```
    pub fn with_buckets(bounds: &[f64]) -> Result<Self, InvalidBuckets> {
        Histogram::new(bounds)?;
        Ok(PerCpuRecorder::with_checked_buckets(bounds))
    }

    fn with_checked_buckets(bounds: &[f64]) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        PerCpuRecorder {
            shared: Arc::new(Shared {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                counters: RwLock::default(),
                gauges: RwLock::default(),
                histograms: RwLock::default(),
                descriptions: Mutex::default(),
                buckets: bounds.into(),
            }),
        }
    }

    /// Installs a clone of this recorder as the process's global `metrics` recorder, so that
    /// every `metrics::counter!` (and gauge, histogram) in every thread records here. Keep
    /// `self` to take snapshots.
    ///
    /// # Errors
    /// When a global recorder is already installed (there can be only one per process); the
    /// error holds the clone that was not installed.
    ///
    /// ```
    /// let recorder = thiscpu::metrics::PerCpuRecorder::new();
    /// recorder.install().expect("the first recorder of this process");
    /// std::thread::spawn(|| metrics::counter!("jobs").increment(1)).join().unwrap();
    /// assert_eq!(recorder.snapshot().counter("jobs"), Some(1));
    /// assert!(thiscpu::metrics::PerCpuRecorder::new().install().is_err());
    /// ```
    pub fn install(&self) -> Result<(), SetRecorderError<PerCpuRecorder>> {
        metrics::set_global_recorder(self.clone())
    }

    /// Every metric's current value, sorted by key, with the descriptions.
    ///
    /// Each value is read on its own (a counter as [`PerCpuCounter::value`]), while writers may
    /// run: the snapshot is exact for metrics that nobody updated during the call, and never
    /// shows a counter below a value that an earlier snapshot showed.
    ///
    /// ```
    /// let recorder = thiscpu::metrics::PerCpuRecorder::new();
    /// metrics::with_local_recorder(&recorder, || {
    ///     metrics::counter!("b").increment(2);
    ///     metrics::counter!("a").increment(1);
    /// });
    /// let snapshot = recorder.snapshot();
    /// let names: Vec<&str> = snapshot.counters.iter().map(|(key, _)| key.name()).collect();
    /// assert_eq!(names, ["a", "b"]);
    /// ```
    pub fn snapshot(&self) -> Snapshot {
        fn sorted<T, V>(map: &RwLock<KeyMap<T>>, read: impl Fn(&T) -> V) -> Vec<(Key, V)> {
            let map = map.read().unwrap_or_else(PoisonError::into_inner);
            let mut entries: Vec<(Key, V)> =
                map.iter().map(|(key, v)| (key.clone(), read(v))).collect();
            drop(map);
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            entries
        }
        let shared = &self.shared;
        Snapshot {
            counters: sorted(&shared.counters, |c| c.value()),
            gauges: sorted(&shared.gauges, |g| {
                f64::from_bits(g.load(Ordering::Relaxed))
            }),
            histograms: sorted(&shared.histograms, |h| h.0.snapshot()),
            descriptions: shared
                .descriptions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }

    /// The shared counter of `key`, made on first use.
    fn shared_counter(&self, key: &Key) -> Arc<PerCpuCounter> {
        get_or_insert(&self.shared.counters, key, PerCpuCounter::new)
    }

    /// This thread's handle on the counter of `key`, or `None` when the thread cannot keep one
    /// (its cache is full, or the thread is exiting).
    fn thread_counter(&self, key: &Key) -> Option<Arc<ThreadCounter>> {
        THREAD_COUNTERS
            .try_with(|cache| {
                let mut cache = cache.try_borrow_mut().ok()?;
                let id = self.shared.id;
                let at = match cache.iter().position(|entry| entry.recorder_id == id) {
                    Some(at) => at,
                    None => {
                        // Forget recorders that are gone before adding one.
                        cache.retain(|entry| entry.recorder.strong_count() > 0);
                        cache.push(ThreadEntry {
                            recorder_id: id,
                            recorder: Arc::downgrade(&self.shared),
                            counters: KeyMap::default(),
                            last: None,
                        });
                        cache.len() - 1
                    }
                };
                let entry = &mut cache[at];
                // A loop that registers one key over and over (`counter!("x")` in a hot
                // path) compares against the last key instead of hashing into the map.
                if let Some((last, handle)) = &entry.last
                    && last == key
                {
                    return Some(handle.clone());
                }
                let (stored, handle) = match entry.counters.get_key_value(key) {
                    Some((stored, handle)) => (stored.clone(), handle.clone()),
                    None if entry.counters.len() >= THREAD_CACHE_KEYS => return None,
                    None => {
                        // Retained keys clone without copying their strings.
                        let stored = key.to_retained();
                        let handle = Arc::new(ThreadCounter(CachePadded(self.shared_counter(key))));
                        entry.counters.insert(stored.clone(), handle.clone());
                        (stored, handle)
                    }
                };
                entry.last = Some((stored, handle.clone()));
                Some(handle)
            })
            .ok()
            .flatten()
    }
}

/// Looks `key` up under the read lock, and inserts `make()` under the write lock if absent.
fn get_or_insert<T>(map: &RwLock<KeyMap<Arc<T>>>, key: &Key, make: impl FnOnce() -> T) -> Arc<T> {
    if let Some(found) = map.read().unwrap_or_else(PoisonError::into_inner).get(key) {
        return found.clone();
    }
    map.write()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(key.to_retained())
        .or_insert_with(|| Arc::new(make()))
        .clone()
}

impl Default for PerCpuRecorder {
    fn default() -> Self {
        PerCpuRecorder::new()
    }
}

impl core::fmt::Debug for PerCpuRecorder {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        fn len<T>(map: &RwLock<KeyMap<T>>) -> usize {
            map.read().unwrap_or_else(PoisonError::into_inner).len()
        }
        f.debug_struct("PerCpuRecorder")
            .field("counters", &len(&self.shared.counters))
            .field("gauges", &len(&self.shared.gauges))
            .field("histograms", &len(&self.shared.histograms))
            .finish()
    }
}

impl Recorder for PerCpuRecorder {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(MetricKind::Counter, key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(MetricKind::Gauge, key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(MetricKind::Histogram, key, unit, description);
    }

    fn register_counter(&self, key: &Key, _metadata: &Metadata<'_>) -> metrics::Counter {
        match self.thread_counter(key) {
            Some(handle) => metrics::Counter::from_arc(handle),
            None => metrics::Counter::from_arc(self.shared_counter(key)),
        }
    }

    fn register_gauge(&self, key: &Key, _metadata: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(get_or_insert(&self.shared.gauges, key, || {
            GaugeWord::new(0.0f64.to_bits())
        }))
    }

    fn register_histogram(&self, key: &Key, _metadata: &Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::from_arc(get_or_insert(&self.shared.histograms, key, || {
            MetricsHistogram(
                Histogram::new(&self.shared.buckets).expect("bounds checked by with_buckets"),
            )
        }))
    }
}

impl PerCpuRecorder {
    fn describe(&self, kind: MetricKind, name: KeyName, unit: Option<Unit>, text: SharedString) {
        let mut descriptions = self
            .shared
            .descriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !descriptions
            .iter()
            .any(|d| d.kind == kind && d.name == name)
        {
            descriptions.push(Description {
                kind,
                name,
                unit,
                text,
            });
        }
    }
}

/// One thread's handle on a shared counter: cloning it (what every `counter!` does) writes
/// only this handle's reference count, alone on its cache lines, instead of the shared one.
struct ThreadCounter(CachePadded<Arc<PerCpuCounter>>);

impl CounterFn for ThreadCounter {
    #[inline]
    fn increment(&self, value: u64) {
        self.0.increment(value);
    }

    fn absolute(&self, value: u64) {
        self.0.absolute(value);
    }
}

struct ThreadEntry {
    recorder_id: u64,
    recorder: Weak<Shared>,
    counters: KeyMap<Arc<ThreadCounter>>,
    /// The key registered last, and its handle.
    last: Option<(Key, Arc<ThreadCounter>)>,
}

thread_local! {
    static THREAD_COUNTERS: RefCell<Vec<ThreadEntry>> = const { RefCell::new(Vec::new()) };
}

/// Hashes a [`Key`], which feeds its precomputed hash as one `u64`; any other input is folded
/// in FNV-1a style so the hasher stays correct whatever it is given.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // FNV-1a 64-bit offset basis and prime.
        let mut hash = self.0 ^ 0xcbf2_9ce4_8422_2325;
        for &byte in bytes {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = hash;
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(5) ^ value).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ value;
    }
}

/// A [`Histogram`] as a `metrics` histogram.
struct MetricsHistogram(Histogram);

impl HistogramFn for MetricsHistogram {
    fn record(&self, value: f64) {
        self.0.observe(value);
    }

    fn record_many(&self, value: f64, count: usize) {
        self.0.observe_many(value, count as u64);
    }
}

/// Which kind of metric a [`Description`] is about.
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum MetricKind {
    /// A counter.
    Counter,
    /// A gauge.
    Gauge,
    /// A histogram.
    Histogram,
}

/// What a `describe_counter!` (`describe_gauge!`, `describe_histogram!`) said about a metric.
///
/// ```
/// let recorder = thiscpu::metrics::PerCpuRecorder::new();
/// metrics::with_local_recorder(&recorder, || {
///     metrics::describe_gauge!("workers", "Worker threads running");
/// });
/// let snapshot = recorder.snapshot();
/// let described = &snapshot.descriptions[0];
/// assert_eq!(described.kind, thiscpu::metrics::MetricKind::Gauge);
/// assert_eq!(described.name.as_str(), "workers");
/// assert_eq!(&*described.text, "Worker threads running");
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Description {
    /// The kind of metric described.
    pub kind: MetricKind,
    /// The metric's name (every label set of that name shares the description).
    pub name: KeyName,
    /// Its unit, if given.
    pub unit: Option<Unit>,
    /// The description.
    pub text: SharedString,
}

/// Every metric of a [`PerCpuRecorder`] at one time, sorted by key.
///
/// ```
/// let recorder = thiscpu::metrics::PerCpuRecorder::new();
/// metrics::with_local_recorder(&recorder, || metrics::counter!("hits", "cache" => "l1").increment(7));
/// let snapshot = recorder.snapshot();
/// let (key, value) = &snapshot.counters[0];
/// assert_eq!((key.name(), *value), ("hits", 7));
/// assert_eq!(snapshot.counter(("hits", vec![metrics::Label::new("cache", "l1")])), Some(7));
/// assert_eq!(snapshot.counter("hits"), None); // that key has labels
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Snapshot {
    /// Counters and their values.
    pub counters: Vec<(Key, u64)>,
    /// Gauges and their values.
    pub gauges: Vec<(Key, f64)>,
    /// Histograms and their buckets, count, sum, minimum and maximum.
    pub histograms: Vec<(Key, HistogramSnapshot)>,
    /// Descriptions, in the order they were first given.
    pub descriptions: Vec<Description>,
}

impl Snapshot {
    /// The value of the counter with exactly this key (name and labels), if it was registered.
    /// A bare name means the key without labels.
    ///
    /// ```
    /// let recorder = thiscpu::metrics::PerCpuRecorder::new();
    /// metrics::with_local_recorder(&recorder, || metrics::counter!("jobs").increment(2));
    /// assert_eq!(recorder.snapshot().counter("jobs"), Some(2));
    /// ```
    pub fn counter(&self, key: impl Into<Key>) -> Option<u64> {
        find(&self.counters, &key.into()).copied()
    }

    /// The value of the gauge with exactly this key, if it was registered.
    ///
    /// ```
    /// let recorder = thiscpu::metrics::PerCpuRecorder::new();
    /// metrics::with_local_recorder(&recorder, || metrics::gauge!("load").set(0.5));
    /// assert_eq!(recorder.snapshot().gauge("load"), Some(0.5));
    /// ```
    pub fn gauge(&self, key: impl Into<Key>) -> Option<f64> {
        find(&self.gauges, &key.into()).copied()
    }

    /// The contents of the histogram with exactly this key, if it was registered.
    ///
    /// ```
    /// let recorder = thiscpu::metrics::PerCpuRecorder::new();
    /// metrics::with_local_recorder(&recorder, || metrics::histogram!("rtt").record(2.0));
    /// assert_eq!(recorder.snapshot().histogram("rtt").map(|h| h.max), Some(2.0));
    /// ```
    pub fn histogram(&self, key: impl Into<Key>) -> Option<HistogramSnapshot> {
        find(&self.histograms, &key.into()).cloned()
    }
}

/// With the `serde` feature, a snapshot serializes as
/// `{"counters": [{"name", "labels": {..}, "value"}], "gauges": [..], "histograms": [..],
/// "descriptions": [{"kind", "name", "unit", "text"}]}`. The `metrics` crate's key types have
/// no serde support, so there is no `Deserialize`.
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
impl serde::Serialize for Snapshot {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;

        struct Labels<'a>(&'a Key);
        impl serde::Serialize for Labels<'_> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_map(self.0.labels().map(|label| (label.key(), label.value())))
            }
        }

        #[derive(serde::Serialize)]
        struct Entry<'a, V> {
            name: &'a str,
            labels: Labels<'a>,
            value: &'a V,
        }

        fn entries<V>(list: &[(Key, V)]) -> Vec<Entry<'_, V>> {
            list.iter()
                .map(|(key, value)| Entry {
                    name: key.name(),
                    labels: Labels(key),
                    value,
                })
                .collect()
        }

        #[derive(serde::Serialize)]
        struct Described<'a> {
            kind: MetricKind,
            name: &'a str,
            unit: Option<&'a str>,
            text: &'a str,
        }

        let descriptions: Vec<Described<'_>> = self
            .descriptions
            .iter()
            .map(|d| Described {
                kind: d.kind,
                name: d.name.as_str(),
                unit: d.unit.map(|unit| unit.as_str()),
                text: &d.text,
            })
            .collect();
        let mut state = serializer.serialize_struct("Snapshot", 4)?;
        state.serialize_field("counters", &entries(&self.counters))?;
        state.serialize_field("gauges", &entries(&self.gauges))?;
        state.serialize_field("histograms", &entries(&self.histograms))?;
        state.serialize_field("descriptions", &descriptions)?;
        state.end()
    }
}

fn find<'a, V>(entries: &'a [(Key, V)], key: &Key) -> Option<&'a V> {
    entries
        .binary_search_by(|(k, _)| k.cmp(key))
        .ok()
        .map(|at| &entries[at].1)
}
