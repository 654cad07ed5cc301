//! A map from attribute sets to series ids that recognises a set by where its strings are, not
//! by their bytes: the first probe of an unbound add, in front of the [`SetMap`] of its shard.
//!
//! Programs mostly name attributes with `&'static str`s (`KeyValue::new("route", "/")`), which
//! keep their address from one add to the next. A set is then known by the address and length
//! of each string, and by the bits of each other value: three words per attribute, read from
//! the `KeyValue`s without touching the strings' bytes, hashed with one multiplication per
//! attribute, and compared where they are stored, inline in one array, beside the set's count on
//! this CPU. The [`SetMap`] lookup it saves hashes every byte and follows a pointer to each
//! stored key; the count beside the words saves a load from another array.
//!
//! # Why equal addresses mean equal sets
//! Only keys the instrument's registry holds (it drops none while the instrument lives, and
//! the map lives no longer) are entered, and only when their words are the caller's: the
//! strings behind an entry stay alive and unchanged for the life of the map. A string a caller
//! passes is alive and unchanged while it adds, so if it has the address and length of a
//! stored one, it is the same memory read at the same time: the same bytes. Strings that are
//! owned (`String`, `Box<str>`) are copied when the set is stored, so their addresses never
//! match; such sets are left to the [`SetMap`] and never entered here. No address is ever read
//! through: the words are plain integers, and the map has no `unsafe`.
//!
//! [`SetMap`]: crate::set_map::SetMap

use crate::hash::folded_multiply;
use opentelemetry::{KeyValue, Value};
use std::hash::{BuildHasher, RandomState};

/// The words of one attribute: the key's address, the key's length with the value's kind (or a
/// string value's length) above it, and the value's address or bits.
type Words = [u64; 3];

/// Kinds of non-string values, in the upper half of the second word, where a string value has
/// its length: string values of these lengths or longer are not entered.
const I64: u64 = u32::MAX as u64;
const F64: u64 = I64 - 1;
const BOOL: u64 = I64 - 2;

/// The words of `kv`, or `None` for an attribute that cannot be entered (an array value, or a
/// string too long to share a word with its kind).
#[inline(always)]
fn words(kv: &KeyValue) -> Option<Words> {
    let key = kv.key.as_str();
    // Strings first and inline: most attributes are strings, and the other kinds' arms would
    // make the common case a jump through a table.
    let (kind, value) = if let Value::String(s) = &kv.value {
        let s = s.as_str();
        let len = s.len() as u64;
        if len >= BOOL {
            return None;
        }
        (len, s.as_ptr() as usize as u64)
    } else {
        other_words(&kv.value)?
    };
    let key_len = u32::try_from(key.len()).ok()?;
    Some([
        key.as_ptr() as usize as u64,
        u64::from(key_len) | kind << 32,
        value,
    ])
}

/// The kind and bits of a value other than a string.
#[inline(never)]
fn other_words(value: &Value) -> Option<(u64, u64)> {
    match value {
        Value::I64(n) => Some((I64, *n as u64)),
        // By their bits, as the `SetMap` compares them.
        Value::F64(f) => Some((F64, f.to_bits())),
        Value::Bool(b) => Some((BOOL, u64::from(*b))),
        _ => None,
    }
}

/// Multipliers by position, so that one set in two orders hashes apart.
const POSITION: [u64; 4] = [
    0xa409_3822_299f_31d0,
    0x082e_fa98_ec4e_6c89,
    0x4528_21e6_38d0_1377,
    0xbe54_66cf_34e9_0c6c,
];

/// The most attributes of a set entered here; larger sets are left to the `SetMap`.
const MAX_ATTRIBUTES: usize = 8;

/// The words of an entry before its attributes': the header (id and size), and the count.
const HEADER: usize = 2;

