//! A `PerCpuAlloc`'s statistics through the library's integrations: the `metrics` facade
//! (feature `metrics`), a `prometheus_client` registry (feature `prometheus-client`) and
//! `serde` (feature `serde`).
//!
//! Both metric exports expose the same series under the same names (the table on
//! `AllocStats::record` and `AllocCollector`), so dashboards do not depend on which one a
//! program uses.
//!
//! # Calling them from any thread
//! Exporting reads the caches' words with atomic loads (`PerCpuAlloc::stats`) and takes none
//! of the allocator's locks: its only one, the release lock, is held by `release`,
//! `release_cpu` and `release_idle` alone, never by `alloc` or `dealloc`. An export allocates
//! (the statistics, label strings, the recorder's or the registry's own tables), and when the
//! allocator is the global one those allocations re-enter it on the exporting thread; they take
//! no lock either, so they cannot wait for a lock that the export (or a recorder or registry
//! under it) holds. Exporting is therefore safe from any thread, at any time, also while other
//! threads allocate, release or export. It is not for a signal handler, nor for code running
//! inside an allocation, since it allocates.

/// The series of the table below, one constant each.
#[cfg(any(feature = "metrics", feature = "prometheus-client"))]
mod series {
    /// One exported series: its name as exposed (counters end in `_total`, byte counts in
    /// `_bytes`) and its help text.
    pub(super) struct Series {
        pub(super) name: &'static str,
        pub(super) help: &'static str,
    }

    pub(super) const CACHED_BYTES: Series = Series {
        name: "thiscpu_alloc_cached_bytes",
        help: "Bytes of free objects in the CPU's cache",
    };
    pub(super) const CACHED_OBJECTS: Series = Series {
        name: "thiscpu_alloc_cached_objects",
        help: "Free objects in the CPU's cache",
    };
    pub(super) const HITS: Series = Series {
        name: "thiscpu_alloc_hits_total",
        help: "Allocations served from the CPU's cache",
    };
    pub(super) const MISSES: Series = Series {
        name: "thiscpu_alloc_misses_total",
        help: "Allocations that found the CPU's cache empty (served by a transfer list or the inner allocator)",
    };
    pub(super) const SPILLS: Series = Series {
        name: "thiscpu_alloc_spills_total",
        help: "Frees that found the CPU's cache full (handed to a transfer list or the inner allocator)",
    };
    pub(super) const PASSED_THROUGH: Series = Series {
        name: "thiscpu_alloc_passed_through_total",
        help: "Calls that found the CPU's cache being released and went to the inner allocator",
    };
    pub(super) const CAPACITY_BYTES: Series = Series {
        name: "thiscpu_alloc_capacity_bytes",
        help: "The bytes of one CPU's capacities now, moved between size classes, within the budget",
    };
    pub(super) const CAPACITY_GROWTHS: Series = Series {
        name: "thiscpu_alloc_capacity_growths_total",
        help: "Growths of a size class's capacity, taken from the budget's room or from quieter classes",
    };
    pub(super) const TRANSFER_BYTES: Series = Series {
        name: "thiscpu_alloc_transfer_bytes",
        help: "Bytes of free objects in the transfer lists between the CPUs' caches",
    };
    pub(super) const TRANSFER_OBJECTS: Series = Series {
        name: "thiscpu_alloc_transfer_objects",
        help: "Free objects in the transfer lists between the CPUs' caches",
    };
    pub(super) const BATCHES_HANDED_OVER: Series = Series {
        name: "thiscpu_alloc_batches_handed_over_total",
        help: "Batches of objects that full caches handed to the transfer lists",
    };
    pub(super) const BATCHES_TAKEN: Series = Series {
        name: "thiscpu_alloc_batches_taken_total",
        help: "Batches of objects that empty caches took from the transfer lists",
    };
    pub(super) const HEAP_MAPPED_BYTES: Series = Series {
        name: "thiscpu_alloc_heap_mapped_bytes",
        help: "Address space the own heap mapped for spans",
    };
    pub(super) const HEAP_IN_USE_BYTES: Series = Series {
        name: "thiscpu_alloc_heap_in_use_bytes",
        help: "Bytes of the own heap's spans that hold objects of a size class",
    };
    pub(super) const HEAP_FREE_RESIDENT_BYTES: Series = Series {
        name: "thiscpu_alloc_heap_free_resident_bytes",
        help: "Bytes of the own heap's free spans whose pages are kept",
    };
    pub(super) const HEAP_FREE_RETURNED_BYTES: Series = Series {
        name: "thiscpu_alloc_heap_free_returned_bytes",
        help: "Bytes of the own heap's free spans whose pages went back to the system",
    };
    pub(super) const HEAP_RETURNED_BYTES: Series = Series {
        name: "thiscpu_alloc_heap_returned_bytes_total",
        help: "Bytes of pages the own heap gave back to the system",
    };
    pub(super) const CACHING: Series = Series {
        name: "thiscpu_alloc_caching",
        help: "1 while the per-CPU caches are in use, 0 before the first allocation or without rseq",
    };
}

