//! The instruments users hold: how they are built from a meter, their adds, their bound
//! handles, and the OpenTelemetry instrument types they hand out.

use crate::registry::{self, Kind};
use crate::series::Store;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{
    AsyncInstrument, AsyncInstrumentBuilder, Counter, Meter, SyncInstrument, UpDownCounter,
};
use std::borrow::Cow;
use std::marker::PhantomData;
use std::sync::Arc;

/// The number of distinct non-empty attribute sets an instrument holds before it counts further
/// sets in the overflow series, as the SDK's default.
pub const DEFAULT_CARDINALITY_LIMIT: usize = 2000;

/// Makes per-CPU instruments from an OpenTelemetry [`Meter`].
///
/// Building an instrument the meter already has (same kind, name without regard to ASCII case,
/// description and unit) returns a handle onto its counts, as the SDK returns its own
/// instruments again: see [One instrument, however many
/// builds](crate#one-instrument-however-many-builds).
///
/// ```
/// use thiscpu_opentelemetry::PerCpuMeterExt;
/// use thiscpu_opentelemetry::opentelemetry::{KeyValue, global};
///
/// let meter = global::meter("my-service");
/// let requests = meter.percpu_u64_counter("requests").with_unit("1").build();
/// requests.add(1, &[KeyValue::new("route", "/")]);
/// let in_flight = meter.percpu_i64_up_down_counter("in_flight").build();
/// in_flight.add(1, &[]);
/// in_flight.add(-1, &[]);
/// ```
pub trait PerCpuMeterExt {
    /// A monotonic per-CPU counter of `u64`, exported as an observable counter named `name`.
    fn percpu_u64_counter(
        &self,
        name: impl Into<Cow<'static, str>>,
    ) -> PerCpuInstrumentBuilder<'_, PerCpuCounter>;

    /// A per-CPU up-down counter of `i64`, exported as an observable up-down counter.
    fn percpu_i64_up_down_counter(
        &self,
        name: impl Into<Cow<'static, str>>,
    ) -> PerCpuInstrumentBuilder<'_, PerCpuUpDownCounter>;
}

impl PerCpuMeterExt for Meter {
    fn percpu_u64_counter(
        &self,
        name: impl Into<Cow<'static, str>>,
    ) -> PerCpuInstrumentBuilder<'_, PerCpuCounter> {
        PerCpuInstrumentBuilder::new(self, name.into())
    }

    fn percpu_i64_up_down_counter(
        &self,
        name: impl Into<Cow<'static, str>>,
    ) -> PerCpuInstrumentBuilder<'_, PerCpuUpDownCounter> {
        PerCpuInstrumentBuilder::new(self, name.into())
    }
}

/// Configures a per-CPU instrument: what the SDK's builders take, and the cardinality limit.
#[derive(Debug)]
#[must_use = "an instrument builder does nothing until `build` is called"]
pub struct PerCpuInstrumentBuilder<'a, I> {
    meter: &'a Meter,
    name: Cow<'static, str>,
    description: Option<Cow<'static, str>>,
    unit: Option<Cow<'static, str>>,
    cardinality_limit: usize,
    instrument: PhantomData<I>,
}

impl<'a, I> PerCpuInstrumentBuilder<'a, I> {
    fn new(meter: &'a Meter, name: Cow<'static, str>) -> Self {
        PerCpuInstrumentBuilder {
            meter,
            name,
            description: None,
            unit: None,
            cardinality_limit: DEFAULT_CARDINALITY_LIMIT,
            instrument: PhantomData,
        }
    }

    /// The instrument's description.
    pub fn with_description(mut self, description: impl Into<Cow<'static, str>>) -> Self {
        self.description = Some(description.into());
        self
    }

    /// The instrument's unit (case sensitive, as in the SDK).
    pub fn with_unit(mut self, unit: impl Into<Cow<'static, str>>) -> Self {
        self.unit = Some(unit.into());
        self
    }

    /// The number of distinct non-empty attribute sets kept before further sets are counted
    /// in the `otel.metric.overflow=true` series ([`DEFAULT_CARDINALITY_LIMIT`] unless set).
    /// A build that finds the instrument already made keeps the limit it was made with.
    pub fn with_cardinality_limit(mut self, limit: usize) -> Self {
        self.cardinality_limit = limit;
        self
    }
}

