//! Peers' indexes behind [`KvIndex`], so `kvindex bench` replays them beside kvindex's own
//! backends in one run (built with `--features peers`). smg's `kv-index` crate, as published:
//! 1.4.0's `PositionalIndexer` (a port of the Flash Indexer design) and 2.0.0's
//! `ChainIndex` (smg's current index); smg's `smg-radix-tree` 0.1.0 `RadixTree`; NVIDIA
//! Dynamo's `dynamo-kv-router` 1.6.1. Each adapter only converts types at the edge; what it
//! cannot express (snapshots, depth limits, per-block outcomes) is said where it happens.
//!
//! Each also answers "every match" in its own form ([`Answering`]), as a router using it would
//! take it: a list or map of every worker's depth, unsorted.

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::{ApplyOutcome, IndexError, IndexStats, KvIndex, MatchOptions, Saved, WorkerMatch};
use kvindex_core::workers::{RegistryError, WorkerRegistry};
use parking_lot::RwLock;
use std::cell::{Cell, RefCell};

use crate::answering::Answering;

/// A peer's answer cut to the `limit` deepest as cheaply as a router using the peer would: the
/// best selected in linear time, only they sorted (deepest first, ties by worker id, the lowest
/// ids kept at the cut: kvindex's rotation among ties is its own choice, not charged to peers).
fn cheapest_cut(out: &mut Vec<WorkerMatch>, limit: Option<usize>) {
    let order = |a: &WorkerMatch, b: &WorkerMatch| b.blocks.cmp(&a.blocks).then(a.worker.cmp(&b.worker));
    if let Some(k) = limit.filter(|&k| k < out.len()) {
        if k == 0 {
            out.clear();
            return;
        }
        out.select_nth_unstable_by(k - 1, order);
        out.truncate(k);
    }
    out.sort_unstable_by(order);
}

/// Workers by the peer's own id, so its scores can be named as kvindex names workers.
#[derive(Default)]
struct Names(RwLock<Vec<Option<WorkerId>>>);

impl Names {
    fn set(&self, id: u32, worker: Option<WorkerId>) {
        let mut names = self.0.write();
        let i = id as usize;
        if names.len() <= i {
            names.resize(i + 1, None);
        }
        names[i] = worker;
    }

    /// A peer's answer (`scores` reports its own worker numbers and depths for the query cut
    /// to `max_blocks`) as kvindex's matches: named, filtered and cut as `opts` asks.
    fn matches(
        &self,
        query: &[LocalHash],
        opts: &MatchOptions,
        scores: impl FnOnce(&[LocalHash], &mut dyn FnMut(u32, u32)),
    ) -> Vec<WorkerMatch> {
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        let names = self.0.read();
        let mut out = Vec::new();
        scores(&query[..n], &mut |peer, depth| {
            let Some(Some(worker)) = names.get(peer as usize) else { return };
            if opts.workers.as_ref().is_none_or(|f| f.contains(&worker.worker_id)) {
                out.push(WorkerMatch { worker: *worker, blocks: depth });
            }
        });
        drop(names);
        cheapest_cut(&mut out, opts.max_matches);
        out
    }
}

