//! Placements a router announces ("I sent this request to worker W"): one worker's announced
//! blocks, bounded by an LRU and aged out by a TTL, kept in a [`KvIndex`] through that
//! worker's writer. The daemon keeps them in an index of their own for workers that publish
//! events (predictions, answered beside the held depth), and in the main index for workers
//! that publish none (approximate mode).
//!
//! An announced block has no engine hash: a hash of its whole path stands in for one (XXH3
//! under the per-process seed, since routers choose the local hashes), unique per path within
//! the worker, and a removal names it.

use crate::hash::{BlockHash, LocalHash, StoredBlock};
use crate::index::KvIndex;
use crate::seeded::{process_seed, SeededState};
use hashlink::LinkedHashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The key of the block `local` under the path keyed `parent` (0: the root).
fn path_key(parent: u64, local: LocalHash) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    xxh3_64_with_seed(&bytes, process_seed())
}

/// What one announcement or expiry did to a worker's announced blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnnounceOutcome {
    /// Blocks newly held.
    pub added: u64,
    /// Blocks already held whose age was reset.
    pub refreshed: u64,
    /// Blocks dropped because the worker's capacity was reached (least recently announced).
    pub evicted: u64,
    /// Blocks dropped because their TTL ran out.
    pub expired: u64,
    /// Blocks of the announcement not kept: past the worker's capacity, or past the room the
    /// caller's total bound left.
    pub refused: u64,
}

/// One worker's announced blocks.
///
/// Invariant: every held block's parent is held and more recently announced than the block,
/// because an announcement touches its chain from the deepest block to the root. So the held
/// blocks along any path form a prefix of it, and dropping the least recently announced block
/// (by capacity or by age) never leaves a held block without its parent.
pub struct Announced {
    /// Held blocks by path key, least recently announced first, each with the time it was
    /// last announced (caller's clock, in ms); times never decrease along the list.
    lru: LinkedHashMap<u64, u64, SeededState>,
    /// The most blocks held (the engine's cache size, for a routed-only worker).
    capacity: usize,
}

impl Announced {
    /// No blocks yet; at most `capacity` held.
    pub fn new(capacity: usize) -> Self {
        Announced { lru: LinkedHashMap::with_hasher(SeededState::default()), capacity: capacity.max(1) }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }

    /// Holds the chain `locals` (from position 0) as announced at `now_ms`, keeping at most
    /// `room` new blocks beyond those held (the caller's share of a total bound), and writes
    /// the change to `index` through `w`, the worker's writer there.
    pub fn announce<I: KvIndex>(
        &mut self,
        index: &I,
        w: &mut I::Writer,
        locals: &[LocalHash],
        now_ms: u64,
        room: usize,
    ) -> AnnounceOutcome {
        let mut out = AnnounceOutcome::default();
        let kept = locals.len().min(self.capacity);
        out.refused += (locals.len() - kept) as u64;
        let mut prefixes = Vec::with_capacity(kept);
        let mut prev = 0;
        for &l in &locals[..kept] {
            prev = path_key(prev, l);
            prefixes.push(prev);
        }
        // Held blocks along the path are a prefix of it (the invariant): new ones follow them.
        let held = prefixes.iter().take_while(|p| self.lru.contains_key(*p)).count();
        let new = (kept - held).min(room);
        out.refused += (kept - held - new) as u64;
        let end = held + new;
        if new > 0 {
            let parent = held.checked_sub(1).map(|i| BlockHash(prefixes[i]));
            let blocks: Vec<StoredBlock> =
                (held..end).map(|i| StoredBlock { block_hash: BlockHash(prefixes[i]), tokens_hash: locals[i] }).collect();
            index.store(w, parent, &blocks);
        }
        out.added = new as u64;
        out.refreshed = held as u64;
        // Deepest first, so each parent ends up more recent than its children.
        for &p in prefixes[..end].iter().rev() {
            self.lru.insert(p, now_ms);
        }
        let mut gone = Vec::new();
        while self.lru.len() > self.capacity {
            match self.lru.pop_front() {
                Some((p, _)) => gone.push(BlockHash(p)),
                None => break,
            }
        }
        out.evicted = gone.len() as u64;
        if !gone.is_empty() {
            index.remove(w, &gone);
        }
        out
    }