/// The words of a set as given and their hash: read from the `KeyValue`s once per add, then
/// compared with the entries. Filled by [`AddressMap::probe`]; each shard keeps one, so that
/// an add neither initialises nor moves it.
#[derive(Debug)]
pub(crate) struct Probe {
    words: [u64; 3 * MAX_ATTRIBUTES],
    attributes: usize,
    hash: u64,
}

impl Default for Probe {
    fn default() -> Probe {
        Probe {
            words: [0; 3 * MAX_ATTRIBUTES],
            attributes: 0,
            hash: 0,
        }
    }
}

impl Probe {
    #[inline(always)]
    fn words(&self) -> &[u64] {
        &self.words[..3 * self.attributes]
    }
}

/// The words of a set of `N` attributes and their hash, read before the shard that looks them
/// up is taken: the caller has just built its `KeyValue`s, and with no call between its stores
/// and these loads the compiler can take most words from what it stored (a literal key's
/// address and length, the kinds of the values) and drop their checks.
pub(crate) struct Read<const N: usize> {
    words: [Words; N],
    hash: u64,
}

impl<const N: usize> Read<N> {
    /// The set's words and hash under `seed` (the seed of the maps that will look it up), or
    /// `None` for a set that cannot be entered.
    #[inline(always)]
    pub(crate) fn of(set: &[KeyValue; N], seed: u64) -> Option<Read<N>> {
        let mut words = [[0; 3]; N];
        let mut hash = seed ^ N as u64;
        for (i, kv) in set.iter().enumerate() {
            let attribute = self::words(kv)?;
            words[i] = attribute;
            hash = hash.wrapping_add(AddressMap::mix(attribute, i, seed));
        }
        Some(Read { words, hash })
    }
}

/// What [`AddressMap::find`] found.
pub(crate) enum Found {
    /// The set's entry, whose count took the value.
    Counted,
    /// No entry; the probe holds the set's words.
    Missing,
    /// A set that cannot be entered.
    Never,
    /// Nothing was entered: the probe was not filled.
    Empty,
}

/// Attribute sets (by the addresses of their strings) to series ids.
#[derive(Debug)]
pub(crate) struct AddressMap {
    /// Open addressing with linear probing, at most a quarter full: 0 for a free slot, else the
    /// upper half of the entry's hash above its offset in `entries` plus one.
    slots: Vec<u64>,
    /// Each entry: its id with its number of attributes above it, its count (a wrapping sum of
    /// the values added through it), then its words.
    entries: Vec<u64>,
    len: usize,
    seed: u64,
    /// Every set hashes alike: the tests' way to make sets meet in one slot.
    #[cfg(test)]
    colliding: bool,
}

/// A random seed for the address maps of one instrument, as the
/// [`SetMap`](crate::set_map::SetMap)s have one each: the sets' words are read and hashed
/// once per add, before the shard is known, so every shard of an instrument shares its seed.
pub(crate) fn random_seed() -> u64 {
    RandomState::new().hash_one(0xadd5_u64) | 1
}

impl AddressMap {
    /// An empty map whose hashes are seeded with `seed` (odd).
    pub(crate) fn new(seed: u64) -> AddressMap {
        AddressMap {
            slots: Vec::new(),
            entries: Vec::new(),
            len: 0,
            seed,
            #[cfg(test)]
            colliding: false,
        }
    }

    #[inline(always)]
    fn finish(&self, hash: u64) -> u64 {
        // The last slot of any table of up to 2^16 slots, so that probes wrap around.
        #[cfg(test)]
        if self.colliding {
            return 0x5eed_0000_ffff;
        }
        hash
    }

    /// The share of the attribute of `words` at `position` in its set's hash: one
    /// multiplication, independent of the other attributes' (their latencies overlap).
    #[inline(always)]
    fn mix([key, lengths, value]: Words, position: usize, seed: u64) -> u64 {
        folded_multiply(
            key ^ lengths.rotate_left(32) ^ seed,
            value ^ POSITION[position % POSITION.len()],
        )
    }

