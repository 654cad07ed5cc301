//! [`Histogram`]: an exact per-CPU histogram with fixed bucket boundaries, as Prometheus
//! histograms have them.

use crate::ops::{self, Outcome};
use crate::percpu::CachePadded;
use core::sync::atomic::{AtomicU64, Ordering};

/// Prometheus' default bucket boundaries (`prometheus.DefBuckets`), in seconds: meant for
/// request latencies from 5 ms to 10 s.
pub const DEFAULT_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Bucket boundaries that a [`Histogram`] cannot use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidBuckets {
    /// A boundary is NaN.
    NotANumber,
    /// The boundaries are not strictly increasing.
    NotIncreasing,
}

impl core::fmt::Display for InvalidBuckets {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            InvalidBuckets::NotANumber => "a histogram bucket boundary is NaN",
            InvalidBuckets::NotIncreasing => {
                "histogram bucket boundaries must be strictly increasing"
            }
        })
    }
}

impl std::error::Error for InvalidBuckets {}

/// Words of a row before the bucket counts: the sum, the minimum and the maximum, as `f64` bits.
const SUM: usize = 0;
const MIN: usize = 1;
const MAX: usize = 2;
const COUNTS: usize = 3;
/// Up to this many bounds, the bucket is found by counting bounds, beyond by a binary search.
const BRANCHLESS_BOUNDS: usize = 16;
/// Words per cache line (128 bytes, as `CachePadded`).
const LINE_WORDS: usize = 16;

type Line = CachePadded<[AtomicU64; LINE_WORDS]>;