/// One adapter per peer: the two share their event API's shape, with their own types.
macro_rules! peer {
    ($(#[$doc:meta])* $name:ident, $writer:ident, $label:literal, $krate:ident, $index:ty, $map:ty, $new:expr, $cap:expr) => {
        $(#[$doc])*
        pub struct $name {
            /// The peer's index.
            index: $index,
            /// kvindex's registry, for the slot bound every backend shares.
            registry: WorkerRegistry,
            /// The peer's worker ids back to kvindex's.
            names: Names,
        }

        /// A worker's write state in the peer's terms, with scratch for converting events.
        pub struct $writer {
            /// kvindex's name for the worker.
            id: WorkerId,
            /// The peer's id for it.
            peer: u32,
            /// The peer's per-worker block map, owned by the caller as its API asks.
            map: $map,
            /// Blocks of the event being converted (reused, so conversion allocates once).
            blocks: Vec<$krate::StoredBlock>,
            /// Hashes of the removal being converted.
            hashes: Vec<$krate::SequenceHash>,
        }

        impl $name {
            /// An empty peer index for up to `max_workers` workers.
            pub fn new(max_workers: u32) -> Self {
                let max_workers = max_workers.min($cap);
                $name {
                    index: $new(max_workers as usize),
                    registry: WorkerRegistry::new(max_workers),
                    names: Names::default(),
                }
            }
        }

        impl KvIndex for $name {
            type Writer = $writer;

            fn name(&self) -> &'static str {
                $label
            }

            fn registry(&self) -> &WorkerRegistry {
                &self.registry
            }

            fn writer(&self, worker: WorkerId) -> Result<$writer, IndexError> {
                self.registry.intern(worker)?;
                let name = format!("{}.{}", worker.worker_id, worker.dp_rank);
                let Ok(peer) = self.index.intern_worker(&name) else {
                    self.registry.release(worker);
                    return Err(RegistryError::Full(self.registry.capacity()).into());
                };
                self.names.set(peer, Some(worker));
                Ok($writer { id: worker, peer, map: Default::default(), blocks: Vec::new(), hashes: Vec::new() })
            }

            fn worker_id(w: &$writer) -> WorkerId {
                w.id
            }

            /// Blocks the peer places count as stored: it reports no duplicates or depth limit.
            fn store(&self, w: &mut $writer, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
                w.blocks.clear();
                w.blocks.extend(blocks.iter().map(|b| $krate::StoredBlock {
                    seq_hash: $krate::SequenceHash(b.block_hash.0),
                    content_hash: $krate::ContentHash(b.tokens_hash.0),
                }));
                let parent = parent.map(|p| $krate::SequenceHash(p.0));
                let n = blocks.len() as u64;
                match self.index.apply_stored(w.peer, &w.blocks, parent, &mut w.map) {
                    Ok(()) => ApplyOutcome { stored: n, ..Default::default() },
                    Err(_) => ApplyOutcome { unplaceable: n, ..Default::default() },
                }
            }

            /// Every hash counts as removed: the peer does not say which it held.
            fn remove(&self, w: &mut $writer, hashes: &[BlockHash]) -> ApplyOutcome {
                w.hashes.clear();
                w.hashes.extend(hashes.iter().map(|h| $krate::SequenceHash(h.0)));
                self.index.apply_removed(w.peer, &w.hashes, &mut w.map);
                ApplyOutcome { removed: hashes.len() as u64, ..Default::default() }
            }

            fn clear(&self, w: &mut $writer) -> ApplyOutcome {
                let removed = w.map.len() as u64;
                self.index.apply_cleared(w.peer, &mut w.map);
                ApplyOutcome { removed, ..Default::default() }
            }

            fn remove_worker(&self, w: $writer) -> ApplyOutcome {
                let removed = w.map.len() as u64;
                self.names.set(w.peer, None);
                self.index.remove_worker(w.peer, w.map);
                self.registry.release(w.id);
                ApplyOutcome { removed, ..Default::default() }
            }

            fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
                self.names.matches(query, opts, |q, report| self.scores(q, report))
            }

            fn stats(&self) -> IndexStats {
                IndexStats {
                    placements: self.index.current_size() as u64,
                    entries: self.index.entry_count() as u64,
                    workers: self.registry.len() as u64,
                    hidden: 0,
                }
            }

            /// The peer keeps no snapshots; `kvindex bench` never takes one.
            fn save(&self, _: &$writer) -> Saved {
                Saved::default()
            }

            /// Nothing saved, so nothing to place: every block counts as unplaceable.
            fn restore(&self, _: &mut $writer, saved: &Saved) -> ApplyOutcome {
                ApplyOutcome { unplaceable: saved.blocks.len() as u64, ..Default::default() }
            }
        }
    };
}

thread_local! {
    /// A lookup's content hashes in smg 1.4.0's type, reused across lookups on a thread.
    static QUERY: RefCell<Vec<smg_positional::ContentHash>> = const { RefCell::new(Vec::new()) };
}