/// The series both exports expose, for their documentation.
#[cfg(any(feature = "metrics", feature = "prometheus-client"))]
macro_rules! series_table {
    () => {
        "| series | type | labels | value |
|---|---|---|---|
| `thiscpu_alloc_cached_bytes` | gauge | `cpu` | [`CpuAllocStats::cached_bytes`] |
| `thiscpu_alloc_cached_objects` | gauge | `cpu` | [`CpuAllocStats::cached_objects`] |
| `thiscpu_alloc_hits_total` | counter | `cpu` | [`CpuAllocStats::hits`], only while hits are counted |
| `thiscpu_alloc_misses_total` | counter | `cpu` | [`CpuAllocStats::misses`] |
| `thiscpu_alloc_spills_total` | counter | `cpu` | [`CpuAllocStats::spills`] |
| `thiscpu_alloc_passed_through_total` | counter | `cpu` | [`CpuAllocStats::passed_through`] |
| `thiscpu_alloc_capacity_bytes` | gauge | | [`AllocStats::capacity_bytes`] (per CPU) |
| `thiscpu_alloc_capacity_growths_total` | counter | | [`AllocStats::capacity_growths`] |
| `thiscpu_alloc_transfer_bytes` | gauge | | [`AllocStats::transfer_bytes`] |
| `thiscpu_alloc_transfer_objects` | gauge | | [`AllocStats::transfer_objects`] |
| `thiscpu_alloc_batches_handed_over_total` | counter | | [`AllocStats::batches_handed_over`] |
| `thiscpu_alloc_batches_taken_total` | counter | | [`AllocStats::batches_taken`] |
| `thiscpu_alloc_heap_mapped_bytes` | gauge | | [`HeapStats::mapped_bytes`] |
| `thiscpu_alloc_heap_in_use_bytes` | gauge | | [`HeapStats::in_use_bytes`] |
| `thiscpu_alloc_heap_free_resident_bytes` | gauge | | [`HeapStats::free_resident_bytes`] |
| `thiscpu_alloc_heap_free_returned_bytes` | gauge | | [`HeapStats::returned_bytes`] |
| `thiscpu_alloc_heap_returned_bytes_total` | counter | | [`HeapStats::returned_total_bytes`] |
| `thiscpu_alloc_caching` | gauge | | [`AllocStats::caching`], 1 or 0 |

`cpu` is the CPU's number (`\"0\"`, `\"1\"`, ...). Every possible CPU has its series once the
caches are in use, none before."
    };
}

