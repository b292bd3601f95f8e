//! Block identity: local hashes of token blocks, the engine's opaque block hashes,
//! kvindex's rolling prefix hashes, and worker identities.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Seed of every XXH3-64 hash kvindex computes (the scheme NVIDIA Dynamo uses).
pub const HASH_SEED: u64 = 1337;

/// Hash of the tokens of one full block, independent of its position.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LocalHash(pub u64);

/// The engine's own hash of a block: opaque, used only as the key of `removed` events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// kvindex's rolling hash of a whole prefix: `p[0] = local[0]`, `p[i] = H(p[i-1], local[i])`.
///
/// `H(p, l) = p * B + l (mod 2^64)` with a fixed odd `B`: the classic polynomial rolling hash.
/// Local hashes are uniform 64-bit values, so distinct prefixes collide with probability about
/// 2^-64, like any 64-bit hash. A lookup computes one per position on its critical path: this
/// costs one multiply-add (about 1.6 ns here) where XXH3 over the same 16 bytes costs 6 ns.
/// It leaves the process only in kvindex's own snapshots (whose format version fixes it), so
/// it is kvindex's to choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefixHash(pub u64);

/// The multiplier of the prefix hash (odd, so multiplying by it is a bijection).
const B: u64 = 0x9E37_79B9_7F4A_7C15;

impl PrefixHash {
    /// The prefix hash of a block at position 0.
    #[inline]
    pub fn root(local: LocalHash) -> Self {
        PrefixHash(local.0)
    }

    /// The prefix hash of the block `local` placed after the prefix `self`.
    #[inline]
    pub fn extend(self, local: LocalHash) -> Self {
        PrefixHash(self.0.wrapping_mul(B).wrapping_add(local.0))
    }

    /// The prefix hash of `local` under an optional parent prefix.
    #[inline]
    pub fn child_of(parent: Option<PrefixHash>, local: LocalHash) -> Self {
        match parent {
            None => Self::root(local),
            Some(p) => p.extend(local),
        }
    }
}

/// Fills `out` with the prefix chain of `locals`, one position at a time.
pub fn prefix_chain(locals: &[LocalHash], out: &mut Vec<PrefixHash>) {
    out.clear();
    let mut prev = None;
    for &l in locals {
        let p = PrefixHash::child_of(prev, l);
        out.push(p);
        prev = Some(p);
    }
}

/// Extends `out` (the chain of `locals` so far) up to and including position `upto`, so a
/// lookup computes the chain once and only as deep as its search goes.
#[inline]
pub fn extend_chain(locals: &[LocalHash], out: &mut Vec<PrefixHash>, upto: usize) {
    let upto = upto.min(locals.len().saturating_sub(1));
    if locals.is_empty() || out.len() > upto {
        return;
    }
    let mut p = match out.last() {
        Some(&p) => p,
        None => {
            out.push(PrefixHash::root(locals[0]));
            PrefixHash::root(locals[0])
        }
    };
    for &l in &locals[out.len()..=upto] {
        p = p.extend(l);
        out.push(p);
    }
}

/// A worker: an engine instance and its data-parallel rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerId {
    /// The engine instance, as in its events subject.
    pub worker_id: u64,
    /// Its data-parallel rank: each rank has a cache of its own.
    #[serde(default)]
    pub dp_rank: u32,
}