/// A histogram of `f64` observations with fixed upper bounds, kept per CPU: each CPU has its own
/// bucket counts, sum, minimum and maximum, on cache lines of their own, so
/// [`observe`](Histogram::observe) is a restartable add to the bucket's count and a restartable
/// compare-and-store of the sum on the current CPU's row, no atomic read-modify-write (plus one
/// for the minimum or maximum when the value is a new extreme on that CPU).
///
/// - A value `v` is counted in the first bucket whose upper bound `le` has `v <= le`; values
///   above every bound (and NaN) in the last bucket, `le = +Inf`. The counts are exact.
/// - The sum adds the values in the order each CPU saw them, in `f64`: as exact as a sum of
///   floating-point numbers is, and the same on every read once writers stop.
/// - A [`snapshot`](Histogram::snapshot) reads every row word by word while observations may
///   run: each count is one that the bucket had during the read, but counts and sum can be
///   from slightly different moments. Once writers have stopped it is exact.
/// - Threads without rseq update a row of their own with atomic instructions.
///
/// Size: `(bounds + 4)` words per possible CPU and one more row, each rounded up to 128 bytes.
///
/// ```
/// let latency = thiscpu::Histogram::new(&[0.01, 0.1, 1.0]).unwrap();
/// // Binary fractions, so their sum is exact whichever CPU sums them in whichever order.
/// let values = [0.0078125, 0.0625, 0.5, 4.0];
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         s.spawn(|| {
///             for v in values {
///                 latency.observe(v);
///             }
///         });
///     }
/// });
/// let snapshot = latency.snapshot();
/// assert_eq!(snapshot.count, 16);
/// assert_eq!(snapshot.sum, 4.0 * values.iter().sum::<f64>());
/// let counts: Vec<u64> = snapshot.buckets.iter().map(|b| b.count).collect();
/// assert_eq!(counts, [4, 4, 4, 4]); // le 0.01, 0.1, 1, +Inf
/// assert_eq!(snapshot.buckets[3].le, f64::INFINITY);
/// ```
pub struct Histogram {
    bounds: Box<[f64]>,
    /// `cpus + 1` rows of `lines_per_row` lines; the last row is for threads without rseq.
    lines: Box<[Line]>,
    lines_per_row: usize,
    cpus: u32,
}

impl Histogram {
    /// A histogram with these bucket upper bounds (strictly increasing; a last `+Inf` is
    /// implied and may be given). No bounds at all make a histogram of one bucket, `+Inf`.
    ///
    /// # Errors
    /// When a bound is NaN or the bounds are not strictly increasing.
    ///
    /// ```
    /// use thiscpu::histogram::InvalidBuckets;
    /// assert!(thiscpu::Histogram::new(&[1.0, 2.0, f64::INFINITY]).is_ok());
    /// assert_eq!(thiscpu::Histogram::new(&[2.0, 1.0]).err(), Some(InvalidBuckets::NotIncreasing));
    /// assert_eq!(thiscpu::Histogram::new(&[f64::NAN]).err(), Some(InvalidBuckets::NotANumber));
    /// ```
    pub fn new(bounds: &[f64]) -> Result<Histogram, InvalidBuckets> {
        if bounds.iter().any(|b| b.is_nan()) {
            return Err(InvalidBuckets::NotANumber);
        }
        if bounds.windows(2).any(|w| w[0] >= w[1]) {
            return Err(InvalidBuckets::NotIncreasing);
        }
        let finite = match bounds.last() {
            Some(&last) if last == f64::INFINITY => &bounds[..bounds.len() - 1],
            _ => bounds,
        };
        let cpus = crate::topology::possible_cpus() as u32;
        let words = COUNTS + finite.len() + 1;
        let lines_per_row = words.div_ceil(LINE_WORDS);
        let rows = cpus as usize + 1;
        let lines = (0..rows * lines_per_row)
            .map(|_| CachePadded([const { AtomicU64::new(0) }; LINE_WORDS]))
            .collect();
        let histogram = Histogram {
            bounds: finite.into(),
            lines,
            lines_per_row,
            cpus,
        };
        for row in 0..rows {
            histogram
                .word(row, MIN)
                .store(f64::INFINITY.to_bits(), Ordering::Relaxed);
            histogram
                .word(row, MAX)
                .store(f64::NEG_INFINITY.to_bits(), Ordering::Relaxed);
        }
        Ok(histogram)
    }

    /// A histogram with [`DEFAULT_BUCKETS`].
    ///
    /// ```
    /// let h = thiscpu::Histogram::with_default_buckets();
    /// assert_eq!(h.bounds(), thiscpu::histogram::DEFAULT_BUCKETS);
    /// ```
    pub fn with_default_buckets() -> Histogram {
        Histogram::new(&DEFAULT_BUCKETS).expect("the default buckets are increasing")
    }

    /// The finite upper bounds, without the last `+Inf`.
    #[must_use]
    pub fn bounds(&self) -> &[f64] {
        &self.bounds
    }

    #[inline(always)]
    fn word(&self, row: usize, word: usize) -> &AtomicU64 {
        &self.lines[row * self.lines_per_row + word / LINE_WORDS].0[word % LINE_WORDS]
    }

    /// The bucket `value` falls in: the first bound at or above it, else (NaN too) the `+Inf`
    /// bucket.
    #[inline]
    // The negated comparison is the point: it is true for NaN.
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    fn bucket_of(&self, value: f64) -> usize {
        // `!(value <= le)` holds for the bounds below `value`, and for every bound when it is
        // NaN. A few bounds are counted without branches (values that hop between buckets
        // would mispredict a search's); many are searched.
        if self.bounds.len() <= BRANCHLESS_BOUNDS {
            self.bounds.iter().filter(|&&le| !(value <= le)).count()
        } else {
            self.bounds.partition_point(|&le| !(value <= le))
        }
    }

    /// Records one observation of `value`.
    ///
    /// ```
    /// let h = thiscpu::Histogram::new(&[1.0]).unwrap();
    /// h.observe(0.5);
    /// h.observe(1.0); // a bound belongs to its bucket
    /// h.observe(2.0);
    /// let counts: Vec<u64> = h.snapshot().buckets.iter().map(|b| b.count).collect();
    /// assert_eq!(counts, [2, 1]);
    /// ```
    #[inline]
    pub fn observe(&self, value: f64) {
        self.observe_many(value, 1);
    }

    /// Records `count` observations of `value` (the sum grows by `value * count`).
    ///
    /// ```
    /// let h = thiscpu::Histogram::new(&[1.0]).unwrap();
    /// h.observe_many(0.25, 4);
    /// let snapshot = h.snapshot();
    /// assert_eq!((snapshot.count, snapshot.sum), (4, 1.0));
    /// ```
    #[inline]
    pub fn observe_many(&self, value: f64, count: u64) {
        if count == 0 {
            return;
        }
        let bucket = COUNTS + self.bucket_of(value);
        let added = if count == 1 {
            value
        } else {
            value * count as f64
        };
        let mut aborts = ops::AbortRun::new();
        let mut at = loop {
            let Some(at) = ops::position().filter(|at| at.index() < self.cpus) else {
                return self.observe_unregistered(bucket, count, value, added);
            };
            // SAFETY: `at` was just read by this thread; the word lives as long as `self`; the
            // rows of CPUs are written only by sections positioned on their CPU (threads
            // without rseq use the last row), and read with atomic loads.
            match unsafe {
                ops::load_add_store(at, self.word(at.index() as usize, bucket).as_ptr(), count)
            } {
                Outcome::Committed(()) => break at,
                Outcome::Mismatch | Outcome::Aborted if aborts.gives_up() => {
                    return self.observe_unregistered(bucket, count, value, added);
                }
                Outcome::Mismatch | Outcome::Aborted => continue,
            }
        };
        // The sum goes to the row of the CPU the count went to unless the thread moved since
        // (rows are added up, so any row will do).
        loop {
            let slot = self.word(at.index() as usize, SUM);
            let old = slot.load(Ordering::Relaxed);
            let new = (f64::from_bits(old) + added).to_bits();
            // SAFETY: as above.
            match unsafe { ops::load_cbne_store(at, slot.as_ptr(), old, new) } {
                Outcome::Committed(()) => break,
                Outcome::Mismatch | Outcome::Aborted => {
                    match ops::position().filter(|at| at.index() < self.cpus && !aborts.gives_up())
                    {
                        Some(now) => at = now,
                        None => {
                            let row = self.cpus as usize;
                            return self.update_f64_atomic(row, SUM, |sum| Some(sum + added));
                        }
                    }
                }
            }
        }
        // A new minimum or maximum is rare once a CPU has seen a few values: two loads decide.
        let row = at.index() as usize;
        if value < f64::from_bits(self.word(row, MIN).load(Ordering::Relaxed)) {
            self.update_f64(MIN, |min| (value < min).then_some(value));
        }
        if value > f64::from_bits(self.word(row, MAX).load(Ordering::Relaxed)) {
            self.update_f64(MAX, |max| (value > max).then_some(value));
        }
    }

    /// Replaces the current CPU's `f64` at `word` by `change(old)` when that is `Some`, in a
    /// restartable compare-and-store that retries when another thread of the same CPU changed
    /// the word in between or the thread moved.
    #[cold]
    fn update_f64(&self, word: usize, change: impl Fn(f64) -> Option<f64>) {
        let mut aborts = ops::AbortRun::new();
        loop {
            let Some(at) = ops::position().filter(|at| at.index() < self.cpus) else {
                return self.update_f64_atomic(self.cpus as usize, word, change);
            };
            let slot = self.word(at.index() as usize, word);
            let old = slot.load(Ordering::Relaxed);
            let Some(new) = change(f64::from_bits(old)) else {
                return;
            };
            // SAFETY: as in `observe_many`.
            match unsafe { ops::load_cbne_store(at, slot.as_ptr(), old, new.to_bits()) } {
                Outcome::Committed(()) => return,
                Outcome::Mismatch | Outcome::Aborted if aborts.gives_up() => {
                    return self.update_f64_atomic(self.cpus as usize, word, change);
                }
                Outcome::Mismatch | Outcome::Aborted => continue,
            }
        }
    }

    fn update_f64_atomic(&self, row: usize, word: usize, change: impl Fn(f64) -> Option<f64>) {
        let _ = self
            .word(row, word)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                change(f64::from_bits(old)).map(f64::to_bits)
            });
    }

    #[cold]
    fn observe_unregistered(&self, bucket: usize, count: u64, value: f64, added: f64) {
        let row = self.cpus as usize;
        self.word(row, bucket).fetch_add(count, Ordering::Relaxed);
        self.update_f64_atomic(row, SUM, |sum| Some(sum + added));
        self.update_f64_atomic(row, MIN, |min| (value < min).then_some(value));
        self.update_f64_atomic(row, MAX, |max| (value > max).then_some(value));
    }

    /// The buckets, count, sum, minimum and maximum over every CPU.
    ///
    /// ```
    /// let h = thiscpu::Histogram::new(&[10.0]).unwrap();
    /// h.observe(3.0);
    /// h.observe(30.0);
    /// let s = h.snapshot();
    /// assert_eq!((s.count, s.sum, s.min, s.max), (2, 33.0, 3.0, 30.0));
    /// assert_eq!(s.mean(), Some(16.5));
    /// ```
    #[must_use]
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut snapshot = HistogramSnapshot::empty(&self.bounds);
        for row in 0..=self.cpus as usize {
            let f = |word| f64::from_bits(self.word(row, word).load(Ordering::Relaxed));
            for (i, bucket) in snapshot.buckets.iter_mut().enumerate() {
                let n = self.word(row, COUNTS + i).load(Ordering::Relaxed);
                bucket.count = bucket.count.wrapping_add(n);
                snapshot.count = snapshot.count.wrapping_add(n);
            }
            snapshot.sum += f(SUM);
            snapshot.min = snapshot.min.min(f(MIN));
            snapshot.max = snapshot.max.max(f(MAX));
        }
        snapshot
    }
}