    /// Drops the blocks last announced before `before_ms`, writing the removals to `index`.
    pub fn expire<I: KvIndex>(&mut self, index: &I, w: &mut I::Writer, before_ms: u64) -> AnnounceOutcome {
        let mut gone = Vec::new();
        while let Some((_, &at)) = self.lru.front() {
            if at >= before_ms {
                break;
            }
            if let Some((p, _)) = self.lru.pop_front() {
                gone.push(BlockHash(p));
            }
        }
        if !gone.is_empty() {
            index.remove(w, &gone);
        }
        AnnounceOutcome { expired: gone.len() as u64, ..AnnounceOutcome::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::WorkerId;
    use crate::index::reference::ReferenceIndex;
    use crate::index::runs::RunIndex;
    use crate::index::MatchOptions;
    use proptest::prelude::*;

    fn depth<I: KvIndex>(index: &I, q: &[u64]) -> u32 {
        let q: Vec<LocalHash> = q.iter().map(|&h| LocalHash(h)).collect();
        index.find_matches(&q, &MatchOptions::default()).first().map_or(0, |m| m.blocks)
    }

    fn chain(v: &[u64]) -> Vec<LocalHash> {
        v.iter().map(|&h| LocalHash(h)).collect()
    }

    #[test]
    fn an_announced_chain_matches_until_it_ages_out() {
        let index = RunIndex::default();
        let mut w = index.writer(WorkerId::new(1, 0)).unwrap();
        let mut a = Announced::new(100);
        let out = a.announce(&index, &mut w, &chain(&[1, 2, 3]), 10, usize::MAX);
        assert_eq!((out.added, out.refreshed), (3, 0));
        assert_eq!(depth(&index, &[1, 2, 3, 4]), 3);
        // A longer request along the same path adds only its new blocks, refreshing the rest.
        let out = a.announce(&index, &mut w, &chain(&[1, 2, 3, 4, 5]), 20, usize::MAX);
        assert_eq!((out.added, out.refreshed), (2, 3));
        // Another branch under the first block.
        a.announce(&index, &mut w, &chain(&[1, 9]), 30, usize::MAX);
        assert_eq!(depth(&index, &[1, 9]), 2);
        // At 25, everything announced before then goes: the blocks last touched at 20.
        let out = a.expire(&index, &mut w, 25);
        assert_eq!(out.expired, 4);
        assert_eq!(depth(&index, &[1, 2, 3, 4, 5]), 1);
        assert_eq!(depth(&index, &[1, 9]), 2);
        assert_eq!(a.expire(&index, &mut w, 31).expired, 2);
        assert!(a.is_empty());
        assert_eq!(index.stats().placements, 0);
    }

    #[test]
    fn capacity_drops_the_least_recent_deepest_blocks_first() {
        let index = RunIndex::default();
        let mut w = index.writer(WorkerId::new(1, 0)).unwrap();
        let mut a = Announced::new(4);
        // Longer than the capacity: its first four blocks are kept.
        let out = a.announce(&index, &mut w, &chain(&[1, 2, 3, 4, 5, 6]), 0, usize::MAX);
        assert_eq!((out.added, out.refused, out.evicted), (4, 2, 0));
        assert_eq!(depth(&index, &[1, 2, 3, 4, 5, 6]), 4);
        // Two new blocks under the root: the old chain's two deepest make room.
        let out = a.announce(&index, &mut w, &chain(&[1, 7, 8]), 1, usize::MAX);
        assert_eq!((out.added, out.refreshed, out.evicted), (2, 1, 2));
        assert_eq!(depth(&index, &[1, 2, 3, 4]), 2);
        assert_eq!(depth(&index, &[1, 7, 8]), 3);
        // A caller's room of one keeps one new block.
        let out = a.announce(&index, &mut w, &chain(&[1, 7, 8, 9, 10]), 2, 1);
        assert_eq!((out.added, out.refused), (1, 1));
    }

    proptest! {
        /// Whatever is announced, expired or evicted, the index answers as a model that keeps
        /// each path's last announcement time does: a prefix of each query, never a block
        /// whose parent was dropped.
        #[test]
        fn the_index_follows_the_model(
            ops in prop::collection::vec((prop::collection::vec(0u64..3, 1..6), any::<bool>()), 1..60),
            capacity in 1usize..12,
        ) {
            let index = ReferenceIndex::new(64, 16);
            let mut w = index.writer(WorkerId::new(1, 0)).unwrap();
            let mut a = Announced::new(capacity);
            // The model: path -> last announced, with its own capacity rule.
            let mut model: Vec<(Vec<u64>, u64)> = Vec::new();
            for (t, (path, expire)) in ops.iter().enumerate() {
                let t = t as u64;
                if *expire {
                    a.expire(&index, &mut w, t.saturating_sub(5));
                    model.retain(|(_, at)| *at >= t.saturating_sub(5));
                } else {
                    a.announce(&index, &mut w, &chain(path), t, usize::MAX);
                    let kept = &path[..path.len().min(capacity)];
                    for i in (1..=kept.len()).rev() {
                        model.retain(|(p, _)| p[..] != kept[..i]);
                        model.push((kept[..i].to_vec(), t));
                    }
                    while model.len() > capacity {
                        model.remove(0);
                    }
                }
                prop_assert_eq!(a.len(), model.len());
                for (path, _) in &model {
                    prop_assert!(depth(&index, path) as usize >= path.len(), "{:?} is held", path);
                }
                for q in [[0u64, 0, 0, 0, 0], [0, 1, 2, 0, 1], [1, 1, 1, 1, 1], [2, 0, 2, 1, 0]] {
                    let want = (0..=5).rev().find(|&n| n == 0 || model.iter().any(|(p, _)| p[..] == q[..n])).unwrap_or(0);
                    prop_assert_eq!(depth(&index, &q) as usize, want, "query {:?}", q);
                }
            }
        }
    }
}