peer!(
    /// smg `kv-index` 1.4.0's `PositionalIndexer`: one `(position, content hash)` table, jump
    /// search (jump 64, its default). Not exact with holes, by its own documentation.
    SmgPositional, SmgPositionalWriter, "smg-positional", smg_positional, smg_positional::PositionalIndexer,
    smg_positional::WorkerBlockMap, |_| smg_positional::PositionalIndexer::new(64), u32::MAX
);

impl SmgPositional {
    /// The peer's answer: its map of worker to depth, as its API returns it.
    fn scores(&self, query: &[LocalHash], mut report: impl FnMut(u32, u32)) {
        QUERY.with_borrow_mut(|q| {
            q.clear();
            q.extend(query.iter().map(|h| smg_positional::ContentHash(h.0)));
            for (worker, depth) in self.index.find_matches(q, false).scores {
                report(worker, depth);
            }
        })
    }
}

peer!(
    /// smg `kv-index` 2.0.0's `ChainIndex`: a tree of runs with per-run worker bitsets, exact
    /// with holes; at most 1,024 workers.
    SmgChain, SmgChainWriter, "smg-chain", smg_chain, smg_chain::ChainIndex, smg_chain::ChainBlockMap,
    smg_chain::ChainIndex::with_max_workers, 1024
);

impl SmgChain {
    /// The peer's answer through its allocation-free walk.
    fn scores(&self, query: &[LocalHash], report: impl FnMut(u32, u32)) {
        self.index.score_into(query, |h| h.0, false, report);
    }
}

thread_local! {
    /// A peer's complete answer as its API gives it (worker, depth), reused.
    static EVERY: RefCell<Vec<(u32, u32)>> = const { RefCell::new(Vec::new()) };
}

/// Every match through the peer's own callback, collected and left unsorted.
fn collected(scores: impl FnOnce(&mut dyn FnMut(u32, u32))) -> usize {
    EVERY.with_borrow_mut(|out| {
        out.clear();
        scores(&mut |w, d| out.push((w, d)));
        out.len()
    })
}

impl Answering for SmgChain {
    fn every_match(&self, query: &[LocalHash]) -> usize {
        collected(|f| self.scores(query, f))
    }
}

impl Answering for SmgPositional {
    fn every_match(&self, query: &[LocalHash]) -> usize {
        collected(|f| self.scores(query, f))
    }
}

/// NVIDIA Dynamo's indexes (`dynamo-kv-router` 1.6.1): its events, converted from kvindex's.
mod dynamo {
    use super::*;
    pub(super) use dynamo_kv_router::indexer::positional::{LevelIndex, PositionalIndexer};
    pub(super) use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
    pub(super) use dynamo_kv_router::protocols::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
        LocalBlockHash, OverlapScores, RouterEvent, WorkerWithDpRank,
    };
    pub(super) use dynamo_kv_router::ConcurrentRadixTreeCompressed;

    thread_local! {
        /// A lookup's local hashes in Dynamo's type, reused across lookups on a thread.
        pub(super) static QUERY: RefCell<Vec<LocalBlockHash>> = const { RefCell::new(Vec::new()) };
    }

    /// A worker's event in Dynamo's terms.
    pub(super) fn event(worker: WorkerId, event_id: u64, data: KvCacheEventData) -> RouterEvent {
        RouterEvent::new(worker.worker_id, KvCacheEvent { event_id, data, dp_rank: worker.dp_rank })
    }

    pub(super) fn stored(parent: Option<BlockHash>, blocks: &[StoredBlock]) -> KvCacheEventData {
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(|p| ExternalSequenceBlockHash(p.0)),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(b.block_hash.0),
                    tokens_hash: LocalBlockHash(b.tokens_hash.0),
                    mm_extra_info: None,
                })
                .collect(),
        })
    }

    pub(super) fn removed(hashes: &[BlockHash]) -> KvCacheEventData {
        KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: hashes.iter().map(|h| ExternalSequenceBlockHash(h.0)).collect(),
        })
    }

    /// The peer's complete answer as it returns it (its map of scores): how many match.
    pub(super) fn every(query: &[LocalHash], find: impl FnOnce(&[LocalBlockHash]) -> OverlapScores) -> usize {
        let scores = QUERY.with_borrow_mut(|q| {
            q.clear();
            q.extend(query.iter().map(|h| LocalBlockHash(h.0)));
            find(q)
        });
        std::hint::black_box(&scores);
        scores.scores.len()
    }

    /// The peer's answer for `query` in kvindex's order.
    pub(super) fn answer(
        query: &[LocalHash],
        opts: &MatchOptions,
        find: impl FnOnce(&[LocalBlockHash]) -> OverlapScores,
    ) -> Vec<WorkerMatch> {
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        let scores = QUERY.with_borrow_mut(|q| {
            q.clear();
            q.extend(query[..n].iter().map(|h| LocalBlockHash(h.0)));
            find(q)
        });
        let mut out: Vec<WorkerMatch> = scores
            .scores
            .into_iter()
            .filter(|&(w, depth)| depth > 0 && opts.workers.as_ref().is_none_or(|f| f.contains(&w.worker_id)))
            .map(|(w, depth)| WorkerMatch { worker: WorkerId::new(w.worker_id, w.dp_rank), blocks: depth })
            .collect();
        cheapest_cut(&mut out, opts.max_matches);
        out
    }
}