impl PerCpuInstrumentBuilder<'_, PerCpuCounter> {
    /// Makes the counter and registers its observable counter with the meter, or, if this
    /// meter already has a per-CPU counter of this name, description and unit, returns a
    /// handle onto that one's counts (as the SDK returns its own counter again).
    pub fn build(self) -> PerCpuCounter {
        let builder = self.meter.u64_observable_counter(self.name);
        let builder = describe(builder, self.description, self.unit);
        let store = registry::store(
            self.meter,
            Kind::U64Counter,
            builder,
            self.cardinality_limit,
            |builder, observed| {
                builder
                    .with_callback(move |observer: &dyn AsyncInstrument<u64>| {
                        observed.collect(|attributes, total| observer.observe(total, attributes))
                    })
                    .build();
            },
        );
        PerCpuCounter { store }
    }
}

impl PerCpuInstrumentBuilder<'_, PerCpuUpDownCounter> {
    /// Makes the up-down counter and registers its observable up-down counter with the meter,
    /// or returns a handle onto the one this meter has of this name, description and unit.
    pub fn build(self) -> PerCpuUpDownCounter {
        let builder = self.meter.i64_observable_up_down_counter(self.name);
        let builder = describe(builder, self.description, self.unit);
        let store = registry::store(
            self.meter,
            Kind::I64UpDownCounter,
            builder,
            self.cardinality_limit,
            |builder, observed| {
                builder
                    .with_callback(move |observer: &dyn AsyncInstrument<i64>| {
                        // The wrapped sum of two's complements is the exact total.
                        observed
                            .collect(|attributes, total| observer.observe(total as i64, attributes))
                    })
                    .build();
            },
        );
        PerCpuUpDownCounter { store }
    }
}

fn describe<'a, I, M>(
    mut builder: AsyncInstrumentBuilder<'a, I, M>,
    description: Option<Cow<'static, str>>,
    unit: Option<Cow<'static, str>>,
) -> AsyncInstrumentBuilder<'a, I, M> {
    if let Some(description) = description {
        builder = builder.with_description(description);
    }
    if let Some(unit) = unit {
        builder = builder.with_unit(unit);
    }
    builder
}

/// A monotonic per-CPU counter. Cloning it shares the counts.
///
/// ```
/// use thiscpu_opentelemetry::PerCpuMeterExt;
/// use thiscpu_opentelemetry::opentelemetry::{KeyValue, global};
///
/// let requests = global::meter("my-service").percpu_u64_counter("requests").build();
/// let ok = requests.bind(&[KeyValue::new("status", 200)]);
/// std::thread::scope(|s| {
///     s.spawn(|| (0..1000).for_each(|_| ok.inc()));
///     s.spawn(|| (0..1000).for_each(|_| requests.add(1, &[KeyValue::new("status", 500)])));
/// });
/// let totals = requests.totals();
/// assert!(totals.contains(&(vec![KeyValue::new("status", 200)], 1000)));
/// assert!(totals.contains(&(vec![KeyValue::new("status", 500)], 1000)));
/// ```
#[derive(Clone, Debug)]
pub struct PerCpuCounter {
    store: Arc<Store>,
}

impl PerCpuCounter {
    /// Adds `value` to the series of `attributes` on the current CPU.
    ///
    /// Inlined into the caller (about 1 KB of code at a call site of three attributes), so
    /// that a set built there from literals is read with little work.
    #[inline(always)]
    pub fn add(&self, value: u64, attributes: &[KeyValue]) {
        self.store.add(value, attributes);
    }

    /// A handle whose adds go to the series of `attributes`, one per-CPU increment each (to the
    /// overflow series if the limit is reached, as the SDK's bound instruments).
    pub fn bind(&self, attributes: &[KeyValue]) -> BoundCounter {
        BoundCounter {
            counter: self.store.bound(attributes),
        }
    }

    /// This counter as OpenTelemetry's [`Counter<u64>`], for code written against the API's
    /// types: its `add` is this counter's.
    ///
    /// Bind through [`PerCpuCounter::bind`], not through the `Counter`. This crate leaves the
    /// API's `experimental_metrics_bound_instruments` feature off, so that depending on it
    /// does not give the SDK's own counters a `bind` that drops every add; if the program
    /// turns that feature on itself, the `Counter`'s `bind` compiles but is the API's
    /// default, whose handles drop every add.
    ///
    /// ```
    /// use thiscpu_opentelemetry::PerCpuMeterExt;
    /// use thiscpu_opentelemetry::opentelemetry::{KeyValue, global, metrics::Counter};
    ///
    /// let per_cpu = global::meter("my-service").percpu_u64_counter("requests").build();
    /// let requests: Counter<u64> = per_cpu.counter();
    /// requests.add(2, &[KeyValue::new("route", "/")]);
    /// per_cpu.bind(&[KeyValue::new("route", "/")]).add(3);
    /// assert_eq!(per_cpu.totals(), vec![(vec![KeyValue::new("route", "/")], 5)]);
    /// ```
    pub fn counter(&self) -> Counter<u64> {
        Counter::new(Arc::new(Instrument(self.store.clone())))
    }