impl core::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Histogram")
            .field("bounds", &self.bounds)
            .field("snapshot", &self.snapshot())
            .finish()
    }
}

/// One bucket of a [`HistogramSnapshot`]: how many observations fell at or below `le` and above
/// the previous bucket's bound (not cumulative).
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct Bucket {
    /// The bucket's upper bound (`+Inf` for the last).
    #[cfg_attr(feature = "serde", serde(with = "crate::histogram::any_float"))]
    pub le: f64,
    /// Observations in this bucket alone.
    pub count: u64,
}

/// A histogram's contents at one time: buckets, count, sum, minimum and maximum.
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct HistogramSnapshot {
    /// Number of observations (the sum of the bucket counts).
    pub count: u64,
    /// Their sum.
    #[cfg_attr(feature = "serde", serde(with = "crate::histogram::any_float"))]
    pub sum: f64,
    /// The smallest (`+inf` when none was recorded).
    #[cfg_attr(feature = "serde", serde(with = "crate::histogram::any_float"))]
    pub min: f64,
    /// The largest (`-inf` when none was recorded).
    #[cfg_attr(feature = "serde", serde(with = "crate::histogram::any_float"))]
    pub max: f64,
    /// Every bucket in increasing order of bound, the last one `+Inf`.
    pub buckets: Vec<Bucket>,
}

