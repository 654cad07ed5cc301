//! A map from attribute sets (in a given order) to series ids, for the hot path of unbound adds.
//!
//! Keyed by the set's hash, computed once per lookup, with the sets of that hash beside it; sets
//! are compared with a fast path for strings that are the same bytes in memory (attribute keys
//! and values are mostly `&'static str`s, whose pointers match), which skips the byte comparison
//! the `KeyValue` equality always makes.

use crate::hash::Seeded;
use opentelemetry::{KeyValue, Value};
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::sync::Arc;

/// An attribute set as the maps hold it: shared between the registry and every shard.
pub(crate) type Attributes = Arc<[KeyValue]>;

/// The sets of one hash: almost always one.
#[derive(Debug)]
enum Entries {
    One(Attributes, u32),
    Many(Vec<(Attributes, u32)>),
}

/// Attribute sets to ids.
#[derive(Debug, Default)]
pub(crate) struct SetMap {
    by_hash: HashMap<u64, Entries, BuildHasherDefault<Identity>>,
    seed: Seeded,
}

impl SetMap {
    /// The id of `attributes` (in this order), and the key it is held under.
    #[inline]
    pub(crate) fn get(&self, attributes: &[KeyValue]) -> Option<(&Attributes, u32)> {
        let hash = self.hash(attributes);
        match self.by_hash.get(&hash)? {
            Entries::One(key, id) => same_set(key, attributes).then_some((key, *id)),
            Entries::Many(entries) => entries
                .iter()
                .find(|(key, _)| same_set(key, attributes))
                .map(|(key, id)| (key, *id)),
        }
    }

    /// The hash of a set, consistent with [`same_set`]: the bytes of each key and string value
    /// (the string hasher folds their lengths in), other values as their bits. Shorter than
    /// `KeyValue`'s own `Hash`, which adds the slice's length and a terminator per string.
    #[inline]
    fn hash(&self, attributes: &[KeyValue]) -> u64 {
        let mut hasher = self.seed.build_hasher();
        for kv in attributes {
            hasher.write(kv.key.as_str().as_bytes());
            match &kv.value {
                Value::String(s) => hasher.write(s.as_str().as_bytes()),
                Value::I64(n) => hasher.write_u64(*n as u64),
                Value::F64(f) => hasher.write_u64(f.to_bits()),
                Value::Bool(b) => hasher.write_u8(u8::from(*b) | 2),
                // Arrays (rare in attributes) by `KeyValue`'s own hash, which their equality
                // matches.
                _ => kv.hash(&mut hasher),
            }
        }
        hasher.finish()
    }

    /// Maps `key` to `id`; the caller has checked that `key` is absent.
    pub(crate) fn insert(&mut self, key: Attributes, id: u32) {
        let hash = self.hash(&key);
        match self.by_hash.remove(&hash) {
            None => {
                self.by_hash.insert(hash, Entries::One(key, id));
            }
            Some(Entries::One(other, other_id)) => {
                self.by_hash
                    .insert(hash, Entries::Many(vec![(other, other_id), (key, id)]));
            }
            Some(Entries::Many(mut entries)) => {
                entries.push((key, id));
                self.by_hash.insert(hash, Entries::Many(entries));
            }
        }
    }
}

/// Whether two sets are the same, in the same order: `KeyValue`'s equality, except that floats
/// compare by their bits (as they hash), so that a NaN attribute names one series rather than a
/// new one at every add.
#[inline]
fn same_set(a: &[KeyValue], b: &[KeyValue]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(a, b)| {
            same_str(a.key.as_str(), b.key.as_str()) && same_value(&a.value, &b.value)
        })
}

#[inline]
fn same_str(a: &str, b: &str) -> bool {
    (a.as_ptr() == b.as_ptr() && a.len() == b.len()) || a == b
}

#[inline]
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::String(a), Value::String(b)) => same_str(a.as_str(), b.as_str()),
        (Value::F64(a), Value::F64(b)) => a.to_bits() == b.to_bits(),
        _ => a == b,
    }
}

/// The hasher of keys that are already hashes.
#[derive(Debug, Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed here; bytes are folded in for completeness.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_equal_sets_whether_or_not_their_strings_share_memory() {
        let mut map = SetMap::default();
        map.insert(Arc::from([KeyValue::new("route", "/a")]), 7);
        let owned = [KeyValue::new(String::from("route"), String::from("/a"))];
        assert_eq!(map.get(&owned).map(|(_, id)| id), Some(7));
        assert_eq!(map.get(&[KeyValue::new("route", "/b")]), None);
        assert_eq!(
            map.get(&[KeyValue::new("route", "/a"), KeyValue::new("x", 1)]),
            None
        );
        map.insert(Arc::from([KeyValue::new("ratio", f64::NAN)]), 8);
        assert_eq!(
            map.get(&[KeyValue::new("ratio", f64::NAN)])
                .map(|(_, id)| id),
            Some(8)
        );
    }

    /// The 1,000 sets of OpenTelemetry's stress workload spread over nearly as many hashes'
    /// low bits (the bits that pick a bucket) as a random function would give.
    #[test]
    fn the_stress_workload_sets_spread_over_buckets() {
        let values: Vec<String> = (1..=10).map(|v| format!("value{v}")).collect();
        let map = SetMap::default();
        let mut buckets = std::collections::HashSet::new();
        for i in 0..1000 {
            let set = [
                KeyValue::new("attribute1", values[i % 10].clone()),
                KeyValue::new("attribute2", values[i / 10 % 10].clone()),
                KeyValue::new("attribute3", values[i / 100 % 10].clone()),
            ];
            buckets.insert(map.hash(&set) & 1023);
        }
        // 1,000 balls in 1,024 bins: about 632 bins used on average.
        assert!(buckets.len() > 550, "{} buckets used", buckets.len());
    }
}
