//! Hashing of values that publishers and routers choose (block hashes, local hashes, prefix
//! hashes, worker ids), keyed with a per-process random seed. An unseeded hash lets a sender
//! pick keys that all land in one slot and turn every insert into a scan of the others; with the
//! seed unknown, chosen keys spread like random ones (docs/BENCHMARKS.md, "Hash flooding").
//!
//! The mix is a folded multiply (`(x ^ seed) * K`, high and low halves XORed), the construction
//! foldhash and ahash use: one multiply, and the fold makes a collision depend on the seed
//! rather than only on the keys' difference (which a seeded Fx hash does not).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// The process's seed: random, drawn once (from the standard library's per-process keys).
pub fn process_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0x006b_7669_6e64_6578_u64) | 1)
}

/// Mixes `x` under `seed`.
#[inline]
pub fn mix(x: u64, seed: u64) -> u64 {
    let p = (x ^ seed) as u128 * K as u128;
    (p as u64) ^ ((p >> 64) as u64)
}

/// A `BuildHasher` keyed with the process seed, for maps keyed by senders' values.
#[derive(Clone, Copy, Debug)]
pub struct SeededState(u64);

impl Default for SeededState {
    fn default() -> Self {
        SeededState(process_seed())
    }
}

impl BuildHasher for SeededState {
    type Hasher = SeededHasher;

    fn build_hasher(&self) -> SeededHasher {
        SeededHasher { seed: self.0, hash: 0 }
    }
}

/// The hasher of [`SeededState`]: each integer written is folded in under the seed.
#[derive(Clone, Copy, Debug)]
pub struct SeededHasher {
    /// The process seed, re-applied at every word so that no word escapes it.
    seed: u64,
    /// The state so far.
    hash: u64,
}

impl Hasher for SeededHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.hash = mix(self.hash ^ x, self.seed);
    }

    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64);
    }

    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// A `HashMap` keyed with the process seed.
pub type SeededMap<K, V> = HashMap<K, V, SeededState>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_built_to_collide_without_a_seed_spread_with_one() {
        // Keys whose unseeded Fibonacci mix is 0..n: all in the first slot of any table.
        let inverse = (0..6).fold(K, |y, _| y.wrapping_mul(2u64.wrapping_sub(K.wrapping_mul(y))));
        assert_eq!(K.wrapping_mul(inverse), 1);
        let keys: Vec<u64> = (1..=4096u64).map(|j| j.wrapping_mul(inverse)).collect();
        let buckets = 1024u128;
        let unseeded: std::collections::HashSet<u64> =
            keys.iter().map(|k| ((k.wrapping_mul(K) as u128 * buckets) >> 64) as u64).collect();
        assert_eq!(unseeded.len(), 1, "the attack works on the unseeded mix");
        let seeded: std::collections::HashSet<u64> =
            keys.iter().map(|&k| ((mix(k, process_seed()) as u128 * buckets) >> 64) as u64).collect();
        // 4096 random keys in 1024 buckets leave ~2% empty; a stuck mix would fill few.
        assert!(seeded.len() > 900, "only {} of 1024 buckets used", seeded.len());
    }

    #[test]
    fn the_seed_is_the_same_within_a_process() {
        assert_eq!(process_seed(), process_seed());
        let s = SeededState::default();
        assert_eq!(s.hash_one((7u64, 3u32)), s.hash_one((7u64, 3u32)));
        assert_ne!(s.hash_one((7u64, 3u32)), s.hash_one((7u64, 4u32)));
    }
}
