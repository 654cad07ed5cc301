//! One store per instrument identity, so that building an instrument again (in another module,
//! or in a handler on every call) counts in the same series, as the SDK's instruments do.
//!
//! # The identity
//! As the SDK's: the meter, the instrument's kind (counter or up-down counter), its name
//! compared as ASCII without case, its description and its unit (none is the same as empty).
//! The cardinality limit is not part of it: the first build's limit stays.
//!
//! The API shows nothing of a meter but the instrument provider it wraps
//! ([`AsyncInstrumentBuilder::instrument_provider`]), and that is what the SDK keys its own
//! instruments on: every `Meter` a provider hands out for one scope (clones, and the meter it
//! returns again on a later `meter("scope")` call) wraps the same one. Its address is the
//! meter's part of the key. An entry keeps a clone of its meter so that this address cannot be
//! freed and reused by another meter while the entry names it.
//!
//! # Memory
//! One entry per identity, whatever the number of builds. A build whose callback the meter
//! does not keep (a no-op meter, whose `Meter`s are new on every call; an instrument the SDK
//! refuses) makes no entry: nothing exports its store, as nothing exports the SDK's own
//! instruments there. An entry, and the meter it keeps, live as long as the process: the SDK
//! keeps an instrument's callback for the life of its pipeline and never tells it has gone,
//! so an entry cannot know when it could go.

use crate::series::Store;
use opentelemetry::metrics::{AsyncInstrumentBuilder, InstrumentProvider, Meter};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

/// The kinds of instrument this crate makes; one name may be both, as two streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    U64Counter,
    I64UpDownCounter,
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct Key {
    /// The address of the meter's instrument provider.
    meter: usize,
    kind: Kind,
    /// In ASCII lower case.
    name: String,
    description: Cow<'static, str>,
    unit: Cow<'static, str>,
}

impl Key {
    fn of<I, M>(kind: Kind, builder: &AsyncInstrumentBuilder<'_, I, M>) -> Key {
        let provider: *const dyn InstrumentProvider = builder.instrument_provider;
        Key {
            meter: provider.cast::<()>() as usize,
            kind,
            name: builder.name.to_ascii_lowercase(),
            description: builder.description.clone().unwrap_or_default(),
            unit: builder.unit.clone().unwrap_or_default(),
        }
    }
}

#[derive(Debug)]
struct Entry {
    /// Keeps the meter's address from being reused (see the module's documentation).
    _meter: Meter,
    store: Arc<Store>,
}

static REGISTRY: LazyLock<Mutex<HashMap<Key, Entry>>> = LazyLock::new(Default::default);

/// The store of the instrument `builder` describes: the one already registered with the meter
/// for this identity, or a new one (of `limit` series) that `register` hands to the meter.
///
/// The registry stays locked while `register` runs, so that two threads building one identity
/// at once register it once; `register` must not build per-CPU instruments itself.
pub(crate) fn store<I, M>(
    meter: &Meter,
    kind: Kind,
    builder: AsyncInstrumentBuilder<'_, I, M>,
    limit: usize,
    register: impl FnOnce(AsyncInstrumentBuilder<'_, I, M>, Arc<Store>),
) -> Arc<Store> {
    let key = Key::of(kind, &builder);
    let mut registry = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(entry) = registry.get(&key) {
        return entry.store.clone();
    }
    let store = Arc::new(Store::new(limit));
    register(builder, store.clone());
    // The callback holds the other reference: if the meter dropped it, nothing will ever export
    // this store, and no later build should find it.
    if Arc::strong_count(&store) > 1 {
        registry.insert(
            key,
            Entry {
                _meter: meter.clone(),
                store: store.clone(),
            },
        );
    }
    store
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PerCpuMeterExt;
    use opentelemetry::metrics::{MeterProvider, NoopMeterProvider};
    use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};

    /// The entries of instruments named `name`.
    fn entries_named(name: &str) -> usize {
        let registry = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
        registry.keys().filter(|key| key.name == name).count()
    }

    #[test]
    fn a_handler_building_its_counter_on_every_call_makes_one_entry() {
        let reader = PeriodicReader::builder(InMemoryMetricExporter::default()).build();
        let provider = SdkMeterProvider::builder().with_reader(reader).build();
        for _ in 0..1000 {
            let meter = provider.meter("registry-test");
            meter
                .percpu_u64_counter("registry-test-handled")
                .build()
                .add(1, &[]);
        }
        assert_eq!(entries_named("registry-test-handled"), 1);
    }

    #[test]
    fn no_op_meters_make_no_entries() {
        for _ in 0..1000 {
            let meter = NoopMeterProvider::new().meter("registry-test");
            meter
                .percpu_i64_up_down_counter("registry-test-noop")
                .build()
                .add(1, &[]);
        }
        assert_eq!(entries_named("registry-test-noop"), 0);
    }
}
