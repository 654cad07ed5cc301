//! The series of one instrument: which attribute sets it has seen (a registry shared by all
//! CPUs, visited only the first time a CPU meets a set), and their counts, one slot per series
//! in each CPU's shard, plus a per-CPU counter for the series that were bound.
//!
//! Values are `u64` words that wrap: an `i64` up-down counter stores its two's complement, and
//! the wrapped sum read back as `i64` is the exact total.

use crate::by_address::{self, AddressMap, Found, Probe, Read};
use crate::set_map::{Attributes, SetMap};
use opentelemetry::KeyValue;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use thiscpu::Sharded;

/// One series: its attribute set in canonical order (sorted by key, each key once), and the
/// per-CPU counter of its bound handles, made by the first `bind`.
#[derive(Debug)]
struct Series {
    attributes: Attributes,
    bound: OnceLock<Arc<thiscpu::Counter>>,
}

/// Every series, by id (its index), and every attribute set seen, in the order given and in
/// canonical order, mapped to its series' id.
#[derive(Debug, Default)]
struct Registry {
    series: Vec<Arc<Series>>,
    ids: SetMap,
    /// Non-empty sets admitted under the limit.
    admitted: usize,
    overflow: Option<u32>,
}

/// What a CPU needs to count an attribute set without the registry: its id, and the key to
/// cache it under (the set as given); no key for a set sent to the overflow series, which is
/// never cached so that sets beyond the limit cannot grow the shards.
struct Resolved {
    id: u32,
    key: Option<Attributes>,
}

/// One CPU's share: the sets it has met (in the orders they were given), by the addresses of
/// their strings (each with its count beside it) or else by their bytes (with a slot per
/// series).
#[derive(Debug)]
struct Shard {
    addresses: AddressMap,
    probe: Probe,
    ids: SetMap,
    counts: Vec<u64>,
}

impl Shard {
    fn new(address_seed: u64) -> Shard {
        Shard {
            addresses: AddressMap::new(address_seed),
            probe: Probe::default(),
            ids: SetMap::default(),
            counts: Vec::new(),
        }
    }

    /// [`add`](Shard::add) of a set of `N` attributes whose words were read beforehand
    /// (`None`: a set that cannot be entered by address).
    #[inline(always)]
    fn add_read<const N: usize>(
        &mut self,
        value: u64,
        set: &[KeyValue; N],
        read: Option<Read<N>>,
        by_address: &AtomicBool,
    ) -> bool {
        match read {
            Some(read) => match self.addresses.find(&read, &mut self.probe, value) {
                Found::Counted => true,
                Found::Missing => self.add_by_bytes(value, set, Words::Probed, by_address),
                Found::Empty | Found::Never => {
                    self.add_by_bytes(value, set, Words::Unread, by_address)
                }
            },
            None => self.add_by_bytes(value, set, Words::Unenterable, by_address),
        }
    }

    /// Counts `value` in the series of `attributes` if this CPU has met the set: false if not.
    #[inline]
    fn add(&mut self, value: u64, attributes: &[KeyValue], by_address: &AtomicBool) -> bool {
        let found = if self.addresses.is_empty() {
            Found::Empty
        } else if !self.addresses.probe(attributes, &mut self.probe) {
            Found::Never
        } else {
            match self.addresses.get(&self.probe) {
                Some(entry) => {
                    self.addresses.count(entry, value);
                    Found::Counted
                }
                None => Found::Missing,
            }
        };
        match found {
            Found::Counted => true,
            Found::Missing => self.add_by_bytes(value, attributes, Words::Probed, by_address),
            Found::Never => self.add_by_bytes(value, attributes, Words::Unenterable, by_address),
            Found::Empty => self.add_by_bytes(value, attributes, Words::Unread, by_address),
        }
    }

    /// The add of a set not found by address: its strings are owned, or this is the first add
    /// of its order on this CPU since the set was met by bytes. `words` says what `probe`
    /// holds.
    #[inline(never)]
    fn add_by_bytes(
        &mut self,
        value: u64,
        attributes: &[KeyValue],
        words: Words,
        by_address: &AtomicBool,
    ) -> bool {
        let Some((key, id)) = self.ids.get(attributes) else {
            return false;
        };
        let probed = match words {
            Words::Probed => true,
            Words::Unenterable => false,
            // Owned strings, met at every add of a caller that has them, differ from the key's
            // in their first attribute already: such a caller reads no more.
            Words::Unread => {
                AddressMap::same_first_words(key, attributes)
                    && self.addresses.probe(attributes, &mut self.probe)
            }
        };
        // The registry holds `key` as long as the store, so as long as this shard; `probe`
        // holds `attributes`' words.
        if probed && self.addresses.insert(key, &self.probe, id, value) {
            enter_by_address(by_address);
        } else {
            self.add_to(id, value);
        }
        true
    }