impl WorkerId {
    /// The worker `worker_id`, rank `dp_rank`.
    pub const fn new(worker_id: u64, dp_rank: u32) -> Self {
        WorkerId { worker_id, dp_rank }
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// One block of a `stored` event: the engine's hash and the local hash of its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's hash: the key later `removed` events name the block by.
    pub block_hash: BlockHash,
    /// The local hash of its tokens: what lookups match on.
    pub tokens_hash: LocalHash,
}

impl StoredBlock {
    /// A block from raw engine and token hashes.
    pub fn new(block_hash: u64, tokens_hash: u64) -> Self {
        StoredBlock { block_hash: BlockHash(block_hash), tokens_hash: LocalHash(tokens_hash) }
    }
}

/// The XXH3 seed of a block.
///
/// Without a LoRA adapter or cache salt it is [`HASH_SEED`]. With either, the seed is
/// `XXH3-64(seed 1337, lora_name ++ 0x00 ++ salt)` (UTF-8, a missing one as the empty
/// string). The identity rule ([`local_hashes`]) seeds every block with the adapter and only
/// a request's first block with its salt.
pub fn block_seed(lora_name: Option<&str>, salt: Option<&str>) -> u64 {
    if lora_name.is_none() && salt.is_none() {
        return HASH_SEED;
    }
    let lora = lora_name.unwrap_or("").as_bytes();
    let salt = salt.unwrap_or("").as_bytes();
    let mut buf = Vec::with_capacity(lora.len() + 1 + salt.len());
    buf.extend_from_slice(lora);
    buf.push(0);
    buf.extend_from_slice(salt);
    xxh3_64_with_seed(&buf, HASH_SEED)
}

/// Local hash of one block of token ids: XXH3-64 of the little-endian u32 ids.
pub fn hash_block_tokens(tokens: &[u32], seed: u64) -> LocalHash {
    let mut buf = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    LocalHash(xxh3_64_with_seed(&buf, seed))
}

/// Local hashes of every *full* block of a request's `tokens`, from its first token; a
/// partial trailing block is not hashed, and a `block_size` of zero yields no blocks.
///
/// The identity rule, whatever the engine: a LoRA adapter seeds every block
/// (`block_seed(lora, None)`), a cache salt only the first (`block_seed(lora, salt)`), as
/// vLLM hashes it. Every later prefix hash chains from the first block, so a salted request
/// still shares nothing with another salt.
pub fn local_hashes(tokens: &[u32], block_size: usize, lora_name: Option<&str>, salt: Option<&str>) -> Vec<LocalHash> {
    local_hashes_ahead(tokens, block_size, lora_name, salt, 0)
}

/// [`local_hashes`] under lookahead hashing (vLLM's `num_hash_lookahead_tokens`): block `i`'s
/// identity also covers the `lookahead` tokens after it ([`with_lookahead`]), so only blocks
/// followed by that many tokens are hashed.
pub fn local_hashes_ahead(
    tokens: &[u32],
    block_size: usize,
    lora_name: Option<&str>,
    salt: Option<&str>,
    lookahead: usize,
) -> Vec<LocalHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let blocks = tokens.len().saturating_sub(lookahead) / block_size;
    let seed = block_seed(lora_name, None);
    let first = if salt.is_some() { block_seed(lora_name, salt) } else { seed };
    (0..blocks)
        .map(|i| {
            let end = (i + 1) * block_size;
            let local = hash_block_tokens(&tokens[end - block_size..end], if i == 0 { first } else { seed });
            if lookahead == 0 {
                local
            } else {
                with_lookahead(local, &tokens[end..end + lookahead])
            }
        })
        .collect()
}

/// A block's local hash with the tokens after it that its identity covers (lookahead
/// hashing): XXH3-64 (seed 1337) of the local hash's 8 little-endian bytes, the byte `0xc1`
/// (never the first byte of msgpack, so this never meets [`with_extra_keys`]'s input), then
/// the tokens as little-endian u32.
pub fn with_lookahead(local: LocalHash, ahead: &[u32]) -> LocalHash {
    // Streamed (the same XXH3-64 as over one buffer), so a lookup allocates nothing per block.
    let mut h = Xxh3::with_seed(HASH_SEED);
    h.update(&local.0.to_le_bytes());
    h.update(&[0xc1]);
    for t in ahead {
        h.update(&t.to_le_bytes());
    }
    LocalHash(h.digest())
}

