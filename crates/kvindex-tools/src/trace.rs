//! Mooncake traces and the mock engine (docs/STREAM.md) that turns a trace into the
//! event and lookup stream of a fleet of workers with bounded LRU prefix caches.

use crate::stream::StreamOp;
use anyhow::{Context, Result};
use kvindex_core::hash::HASH_SEED;
use rustc_hash::FxHashMap;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::io::BufRead;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// One request of a Mooncake trace.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival time, ms from the start of the trace.
    pub timestamp: u64,
    #[serde(default)]
    pub input_length: u64,
    #[serde(default)]
    pub output_length: u64,
    /// One id per 512-token block; equal ids mean a shared prefix.
    pub hash_ids: Vec<u64>,
}

/// Reads a Mooncake trace (JSONL); a bad line is an error naming its line number.
pub fn read_trace(r: impl BufRead) -> Result<Vec<TraceRequest>> {
    crate::stream::read_jsonl(r, "trace")
}

/// Reads a trace file.
pub fn read_trace_file(path: &std::path::Path) -> Result<Vec<TraceRequest>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    read_trace(std::io::BufReader::new(f))
}

/// The mock engine's settings. The defaults are the reference configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MockConfig {
    /// Workers W.
    pub workers: u64,
    /// LRU capacity C of each worker, in blocks.
    pub capacity: usize,
    /// Length factor F: each trace block becomes F blocks.
    pub factor: u64,
    /// SplitMix64 seed of the worker choice.
    pub seed: u64,
    /// Fraction of evictions that remove a random cached block of the victim's sequence
    /// instead of its tail, leaving its children cached (holes); 0 is the reference engine.
    pub hole_rate: f64,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig { workers: 16, capacity: 16384, factor: 16, seed: 42, hole_rate: 0.0 }
    }
}

/// A stream op with the arrival time of the request that caused it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimedOp {
    pub ts_ms: u64,
    pub op: StreamOp,
}