    /// Caches `key` (the set as given, held by the registry) as `id`, then counts `value`.
    /// Another thread may have cached it on this CPU since this one looked.
    ///
    /// A set entered by address is not cached by bytes too, which would cost each CPU about as
    /// much memory again: should it come with owned strings later, the first such add on this
    /// CPU finds it in the registry and caches it by bytes then.
    ///
    /// Says whether the set is counted by address on this CPU from now on.
    fn add_first(&mut self, value: u64, attributes: &[KeyValue], key: Attributes, id: u32) -> bool {
        if self.addresses.probe(attributes, &mut self.probe) {
            if let Some(entry) = self.addresses.get(&self.probe) {
                self.addresses.count(entry, value);
                return true;
            }
            // The registry holds `key` as long as the store, so as long as this shard.
            if self.addresses.insert(&key, &self.probe, id, value) {
                return true;
            }
        }
        if self.ids.get(attributes).is_none() {
            self.ids.insert(key, id);
        }
        self.add_to(id, value);
        false
    }

    #[inline]
    fn add_to(&mut self, id: u32, value: u64) {
        let id = id as usize;
        if id >= self.counts.len() {
            self.counts.resize(id + 1, 0);
        }
        self.counts[id] = self.counts[id].wrapping_add(value);
    }
}

/// Records in a store's flag that some CPU counts a set by address.
#[inline]
fn enter_by_address(by_address: &AtomicBool) {
    if !by_address.load(Ordering::Relaxed) {
        by_address.store(true, Ordering::Relaxed);
    }
}

/// What a shard's probe holds when an add goes on by bytes.
enum Words {
    /// The set's words: it can be entered by address, and was not found there.
    Probed,
    /// Nothing: the address map is empty (nothing met on this CPU yet, or only sets of owned
    /// strings), and the set was not read.
    Unread,
    /// Nothing: the set cannot be entered by address.
    Unenterable,
}

/// The series of one instrument and their per-CPU counts.
#[derive(Debug)]
pub(crate) struct Store {
    shards: Sharded<Shard>,
    /// The seed of every shard's address map.
    address_seed: u64,
    /// Whether some CPU counts a set by address: until then, adds do not read their sets'
    /// words before taking the shard (a caller whose strings are owned never has them
    /// entered). Either way of adding finds every entry; this only chooses the faster.
    by_address: AtomicBool,
    registry: RwLock<Registry>,
    limit: usize,
}

/// The attribute of the series that counts sets beyond the cardinality limit, as the SDK names
/// it.
fn overflow_attributes() -> Attributes {
    Arc::from([KeyValue::new("otel.metric.overflow", true)])
}

/// The set in canonical order: sorted by key, each key once (its first occurrence: a stable sort
/// keeps repeated keys in the order given).
fn canonical(attributes: &[KeyValue]) -> Vec<KeyValue> {
    let mut sorted = attributes.to_vec();
    sorted.sort_by(|a, b| a.key.cmp(&b.key));
    sorted.dedup_by(|later, first| later.key == first.key);
    sorted
}

impl Store {
    pub(crate) fn new(limit: usize) -> Store {
        let address_seed = by_address::random_seed();
        Store {
            shards: Sharded::new(move |_| Shard::new(address_seed)),
            address_seed,
            by_address: AtomicBool::new(false),
            registry: RwLock::new(Registry::default()),
            limit,
        }
    }

