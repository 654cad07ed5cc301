//! The hasher of the attribute-set maps: a folded-multiply hash with a random seed per map.
//!
//! The maps sit on the hot path of every unbound add, where std's SipHash costs more than the
//! rest of the add. Their size is bounded by the cardinality limit (sets beyond it are never
//! inserted), and the seed differs from map to map and run to run, so inputs chosen to collide
//! cannot grow a map or be precomputed.

use std::hash::{BuildHasher, Hasher, RandomState};

/// Builds [`FoldHasher`]s from one random seed.
#[derive(Clone, Debug)]
pub(crate) struct Seeded(u64);

impl Default for Seeded {
    fn default() -> Self {
        Seeded(RandomState::new().hash_one(0x5eed_u64) | 1)
    }
}

impl BuildHasher for Seeded {
    type Hasher = FoldHasher;

    #[inline]
    fn build_hasher(&self) -> FoldHasher {
        FoldHasher(self.0)
    }
}

/// Folds each string into the state with one 64x64->128-bit multiplication whose halves are
/// combined (the folded multiply of foldhash and wyhash): attribute keys and values are short,
/// and one multiplication per string keeps the dependency chain of a set's hash short. Small
/// integers (a string's terminator, a bool) are rotated in without a multiplication; the
/// finalizer mixes them.
#[derive(Debug)]
pub(crate) struct FoldHasher(u64);

/// Odd constants from the fractional digits of pi, as foldhash takes them.
const K1: u64 = 0x243f_6a88_85a3_08d3;
const K2: u64 = 0x1319_8a2e_0370_7344;

#[inline(always)]
pub(crate) fn folded_multiply(x: u64, y: u64) -> u64 {
    let full = u128::from(x) * u128::from(y);
    (full as u64) ^ ((full >> 64) as u64)
}

#[inline(always)]
fn word(bytes: &[u8]) -> u64 {
    let mut word = [0; 8];
    word.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(word)
}

#[inline(always)]
fn half(bytes: &[u8]) -> u64 {
    let mut half = [0; 4];
    half.copy_from_slice(&bytes[..4]);
    u64::from(u32::from_le_bytes(half))
}

impl Hasher for FoldHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let len = bytes.len();
        let mut state = self.0;
        let (a, b) = if len > 16 {
            // Long strings: 16 bytes a step, then the last 16 (overlapping).
            let mut rest = bytes;
            while rest.len() > 16 {
                state = folded_multiply(word(rest) ^ state, word(&rest[8..]) ^ K2);
                rest = &rest[16..];
            }
            (word(&bytes[len - 16..]), word(&bytes[len - 8..]))
        } else if len >= 8 {
            (word(bytes), word(&bytes[len - 8..]))
        } else if len >= 4 {
            (half(bytes), half(&bytes[len - 4..]))
        } else if len > 0 {
            (
                u64::from(bytes[0]) | u64::from(bytes[len / 2]) << 8,
                u64::from(bytes[len - 1]),
            )
        } else {
            (0, 0)
        };
        // The length keeps strings whose reads overlap differently apart.
        self.0 = folded_multiply(a ^ state, b ^ K2 ^ (len as u64).rotate_left(32));
    }

    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.0 = self.0.rotate_left(8) ^ u64::from(n);
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = folded_multiply(self.0 ^ n, K1);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // The finalizer of MurmurHash3: every output bit depends on every input bit, so the
        // low bits that pick the bucket see the rotated-in bytes too.
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn different_strings_hash_differently_and_equal_ones_alike() {
        let seeded = Seeded::default();
        assert_eq!(seeded.hash_one("route"), seeded.hash_one("route"));
        // Reads of 4 to 7 bytes overlap: only the length tells these apart.
        assert_ne!(seeded.hash_one("abab"), seeded.hash_one("ababab"));
        assert_ne!(seeded.hash_one("value1"), seeded.hash_one("value2"));
        assert_ne!(seeded.hash_one("attribute1"), seeded.hash_one("attribute2"));
        let long = "a string longer than sixteen bytes";
        assert_ne!(
            seeded.hash_one(long),
            seeded.hash_one("a string longer than sixteen byteS")
        );
        assert_ne!(seeded.hash_one(1u64), seeded.hash_one(2u64));
    }
}