/// SplitMix64, the worker-choice generator.
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` by the multiply-shift rule.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Local hash of mock block id `b`: XXH3-64 (seed 1337) of its 8 little-endian bytes.
pub fn mock_local_hash(b: u64) -> u64 {
    xxh3_64_with_seed(&b.to_le_bytes(), HASH_SEED)
}

/// Engine hash of a block after `prev`: XXH3-64 (seed 1337) of `prev` LE ++ `local` LE.
pub fn mock_block_hash(prev: u64, local: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&prev.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, HASH_SEED)
}

/// One worker's LRU prefix cache, keyed by engine block hash.
#[derive(Default)]
pub struct PrefixCache {
    stamp_of: FxHashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
    /// Each cached block's parent, to find a victim's sequence when evicting with holes.
    parent_of: FxHashMap<u64, u64>,
}

/// Evictions that leave holes: with probability `rate` an eviction takes a random cached block
/// of the victim's sequence (the victim or an ancestor) instead of the victim.
pub struct Holes<'a> {
    pub rng: &'a mut SplitMix64,
    pub rate: f64,
}

/// What a worker's cache did with one request.
pub struct Served {
    /// Leading blocks found cached (the prefix the request did not have to compute).
    pub hit: usize,
    /// Blocks evicted to make room, least recently used first.
    pub evicted: Vec<u64>,
}

impl PrefixCache {
    fn touch(&mut self, block: u64, stamp: u64) {
        if let Some(old) = self.stamp_of.insert(block, stamp) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(stamp, block);
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    /// No block is cached.
    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }

    /// Leading blocks of `engine` (a request's engine hashes) that are cached.
    pub fn hits(&self, engine: &[u64]) -> usize {
        engine.iter().take_while(|b| self.stamp_of.contains_key(b)).count()
    }

    /// Serves a request: its longest cached prefix hits; least recently used blocks it does not
    /// use make room for its new blocks; then all its blocks are stamped tail-first from
    /// `clock`, as engines free them, so that without holes parents always outlive children.
    /// At most `capacity` blocks stay, except that a request longer than that is stored whole
    /// and the cache keeps that size from then on: the rule every benchmark stream so far was
    /// made with (docs/STREAM.md).
    pub fn serve(&mut self, engine: &[u64], capacity: usize, clock: &mut u64, mut holes: Option<Holes<'_>>) -> Served {
        let hit = self.hits(engine);
        // Past a hole, blocks of the request may still be cached: they take no new room.
        let new = engine[hit..].iter().filter(|b| !self.stamp_of.contains_key(b)).count();
        let over = new.saturating_sub(capacity.saturating_sub(self.len()));
        let mut evicted = Vec::new();
        if over > 0 {
            let used: rustc_hash::FxHashSet<u64> = engine.iter().copied().collect();
            let mut gone = rustc_hash::FxHashSet::default();
            for &v in self.by_stamp.values().filter(|b| !used.contains(b)) {
                if evicted.len() == over {
                    break;
                }
                let hole = holes.as_mut().filter(|h| h.rate > 0.0).and_then(|h| {
                    let roll = h.rng.next_u64() as f64 / 18_446_744_073_709_551_616.0;
                    (roll < h.rate).then_some(h)
                });
                let pick = match hole {
                    Some(h) => {
                        let mut seq = vec![v];
                        let mut cur = v;
                        while let Some(&p) = self.parent_of.get(&cur) {
                            if !self.stamp_of.contains_key(&p) || used.contains(&p) || gone.contains(&p) {
                                break;
                            }
                            seq.push(p);
                            cur = p;
                        }
                        seq[h.rng.below(seq.len() as u64) as usize]
                    }
                    _ => v,
                };
                // A victim already taken as another's ancestor frees nothing: the next one must.
                let pick = if gone.contains(&pick) { v } else { pick };
                if gone.insert(pick) {
                    evicted.push(pick);
                }
            }
            for v in &evicted {
                if let Some(s) = self.stamp_of.remove(v) {
                    self.by_stamp.remove(&s);
                }
                self.parent_of.remove(v);
            }
        }
        for (i, &b) in engine.iter().enumerate().rev() {
            *clock += 1;
            self.touch(b, *clock);
            if i > 0 {
                self.parent_of.insert(b, engine[i - 1]);
            }
        }
        Served { hit, evicted }
    }
}

/// The engine hashes of a chain of local hashes: `B[0] = L[0]`, `B[i] = H(B[i-1], L[i])`.
pub fn chain_hashes(locals: &[u64]) -> Vec<u64> {
    let mut engine = Vec::with_capacity(locals.len());
    for (i, &l) in locals.iter().enumerate() {
        engine.push(if i == 0 { l } else { mock_block_hash(engine[i - 1], l) });
    }
    engine
}

/// A trace request's blocks, numbered: trace block `h` becomes blocks `h*factor..h*factor+factor`.
pub fn request_blocks(req: &TraceRequest, factor: u64) -> impl Iterator<Item = u64> + '_ {
    req.hash_ids.iter().flat_map(move |&h| h * factor..h * factor + factor)
}

/// The token ids of numbered blocks, for runs that ask by tokens: block `g` holds tokens
/// `g*bs..g*bs+bs` (mod 2^32).
pub fn block_tokens(blocks: impl IntoIterator<Item = u64>, bs: u64) -> Vec<u32> {
    blocks.into_iter().flat_map(|g| (0..bs).map(move |k| (g * bs + k) as u32)).collect()
}

/// The local hashes of a trace request's blocks: trace block `h` becomes `factor` blocks.
pub fn request_locals(req: &TraceRequest, factor: u64) -> Vec<u64> {
    request_blocks(req, factor).map(mock_local_hash).collect()
}

/// Turns trace requests into events and lookups, worker by worker, as the rules of
/// `STREAM.md` say; the same configuration always gives the same stream.
pub struct MockEngine {
    cfg: MockConfig,
    rng: SplitMix64,
    /// Chooses holes, apart from the worker choice, so that rate 0 is the reference stream.
    hole_rng: SplitMix64,
    caches: Vec<PrefixCache>,
    event_ids: Vec<u64>,
    clock: u64,
}

impl MockEngine {
    pub fn new(cfg: MockConfig) -> Self {
        MockEngine {
            cfg,
            rng: SplitMix64::new(cfg.seed),
            hole_rng: SplitMix64::new(cfg.seed ^ 0x4F1E_5EED),
            caches: (0..cfg.workers).map(|_| PrefixCache::default()).collect(),
            event_ids: vec![0; cfg.workers as usize],
            clock: 0,
        }
    }

    /// Blocks cached by all workers now.
    pub fn cached_blocks(&self) -> usize {
        self.caches.iter().map(PrefixCache::len).sum()
    }

    fn next_event_id(&mut self, worker: u64) -> u64 {
        let id = self.event_ids[worker as usize];
        self.event_ids[worker as usize] += 1;
        id
    }

    /// The ops of one request, appended to `out`.
    pub fn request(&mut self, req: &TraceRequest, out: &mut Vec<TimedOp>) {
        let locals = request_locals(req, self.cfg.factor);
        let engine = chain_hashes(&locals);
        let worker = self.rng.below(self.cfg.workers);
        let ts_ms = req.timestamp;
        out.push(TimedOp { ts_ms, op: StreamOp::Lookup { local: locals.clone() } });
        let holes = (self.cfg.hole_rate > 0.0).then_some(Holes { rng: &mut self.hole_rng, rate: self.cfg.hole_rate });
        let served = self.caches[worker as usize].serve(&engine, self.cfg.capacity, &mut self.clock, holes);
        if !served.evicted.is_empty() {
            let event_id = self.next_event_id(worker);
            out.push(TimedOp { ts_ms, op: StreamOp::Removed { worker, event_id, seq: served.evicted } });
        }
        let hit = served.hit;
        if hit < locals.len() {
            let parent = if hit == 0 { None } else { Some(engine[hit - 1]) };
            let blocks = (hit..locals.len()).map(|i| (locals[i], engine[i])).collect();
            let event_id = self.next_event_id(worker);
            out.push(TimedOp { ts_ms, op: StreamOp::Stored { worker, event_id, parent, blocks } });
        }
    }

    /// The whole stream of a trace.
    pub fn run(cfg: MockConfig, trace: &[TraceRequest]) -> Vec<TimedOp> {
        let mut engine = MockEngine::new(cfg);
        let mut out = Vec::new();
        for r in trace {
            engine.request(r, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_vectors() {
        // First outputs of SplitMix64 seeded with 0 (the published reference sequence).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn mock_hashes_match_an_independent_xxh3() {
        // python-xxhash: xxh3_64_intdigest(struct.pack('<Q', 0), seed=1337)
        assert_eq!(mock_local_hash(0), 0x60a8_85a6_b03b_1f0a);
    }

    /// Each worker's blocks as the events say (block -> parent).
    type Held = Vec<FxHashMap<u64, Option<u64>>>;

    /// Applies one request's events to `held`, checking that every removed block was held.
    fn mirror(ops: &[TimedOp], held: &mut Held) {
        for op in ops {
            match &op.op {
                StreamOp::Removed { worker, seq, .. } => {
                    for b in seq {
                        assert!(held[*worker as usize].remove(b).is_some());
                    }
                }
                StreamOp::Stored { worker, parent, blocks, .. } => {
                    let mut p = *parent;
                    for &(_, b) in blocks {
                        held[*worker as usize].insert(b, p);
                        p = Some(b);
                    }
                }
                _ => {}
            }
        }
    }

    fn small_trace() -> Vec<TraceRequest> {
        (0..200u64)
            .map(|i| TraceRequest { timestamp: i, input_length: 0, output_length: 0, hash_ids: vec![0, 1 + i % 7, 100 + i] })
            .collect()
    }

    #[test]
    fn lru_keeps_caches_prefix_closed_and_bounded() {
        let cfg = MockConfig { workers: 3, capacity: 20, factor: 2, seed: 7, hole_rate: 0.0 };
        let mut engine = MockEngine::new(cfg);
        let mut ops = Vec::new();
        let mut held: Held = vec![FxHashMap::default(); 3];
        for r in &small_trace() {
            let start = ops.len();
            engine.request(r, &mut ops);
            mirror(&ops[start..], &mut held);
            for h in &held {
                assert!(h.len() <= 20);
                for p in h.values().flatten() {
                    assert!(h.contains_key(p), "a cached block's parent was evicted first");
                }
            }
        }
        assert_eq!(engine.cached_blocks(), held.iter().map(|h| h.len()).sum::<usize>());
    }

    #[test]
    fn holes_leave_orphans_within_capacity() {
        for hole_rate in [0.1, 0.5, 1.0] {
            let cfg = MockConfig { workers: 3, capacity: 20, factor: 2, seed: 7, hole_rate };
            let mut engine = MockEngine::new(cfg);
            let mut ops = Vec::new();
            let mut held: Held = vec![FxHashMap::default(); 3];
            let mut orphans = 0;
            for r in &small_trace() {
                let start = ops.len();
                engine.request(r, &mut ops);
                mirror(&ops[start..], &mut held);
                for h in &held {
                    assert!(h.len() <= 20, "hole rate {hole_rate}: {} blocks cached, capacity 20", h.len());
                    orphans += h.values().flatten().filter(|p| !h.contains_key(p)).count();
                }
                assert_eq!(engine.cached_blocks(), held.iter().map(|h| h.len()).sum::<usize>());
            }
            assert!(orphans > 0, "hole rate {hole_rate} made no hole");
        }
    }
}
