//! The hasher of the attribute-set maps: a multiply-rotate hash with a random seed per map.
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

/// Folds each word in with a rotate, an exclusive or and a multiplication by an odd constant
/// (the one rustc's FxHasher uses), then mixes the high bits down at the end for hashbrown,
/// which takes its control bits from the top and its bucket from the bottom.
#[derive(Debug)]
pub(crate) struct FoldHasher(u64);

const MULTIPLIER: u64 = 0x517c_c1b7_2722_0a95;

impl FoldHasher {
    #[inline(always)]
    fn fold(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(MULTIPLIER);
    }
}

impl Hasher for FoldHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            self.fold(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0; 8];
            word[..rest.len()].copy_from_slice(rest);
            // The length keeps "a" and "a\0" apart.
            self.fold(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.fold(u64::from(n));
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.fold(u64::from(n));
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.fold(n);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.fold(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        let h = self.0;
        h ^ (h >> 29) ^ (h >> 47)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn different_strings_hash_differently_and_equal_ones_alike() {
        let seeded = Seeded::default();
        assert_eq!(seeded.hash_one("route"), seeded.hash_one("route"));
        assert_ne!(seeded.hash_one("a"), seeded.hash_one("a\0"));
        assert_ne!(seeded.hash_one("value1"), seeded.hash_one("value2"));
    }
}