    /// Adds `value` to the series of `attributes` on the current CPU.
    ///
    /// Inlined into the caller, with sets of one to four attributes read before the shard is
    /// taken: where the caller builds its `KeyValue`s from literals, as most do, the compiler
    /// folds most of their reading away, since no call comes between its stores and these
    /// loads (what that saves is measured in docs/opentelemetry.md).
    #[inline(always)]
    pub(crate) fn add(&self, value: u64, attributes: &[KeyValue]) {
        let counted = if !self.by_address.load(Ordering::Relaxed) {
            self.shards
                .with_current(|shard| shard.add(value, attributes, &self.by_address))
        } else if let Ok(set) = <&[KeyValue; 1]>::try_from(attributes) {
            self.add_set(value, set)
        } else if let Ok(set) = <&[KeyValue; 2]>::try_from(attributes) {
            self.add_set(value, set)
        } else if let Ok(set) = <&[KeyValue; 3]>::try_from(attributes) {
            self.add_set(value, set)
        } else if let Ok(set) = <&[KeyValue; 4]>::try_from(attributes) {
            self.add_set(value, set)
        } else {
            self.shards
                .with_current(|shard| shard.add(value, attributes, &self.by_address))
        };
        if !counted {
            self.add_first(value, attributes);
        }
    }

    /// The add of a set of `N` attributes on the current CPU's shard: false if it has not met
    /// the set.
    #[inline(always)]
    fn add_set<const N: usize>(&self, value: u64, set: &[KeyValue; N]) -> bool {
        let read = Read::of(set, self.address_seed);
        self.shards
            .lock_current()
            .add_read(value, set, read, &self.by_address)
    }

    /// The add of a set this CPU has not met: resolve it in the registry (outside the shard, so
    /// that no shard is held while waiting for the registry's lock), then count it.
    #[cold]
    fn add_first(&self, value: u64, attributes: &[KeyValue]) {
        let resolved = self.resolve(attributes);
        let by_address = self.shards.with_current(|shard| match resolved.key {
            Some(key) => shard.add_first(value, attributes, key, resolved.id),
            None => {
                shard.add_to(resolved.id, value);
                false
            }
        });
        if by_address {
            enter_by_address(&self.by_address);
        }
    }

    /// The per-CPU counter of the series of `attributes`, made on first use.
    pub(crate) fn bound(&self, attributes: &[KeyValue]) -> Arc<thiscpu::Counter> {
        let id = self.resolve(attributes).id;
        let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
        let series = &registry.series[id as usize];
        series
            .bound
            .get_or_init(|| Arc::new(thiscpu::Counter::new()))
            .clone()
    }

    fn resolve(&self, attributes: &[KeyValue]) -> Resolved {
        {
            let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
            if let Some((key, id)) = registry.ids.get(attributes) {
                return Resolved {
                    id,
                    key: Some(key.clone()),
                };
            }
        }
        let sorted = canonical(attributes);
        {
            // Once the overflow series exists the limit is reached: a set unknown in canonical
            // order goes there without the write lock, so that sets beyond the limit, which no
            // CPU caches, do not queue for it on every add.
            let registry = self.registry.read().unwrap_or_else(|p| p.into_inner());
            if let Some(overflow) = registry.overflow
                && !sorted.is_empty()
                && registry.ids.get(&sorted).is_none()
            {
                return Resolved {
                    id: overflow,
                    key: None,
                };
            }
        }
        let mut registry = self.registry.write().unwrap_or_else(|p| p.into_inner());
        let registry = &mut *registry;
        if let Some((key, id)) = registry.ids.get(attributes) {
            return Resolved {
                id,
                key: Some(key.clone()),
            };
        }
        let id = match registry.ids.get(&sorted) {
            Some((_, id)) => id,
            None if sorted.is_empty() || registry.admitted < self.limit => {
                let id = registry.series.len() as u32;
                let attributes: Attributes = Arc::from(sorted);
                registry.series.push(Arc::new(Series {
                    attributes: attributes.clone(),
                    bound: OnceLock::new(),
                }));
                registry.ids.insert(attributes.clone(), id);
                if !attributes.is_empty() {
                    registry.admitted += 1;
                }
                id
            }
            None => {
                let id = match registry.overflow {
                    Some(id) => id,
                    None => {
                        let id = registry.series.len() as u32;
                        let attributes = overflow_attributes();
                        registry.series.push(Arc::new(Series {
                            attributes: attributes.clone(),
                            bound: OnceLock::new(),
                        }));
                        registry.ids.insert(attributes, id);
                        registry.overflow = Some(id);
                        id
                    }
                };
                return Resolved { id, key: None };
            }
        };
        // The set as given becomes a key of its own, so the next lookup of this order (on any
        // CPU) is one probe, as the SDK does.
        let key: Attributes = match registry.ids.get(attributes) {
            Some((key, _)) => key.clone(),
            None => {
                let key: Attributes = Arc::from(attributes);
                registry.ids.insert(key.clone(), id);
                key
            }
        };
        Resolved { id, key: Some(key) }
    }