thread_local! {
    /// The Dynamo thread pool this thread enqueued events to since its last flush (its
    /// address), so that its next lookup sees its own writes, as in a sequential replay, while
    /// lookups from other threads do not wait.
    static UNFLUSHED: Cell<usize> = const { Cell::new(0) };
}

/// A worker's write state for Dynamo's indexes: its next event id, and (for the positional
/// indexer, which the caller drives) its block map.
pub struct DynamoWriter {
    /// kvindex's name for the worker.
    id: WorkerId,
    /// The id its next event gets.
    next_event: u64,
    /// Its blocks as Dynamo's positional indexer keeps them (empty for the radix tree, whose
    /// pool threads keep theirs).
    blocks: rustc_hash::FxHashMap<dynamo::WorkerWithDpRank, dynamo::LevelIndex>,
}

impl DynamoWriter {
    fn new(id: WorkerId) -> Self {
        DynamoWriter { id, next_event: 0, blocks: Default::default() }
    }

    fn event(&mut self, data: dynamo::KvCacheEventData) -> dynamo::RouterEvent {
        self.next_event += 1;
        dynamo::event(self.id, self.next_event, data)
    }

    fn held(&self) -> i64 {
        self.blocks.values().map(|m| m.len() as i64).sum()
    }
}

/// Dynamo's production default: the compressed concurrent radix tree behind its thread pool,
/// as its router runs it. Events go to the pool's threads (each worker to one); lookups run on
/// the caller's thread. A thread's lookup first waits for the events it enqueued.
pub struct DynamoCrtc {
    /// The pool and the tree it owns.
    pool: dynamo::ThreadPoolIndexer<dynamo::ConcurrentRadixTreeCompressed>,
    /// kvindex's registry, for the slot bound every backend shares.
    registry: WorkerRegistry,
}

impl DynamoCrtc {
    /// The tree behind a pool of `threads` event threads.
    pub fn new(threads: usize, max_workers: u32) -> Self {
        DynamoCrtc {
            pool: dynamo::ThreadPoolIndexer::new(dynamo::ConcurrentRadixTreeCompressed::new(), threads.max(1), 16),
            registry: WorkerRegistry::new(max_workers),
        }
    }

    fn key(&self) -> usize {
        &self.pool as *const _ as usize
    }

    fn enqueue(&self, ev: dynamo::RouterEvent) {
        if self.pool.enqueue_event(ev).is_ok() {
            UNFLUSHED.set(self.key());
        }
    }
}

impl KvIndex for DynamoCrtc {
    type Writer = DynamoWriter;