/// A block's local hash with its extra keys folded in (multimodal content hashes, per-block
/// LoRA or salt): XXH3-64 (seed 1337) of the local hash's 8 little-endian bytes followed by
/// `extra`, the canonical msgpack of the block's extra keys. Blocks of the same placeholder
/// tokens with other images then never match.
pub fn with_extra_keys(local: LocalHash, extra: &[u8]) -> LocalHash {
    let mut buf = Vec::with_capacity(8 + extra.len());
    buf.extend_from_slice(&local.0.to_le_bytes());
    buf.extend_from_slice(extra);
    LocalHash(xxh3_64_with_seed(&buf, HASH_SEED))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hash_matches_xxh3_of_le_bytes() {
        // XXH3-64(seed 1337) of the bytes 01 00 00 00 02 00 00 00 03 00 00 00 04 00 00 00.
        let bytes: Vec<u8> = [1u32, 2, 3, 4].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(hash_block_tokens(&[1, 2, 3, 4], HASH_SEED).0, xxh3_64_with_seed(&bytes, 1337));
        assert_eq!(hash_block_tokens(&[1, 2, 3, 4], HASH_SEED).0, FIXED_1234);
    }

    /// From an independent implementation (python-xxhash 3, `xxh3_64_intdigest(..., seed=1337)`).
    const FIXED_1234: u64 = 0xcb38_e4d7_fb2d_ca5c;

    #[test]
    fn only_full_blocks_are_hashed() {
        let toks: Vec<u32> = (0..10).collect();
        let h = local_hashes(&toks, 4, None, None);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], hash_block_tokens(&[0, 1, 2, 3], HASH_SEED));
        assert_eq!(h[1], hash_block_tokens(&[4, 5, 6, 7], HASH_SEED));
        assert!(local_hashes(&toks, 0, None, None).is_empty());
        assert!(local_hashes(&toks[..3], 4, None, None).is_empty());
    }

    #[test]
    fn lora_seeds_every_block_and_salt_the_first() {
        let toks = [7u32, 8, 9, 10, 11, 12, 13, 14];
        let plain = local_hashes(&toks, 4, None, None);
        let lora = local_hashes(&toks, 4, Some("sql-adapter"), None);
        let salt = local_hashes(&toks, 4, None, Some("tenant-a"));
        let both = local_hashes(&toks, 4, Some("sql-adapter"), Some("tenant-a"));
        let firsts = [plain[0], lora[0], salt[0], both[0]];
        for i in 0..firsts.len() {
            for j in i + 1..firsts.len() {
                assert_ne!(firsts[i], firsts[j]);
            }
        }
        let lora_seed = xxh3_64_with_seed(b"sql-adapter\0", 1337);
        assert_eq!(block_seed(Some("sql-adapter"), None), lora_seed);
        assert_eq!(block_seed(None, Some("tenant-a")), xxh3_64_with_seed(b"\0tenant-a", 1337));
        assert_eq!(lora, vec![hash_block_tokens(&toks[..4], lora_seed), hash_block_tokens(&toks[4..], lora_seed)]);
        assert_eq!(salt[0], hash_block_tokens(&toks[..4], xxh3_64_with_seed(b"\0tenant-a", 1337)));
        assert_eq!(salt[1], plain[1], "the salt is in the first block only");
        assert_eq!(both[1], lora[1]);
        // The first block differs, so every prefix differs.
        let (mut p, mut s) = (Vec::new(), Vec::new());
        prefix_chain(&plain, &mut p);
        prefix_chain(&salt, &mut s);
        assert!(p.iter().zip(&s).all(|(a, b)| a != b));
    }

    #[test]
    fn lookahead_covers_the_tokens_after_each_block() {
        let toks: Vec<u32> = (0..10).collect();
        let ahead = local_hashes_ahead(&toks, 4, None, None, 2);
        assert_eq!(ahead.len(), 2, "a block needs its lookahead tokens: 4 + 2 and 8 + 2 fit in 10");
        assert_eq!(local_hashes_ahead(&toks[..9], 4, None, None, 2).len(), 1);
        let plain = local_hashes(&toks, 4, None, None);
        assert_eq!(ahead[0], with_lookahead(plain[0], &[4, 5]));
        assert_eq!(ahead[1], with_lookahead(plain[1], &[8, 9]));
        assert_ne!(ahead[0], plain[0]);
        let mut other = toks.clone();
        other[5] = 99;
        let changed = local_hashes_ahead(&other, 4, None, None, 2);
        assert_ne!(changed[0], ahead[0], "a token inside the first block's lookahead changes it");
        assert_eq!(local_hashes_ahead(&toks, 4, None, None, 0), plain);
        assert_ne!(with_lookahead(plain[0], &[]), plain[0]);
        // The documented formula: one XXH3-64 over the local hash, 0xc1 and the tokens.
        let bytes: Vec<u8> = [&plain[0].0.to_le_bytes()[..], &[0xc1], &4u32.to_le_bytes(), &5u32.to_le_bytes()].concat();
        assert_eq!(ahead[0].0, xxh3_64_with_seed(&bytes, HASH_SEED));
    }

    #[test]
    fn prefix_chain_is_rolling() {
        let l = [LocalHash(11), LocalHash(22), LocalHash(33)];
        let mut out = Vec::new();
        prefix_chain(&l, &mut out);
        assert_eq!(out[0], PrefixHash(11));
        assert_eq!(out[1].0, 11u64.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(22));
        assert_eq!(out[2], out[1].extend(LocalHash(33)));
        // Same chunk under another parent gives another prefix.
        assert_ne!(PrefixHash(12).extend(LocalHash(22)), out[1]);
    }

    #[test]
    fn extended_chain_equals_the_plain_chain() {
        let locals: Vec<LocalHash> = (0..700u64).map(|i| LocalHash(i.wrapping_mul(0x5851_F42D_4C95_7F2D) ^ 0xABCD)).collect();
        let mut want = Vec::new();
        prefix_chain(&locals, &mut want);
        // Extend in uneven steps, as a lookup does.
        for steps in [vec![0usize, 5, 6, 40, 41, 300, 699], vec![699], vec![3, 2, 1, 1000]] {
            let mut got = Vec::new();
            for s in steps {
                extend_chain(&locals, &mut got, s);
                assert_eq!(&got[..], &want[..got.len()]);
            }
            assert_eq!(got.len(), 700);
        }
        let mut none = Vec::new();
        extend_chain(&[], &mut none, 10);
        assert!(none.is_empty());
    }
}