#[cfg(feature = "metrics")]
mod facade {
    use super::series::*;
    use crate::allocator::{AllocStats, CpuAllocStats, HeapStats, PerCpuAlloc};
    use core::alloc::GlobalAlloc;

    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    impl AllocStats {
        /// Publishes these figures through the [`metrics`] facade, to whatever recorder is
        /// installed (thiscpu's [`PerCpuRecorder`](crate::metrics::PerCpuRecorder),
        /// `metrics-exporter-prometheus`, ...): gauges are `set`, counters raised with
        /// `absolute`, and every series is described (recorders keep or replace the
        /// description; either way it is the same).
        ///
        #[doc = series_table!()]
        ///
        /// Call it periodically, or before each scrape; safe from any thread, also while this
        /// allocator is the global one and other threads allocate (it takes no lock the
        /// allocator needs). Shorthand: [`PerCpuAlloc::record_stats`].
        ///
        /// ```
        /// use std::alloc::{GlobalAlloc, Layout};
        ///
        /// static ALLOCATOR: thiscpu::PerCpuAlloc = thiscpu::PerCpuAlloc::new();
        /// let layout = Layout::from_size_align(100, 8).unwrap();
        /// // SAFETY: a non-zero layout; the object is freed with it.
        /// unsafe { ALLOCATOR.dealloc(ALLOCATOR.alloc(layout), layout) };
        ///
        /// let recorder = thiscpu::metrics::PerCpuRecorder::new();
        /// let stats = ALLOCATOR.stats();
        /// metrics::with_local_recorder(&recorder, || stats.record());
        ///
        /// let snapshot = recorder.snapshot();
        /// assert_eq!(snapshot.gauge("thiscpu_alloc_caching"), Some(f64::from(u8::from(stats.caching))));
        /// for cpu in &stats.per_cpu {
        ///     let label = vec![metrics::Label::new("cpu", cpu.cpu.to_string())];
        ///     let key = |name| metrics::Key::from_parts(name, label.clone());
        ///     assert_eq!(snapshot.counter(key("thiscpu_alloc_misses_total")), Some(cpu.misses));
        ///     assert_eq!(
        ///         snapshot.gauge(key("thiscpu_alloc_cached_bytes")),
        ///         Some(cpu.cached_bytes as f64)
        ///     );
        /// }
        /// ```
        pub fn record(&self) {
            // Destructured in full, so that a new field cannot be left out unnoticed.
            let AllocStats {
                per_cpu,
                caching,
                capacity_bytes,
                bound_bytes: _,
                capacity_growths,
                counting_hits: _,
                transfer_objects,
                transfer_bytes,
                batches_handed_over,
                batches_taken,
                heap,
            } = self;
            describe();
            metrics::gauge!(CACHING.name).set(f64::from(u8::from(*caching)));
            metrics::gauge!(CAPACITY_BYTES.name).set(*capacity_bytes as f64);
            metrics::counter!(CAPACITY_GROWTHS.name).absolute(*capacity_growths);
            metrics::gauge!(TRANSFER_BYTES.name).set(*transfer_bytes as f64);
            metrics::gauge!(TRANSFER_OBJECTS.name).set(*transfer_objects as f64);
            metrics::counter!(BATCHES_HANDED_OVER.name).absolute(*batches_handed_over);
            metrics::counter!(BATCHES_TAKEN.name).absolute(*batches_taken);
            let HeapStats {
                mapped_bytes,
                in_use_bytes,
                free_resident_bytes,
                returned_bytes,
                returned_total_bytes,
            } = *heap;
            metrics::gauge!(HEAP_MAPPED_BYTES.name).set(mapped_bytes as f64);
            metrics::gauge!(HEAP_IN_USE_BYTES.name).set(in_use_bytes as f64);
            metrics::gauge!(HEAP_FREE_RESIDENT_BYTES.name).set(free_resident_bytes as f64);
            metrics::gauge!(HEAP_FREE_RETURNED_BYTES.name).set(returned_bytes as f64);
            metrics::counter!(HEAP_RETURNED_BYTES.name).absolute(returned_total_bytes);
            for stats in per_cpu {
                let CpuAllocStats {
                    cpu,
                    hits,
                    misses,
                    spills,
                    passed_through,
                    cached_objects,
                    cached_bytes,
                } = *stats;
                let cpu = cpu.to_string();
                metrics::gauge!(CACHED_BYTES.name, "cpu" => cpu.clone()).set(cached_bytes as f64);
                metrics::gauge!(CACHED_OBJECTS.name, "cpu" => cpu.clone())
                    .set(cached_objects as f64);
                if let Some(hits) = hits {
                    metrics::counter!(HITS.name, "cpu" => cpu.clone()).absolute(hits);
                }
                metrics::counter!(MISSES.name, "cpu" => cpu.clone()).absolute(misses);
                metrics::counter!(SPILLS.name, "cpu" => cpu.clone()).absolute(spills);
                metrics::counter!(PASSED_THROUGH.name, "cpu" => cpu).absolute(passed_through);
            }
        }
    }

    /// Describes every series to the current recorder.
    fn describe() {
        use metrics::Unit;
        for gauge in [
            &CACHED_BYTES,
            &CAPACITY_BYTES,
            &TRANSFER_BYTES,
            &HEAP_MAPPED_BYTES,
            &HEAP_IN_USE_BYTES,
            &HEAP_FREE_RESIDENT_BYTES,
            &HEAP_FREE_RETURNED_BYTES,
        ] {
            metrics::describe_gauge!(gauge.name, Unit::Bytes, gauge.help);
        }
        for gauge in [&CACHED_OBJECTS, &CACHING, &TRANSFER_OBJECTS] {
            metrics::describe_gauge!(gauge.name, gauge.help);
        }
        for counter in [
            &HITS,
            &MISSES,
            &SPILLS,
            &PASSED_THROUGH,
            &CAPACITY_GROWTHS,
            &BATCHES_HANDED_OVER,
            &BATCHES_TAKEN,
        ] {
            metrics::describe_counter!(counter.name, Unit::Count, counter.help);
        }
        metrics::describe_counter!(
            HEAP_RETURNED_BYTES.name,
            Unit::Bytes,
            HEAP_RETURNED_BYTES.help
        );
    }

    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    impl<A: GlobalAlloc> PerCpuAlloc<A> {
        /// Reads the [`stats`](PerCpuAlloc::stats) and publishes them through the `metrics`
        /// facade: [`AllocStats::record`], which lists the series.
        ///
        /// ```
        /// static ALLOCATOR: thiscpu::PerCpuAlloc = thiscpu::PerCpuAlloc::new();
        ///
        /// let recorder = thiscpu::metrics::PerCpuRecorder::new();
        /// metrics::with_local_recorder(&recorder, || ALLOCATOR.record_stats());
        /// // Nothing allocated through it yet: the caches are not in use.
        /// assert_eq!(recorder.snapshot().gauge("thiscpu_alloc_caching"), Some(0.0));
        /// ```
        pub fn record_stats(&self) {
            self.stats().record();
        }
    }
}