    fn name(&self) -> &'static str {
        "dynamo-crtc"
    }

    fn registry(&self) -> &WorkerRegistry {
        &self.registry
    }

    fn writer(&self, worker: WorkerId) -> Result<DynamoWriter, IndexError> {
        self.registry.intern(worker)?;
        Ok(DynamoWriter::new(worker))
    }

    fn worker_id(w: &DynamoWriter) -> WorkerId {
        w.id
    }

    /// Blocks the peer is given count as stored: it reports no outcome per block.
    fn store(&self, w: &mut DynamoWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
        let ev = w.event(dynamo::stored(parent, blocks));
        self.enqueue(ev);
        ApplyOutcome { stored: blocks.len() as u64, ..Default::default() }
    }

    fn remove(&self, w: &mut DynamoWriter, hashes: &[BlockHash]) -> ApplyOutcome {
        let ev = w.event(dynamo::removed(hashes));
        self.enqueue(ev);
        ApplyOutcome { removed: hashes.len() as u64, ..Default::default() }
    }

    fn clear(&self, w: &mut DynamoWriter) -> ApplyOutcome {
        let ev = w.event(dynamo::KvCacheEventData::Cleared);
        self.enqueue(ev);
        ApplyOutcome::default()
    }

    fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
        if UNFLUSHED.get() == self.key() {
            self.settle();
        }
        dynamo::answer(query, opts, |q| dynamo::SyncIndexer::find_matches(self.pool.backend(), q, false))
    }

    fn settle(&self) {
        if futures::executor::block_on(self.pool.flush_and_wait()).is_ok() {
            UNFLUSHED.set(0);
        }
    }

    fn stats(&self) -> IndexStats {
        self.settle();
        let shards = futures::executor::block_on(dynamo_kv_router::indexer::KvIndexerInterface::shard_sizes(&self.pool));
        IndexStats {
            placements: shards.iter().map(|s| s.block_count as u64).sum(),
            entries: shards.iter().map(|s| s.node_count as u64).sum(),
            workers: self.registry.len() as u64,
            hidden: 0,
        }
    }

    /// The peer keeps no snapshots; `kvindex bench` never takes one.
    fn save(&self, _: &DynamoWriter) -> Saved {
        Saved::default()
    }

    /// Nothing saved, so nothing to place: every block counts as unplaceable.
    fn restore(&self, _: &mut DynamoWriter, saved: &Saved) -> ApplyOutcome {
        ApplyOutcome { unplaceable: saved.blocks.len() as u64, ..Default::default() }
    }
}

impl Answering for DynamoCrtc {
    fn every_match(&self, query: &[LocalHash]) -> usize {
        if UNFLUSHED.get() == self.key() {
            self.settle();
        }
        dynamo::every(query, |q| dynamo::SyncIndexer::find_matches(self.pool.backend(), q, false))
    }
}

/// Dynamo's positional indexer (the Flash Indexer): a `(position, local hash)` table with jump
/// search, driven directly on the caller's thread with the worker's block map, as Dynamo's
/// pool threads drive it.
pub struct DynamoPositional {
    /// The peer's index.
    index: dynamo::PositionalIndexer,
    /// kvindex's registry, for the slot bound every backend shares.
    registry: WorkerRegistry,
    /// Placements: the writers' block maps' sizes (the index does not count them).
    placements: std::sync::atomic::AtomicI64,
}

impl DynamoPositional {
    /// An empty index probing every `jump` positions.
    pub fn new(jump: usize, max_workers: u32) -> Self {
        DynamoPositional {
            index: dynamo::PositionalIndexer::new_with_mode(
                jump.max(1),
                dynamo_kv_router::indexer::positional::SearchMode::Strided,
            ),
            registry: WorkerRegistry::new(max_workers),
            placements: Default::default(),
        }
    }

    fn apply(&self, w: &mut DynamoWriter, data: dynamo::KvCacheEventData) -> bool {
        let before = w.held();
        let ev = w.event(data);
        let ok = self.index.apply_event(&mut w.blocks, ev, None).is_ok();
        self.placements.fetch_add(w.held() - before, std::sync::atomic::Ordering::Relaxed);
        ok
    }
}

impl KvIndex for DynamoPositional {
    type Writer = DynamoWriter;

