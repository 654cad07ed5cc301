//! Per-CPU OpenTelemetry counters: each add goes to the current CPU's slot inside a restartable
//! sequence ([`thiscpu`]), with no lock and no atomic read-modify-write, and the totals reach
//! any OpenTelemetry metrics pipeline (periodic OTLP readers, the Prometheus exporter, the
//! in-memory exporter) as observable instruments reporting cumulative sums.
//!
//! ```
//! use thiscpu_opentelemetry::PerCpuMeterExt;
//! use thiscpu_opentelemetry::opentelemetry::{KeyValue, global};
//!
//! let meter = global::meter("my-service");
//! // Before: let requests = meter.u64_counter("requests").build();
//! let requests = meter.percpu_u64_counter("requests").build().counter();
//! requests.add(1, &[KeyValue::new("route", "/")]);
//! ```
//!
//! - [`PerCpuMeterExt`] makes per-CPU instruments from any [`Meter`](opentelemetry::metrics::Meter):
//!   [`PerCpuCounter`] (monotonic, `u64`) and [`PerCpuUpDownCounter`] (`i64`).
//! - **Unbound adds** with attributes ([`PerCpuCounter::add`]) look the attribute set up in the
//!   current CPU's own maps ([`thiscpu::Sharded`]): first by the addresses of its strings (a
//!   `&'static str` keeps its address from one add to the next), then by their bytes. The same
//!   set in another order, or with a key repeated, is the same series, as in the SDK.
//! - **Bound handles** ([`PerCpuCounter::bind`]) own one [`thiscpu::Counter`] per series: an
//!   add is one per-CPU increment.
//! - [`PerCpuCounter::counter`] hands out a real [`opentelemetry::metrics::Counter<u64>`], so
//!   code written against OpenTelemetry's types changes one line. Bound handles come from
//!   this crate's own types only ([`PerCpuCounter::bind`]): the API's bound instruments are
//!   behind its `experimental_metrics_bound_instruments` feature, which this crate leaves off,
//!   since Cargo unifies features over the whole program and, with that feature on, the SDK's
//!   own counters get a `bind` whose handles drop every add unless `opentelemetry_sdk`'s
//!   feature of the same name is on too. Should the program turn the API's feature on itself,
//!   the `bind` of a `Counter` from [`PerCpuCounter::counter`] is the API's default, which
//!   drops every add: bind the per-CPU counter instead.
//!
//! # Export
//! Each instrument registers an observable instrument of the same name, unit and description
//! with the meter; its callback sums the CPUs' slots and observes one cumulative value per
//! series. Slots are never reset, so delta readers (the SDK subtracts the last observed
//! value), cumulative readers, and several readers at once all stay exact.
//!
//! # One instrument, however many builds
//! As with the SDK's instruments, building an instrument of the same identity again (meter,
//! kind, name without regard to ASCII case, description, unit) returns a handle onto the same
//! counts: two modules that build `requests` on one meter, or a handler that builds it on
//! every call, add to one stream. A meter here is what the API lets a `Meter` show of itself,
//! the instrument provider it wraps, which is also what the SDK keys its instruments on: every
//! `Meter` a provider hands out for one scope shares it. Another description, unit or kind is
//! another stream of the same name, as in the SDK. The cardinality limit is not part of the
//! identity: the first build's limit stays.
//!
//! The first build of an identity on a meter that exports it is remembered, with a clone of the
//! meter, for the life of the process: one entry per identity, not per build (builds on a no-op
//! meter are not remembered). The SDK keeps the callback as long, and never says when it is
//! gone.
//!
//! # Cardinality
//! As in the SDK: at most [`DEFAULT_CARDINALITY_LIMIT`] (2000) distinct non-empty attribute
//! sets per instrument ([`PerCpuInstrumentBuilder::with_cardinality_limit`] changes it); adds
//! with further sets go to the series `otel.metric.overflow=true`. The set with no attribute
//! does not count. The SDK applies its own limit (2000 unless a view says otherwise) to the
//! observable instrument too, so a limit above it needs a view raising the SDK's.
//!
//! # Collection cost
//! Each collection takes every CPU's map in turn ([`thiscpu::Sharded::for_each`]: a
//! `membarrier` fence per possible CPU, a few microseconds each) and adds its slots: about
//! `possible CPUs x (fence + 8 bytes x series)`, plus one read of every bound handle's per-CPU
//! words.
//!
//! # Signal handlers
//! Unbound adds take the current CPU's map ([`thiscpu::Sharded`]); a signal handler that
//! interrupts an add and adds on the same thread finds that map held by its own thread, and
//! panics. Do not make unbound adds from signal handlers; a bound handle's add (one
//! [`thiscpu::Counter::add`]) may be made there.
//!
//! # What is not here
//! Histograms: the SDK offers no public way to hand it pre-aggregated buckets (its metric
//! producer API was removed in 0.26), so a per-CPU histogram cannot be exported through it
//! without re-recording every value. `f64` counters: per-CPU float sums would be exact only up
//! to rounding in an order that depends on scheduling.

// The Rust snippets of docs/opentelemetry.md, compiled and run as doctests of this crate, the
// one they use.
#[cfg(doctest)]
#[doc = include_str!("../../docs/opentelemetry.md")]
struct GuideSnippets;

mod by_address;
mod hash;
mod instrument;
mod registry;
mod series;
mod set_map;

pub use instrument::{
    BoundCounter, BoundUpDownCounter, DEFAULT_CARDINALITY_LIMIT, PerCpuCounter,
    PerCpuInstrumentBuilder, PerCpuMeterExt, PerCpuUpDownCounter,
};
/// The OpenTelemetry API crate this crate is built against: use it (or the same version) for
/// `Meter`, `KeyValue` and the instrument types, so that versions cannot disagree.
pub use opentelemetry;