#[cfg(feature = "prometheus-client")]
pub use registry::AllocCollector;

#[cfg(feature = "prometheus-client")]
mod registry {
    use super::series::*;
    use crate::allocator::{AllocStats, CpuAllocStats, HeapStats, PerCpuAlloc};
    use crate::prometheus::prometheus_client;
    use core::alloc::GlobalAlloc;
    use prometheus_client::collector::Collector;
    use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue};
    use prometheus_client::metrics::MetricType;
    use prometheus_client::registry::Unit;

    /// A `prometheus_client` [`Collector`] that encodes a static [`PerCpuAlloc`]'s statistics,
    /// read afresh at every scrape (every encoding of the registry).
    ///
    #[doc = series_table!()]
    ///
    /// These are the series [`AllocStats::record`] publishes through the `metrics` facade,
    /// under the same names: the two series in bytes (`thiscpu_alloc_cached_bytes`,
    /// `thiscpu_alloc_capacity_bytes`) carry the unit `bytes` (an OpenMetrics `# UNIT` line),
    /// and the counters get their `_total` as `prometheus_client` adds it. A registry with a prefix (`sub_registry_with_prefix`)
    /// puts it in front of each name.
    ///
    /// Encoding is safe from any thread, also while the allocator is the global one and
    /// other threads allocate: it takes no lock the allocator needs.
    ///
    /// ```
    /// use std::alloc::{GlobalAlloc, Layout};
    /// use thiscpu::prometheus::prometheus_client;
    /// use prometheus_client::registry::Registry;
    ///
    /// // In a program, with `#[global_allocator]`.
    /// static ALLOCATOR: thiscpu::PerCpuAlloc = thiscpu::PerCpuAlloc::new();
    ///
    /// let mut registry = Registry::default();
    /// registry.register_collector(Box::new(thiscpu::allocator::AllocCollector::new(&ALLOCATOR)));
    ///
    /// let layout = Layout::from_size_align(100, 8).unwrap();
    /// // SAFETY: a non-zero layout; the object is freed with it.
    /// unsafe { ALLOCATOR.dealloc(ALLOCATOR.alloc(layout), layout) };
    ///
    /// let mut text = String::new();
    /// prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    /// let stats = ALLOCATOR.stats();
    /// assert!(text.contains(&format!("thiscpu_alloc_caching {}\n", u8::from(stats.caching))));
    /// for cpu in &stats.per_cpu {
    ///     let line = format!("thiscpu_alloc_cached_bytes{{cpu=\"{}\"}} {}\n", cpu.cpu, cpu.cached_bytes);
    ///     assert!(text.contains(&line), "{text}");
    /// }
    /// ```
    pub struct AllocCollector<A: GlobalAlloc + Sync + 'static = std::alloc::System> {
        allocator: &'static PerCpuAlloc<A>,
    }

    impl<A: GlobalAlloc + Sync + 'static> AllocCollector<A> {
        /// A collector of `allocator`'s statistics, for
        /// `Registry::register_collector(Box::new(..))`.
        pub fn new(allocator: &'static PerCpuAlloc<A>) -> Self {
            AllocCollector { allocator }
        }
    }

    impl<A: GlobalAlloc + Sync + 'static> core::fmt::Debug for AllocCollector<A> {
        fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
            f.debug_tuple("AllocCollector")
                .field(self.allocator)
                .finish()
        }
    }

    impl<A: GlobalAlloc + Sync + 'static> Collector for AllocCollector<A> {
        fn encode(&self, encoder: DescriptorEncoder) -> Result<(), core::fmt::Error> {
            encode(&self.allocator.stats(), encoder)
        }
    }

    /// `stats` as the series of the table above.
    fn encode(stats: &AllocStats, mut encoder: DescriptorEncoder) -> Result<(), core::fmt::Error> {
        let AllocStats {
            per_cpu,
            caching,
            capacity_bytes,
            bound_bytes: _,
            capacity_growths,
            counting_hits: _,
            transfer_objects,
            transfer_bytes,
            batches_handed_over,
            batches_taken,
            heap,
        } = stats;
        per_cpu_gauge(&mut encoder, &CACHED_BYTES, per_cpu, |cpu| cpu.cached_bytes)?;
        per_cpu_gauge(&mut encoder, &CACHED_OBJECTS, per_cpu, |cpu| {
            cpu.cached_objects
        })?;
        if per_cpu.iter().all(|cpu| cpu.hits.is_some()) {
            per_cpu_counter(&mut encoder, &HITS, per_cpu, |cpu| cpu.hits.unwrap_or(0))?;
        }
        per_cpu_counter(&mut encoder, &MISSES, per_cpu, |cpu| cpu.misses)?;
        per_cpu_counter(&mut encoder, &SPILLS, per_cpu, |cpu| cpu.spills)?;
        per_cpu_counter(&mut encoder, &PASSED_THROUGH, per_cpu, |cpu| {
            cpu.passed_through
        })?;
        gauge(&mut encoder, &CAPACITY_BYTES, capacity_bytes)?;
        counter(&mut encoder, &CAPACITY_GROWTHS, *capacity_growths)?;
        gauge(&mut encoder, &TRANSFER_BYTES, transfer_bytes)?;
        gauge(&mut encoder, &TRANSFER_OBJECTS, transfer_objects)?;
        counter(&mut encoder, &BATCHES_HANDED_OVER, *batches_handed_over)?;
        counter(&mut encoder, &BATCHES_TAKEN, *batches_taken)?;
        let HeapStats {
            mapped_bytes,
            in_use_bytes,
            free_resident_bytes,
            returned_bytes,
            returned_total_bytes,
        } = heap;
        gauge(&mut encoder, &HEAP_MAPPED_BYTES, mapped_bytes)?;
        gauge(&mut encoder, &HEAP_IN_USE_BYTES, in_use_bytes)?;
        gauge(&mut encoder, &HEAP_FREE_RESIDENT_BYTES, free_resident_bytes)?;
        gauge(&mut encoder, &HEAP_FREE_RETURNED_BYTES, returned_bytes)?;
        counter(&mut encoder, &HEAP_RETURNED_BYTES, *returned_total_bytes)?;
        gauge(&mut encoder, &CACHING, &u64::from(*caching))
    }

    fn counter(
        encoder: &mut DescriptorEncoder,
        series: &Series,
        value: u64,
    ) -> Result<(), core::fmt::Error> {
        let (name, unit) = descriptor(series);
        encoder
            .encode_descriptor(name, series.help, unit.as_ref(), MetricType::Counter)?
            .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(&value, None)
    }

    /// The name and unit to give `prometheus_client` for `series`, which adds `_total` to a
    /// counter's name and the unit's name to the name.
    fn descriptor(series: &Series) -> (&'static str, Option<Unit>) {
        let name = series.name;
        let name = name.strip_suffix("_total").unwrap_or(name);
        match name.strip_suffix("_bytes") {
            Some(stem) => (stem, Some(Unit::Bytes)),
            None => (name, None),
        }
    }

    fn gauge(
        encoder: &mut DescriptorEncoder,
        series: &Series,
        value: &impl EncodeGaugeValue,
    ) -> Result<(), core::fmt::Error> {
        let (name, unit) = descriptor(series);
        encoder
            .encode_descriptor(name, series.help, unit.as_ref(), MetricType::Gauge)?
            .encode_gauge(value)
    }

    /// One gauge per CPU, labelled `cpu`; nothing while there are no CPUs' figures.
    fn per_cpu_gauge(
        encoder: &mut DescriptorEncoder,
        series: &Series,
        per_cpu: &[CpuAllocStats],
        value: impl Fn(&CpuAllocStats) -> u64,
    ) -> Result<(), core::fmt::Error> {
        if per_cpu.is_empty() {
            return Ok(());
        }
        let (name, unit) = descriptor(series);
        let mut metric =
            encoder.encode_descriptor(name, series.help, unit.as_ref(), MetricType::Gauge)?;
        for cpu in per_cpu {
            metric
                .encode_family(&[("cpu", cpu.cpu)])?
                .encode_gauge(&value(cpu))?;
        }
        Ok(())
    }

    /// One counter per CPU, labelled `cpu`; nothing while there are no CPUs' figures.
    fn per_cpu_counter(
        encoder: &mut DescriptorEncoder,
        series: &Series,
        per_cpu: &[CpuAllocStats],
        value: impl Fn(&CpuAllocStats) -> u64,
    ) -> Result<(), core::fmt::Error> {
        if per_cpu.is_empty() {
            return Ok(());
        }
        let (name, unit) = descriptor(series);
        let mut metric =
            encoder.encode_descriptor(name, series.help, unit.as_ref(), MetricType::Counter)?;
        for cpu in per_cpu {
            metric
                .encode_family(&[("cpu", cpu.cpu)])?
                .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                    &value(cpu),
                    None,
                )?;
        }
        Ok(())
    }
}