    fn name(&self) -> &'static str {
        "dynamo-positional"
    }

    fn registry(&self) -> &WorkerRegistry {
        &self.registry
    }

    fn writer(&self, worker: WorkerId) -> Result<DynamoWriter, IndexError> {
        self.registry.intern(worker)?;
        Ok(DynamoWriter::new(worker))
    }

    fn worker_id(w: &DynamoWriter) -> WorkerId {
        w.id
    }

    /// Blocks the peer places count as stored: it reports no duplicates or depth limit.
    fn store(&self, w: &mut DynamoWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
        let n = blocks.len() as u64;
        if self.apply(w, dynamo::stored(parent, blocks)) {
            ApplyOutcome { stored: n, ..Default::default() }
        } else {
            ApplyOutcome { unplaceable: n, ..Default::default() }
        }
    }

    /// Every hash counts as removed: the peer does not say which it held.
    fn remove(&self, w: &mut DynamoWriter, hashes: &[BlockHash]) -> ApplyOutcome {
        self.apply(w, dynamo::removed(hashes));
        ApplyOutcome { removed: hashes.len() as u64, ..Default::default() }
    }

    fn clear(&self, w: &mut DynamoWriter) -> ApplyOutcome {
        let removed = w.held() as u64;
        self.apply(w, dynamo::KvCacheEventData::Cleared);
        ApplyOutcome { removed, ..Default::default() }
    }

    fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
        dynamo::answer(query, opts, |q| dynamo::SyncIndexer::find_matches(&self.index, q, false))
    }

    fn stats(&self) -> IndexStats {
        IndexStats {
            placements: self.placements.load(std::sync::atomic::Ordering::Relaxed).max(0) as u64,
            entries: 0,
            workers: self.registry.len() as u64,
            hidden: 0,
        }
    }

    /// The peer keeps no snapshots; `kvindex bench` never takes one.
    fn save(&self, _: &DynamoWriter) -> Saved {
        Saved::default()
    }

    /// Nothing saved, so nothing to place: every block counts as unplaceable.
    fn restore(&self, _: &mut DynamoWriter, saved: &Saved) -> ApplyOutcome {
        ApplyOutcome { unplaceable: saved.blocks.len() as u64, ..Default::default() }
    }
}

impl Answering for DynamoPositional {
    fn every_match(&self, query: &[LocalHash]) -> usize {
        dynamo::every(query, |q| dynamo::SyncIndexer::find_matches(&self.index, q, false))
    }
}

/// smg's `smg-radix-tree` 0.1.0 `RadixTree`: chains stored once, membership as runs over
/// hash-consed (interned) holder sets. Its writes take `&mut self` (single-threaded by design),
/// so here it sits behind a `RwLock`: writes exclusive, lookups shared.
pub struct SmgRadix {
    /// The peer's tree.
    tree: RwLock<radix_tree::RadixTree>,
    /// kvindex's registry, for the slot bound every backend shares.
    registry: WorkerRegistry,
    /// The tree's holder index back to kvindex's worker.
    names: Names,
}

/// A worker's holder in the tree, with scratch for converting events.
pub struct SmgRadixWriter {
    /// kvindex's name for the worker.
    id: WorkerId,
    /// The tree's holder.
    holder: radix_tree::HolderId,
    /// Blocks of the event being converted, `(engine hash, local hash)`.
    blocks: Vec<(u64, u64)>,
    /// Hashes of the removal being converted.
    hashes: Vec<u64>,
}

thread_local! {
    /// The tree's lookup scratch and answer rows, reused across lookups on a thread.
    static RADIX: RefCell<(radix_tree::OverlapScratch, Vec<radix_tree::Overlap>, Vec<u64>)> =
        RefCell::new(Default::default());
}

impl SmgRadix {
    /// An empty tree for up to `max_workers` workers.
    pub fn new(max_workers: u32) -> Self {
        SmgRadix {
            tree: RwLock::new(radix_tree::RadixTree::new(radix_tree::Config::default())),
            registry: WorkerRegistry::new(max_workers),
            names: Names::default(),
        }
    }