    /// Whether nothing was entered.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether the first attributes of `key` and `attributes` have the same words (and both
    /// have some): false says that `key` cannot be entered for `attributes`.
    #[inline]
    pub(crate) fn same_first_words(key: &[KeyValue], attributes: &[KeyValue]) -> bool {
        match (key.first(), attributes.first()) {
            (Some(a), Some(b)) => words(a).is_some_and(|[key, lengths, value]| {
                words(b).is_some_and(|given| {
                    key == given[0] && lengths == given[1] && value == given[2]
                })
            }),
            (None, None) => true,
            _ => false,
        }
    }

    /// Fills `probe` with the words of `attributes` and their hash: false for a set that
    /// cannot be entered.
    #[inline(always)]
    pub(crate) fn probe(&self, attributes: &[KeyValue], probe: &mut Probe) -> bool {
        if attributes.len() > MAX_ATTRIBUTES {
            return false;
        }
        probe.attributes = attributes.len();
        let mut hash = self.seed ^ attributes.len() as u64;
        for (i, (kv, slot)) in attributes
            .iter()
            .zip(probe.words.chunks_exact_mut(3))
            .enumerate()
        {
            let Some([key, lengths, value]) = words(kv) else {
                return false;
            };
            slot[0] = key;
            slot[1] = lengths;
            slot[2] = value;
            hash = hash.wrapping_add(Self::mix([key, lengths, value], i, self.seed));
        }
        probe.hash = self.finish(hash);
        true
    }

