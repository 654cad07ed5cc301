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
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

/// The kinds of instrument this crate makes; one name may be both, as two streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    U64Counter,
    I64UpDownCounter,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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

fn registry() -> MutexGuard<'static, HashMap<Key, Entry>> {
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What `register` hands to the callback it registers: the store, and a witness that tells
/// whether the meter kept the callback (the callback is then its only other holder).
pub(crate) struct Observed {
    store: Arc<Store>,
    _witness: Arc<()>,
}

impl core::ops::Deref for Observed {
    type Target = Store;
    fn deref(&self) -> &Store {
        &self.store
    }
}

/// Takes an identity's entry out of the registry unless disarmed: after a build whose callback
/// the meter did not keep, and when `register` unwinds.
struct WithdrawUnlessKept<'a> {
    key: &'a Key,
    store: &'a Arc<Store>,
    kept: bool,
}

impl Drop for WithdrawUnlessKept<'_> {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        let mut registry = registry();
        if registry
            .get(self.key)
            .is_some_and(|entry| Arc::ptr_eq(&entry.store, self.store))
        {
            registry.remove(self.key);
        }
    }
}

/// The store of the instrument `builder` describes: the one already registered with the meter
/// for this identity, or a new one (of `limit` series) that `register` hands to the meter.
///
/// The registry is locked only to find or enter the identity, never while `register` runs:
/// the SDK's build takes its pipeline's lock, and a collection holds that lock while it runs
/// observable callbacks, which may build per-CPU instruments themselves (as may whatever the
/// SDK calls during a build, such as a `tracing` subscriber of its internal logs). A build
/// that finds an identity being registered by another thread, or by this one further up its
/// stack, returns that store at once. Where the meter then does not keep the callback (a no-op
/// meter), such a build holds a store nothing exports, as its own build would have.
pub(crate) fn store<I, M>(
    meter: &Meter,
    kind: Kind,
    builder: AsyncInstrumentBuilder<'_, I, M>,
    limit: usize,
    register: impl FnOnce(AsyncInstrumentBuilder<'_, I, M>, Observed),
) -> Arc<Store> {
    let key = Key::of(kind, &builder);
    let store = {
        let mut registry = registry();
        if let Some(entry) = registry.get(&key) {
            return entry.store.clone();
        }
        let store = Arc::new(Store::new(limit));
        registry.insert(
            key.clone(),
            Entry {
                _meter: meter.clone(),
                store: store.clone(),
            },
        );
        store
    };
    let mut withdraw = WithdrawUnlessKept {
        key: &key,
        store: &store,
        kept: false,
    };
    let witness = Arc::new(());
    register(
        builder,
        Observed {
            store: store.clone(),
            _witness: witness.clone(),
        },
    );
    withdraw.kept = Arc::strong_count(&witness) > 1;
    drop(withdraw);
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
        let registry = registry();
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

    /// The SDK can call out while it registers a callback (its internal logs reach a `tracing`
    /// subscriber, which may build per-CPU counters): a build of another identity, and of the
    /// one being registered, on the registering thread.
    #[test]
    fn builds_inside_a_registration_on_its_thread_complete() {
        let (finished, outcome) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let reader = PeriodicReader::builder(InMemoryMetricExporter::default()).build();
            let provider = SdkMeterProvider::builder().with_reader(reader).build();
            let meter = provider.meter("registry-test-nested");
            let mut inside = None;
            let outer = store(
                &meter,
                Kind::U64Counter,
                meter.u64_observable_counter("registry-test-outer"),
                16,
                |builder, observed| {
                    meter
                        .percpu_u64_counter("registry-test-inner")
                        .build()
                        .add(1, &[]);
                    inside = Some(store(
                        &meter,
                        Kind::U64Counter,
                        meter.u64_observable_counter("registry-test-outer"),
                        16,
                        |_, _| panic!("one identity registered twice"),
                    ));
                    builder
                        .with_callback(move |_| {
                            let _ = &observed;
                        })
                        .build();
                },
            );
            let inside = inside.expect("the inner build ran");
            let _ = finished.send(Arc::ptr_eq(&outer, &inside));
        });
        let same = outcome
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("a build inside a registration on its thread hung");
        assert!(same, "the inner build of the identity got another store");
        assert_eq!(entries_named("registry-test-outer"), 1);
        assert_eq!(entries_named("registry-test-inner"), 1);
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