    /// The tree's answer rows for `query`, as its API gives them, to `report`.
    fn scores(&self, query: &[LocalHash], mut report: impl FnMut(u32, u32)) {
        RADIX.with_borrow_mut(|(scratch, rows, q)| {
            q.clear();
            q.extend(query.iter().map(|h| h.0));
            self.tree.read().overlap(q, scratch, rows);
            for r in rows.iter() {
                report(r.holder.parts().0, r.depth);
            }
        })
    }
}

impl Answering for SmgRadix {
    fn every_match(&self, query: &[LocalHash]) -> usize {
        RADIX.with_borrow_mut(|(scratch, rows, q)| {
            q.clear();
            q.extend(query.iter().map(|h| h.0));
            self.tree.read().overlap(q, scratch, rows);
            rows.len()
        })
    }
}

impl KvIndex for SmgRadix {
    type Writer = SmgRadixWriter;

    fn name(&self) -> &'static str {
        "smg-radix"
    }

    fn registry(&self) -> &WorkerRegistry {
        &self.registry
    }

    fn writer(&self, worker: WorkerId) -> Result<SmgRadixWriter, IndexError> {
        self.registry.intern(worker)?;
        let holder = self.tree.write().create_holder(&format!("{}.{}", worker.worker_id, worker.dp_rank));
        self.names.set(holder.parts().0, Some(worker));
        Ok(SmgRadixWriter { id: worker, holder, blocks: Vec::new(), hashes: Vec::new() })
    }

    fn worker_id(w: &SmgRadixWriter) -> WorkerId {
        w.id
    }

    fn store(&self, w: &mut SmgRadixWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
        w.blocks.clear();
        w.blocks.extend(blocks.iter().map(|b| (b.block_hash.0, b.tokens_hash.0)));
        let n = blocks.len() as u64;
        match self.tree.write().store(w.holder, parent.map(|p| p.0), &w.blocks) {
            Ok(o) => ApplyOutcome { stored: u64::from(o.applied), duplicates: u64::from(o.duplicates), ..Default::default() },
            Err(radix_tree::StoreError::ChainTooLong) => ApplyOutcome { too_deep: n, ..Default::default() },
            Err(_) => ApplyOutcome { unplaceable: n, ..Default::default() },
        }
    }

    fn remove(&self, w: &mut SmgRadixWriter, hashes: &[BlockHash]) -> ApplyOutcome {
        w.hashes.clear();
        w.hashes.extend(hashes.iter().map(|h| h.0));
        let removed = u64::from(self.tree.write().remove(w.holder, &w.hashes));
        ApplyOutcome { removed, unknown_removes: hashes.len() as u64 - removed, ..Default::default() }
    }

    fn clear(&self, w: &mut SmgRadixWriter) -> ApplyOutcome {
        let mut tree = self.tree.write();
        let removed = tree.holder_blocks(w.holder);
        tree.clear(w.holder);
        ApplyOutcome { removed, ..Default::default() }
    }

    fn remove_worker(&self, w: SmgRadixWriter) -> ApplyOutcome {
        let mut tree = self.tree.write();
        let removed = tree.holder_blocks(w.holder);
        self.names.set(w.holder.parts().0, None);
        tree.retire_holder(w.holder);
        drop(tree);
        self.registry.release(w.id);
        ApplyOutcome { removed, ..Default::default() }
    }

    fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
        self.names.matches(query, opts, |q, report| self.scores(q, report))
    }

    fn stats(&self) -> IndexStats {
        let s = self.tree.read().stats();
        IndexStats { placements: s.holder_blocks, entries: s.distinct_entries, workers: self.registry.len() as u64, hidden: 0 }
    }

    /// The peer keeps no snapshots; `kvindex bench` never takes one.
    fn save(&self, _: &SmgRadixWriter) -> Saved {
        Saved::default()
    }

    /// Nothing saved, so nothing to place: every block counts as unplaceable.
    fn restore(&self, _: &mut SmgRadixWriter, saved: &Saved) -> ApplyOutcome {
        ApplyOutcome { unplaceable: saved.blocks.len() as u64, ..Default::default() }
    }
}
