//! Peers' indexes behind [`KvIndex`], so `kvindex bench` replays them beside kvindex's own
//! backends in one run (built with `--features peers`). smg's `kv-index` crate, as published:
//! 1.4.0's `PositionalIndexer` (the Flash Indexer port issue 13 measured) and 2.0.0's
//! `ChainIndex` (smg's current index). Each adapter only converts types at the edge; what it
//! cannot express (snapshots, depth limits, per-block outcomes) is said where it happens.

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::{order_matches, ApplyOutcome, IndexError, IndexStats, KvIndex, MatchOptions, Saved, WorkerMatch};
use kvindex_core::workers::{RegistryError, WorkerRegistry};
use parking_lot::RwLock;
use std::cell::RefCell;

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
                let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
                let names = self.names.0.read();
                let mut out = Vec::new();
                self.scores(&query[..n], |peer, depth| {
                    let Some(Some(worker)) = names.get(peer as usize) else { return };
                    if opts.workers.as_ref().is_none_or(|f| f.contains(&worker.worker_id)) {
                        out.push(WorkerMatch { worker: *worker, blocks: depth });
                    }
                });
                drop(names);
                order_matches(&mut out, opts.max_matches);
                out
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