#[cfg(feature = "serde")]
mod serialize {
    use crate::allocator::{AllocStats, CpuAllocStats, HeapStats};

    /// With the `serde` feature, the statistics serialize as their fields, under their names:
    /// `{"per_cpu": [{"cpu", "hits", "misses", "spills", "passed_through", "cached_objects",
    /// "cached_bytes"}, ..], "caching", "capacity_bytes", "bound_bytes", "capacity_growths",
    /// "counting_hits", "transfer_objects",
    /// "transfer_bytes", "batches_handed_over", "batches_taken", "heap": {"mapped_bytes",
    /// "in_use_bytes", "free_resident_bytes", "returned_bytes", "returned_total_bytes"}}`,
    /// with `null` for hits that are not counted.
    ///
    /// ```
    /// let stats = thiscpu::PerCpuAlloc::new().counting_hits().stats();
    /// let json = serde_json::to_value(&stats).unwrap();
    /// assert_eq!(json["caching"], false);
    /// assert_eq!(json["counting_hits"], true);
    /// assert_eq!(json["per_cpu"], serde_json::json!([]));
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    impl serde::Serialize for AllocStats {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct;
            let AllocStats {
                per_cpu,
                caching,
                capacity_bytes,
                bound_bytes,
                capacity_growths,
                counting_hits,
                transfer_objects,
                transfer_bytes,
                batches_handed_over,
                batches_taken,
                heap,
            } = self;
            let mut state = serializer.serialize_struct("AllocStats", 11)?;
            state.serialize_field("per_cpu", per_cpu)?;
            state.serialize_field("caching", caching)?;
            state.serialize_field("capacity_bytes", capacity_bytes)?;
            state.serialize_field("bound_bytes", bound_bytes)?;
            state.serialize_field("capacity_growths", capacity_growths)?;
            state.serialize_field("counting_hits", counting_hits)?;
            state.serialize_field("transfer_objects", transfer_objects)?;
            state.serialize_field("transfer_bytes", transfer_bytes)?;
            state.serialize_field("batches_handed_over", batches_handed_over)?;
            state.serialize_field("batches_taken", batches_taken)?;
            state.serialize_field("heap", heap)?;
            state.end()
        }
    }

    /// With the `serde` feature, the heap's figures serialize as their fields, under their
    /// names (see [`AllocStats`]'s `Serialize`).
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    impl serde::Serialize for HeapStats {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct;
            let HeapStats {
                mapped_bytes,
                in_use_bytes,
                free_resident_bytes,
                returned_bytes,
                returned_total_bytes,
            } = self;
            let mut state = serializer.serialize_struct("HeapStats", 5)?;
            state.serialize_field("mapped_bytes", mapped_bytes)?;
            state.serialize_field("in_use_bytes", in_use_bytes)?;
            state.serialize_field("free_resident_bytes", free_resident_bytes)?;
            state.serialize_field("returned_bytes", returned_bytes)?;
            state.serialize_field("returned_total_bytes", returned_total_bytes)?;
            state.end()
        }
    }

    /// With the `serde` feature, one CPU's figures serialize as their fields, under their names
    /// (see [`AllocStats`]'s `Serialize`).
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    impl serde::Serialize for CpuAllocStats {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct;
            let CpuAllocStats {
                cpu,
                hits,
                misses,
                spills,
                passed_through,
                cached_objects,
                cached_bytes,
            } = self;
            let mut state = serializer.serialize_struct("CpuAllocStats", 7)?;
            state.serialize_field("cpu", cpu)?;
            state.serialize_field("hits", hits)?;
            state.serialize_field("misses", misses)?;
            state.serialize_field("spills", spills)?;
            state.serialize_field("passed_through", passed_through)?;
            state.serialize_field("cached_objects", cached_objects)?;
            state.serialize_field("cached_bytes", cached_bytes)?;
            state.end()
        }
    }
}