    /// Calls `observe` with each series' attributes and total (wrapping sum) over every CPU and
    /// its bound handles. Series made while this runs may be left to the next collection;
    /// every slot only grows, so totals never go backwards from one collection to the next.
    pub(crate) fn collect(&self, mut observe: impl FnMut(&[KeyValue], u64)) {
        let series: Vec<Arc<Series>> = self
            .registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .series
            .clone();
        let mut totals = vec![0u64; series.len()];
        self.shards.for_each(|_, shard| {
            for (total, count) in totals.iter_mut().zip(&shard.counts) {
                *total = total.wrapping_add(*count);
            }
            shard.addresses.for_each_count(|id, count| {
                if let Some(total) = totals.get_mut(id as usize) {
                    *total = total.wrapping_add(count);
                }
            });
        });
        for (series, total) in series.iter().zip(totals) {
            let bound = series.bound.get().map_or(0, |counter| counter.sum());
            observe(&series.attributes, total.wrapping_add(bound));
        }
    }

    /// The number of series (the set with no attribute and the overflow series included).
    pub(crate) fn series_count(&self) -> usize {
        self.registry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .series
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::Value;

    fn totals(store: &Store) -> Vec<(Vec<KeyValue>, u64)> {
        let mut out = Vec::new();
        store.collect(|attributes, total| out.push((attributes.to_vec(), total)));
        out
    }

    #[test]
    fn order_and_repeated_keys_name_one_series() {
        let store = Store::new(10);
        let a = KeyValue::new("a", 1);
        let b = KeyValue::new("b", "x");
        store.add(1, &[a.clone(), b.clone()]);
        store.add(2, &[b.clone(), a.clone()]);
        store.add(4, &[a.clone(), b.clone(), KeyValue::new("a", 2)]);
        assert_eq!(totals(&store), vec![(vec![a, b], 7)]);
    }

    /// A set met by the addresses of its strings, by their bytes (owned copies) and in another
    /// order is one series; strings at one address but of other lengths, and values of the
    /// same bits but another kind, are other series.
    #[test]
    fn sets_found_by_address_are_the_sets_found_by_bytes() {
        const VALUE10: &str = "value10";
        let store = Store::new(10);
        let given = [KeyValue::new("k", VALUE10), KeyValue::new("b", true)];
        let owned = [
            KeyValue::new(String::from("k"), String::from(VALUE10)),
            KeyValue::new(String::from("b"), true),
        ];
        for _ in 0..3 {
            store.add(1, &given);
            store.add(10, &owned);
            store.add(100, &[given[1].clone(), given[0].clone()]);
        }
        // The same address as `VALUE10`, a shorter string: "value1".
        store.add(1000, &[KeyValue::new("k", &VALUE10[..6]), given[1].clone()]);
        // The bits of `true`, as an integer.
        store.add(10000, &[given[0].clone(), KeyValue::new("b", 1)]);
        assert_eq!(
            totals(&store),
            vec![
                (vec![given[1].clone(), given[0].clone()], 333),
                (vec![given[1].clone(), KeyValue::new("k", "value1")], 1000),
                (vec![KeyValue::new("b", 1), given[0].clone()], 10000),
            ]
        );
    }

    /// For every size of set, up to beyond those looked up with their words in registers: sets
    /// that differ in one word of their last attribute only are different series, each exact.
    #[test]
    fn sets_of_every_size_that_differ_in_one_word_are_different_series() {
        const KEYS: [&str; 7] = ["a", "b", "c", "d", "e", "f", "g"];
        const VALUE: &str = "value10";
        for size in 1..=KEYS.len() {
            let store = Store::new(100);
            let set = |last: Value| -> Vec<KeyValue> {
                let mut set: Vec<KeyValue> = KEYS[..size - 1]
                    .iter()
                    .map(|&key| KeyValue::new(key, VALUE))
                    .collect();
                set.push(KeyValue::new(KEYS[size - 1], last));
                set
            };
            let sets = [
                set(VALUE.into()),
                set(VALUE[..6].into()),
                set(true.into()),
                set(1.into()),
                set(1.0.into()),
            ];
            for round in 1..=3 {
                for (i, set) in sets.iter().enumerate() {
                    store.add(10u64.pow(i as u32) * round, set);
                }
            }
            let found = totals(&store);
            assert_eq!(found.len(), sets.len(), "{size} attributes: {found:?}");
            for (i, (_, total)) in found.iter().enumerate() {
                assert_eq!(
                    *total,
                    6 * 10u64.pow(i as u32),
                    "{size} attributes: {found:?}"
                );
            }
        }
    }

    /// An instrument first added to with owned strings only (nothing entered by address, sets
    /// not read before the shard is taken), then with literals of another set (entered, read
    /// before), then each set the other way: one series per set, for every size, each exact.
    #[test]
    fn adds_before_and_after_a_set_is_entered_by_address_count_in_one_series() {
        const KEYS: [&str; 6] = ["a", "b", "c", "d", "e", "f"];
        const VALUES: [&str; 2] = ["x", "y"];
        for size in 1..=KEYS.len() {
            let store = Store::new(100);
            let literal = |v: usize| -> Vec<KeyValue> {
                KEYS[..size]
                    .iter()
                    .map(|&key| KeyValue::new(key, VALUES[v]))
                    .collect()
            };
            let owned = |v: usize| -> Vec<KeyValue> {
                KEYS[..size]
                    .iter()
                    .map(|&key| KeyValue::new(key.to_owned(), VALUES[v].to_owned()))
                    .collect()
            };
            store.add(1, &owned(0));
            assert!(
                !store.by_address.load(Ordering::Relaxed),
                "{size} attributes"
            );
            store.add(2, &literal(1));
            assert!(
                store.by_address.load(Ordering::Relaxed),
                "{size} attributes"
            );
            for _ in 0..2 {
                store.add(10, &literal(0));
                store.add(100, &owned(1));
                store.add(1000, &literal(1));
                store.add(10_000, &owned(0));
            }
            assert_eq!(
                totals(&store),
                vec![(literal(0), 20_021), (literal(1), 2_202)],
                "{size} attributes"
            );
        }
    }

    #[test]
    fn sets_beyond_the_limit_go_to_the_overflow_series() {
        let store = Store::new(2);
        for v in 0..5 {
            store.add(1, &[KeyValue::new("v", v)]);
        }
        store.add(10, &[]);
        let found = totals(&store);
        assert_eq!(found.len(), 4, "{found:?}");
        assert_eq!(found[0], (vec![KeyValue::new("v", 0)], 1));
        assert_eq!(found[1], (vec![KeyValue::new("v", 1)], 1));
        assert_eq!(
            found[2],
            (vec![KeyValue::new("otel.metric.overflow", true)], 3)
        );
        assert_eq!(found[3], (vec![], 10));
    }

    #[test]
    fn a_set_admitted_before_the_limit_keeps_its_series_in_any_order_after_it() {
        let store = Store::new(2);
        let (a, b) = (KeyValue::new("a", 1), KeyValue::new("b", 1));
        store.add(1, &[a.clone(), b.clone()]);
        store.add(1, &[KeyValue::new("v", 0)]);
        store.add(1, &[KeyValue::new("v", 1)]);
        // A new order of an admitted set, first met after the overflow series exists; resolved
        // directly, as a CPU that has not met it would.
        let resolved = store.resolve(&[b.clone(), a.clone()]);
        assert_eq!(resolved.id, 0);
        assert!(resolved.key.is_some(), "an admitted set is cached");
        let beyond = store.resolve(&[KeyValue::new("v", 2)]);
        assert!(beyond.key.is_none(), "a set beyond the limit is not cached");
        store.add(1, &[b.clone(), a.clone()]);
        store.add(1, &[KeyValue::new("v", 3)]);
        assert_eq!(
            totals(&store),
            vec![
                (vec![a, b], 2),
                (vec![KeyValue::new("v", 0)], 1),
                (vec![KeyValue::new("otel.metric.overflow", true)], 2),
            ]
        );
    }

    /// As the SDK's bound instruments: a handle bound at the limit counts in the overflow
    /// series for its life; one bound to an admitted set counts in that set's series.
    #[test]
    fn bound_handles_at_the_limit_count_in_the_overflow_series() {
        let store = Store::new(1);
        let admitted = store.bound(&[KeyValue::new("v", 0)]);
        let overflowed = store.bound(&[KeyValue::new("v", 1)]);
        admitted.add(2);
        overflowed.add(5);
        store.add(1, &[KeyValue::new("v", 0)]);
        assert_eq!(
            totals(&store),
            vec![
                (vec![KeyValue::new("v", 0)], 3),
                (vec![KeyValue::new("otel.metric.overflow", true)], 5),
            ]
        );
    }
}