impl HistogramSnapshot {
    fn empty(bounds: &[f64]) -> HistogramSnapshot {
        HistogramSnapshot {
            count: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            buckets: bounds
                .iter()
                .chain([&f64::INFINITY])
                .map(|&le| Bucket { le, count: 0 })
                .collect(),
        }
    }

    /// The mean, or `None` when nothing was observed.
    #[must_use]
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }

    /// The buckets as Prometheus exposes them: each bound with the number of observations at
    /// or below it.
    ///
    /// ```
    /// let h = thiscpu::Histogram::new(&[1.0, 2.0]).unwrap();
    /// [0.5, 1.5, 1.5, 9.0].into_iter().for_each(|v| h.observe(v));
    /// assert_eq!(h.snapshot().cumulative(), [(1.0, 1), (2.0, 3), (f64::INFINITY, 4)]);
    /// ```
    #[must_use]
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut below = 0u64;
        self.buckets
            .iter()
            .map(|b| {
                below = below.wrapping_add(b.count);
                (b.le, below)
            })
            .collect()
    }
}
/// Floats that may be infinite (a last bucket's bound, an empty histogram's extremes) or NaN,
/// which JSON has no number for: such values are written as the strings Prometheus uses,
/// `+Inf`, `-Inf` and `NaN`, and read back from them or from numbers.
#[cfg(feature = "serde")]
pub(crate) mod any_float {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        if value.is_finite() {
            serializer.serialize_f64(*value)
        } else if value.is_nan() {
            serializer.serialize_str("NaN")
        } else if *value > 0.0 {
            serializer.serialize_str("+Inf")
        } else {
            serializer.serialize_str("-Inf")
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Number(f64),
        Text(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        match Written::deserialize(deserializer)? {
            Written::Number(value) => Ok(value),
            Written::Text(text) => match text.as_str() {
                "+Inf" | "Inf" => Ok(f64::INFINITY),
                "-Inf" => Ok(f64::NEG_INFINITY),
                "NaN" => Ok(f64::NAN),
                other => Err(serde::de::Error::custom(format!(
                    "expected a number, +Inf, -Inf or NaN, got {other:?}"
                ))),
            },
        }
    }
}