    /// The offset of the entry of `probe`'s words.
    #[inline]
    pub(crate) fn get(&self, probe: &Probe) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let tag = probe.hash >> 32;
        let at = probe.hash as usize & mask;
        if let Some(offset) = self.near(at, tag)
            && self.matches(offset, probe)
        {
            return Some(offset);
        }
        self.get_beyond(probe, at)
    }

    /// Adds `value` to the count of the entry at `offset` (from [`get`](AddressMap::get)).
    #[inline]
    pub(crate) fn count(&mut self, offset: usize, value: u64) {
        if let Some(count) = self.entries.get_mut(offset + 1) {
            *count = count.wrapping_add(value);
        }
    }

    /// The id of the entry at `offset`.
    #[cfg(test)]
    fn id(&self, offset: usize) -> u32 {
        self.entries[offset] as u32
    }

    /// Calls `f` with each entry's id and count.
    pub(crate) fn for_each_count(&self, mut f: impl FnMut(u32, u64)) {
        let mut offset = 0;
        while let Some(&header) = self.entries.get(offset) {
            f(header as u32, self.entries[offset + 1]);
            offset += HEADER + 3 * (header >> 32) as usize;
        }
    }

    /// The entry of tag `tag` in slot `at` or the next, if either has one.
    ///
    /// At most a quarter full, a set is in its first slot or the next nearly always. Choosing
    /// between the two without a branch spares the misprediction a probe loop pays whenever its
    /// first slot belongs to another set. Any entry whose words match is the set's, wherever it
    /// was found.
    #[inline(always)]
    fn near(&self, at: usize, tag: u64) -> Option<usize> {
        let mask = self.slots.len() - 1;
        let (first, second) = (self.slots[at], self.slots[(at + 1) & mask]);
        let slot = std::hint::select_unpredictable(first >> 32 == tag, first, second);
        (slot >> 32 == tag && slot != 0).then(|| (slot as u32 - 1) as usize)
    }

    /// [`get`](AddressMap::get) and [`count`](AddressMap::count) for a set of `N` attributes
    /// read by [`Read::of`] with this map's seed, filling `probe` only if it finds no entry:
    /// the words stay in registers, and the loops are unrolled.
    #[inline(always)]
    pub(crate) fn find<const N: usize>(
        &mut self,
        read: &Read<N>,
        probe: &mut Probe,
        value: u64,
    ) -> Found {
        if self.slots.is_empty() {
            return Found::Empty;
        }
        let words = &read.words;
        let hash = self.finish(read.hash);
        let tag = hash >> 32;
        let at = hash as usize & (self.slots.len() - 1);
        if let Some(offset) = self.near(at, tag)
            && let Some(entry) = self.entries.get_mut(offset..offset + HEADER + 3 * N)
            && entry[0] >> 32 == N as u64
        {
            // Indexed, so that the loop over a constant count unrolls and keeps no iterator.
            let mut differ = 0;
            for (i, given) in words.iter().enumerate() {
                let stored = &entry[HEADER + 3 * i..HEADER + 3 + 3 * i];
                differ |= (given[0] ^ stored[0]) | (given[1] ^ stored[1]) | (given[2] ^ stored[2]);
            }
            if differ == 0 {
                entry[1] = entry[1].wrapping_add(value);
                return Found::Counted;
            }
        }
        probe.attributes = N;
        probe.hash = hash;
        for (i, given) in words.iter().enumerate() {
            probe.words[3 * i..3 * i + 3].copy_from_slice(given);
        }
        match self.get_beyond(probe, at) {
            Some(offset) => {
                self.count(offset, value);
                Found::Counted
            }
            None => Found::Missing,
        }
    }

    /// [`get`](AddressMap::get) from slot `at` on: a set not found in its first two slots.
    #[inline(never)]
    fn get_beyond(&self, probe: &Probe, mut at: usize) -> Option<usize> {
        let mask = self.slots.len() - 1;
        let tag = probe.hash >> 32;
        loop {
            let slot = self.slots[at];
            if slot == 0 {
                return None;
            }
            let offset = (slot as u32 - 1) as usize;
            if slot >> 32 == tag && self.matches(offset, probe) {
                return Some(offset);
            }
            at = (at + 1) & mask;
        }
    }

    /// Whether the entry at `offset` has `probe`'s words.
    #[inline(always)]
    fn matches(&self, offset: usize, probe: &Probe) -> bool {
        let header = self.entries[offset];
        if (header >> 32) as usize != probe.attributes {
            return false;
        }
        let words = probe.words();
        let Some(stored) = self
            .entries
            .get(offset + HEADER..offset + HEADER + words.len())
        else {
            return false;
        };
        // Word by word, not as slices: `memcmp` is a call, and a vector load of the words just
        // stored cannot be served by store forwarding. No early exit: the words of a matching
        // tag almost always match.
        let differ = stored
            .iter()
            .zip(words)
            .fold(0, |differ, (stored, word)| differ | (stored ^ word));
        differ == 0
    }

    /// Enters `key` as `id` with a count of `value` if its words are `probe`'s, and says
    /// whether it did; the caller keeps `key` alive and unchanged for the life of this map, and
    /// has checked that `probe` finds no entry.
    pub(crate) fn insert(&mut self, key: &[KeyValue], probe: &Probe, id: u32, value: u64) -> bool {
        let given = probe.words();
        if key.len() != probe.attributes
            || !key
                .iter()
                .zip(given.chunks_exact(3))
                // Word by word, for store forwarding (see `matches`): a caller with owned
                // strings comes here at every add.
                .all(|(kv, given)| {
                    words(kv).is_some_and(|[key, lengths, value]| {
                        key == given[0] && lengths == given[1] && value == given[2]
                    })
                })
        {
            return false;
        }
        let offset = self.entries.len();
        // Offsets (plus one) fit in the lower half of a slot; a map that large stops growing.
        if offset + HEADER + given.len() >= u32::MAX as usize {
            return false;
        }
        if (self.len + 1) * 4 > self.slots.len() {
            self.grow();
        }
        self.entries.push(u64::from(id) | (key.len() as u64) << 32);
        self.entries.push(value);
        self.entries.extend_from_slice(given);
        self.place(probe.hash, offset);
        self.len += 1;
        true
    }

    /// The hash of a set's words, as [`probe`](AddressMap::probe) and
    /// [`find`](AddressMap::find) compute it: entries keep no hash, for the rare growth.
    fn hash_of(&self, words: &[u64]) -> u64 {
        let mut hash = self.seed ^ (words.len() / 3) as u64;
        for (i, attribute) in words.chunks_exact(3).enumerate() {
            hash = hash.wrapping_add(Self::mix(
                [attribute[0], attribute[1], attribute[2]],
                i,
                self.seed,
            ));
        }
        self.finish(hash)
    }

    fn place(&mut self, hash: u64, offset: usize) {
        let mask = self.slots.len() - 1;
        let mut at = hash as usize & mask;
        while self.slots[at] != 0 {
            at = (at + 1) & mask;
        }
        self.slots[at] = (hash >> 32) << 32 | (offset as u64 + 1);
    }

    fn grow(&mut self) {
        let capacity = (self.slots.len() * 2).max(16);
        self.slots = vec![0; capacity];
        let mut offset = 0;
        while offset < self.entries.len() {
            let attributes = (self.entries[offset] >> 32) as usize;
            let words = &self.entries[offset + HEADER..offset + HEADER + 3 * attributes];
            self.place(self.hash_of(words), offset);
            offset += HEADER + 3 * attributes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(map: &AddressMap, set: &[KeyValue]) -> Probe {
        let mut probe = Probe::default();
        assert!(map.probe(set, &mut probe), "every attribute has its words");
        probe
    }

    fn entered(map: &mut AddressMap, set: &[KeyValue], id: u32) {
        let probe = probe(map, set);
        map.insert(set, &probe, id, 0);
    }

    fn find(map: &AddressMap, set: &[KeyValue]) -> Option<u32> {
        map.get(&probe(map, set)).map(|offset| map.id(offset))
    }

    fn counts(map: &AddressMap) -> Vec<(u32, u64)> {
        let mut counts = Vec::new();
        map.for_each_count(|id, count| counts.push((id, count)));
        counts
    }

    #[test]
    fn finds_the_sets_entered_and_no_other() {
        let mut map = AddressMap::new(7);
        let sets: Vec<Vec<KeyValue>> = (0..100)
            .map(|i| vec![KeyValue::new("n", i), KeyValue::new("route", "/")])
            .collect();
        for (id, set) in sets.iter().enumerate() {
            entered(&mut map, set, id as u32);
        }
        for (id, set) in sets.iter().enumerate() {
            assert_eq!(find(&map, set), Some(id as u32));
        }
        assert_eq!(find(&map, &[KeyValue::new("n", 100)]), None);
        // Another order is another entry.
        assert_eq!(
            find(&map, &[KeyValue::new("route", "/"), KeyValue::new("n", 0)]),
            None
        );
    }

    /// An entry is found by its words, not by its hash: a set of another string, kind or
    /// length looked up under the same hash is not it.
    #[test]
    fn a_lookup_under_an_entry_hash_compares_every_word() {
        const VALUE10: &str = "value10";
        let mut map = AddressMap::new(7);
        let set = [KeyValue::new("k", VALUE10), KeyValue::new("b", true)];
        entered(&mut map, &set, 3);
        let hash = probe(&map, &set).hash;
        assert_eq!(find(&map, &set), Some(3));
        for other in [
            // The same address, a shorter string.
            [KeyValue::new("k", &VALUE10[..6]), KeyValue::new("b", true)],
            // The same bits, another kind.
            [KeyValue::new("k", VALUE10), KeyValue::new("b", 1)],
            [KeyValue::new("k", VALUE10), KeyValue::new("b", false)],
            [KeyValue::new("kk", VALUE10), KeyValue::new("b", true)],
        ] {
            let mut other = probe(&map, &other);
            other.hash = hash;
            assert_eq!(map.get(&other), None);
        }
    }

    /// Sets entered under one hash fill consecutive slots, past the first two and around the
    /// end of the table, growing it; each is found there.
    #[test]
    fn sets_of_one_hash_are_found_however_far_they_lie() {
        let mut map = AddressMap::new(7);
        map.colliding = true;
        let sets: Vec<[KeyValue; 1]> = (0..6).map(|i| [KeyValue::new("n", i)]).collect();
        for (id, set) in sets.iter().enumerate() {
            entered(&mut map, set, id as u32);
        }
        for (id, set) in sets.iter().enumerate() {
            assert_eq!(find(&map, set), Some(id as u32), "{set:?}");
        }
        assert_eq!(find(&map, &[KeyValue::new("n", 6)]), None);
    }

    /// Sets of one to four attributes (looked up with their words in registers) and of more,
    /// all of one hash, that differ in one word of one attribute: each finds its own entry, and
    /// counts there.
    #[test]
    fn sets_of_one_hash_are_told_apart_by_every_word() {
        fn check<const N: usize>() {
            const VALUE: &str = "value10";
            let mut map = AddressMap::new(7);
            map.colliding = true;
            let mut sets = Vec::new();
            for at in 0..N {
                for other in [
                    KeyValue::new("k", &VALUE[..6]),
                    KeyValue::new("kk", VALUE),
                    KeyValue::new("k", 1),
                    KeyValue::new("k", true),
                ] {
                    let mut set: [KeyValue; N] = std::array::from_fn(|_| KeyValue::new("k", VALUE));
                    set[at] = other;
                    sets.push(set);
                }
            }
            sets.push(std::array::from_fn(|_| KeyValue::new("k", VALUE)));
            let mut probe = Probe::default();
            for (id, set) in sets.iter().enumerate() {
                match map.find(&Read::of(set, 7).expect("enterable"), &mut probe, 1) {
                    Found::Missing => {}
                    Found::Empty => assert!(map.probe(set, &mut probe)),
                    _ => panic!("{set:?} found before it was entered"),
                }
                assert!(map.insert(set, &probe, id as u32, 1));
            }
            for (id, set) in sets.iter().enumerate() {
                match map.find(
                    &Read::of(set, 7).expect("enterable"),
                    &mut probe,
                    100 * id as u64,
                ) {
                    Found::Counted => {}
                    _ => panic!("{set:?} not found"),
                }
                assert_eq!(find(&map, set), Some(id as u32), "{set:?}");
                let offset = map.get(&self::probe(&map, set)).expect("entered");
                map.count(offset, 10_000);
            }
            let expected: Vec<(u32, u64)> = (0..sets.len())
                .map(|id| (id as u32, 1 + 100 * id as u64 + 10_000))
                .collect();
            assert_eq!(counts(&map), expected, "{N} attributes");
        }
        check::<1>();
        check::<2>();
        check::<3>();
        check::<4>();
        check::<6>();
    }

    /// The check that spares a caller with owned strings reading its whole set at every add.
    #[test]
    fn the_first_attribute_tells_owned_copies_from_the_same_strings() {
        let set = [KeyValue::new("route", "/a"), KeyValue::new("n", 1)];
        let owned = [KeyValue::new("route", String::from("/a")), set[1].clone()];
        assert!(AddressMap::same_first_words(&set, &set.clone()));
        assert!(AddressMap::same_first_words(&[], &[]));
        assert!(!AddressMap::same_first_words(&set, &owned));
        assert!(!AddressMap::same_first_words(&set[1..], &set));
        assert!(!AddressMap::same_first_words(&set, &[]));
    }

    #[test]
    fn owned_strings_are_not_entered() {
        let mut map = AddressMap::new(7);
        let set = [KeyValue::new("route", String::from("/a"))];
        let key = set.clone();
        assert!(!map.insert(&key, &probe(&map, &set), 0, 1));
        assert_eq!(find(&map, &key), None);
        assert_eq!(find(&map, &set), None);
    }
}