#[cfg(all(
    test,
    not(thiscpu_model),
    any(feature = "metrics", feature = "prometheus-client", feature = "serde")
))]
mod tests {
    use super::super::PerCpuAlloc;
    #[cfg(any(feature = "metrics", feature = "prometheus-client"))]
    use {super::super::AllocStats, std::collections::BTreeMap};

    use std::alloc::{GlobalAlloc, Layout};

    /// An allocator used by one test alone (not the global one), after it allocated, spilled
    /// and cached objects of several sizes, so that every figure it reports is settled and
    /// most are not zero.
    fn churned() -> &'static PerCpuAlloc {
        // Room for one 4,104-byte object per class and CPU: the largest class spills the second.
        // Leaked: a collector needs a `&'static` allocator (`.ci/lsan.supp` names it). Without
        // the own heap, which the process's other tests share: its figures would move between
        // a read and an export.
        let allocator = Box::leak(Box::new(
            PerCpuAlloc::new()
                .with_own_heap(false)
                .with_cache_bytes(4104 * super::super::classes::CLASSES)
                .counting_hits(),
        ));
        for size in [24, 100, 4096] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            for _ in 0..3 {
                let objects: Vec<*mut u8> = (0..20)
                    // SAFETY: a non-zero layout; every object is freed with it below.
                    .map(|_| unsafe { allocator.alloc(layout) })
                    .collect();
                for object in objects {
                    assert!(!object.is_null());
                    // SAFETY: made with `layout` just above.
                    unsafe { allocator.dealloc(object, layout) };
                }
            }
        }
        let stats = allocator.stats();
        if stats.caching {
            assert!(stats.misses() > 0 && stats.spills() > 0, "{stats:?}");
            assert!(
                stats.hits() > Some(0) && stats.cached_bytes() > 0,
                "{stats:?}"
            );
        }
        allocator
    }

    /// Every series and value the table documents for `stats`, keyed as the Prometheus text
    /// format writes them (`name{cpu="N"}`).
    #[cfg(any(feature = "metrics", feature = "prometheus-client"))]
    fn expected(stats: &AllocStats) -> BTreeMap<String, f64> {
        let mut series = BTreeMap::new();
        series.insert(
            "thiscpu_alloc_caching".into(),
            f64::from(u8::from(stats.caching)),
        );
        series.insert(
            "thiscpu_alloc_capacity_bytes".into(),
            stats.capacity_bytes as f64,
        );
        for (name, value) in [
            (
                "thiscpu_alloc_capacity_growths_total",
                stats.capacity_growths,
            ),
            ("thiscpu_alloc_transfer_bytes", stats.transfer_bytes),
            ("thiscpu_alloc_transfer_objects", stats.transfer_objects),
            (
                "thiscpu_alloc_batches_handed_over_total",
                stats.batches_handed_over,
            ),
            ("thiscpu_alloc_batches_taken_total", stats.batches_taken),
            ("thiscpu_alloc_heap_mapped_bytes", stats.heap.mapped_bytes),
            ("thiscpu_alloc_heap_in_use_bytes", stats.heap.in_use_bytes),
            (
                "thiscpu_alloc_heap_free_resident_bytes",
                stats.heap.free_resident_bytes,
            ),
            (
                "thiscpu_alloc_heap_free_returned_bytes",
                stats.heap.returned_bytes,
            ),
            (
                "thiscpu_alloc_heap_returned_bytes_total",
                stats.heap.returned_total_bytes,
            ),
        ] {
            series.insert(name.into(), value as f64);
        }
        for cpu in &stats.per_cpu {
            let mut add = |name: &str, value: u64| {
                series.insert(format!("{name}{{cpu=\"{}\"}}", cpu.cpu), value as f64);
            };
            add("thiscpu_alloc_cached_bytes", cpu.cached_bytes);
            add("thiscpu_alloc_cached_objects", cpu.cached_objects);
            if let Some(hits) = cpu.hits {
                add("thiscpu_alloc_hits_total", hits);
            }
            add("thiscpu_alloc_misses_total", cpu.misses);
            add("thiscpu_alloc_spills_total", cpu.spills);
            add("thiscpu_alloc_passed_through_total", cpu.passed_through);
        }
        series
    }

    /// The samples of a Prometheus or OpenMetrics text exposition.
    #[cfg(any(feature = "metrics", feature = "prometheus-client"))]
    fn samples(text: &str) -> BTreeMap<String, f64> {
        text.lines()
            .filter(|line| !line.starts_with('#') && !line.is_empty())
            .map(|line| {
                let (key, value) = line.rsplit_once(' ').expect("a sample line");
                (key.to_owned(), value.parse().expect("a number"))
            })
            .collect()
    }

    #[cfg(feature = "metrics")]
    #[test]
    fn recorded_metrics_equal_the_stats() {
        let allocator = churned();
        let recorder = crate::metrics::PerCpuRecorder::new();
        metrics::with_local_recorder(&recorder, || allocator.record_stats());
        let snapshot = recorder.snapshot();
        let key = |key: &metrics::Key| {
            let labels: Vec<String> = key
                .labels()
                .map(|label| format!("{}=\"{}\"", label.key(), label.value()))
                .collect();
            match labels.is_empty() {
                true => key.name().to_owned(),
                false => format!("{}{{{}}}", key.name(), labels.join(",")),
            }
        };
        let mut recorded: BTreeMap<String, f64> = snapshot
            .counters
            .iter()
            .map(|(k, value)| (key(k), *value as f64))
            .collect();
        recorded.extend(snapshot.gauges.iter().map(|(k, value)| (key(k), *value)));
        assert_eq!(recorded, expected(&allocator.stats()));
        let described = |name: &str| {
            snapshot
                .descriptions
                .iter()
                .any(|d| d.name.as_str() == name)
        };
        assert!(
            recorded
                .keys()
                .all(|key| described(key.split('{').next().unwrap()))
        );
    }

    #[cfg(feature = "metrics")]
    #[test]
    fn the_prometheus_exporter_renders_the_stats() {
        let allocator = churned();
        let exporter = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = exporter.handle();
        metrics::with_local_recorder(&exporter, || allocator.record_stats());
        assert_eq!(samples(&handle.render()), expected(&allocator.stats()));
    }

    #[cfg(feature = "prometheus-client")]
    #[test]
    fn the_collector_encodes_the_stats_at_every_scrape() {
        use crate::prometheus::prometheus_client::encoding::text::encode;
        use crate::prometheus::prometheus_client::registry::Registry;

        let allocator = churned();
        let mut registry = Registry::default();
        registry.register_collector(Box::new(super::AllocCollector::new(allocator)));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert_eq!(samples(&text), expected(&allocator.stats()), "{text}");
        assert!(
            text.contains("# UNIT thiscpu_alloc_capacity_bytes bytes\n"),
            "{text}"
        );
        // The per-CPU series exist only while the caches are in use (not without rseq).
        assert_eq!(
            text.contains("# UNIT thiscpu_alloc_cached_bytes bytes\n"),
            allocator.stats().caching,
            "{text}"
        );

        // A later scrape reads the figures again.
        let layout = Layout::from_size_align(4096, 8).unwrap();
        // SAFETY: a non-zero layout; freed with it.
        unsafe { allocator.dealloc(allocator.alloc(layout), layout) };
        let mut again = String::new();
        encode(&mut again, &registry).unwrap();
        assert_eq!(samples(&again), expected(&allocator.stats()), "{again}");
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serialized_stats_are_the_stats() {
        let stats = churned().stats();
        let per_cpu: Vec<serde_json::Value> = stats
            .per_cpu
            .iter()
            .map(|cpu| {
                serde_json::json!({
                    "cpu": cpu.cpu,
                    "hits": cpu.hits,
                    "misses": cpu.misses,
                    "spills": cpu.spills,
                    "passed_through": cpu.passed_through,
                    "cached_objects": cpu.cached_objects,
                    "cached_bytes": cpu.cached_bytes,
                })
            })
            .collect();
        let expected = serde_json::json!({
            "per_cpu": per_cpu,
            "caching": stats.caching,
            "capacity_bytes": stats.capacity_bytes,
            "bound_bytes": stats.bound_bytes,
            "capacity_growths": stats.capacity_growths,
            "counting_hits": stats.counting_hits,
            "transfer_objects": stats.transfer_objects,
            "transfer_bytes": stats.transfer_bytes,
            "batches_handed_over": stats.batches_handed_over,
            "batches_taken": stats.batches_taken,
            "heap": {
                "mapped_bytes": stats.heap.mapped_bytes,
                "in_use_bytes": stats.heap.in_use_bytes,
                "free_resident_bytes": stats.heap.free_resident_bytes,
                "returned_bytes": stats.heap.returned_bytes,
                "returned_total_bytes": stats.heap.returned_total_bytes,
            },
        });
        assert_eq!(serde_json::to_value(&stats).unwrap(), expected);
        let uncounted = serde_json::to_value(PerCpuAlloc::new().stats()).unwrap();
        assert_eq!(uncounted["counting_hits"], false);
    }
}
