//! The reference model: the simplest obviously-correct index, for tests to compare against.
//! Each worker is a map block hash -> (position, prefix); a lookup checks every position of
//! every worker. Slow on purpose; never used to serve.

use super::{ApplyOutcome, Beyond, IndexError, IndexStats, KvIndex, MatchOptions, Saved, SavedBlock, SavedParent, WorkerMatch};
use crate::hash::{prefix_chain, BlockHash, LocalHash, PrefixHash, StoredBlock, WorkerId};
use crate::workers::WorkerRegistry;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};

/// A worker's blocks: engine hash -> (position, prefix).
type Held = HashMap<u64, (u32, PrefixHash)>;

/// The reference backend.
pub struct ReferenceIndex {
    registry: WorkerRegistry,
    max_depth: u32,
    workers: Mutex<HashMap<WorkerId, Held>>,
}

/// The reference writer names its worker (the blocks live in the shared map) and keeps the
/// engine hashes of its blocks past the maximum depth.
pub struct ReferenceWriter(WorkerId, Beyond);

impl ReferenceIndex {
    /// An empty model with the same limits as the backends it checks.
    pub fn new(max_depth: u32, max_workers: u32) -> Self {
        ReferenceIndex { registry: WorkerRegistry::new(max_workers), max_depth, workers: Mutex::new(HashMap::new()) }
    }
}

/// The reference model's answers for a state that no longer changes: each worker's places
/// gathered once, so that checking every lookup of a long replay costs one probe per worker
/// and position instead of a pass over every block.
pub struct FrozenReference {
    /// Each worker and the places it holds.
    workers: Vec<(WorkerId, HashSet<(u32, PrefixHash)>)>,
}

impl FrozenReference {
    /// The answer [`ReferenceIndex::find_matches`] gives in the frozen state.
    pub fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        let mut chain = Vec::new();
        prefix_chain(&query[..n], &mut chain);
        let mut out: Vec<WorkerMatch> = self
            .workers
            .iter()
            .filter(|(id, _)| opts.workers.as_ref().is_none_or(|f| f.contains(&id.worker_id)))
            .filter_map(|(id, places)| {
                let depth = chain.iter().enumerate().take_while(|&(i, p)| places.contains(&(i as u32, *p))).count();
                (depth > 0).then_some(WorkerMatch { worker: *id, blocks: depth as u32 })
            })
            .collect();
        super::order_matches(&mut out, opts.max_matches);
        out
    }
}

impl ReferenceIndex {
    /// Its state, frozen for fast answers (benchmarks check every end-state lookup with it).
    pub fn freeze(&self) -> FrozenReference {
        let all = self.workers.lock();
        FrozenReference { workers: all.iter().map(|(id, held)| (*id, held.values().copied().collect())).collect() }
    }
}

impl KvIndex for ReferenceIndex {
    type Writer = ReferenceWriter;

    fn name(&self) -> &'static str {
        "reference"
    }

    fn registry(&self) -> &WorkerRegistry {
        &self.registry
    }

    fn writer(&self, worker: WorkerId) -> Result<ReferenceWriter, IndexError> {
        self.registry.intern(worker)?;
        self.workers.lock().entry(worker).or_default();
        Ok(ReferenceWriter(worker, Beyond::default()))
    }

    fn worker_id(w: &ReferenceWriter) -> WorkerId {
        w.0
    }

    fn store(&self, w: &mut ReferenceWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let mut all = self.workers.lock();
        let held = all.entry(w.0).or_default();
        let (mut pos, mut prev) = match parent {
            None => (0, None),
            Some(h) => match held.get(&h.0) {
                Some(&(p, prefix)) => (p + 1, Some(prefix)),
                None => {
                    w.1.orphan_store(h, blocks, &mut out);
                    return out;
                }
            },
        };
        for (i, b) in blocks.iter().enumerate() {
            if pos >= self.max_depth {
                out.too_deep += w.1.add(&blocks[i..]);
                break;
            }
            let prefix = PrefixHash::child_of(prev, b.tokens_hash);
            match held.insert(b.block_hash.0, (pos, prefix)) {
                Some(old) if old == (pos, prefix) => out.duplicates += 1,
                Some(_) => {
                    out.replaced += 1;
                    out.stored += 1;
                }
                None => out.stored += 1,
            }
            prev = Some(prefix);
            pos += 1;
        }
        out
    }

    fn remove(&self, w: &mut ReferenceWriter, hashes: &[BlockHash]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let mut all = self.workers.lock();
        let held = all.entry(w.0).or_default();
        for h in hashes {
            let was_beyond = w.1.forget(*h);
            match held.remove(&h.0) {
                Some(_) => out.removed += 1,
                None if was_beyond => {}
                None => out.unknown_removes += 1,
            }
        }
        out
    }

    fn clear(&self, w: &mut ReferenceWriter) -> ApplyOutcome {
        let mut all = self.workers.lock();
        let held = all.entry(w.0).or_default();
        let removed = held.len() as u64;
        held.clear();
        w.1.clear();
        ApplyOutcome { removed, ..Default::default() }
    }

    fn remove_worker(&self, mut w: ReferenceWriter) -> ApplyOutcome {
        let out = self.clear(&mut w);
        self.workers.lock().remove(&w.0);
        self.registry.release(w.0);
        out
    }

    fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        let mut chain = Vec::new();
        prefix_chain(&query[..n], &mut chain);
        let all = self.workers.lock();
        let mut out = Vec::new();
        for (id, held) in all.iter() {
            if opts.workers.as_ref().is_some_and(|f| !f.contains(&id.worker_id)) {
                continue;
            }
            let places: HashSet<(u32, PrefixHash)> = held.values().copied().collect();
            let depth = chain.iter().enumerate().take_while(|&(i, p)| places.contains(&(i as u32, *p))).count();
            if depth > 0 {
                out.push(WorkerMatch { worker: *id, blocks: depth as u32 });
            }
        }
        super::order_matches(&mut out, opts.max_matches);
        out
    }

    fn save(&self, w: &ReferenceWriter) -> Saved {
        let all = self.workers.lock();
        let mut blocks: Vec<SavedBlock> = all
            .get(&w.0)
            .into_iter()
            .flatten()
            .map(|(&hash, &(pos, prefix))| SavedBlock { hash, pos, key: prefix.0, parent: SavedParent::Loose })
            .collect();
        blocks.sort_unstable_by_key(|b| (b.pos, b.hash));
        Saved { blocks, beyond: w.1.to_vec() }
    }

    fn restore(&self, w: &mut ReferenceWriter, saved: &Saved) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let mut all = self.workers.lock();
        let held = all.entry(w.0).or_default();
        for b in &saved.blocks {
            if b.pos >= self.max_depth {
                out.too_deep += 1;
            } else if held.insert(b.hash, (b.pos, PrefixHash(b.key))).is_some() {
                out.duplicates += 1;
            } else {
                out.stored += 1;
            }
        }
        w.1.extend(&saved.beyond);
        out
    }

    fn stats(&self) -> IndexStats {
        let all = self.workers.lock();
        let placements = all.values().map(|h| h.len() as u64).sum();
        let entries = all.values().flat_map(|h| h.values()).collect::<HashSet<_>>().len() as u64;
        IndexStats { placements, entries, workers: self.registry.len() as u64, ..Default::default() }
    }
}