    /// Each series' attributes (sorted by key) and total over every CPU, in the order the series
    /// were first seen: what the next collection reports, read without a meter provider.
    pub fn totals(&self) -> Vec<(Vec<KeyValue>, u64)> {
        let mut totals = Vec::with_capacity(self.store.series_count());
        self.store
            .collect(|attributes, total| totals.push((attributes.to_vec(), total)));
        totals
    }
}

/// A per-CPU up-down counter of `i64`. Cloning it shares the counts.
///
/// ```
/// use thiscpu_opentelemetry::PerCpuMeterExt;
/// use thiscpu_opentelemetry::opentelemetry::global;
///
/// let in_flight = global::meter("my-service").percpu_i64_up_down_counter("in_flight").build();
/// in_flight.add(3, &[]);
/// in_flight.bind(&[]).add(-1);
/// assert_eq!(in_flight.totals(), vec![(vec![], 2)]);
/// ```
#[derive(Clone, Debug)]
pub struct PerCpuUpDownCounter {
    store: Arc<Store>,
}

impl PerCpuUpDownCounter {
    /// Adds `value` (negative to subtract) to the series of `attributes` on the current CPU.
    #[inline]
    pub fn add(&self, value: i64, attributes: &[KeyValue]) {
        self.store.add(value as u64, attributes);
    }

    /// A handle whose adds go to the series of `attributes`, one per-CPU add each.
    pub fn bind(&self, attributes: &[KeyValue]) -> BoundUpDownCounter {
        BoundUpDownCounter {
            counter: self.store.bound(attributes),
        }
    }

    /// This counter as OpenTelemetry's [`UpDownCounter<i64>`]: its `add` is this counter's.
    /// Bind through [`PerCpuUpDownCounter::bind`], as for [`PerCpuCounter::counter`].
    ///
    /// ```
    /// use thiscpu_opentelemetry::PerCpuMeterExt;
    /// use thiscpu_opentelemetry::opentelemetry::{KeyValue, global, metrics::UpDownCounter};
    ///
    /// let per_cpu = global::meter("my-service").percpu_i64_up_down_counter("queued").build();
    /// let queued: UpDownCounter<i64> = per_cpu.up_down_counter();
    /// queued.add(5, &[KeyValue::new("queue", "mail")]);
    /// per_cpu.bind(&[KeyValue::new("queue", "mail")]).add(-7);
    /// assert_eq!(per_cpu.totals(), vec![(vec![KeyValue::new("queue", "mail")], -2)]);
    /// ```
    pub fn up_down_counter(&self) -> UpDownCounter<i64> {
        UpDownCounter::new(Arc::new(Instrument(self.store.clone())))
    }

    /// Each series' attributes (sorted by key) and total over every CPU.
    pub fn totals(&self) -> Vec<(Vec<KeyValue>, i64)> {
        let mut totals = Vec::with_capacity(self.store.series_count());
        self.store
            .collect(|attributes, total| totals.push((attributes.to_vec(), total as i64)));
        totals
    }
}

/// A [`PerCpuCounter`] bound to one attribute set: [`add`](BoundCounter::add) is one
/// [`thiscpu::Counter::add`]. Cloning it shares the series.
#[derive(Clone, Debug)]
pub struct BoundCounter {
    counter: Arc<thiscpu::Counter>,
}

impl BoundCounter {
    /// Adds `value` on the current CPU.
    #[inline]
    pub fn add(&self, value: u64) {
        self.counter.add(value);
    }

    /// Adds one on the current CPU.
    #[inline]
    pub fn inc(&self) {
        self.counter.inc();
    }
}

/// A [`PerCpuUpDownCounter`] bound to one attribute set.
#[derive(Clone, Debug)]
pub struct BoundUpDownCounter {
    counter: Arc<thiscpu::Counter>,
}

impl BoundUpDownCounter {
    /// Adds `value` (negative to subtract) on the current CPU.
    #[inline]
    pub fn add(&self, value: i64) {
        self.counter.add(value as u64);
    }
}

/// A store behind OpenTelemetry's instrument types.
///
/// It implements `measure` only: `bind` exists on the trait only with the API's experimental
/// feature, which this crate leaves off (see [`PerCpuCounter::counter`]).
struct Instrument(Arc<Store>);

impl SyncInstrument<u64> for Instrument {
    fn measure(&self, value: u64, attributes: &[KeyValue]) {
        self.0.add(value, attributes);
    }
}

impl SyncInstrument<i64> for Instrument {
    fn measure(&self, value: i64, attributes: &[KeyValue]) {
        self.0.add(value as u64, attributes);
    }
}
