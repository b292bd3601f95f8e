//! The index behind one trait: who holds which block, and who matches a request's prefix.
//!
//! Writes go through a per-worker [`KvIndex::Writer`] that the caller owns exclusively (in the
//! daemon, one apply thread owns each worker's writer), so a worker's reverse map needs no
//! lock. Lookups take `&self` and run on the caller's thread, concurrently with writes.
//!
//! Backends: [`runs::RunIndex`] (the default), [`positional::PositionalIndex`] and the
//! [`reference::ReferenceIndex`] model the tests compare them against.

pub(crate) mod linear;
pub mod positional;
pub mod reference;
pub mod runs;

use crate::digest::Digest;
use crate::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use crate::seeded::SeededState;
use crate::workers::{RegistryError, Slot, SlotBits, WorkerRegistry};
use serde::{Deserialize, Serialize};

/// What one write did, for the caller to count. Bad input is reported here, never a panic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ApplyOutcome {
    /// Blocks newly placed.
    pub stored: u64,
    /// Blocks stored again at the same place (idempotent, nothing changed).
    pub duplicates: u64,
    /// Stored blocks whose engine hash the worker already held elsewhere (old placement dropped).
    pub replaced: u64,
    /// Blocks removed (by `removed` or `cleared`).
    pub removed: u64,
    /// `removed` hashes the worker did not hold.
    pub unknown_removes: u64,
    /// Stored blocks that could not be placed: their parent is not held by the worker.
    pub unplaceable: u64,
    /// Stored blocks beyond the index's maximum depth, or under such a block: ignored, but
    /// remembered, so that the rest of a long chain is not unplaceable (a resync would not
    /// help: the snapshot would send the same chain).
    pub too_deep: u64,
    /// Events not applied because the worker could not be tracked (every slot taken).
    pub refused: u64,
    /// Stored blocks refused because the worker holds the most blocks a worker may: the
    /// worker's state is incomplete, so it is flagged stale.
    pub over_limit: u64,
    /// Host or disk blocks whose parent the worker does not hold in that tier: not placed
    /// there, and no sign that the worker's device state is off (see [`crate::tiers`]).
    pub tier_unplaceable: u64,
    /// Blocks of a hybrid model's other groups not placed (their hash is not held in the
    /// worker's primary group) or removed without being held: the worker's depth can only
    /// come out shallower for them, so they never make it stale (see [`crate::groups`]).
    pub group_missed: u64,
    /// Restatements given up because the snapshot named more blocks than one may: the worker
    /// keeps its old blocks beside the new, so it is stale until a snapshot rebuilds it.
    pub restatements_given_up: u64,
}

impl ApplyOutcome {
    /// The first of `blocks` that fit a worker holding `held` blocks under the bound `max`;
    /// those cut off are counted in `over_limit`. A block the worker holds already (`holds`
    /// its engine hash) takes no room: a chain stored again (a snapshot restating it) is never
    /// over the bound. Asked only when the chain is longer than the room left.
    pub(crate) fn within_bound<'a>(
        &mut self,
        blocks: &'a [StoredBlock],
        held: u64,
        max: u64,
        holds: impl Fn(u64) -> bool,
    ) -> &'a [StoredBlock] {
        let mut room = max.saturating_sub(held);
        if blocks.len() as u64 <= room {
            return blocks;
        }
        let mut fit = 0;
        for b in blocks {
            if !holds(b.block_hash.0) {
                if room == 0 {
                    break;
                }
                room -= 1;
            }
            fit += 1;
        }
        self.over_limit += (blocks.len() - fit) as u64;
        &blocks[..fit]
    }
}

impl ApplyOutcome {
    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &ApplyOutcome) {
        self.stored += other.stored;
        self.duplicates += other.duplicates;
        self.replaced += other.replaced;
        self.removed += other.removed;
        self.unknown_removes += other.unknown_removes;
        self.unplaceable += other.unplaceable;
        self.too_deep += other.too_deep;
        self.refused += other.refused;
        self.over_limit += other.over_limit;
        self.tier_unplaceable += other.tier_unplaceable;
        self.group_missed += other.group_missed;
        self.restatements_given_up += other.restatements_given_up;
    }
}

/// Restrictions on a lookup.
#[derive(Clone, Debug, Default)]
pub struct MatchOptions {
    /// Only these workers (any dp rank) are considered; `None` means all.
    pub workers: Option<Vec<u64>>,
    /// Only the first `max_blocks` blocks of the request are matched.
    pub max_blocks: Option<usize>,
    /// At most this many matches, the deepest; `None` means all. Where the cut falls among
    /// workers tied at one depth, those kept rotate from one lookup to the next (never the
    /// lowest ids every time, which would steer load onto them).
    pub max_matches: Option<usize>,
}

/// Every matching worker grouped by depth, deepest first: the complete answer a router that
/// weighs load needs, at the cost of the distinct depths, not of a sort of the workers (a
/// thousand workers that share a system prompt and nothing after it are one group).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DepthGroups {
    /// Each group's depth and the end of its workers in `workers`, deepest first.
    groups: Vec<(u32, u32)>,
    /// The workers, group after group, in no particular order within a group.
    workers: Vec<WorkerId>,
    /// The last group is the part of a depth's workers that a cut kept (in the rotation's
    /// order, which [`DepthGroups::to_matches`] keeps).
    cut: bool,
}

impl DepthGroups {
    /// Empties it, keeping its allocations.
    pub fn clear(&mut self) {
        self.groups.clear();
        self.workers.clear();
        self.cut = false;
    }

    /// Marks the last group as the part of its depth a cut kept.
    pub(crate) fn set_cut(&mut self) {
        self.cut = true;
    }

    /// Appends a group of `workers` at `depth`, shallower than the last group (an empty
    /// group is left out).
    pub fn push_group(&mut self, depth: u32, workers: impl IntoIterator<Item = WorkerId>) {
        debug_assert!(self.groups.last().is_none_or(|&(d, _)| d > depth), "groups go deepest first");
        self.workers.extend(workers);
        let end = self.workers.len() as u32;
        if self.groups.last().map_or(0, |&(_, e)| e) < end {
            self.groups.push((depth, end));
        }
    }

    /// Appends `worker` to the group being built (closed by [`DepthGroups::close_group`]).
    #[inline]
    pub(crate) fn push_worker(&mut self, worker: WorkerId) {
        self.workers.push(worker);
    }

    /// Closes the group being built at `depth` (shallower than the last): the workers pushed
    /// since the last group (none: no group).
    pub(crate) fn close_group(&mut self, depth: u32) {
        debug_assert!(self.groups.last().is_none_or(|&(d, _)| d > depth), "groups go deepest first");
        let end = self.workers.len() as u32;
        if self.groups.last().map_or(0, |&(_, e)| e) < end {
            self.groups.push((depth, end));
        }
    }

    /// The groups, deepest first: each depth with its workers.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &[WorkerId])> + '_ {
        let mut from = 0;
        self.groups.iter().map(move |&(d, end)| {
            let ws = &self.workers[from as usize..end as usize];
            from = end;
            (d, ws)
        })
    }

    /// Workers in all.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// No worker matches.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Distinct depths.
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// The depth of `worker`, if it matches.
    pub fn depth_of(&self, worker: WorkerId) -> Option<u32> {
        self.iter().find(|(_, ws)| ws.contains(&worker)).map(|(d, _)| d)
    }

    /// One match per worker, deepest first, ties by worker id (the workers a cut kept at its
    /// depth in the rotation's order).
    pub fn to_matches(&self) -> Vec<WorkerMatch> {
        let mut out = Vec::with_capacity(self.len());
        let last = self.groups.len().saturating_sub(1);
        for (i, (blocks, ws)) in self.iter().enumerate() {
            let from = out.len();
            out.extend(ws.iter().map(|&worker| WorkerMatch { worker, blocks }));
            if !(self.cut && i == last) {
                out[from..].sort_unstable_by_key(|m| m.worker);
            }
        }
        out
    }

    /// The groups of `matches`, which are deepest first.
    pub fn from_matches(matches: &[WorkerMatch]) -> DepthGroups {
        let mut g = DepthGroups::default();
        g.extend_from_matches(matches);
        g
    }

    /// Appends the groups of `matches` (deepest first, shallower than what it holds).
    pub fn extend_from_matches(&mut self, matches: &[WorkerMatch]) {
        for chunk in matches.chunk_by(|a, b| a.blocks == b.blocks) {
            self.push_group(chunk[0].blocks, chunk.iter().map(|m| m.worker));
        }
    }

    /// The same answer with each group's workers sorted, for comparing answers.
    pub fn normalized(&self) -> DepthGroups {
        let mut g = self.clone();
        let mut from = 0;
        for &(_, end) in &self.groups {
            g.workers[from as usize..end as usize].sort_unstable();
            from = end;
        }
        g
    }
}

/// One worker's answer: the length of the longest contiguous prefix of the request it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerMatch {
    /// The worker and dp rank.
    pub worker: WorkerId,
    /// Length of the longest contiguous prefix of the request it holds, in blocks.
    pub blocks: u32,
}

/// Size of an index, for metrics and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    /// (worker, block) placements.
    pub placements: u64,
    /// Distinct (position, prefix) entries (positional), or local hashes held by runs (runs).
    pub entries: u64,
    /// Workers holding a slot.
    pub workers: u64,
    /// Placements hidden from lookups because an ancestor is missing (positional only):
    /// they wait for it to be stored again.
    pub hidden: u64,
}

/// One worker's blocks as a snapshot keeps them (see [`KvIndex::save`]): enough for the
/// same backend to rebuild the worker exactly, holes and hidden blocks included.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Saved {
    /// Its blocks, by position (so every parent comes before its children).
    pub blocks: Vec<SavedBlock>,
    /// Engine hashes of its blocks past the maximum depth (see [`ApplyOutcome::too_deep`]), so a chain
    /// continued under one of them stays too deep, not unplaceable.
    pub beyond: Vec<u64>,
}

/// A block of a saved worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBlock {
    /// Its engine hash.
    pub hash: u64,
    /// Its position in the sequence.
    pub pos: u32,
    /// The backend's key of its place: the prefix hash (positional, reference) or the
    /// local hash (runs).
    pub key: u64,
    /// What it hangs under.
    pub parent: SavedParent,
}

/// What a saved block hangs under.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SavedParent {
    /// Nothing: it is at position 0.
    Root,
    /// The worker's block with this engine hash (saved before it).
    Block(u64),
    /// A place the worker does not hold (the block is an orphan), in the backend's terms:
    /// the parent's prefix hash (positional), or the local hashes of its path (runs).
    Place(Vec<u64>),
    /// Unknown: the worker's links were given up (a tangled positional worker); the block
    /// is placed alone.
    Loose,
}

/// Errors of the index itself (not of the input).
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// The worker registry is full.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// A KV-block index backend.
pub trait KvIndex: Send + Sync + 'static {
    /// A worker's private write state (its reverse map); owned by one thread at a time.
    type Writer: Send + 'static;

    /// Backend name, as benchmarks and config spell it.
    fn name(&self) -> &'static str;

    /// The worker registry the backend interns slots in.
    fn registry(&self) -> &WorkerRegistry;

    /// Creates the write state of `worker`, giving it a slot.
    fn writer(&self, worker: WorkerId) -> Result<Self::Writer, IndexError>;

    /// Stores a chain of blocks under `parent` (`None`: the chain starts at position 0).
    fn store(&self, w: &mut Self::Writer, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome;

    /// Removes blocks by engine hash.
    fn remove(&self, w: &mut Self::Writer, hashes: &[BlockHash]) -> ApplyOutcome;

    /// Drops every block of the worker; it keeps its slot.
    fn clear(&self, w: &mut Self::Writer) -> ApplyOutcome;

    /// Drops every block of the worker and frees its slot.
    fn remove_worker(&self, mut w: Self::Writer) -> ApplyOutcome {
        let out = self.clear(&mut w);
        self.registry().release(Self::worker_id(&w));
        out
    }

    /// The worker a writer belongs to.
    fn worker_id(w: &Self::Writer) -> WorkerId;

    /// Workers holding at least the first block of `query`, with their contiguous match
    /// depth, deepest first (ties by worker id; those a cut kept at its depth in the order the
    /// rotation kept them: see [`MatchOptions::max_matches`]).
    ///
    /// Each worker's depth is its depth in one state it passed through while the lookup ran,
    /// and the worker named is the one that held it (see the [module doc](self)).
    fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch>;

    /// [`KvIndex::find_matches`] grouped by depth into `out` (cleared first): the complete
    /// answer at the cost of its distinct depths. Backends answer it natively; by default it
    /// groups `find_matches`.
    fn find_grouped(&self, query: &[LocalHash], opts: &MatchOptions, out: &mut DepthGroups) {
        out.clear();
        out.extend_from_matches(&self.find_matches(query, opts));
    }

    /// Returns once every write accepted so far is applied and the memory it retired is
    /// released (as far as lookups in flight allow), for benchmarks and memory readings. The
    /// backends here apply a write on the caller's thread before returning; the run index
    /// frees what writes retired; an adapter of an index that applies writes on threads of its
    /// own (a peer in the benchmarks) waits for them.
    fn settle(&self) {}

    /// Current size.
    fn stats(&self) -> IndexStats;

    /// The worker's blocks, for a snapshot that [`KvIndex::restore`] of the same backend
    /// reads back.
    fn save(&self, w: &Self::Writer) -> Saved;

    /// Engine hashes the worker holds (past the depth limit not counted): what the inspect
    /// API reports per worker. By default counted from [`KvIndex::save`]; backends count it
    /// from their own map.
    fn held(&self, w: &Self::Writer) -> u64 {
        self.save(w).blocks.len() as u64
    }

    /// The digest of the engine hashes the worker holds, placed or past the maximum depth:
    /// what its publisher's digest of the same blocks must equal (see [`crate::digest`]). By
    /// default computed from [`KvIndex::save`]; the run index keeps its own as blocks come and go.
    fn digest(&self, w: &Self::Writer) -> Digest {
        let saved = self.save(w);
        Digest::of(saved.blocks.iter().map(|b| b.hash).chain(saved.beyond.iter().copied()))
    }

    /// Rebuilds an empty worker from what [`KvIndex::save`] of this backend wrote. A block
    /// that cannot be placed (a parent not saved before it, a position past the maximum
    /// depth) is counted as unplaceable or too deep, never a panic.
    fn restore(&self, w: &mut Self::Writer, saved: &Saved) -> ApplyOutcome;
}

/// Engine hashes of a worker's blocks past the maximum depth. They are never placed, but they
/// are remembered, so that a chain continued under one of them (the next piece of a long
/// chain, or a snapshot's) is counted as too deep as well, not as unplaceable: an unplaceable
/// store makes the worker stale and asks for a snapshot, which would send the same blocks
/// again, forever. Every backend keeps one per writer, with the same rules.
#[derive(Default)]
pub(crate) struct Beyond {
    /// The hashes.
    held: std::collections::HashSet<u64, SeededState>,
    /// Their digest (part of the worker's: the publisher holds these blocks too).
    digest: Digest,
}

impl Beyond {
    /// Whether `hash` is a block past the maximum depth.
    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        !self.held.is_empty() && self.held.contains(&hash.0)
    }

    /// Remembers `blocks` as too deep; returns how many that is.
    pub(crate) fn add(&mut self, blocks: &[StoredBlock]) -> u64 {
        self.extend_hashes(blocks.iter().map(|b| b.block_hash.0));
        blocks.len() as u64
    }

    fn extend_hashes(&mut self, hashes: impl Iterator<Item = u64>) {
        for h in hashes {
            if self.held.insert(h) {
                self.digest.add(h);
            }
        }
    }

    /// What a store of `blocks` under `parent`, a block the worker does not hold, does: the
    /// chain is too deep if its parent was (remembered here), else unplaceable (its place is
    /// unknown). The rule every backend applies.
    pub(crate) fn orphan_store(&mut self, parent: BlockHash, blocks: &[StoredBlock], out: &mut ApplyOutcome) {
        if self.contains(parent) {
            out.too_deep = self.add(blocks);
        } else {
            out.unplaceable = blocks.len() as u64;
        }
    }

    /// Forgets `hash` (it was removed); whether it was there.
    pub(crate) fn forget(&mut self, hash: BlockHash) -> bool {
        let was = !self.held.is_empty() && self.held.remove(&hash.0);
        if was {
            self.digest.remove(hash.0);
        }
        was
    }

    /// Forgets everything (the worker was cleared).
    pub(crate) fn clear(&mut self) {
        *self = Beyond::default();
    }

    /// Every hash past the maximum depth, for a snapshot.
    pub(crate) fn to_vec(&self) -> Vec<u64> {
        self.held.iter().copied().collect()
    }

    /// Remembers saved hashes as too deep.
    pub(crate) fn extend(&mut self, hashes: &[u64]) {
        self.extend_hashes(hashes.iter().copied());
    }

    /// The digest of the hashes.
    pub(crate) fn digest(&self) -> Digest {
        self.digest
    }
}

/// The slots a lookup may consider: every interned slot, or those of the filter's workers.
pub(crate) fn candidate_slots(registry: &WorkerRegistry, opts: &MatchOptions, out: &mut SlotBits) {
    let width = registry.high_water();
    out.fill(width);
    if let Some(filter) = &opts.workers {
        // A set, so that a long filter costs its length once, not once per worker slot.
        let filter: std::collections::HashSet<u64, SeededState> = filter.iter().copied().collect();
        for slot in 0..width {
            if !registry.worker(slot).is_some_and(|id| filter.contains(&id.worker_id)) {
                out.remove(slot);
            }
        }
    }
}

/// Turns `(slot, depth)` pairs into sorted worker matches, at most `limit` of them. The
/// caller is still pinned, so no slot met in the lookup has a new owner yet.
pub(crate) fn finish_matches(registry: &WorkerRegistry, depths: &[(Slot, u32)], limit: Option<usize>) -> Vec<WorkerMatch> {
    let mut out: Vec<WorkerMatch> =
        depths.iter().filter_map(|&(s, blocks)| registry.worker(s).map(|worker| WorkerMatch { worker, blocks })).collect();
    order_matches(&mut out, limit);
    out
}

/// Orders matches deepest first (ties by worker id) and keeps the first `limit`; where the
/// cut falls among workers tied at one depth, those kept are chosen in rotation
/// ([`rotation`]). Public so that adapters of other indexes (the bench's peers) answer alike.
pub fn order_matches(out: &mut Vec<WorkerMatch>, limit: Option<usize>) {
    out.sort_unstable_by(|a, b| b.blocks.cmp(&a.blocks).then(a.worker.cmp(&b.worker)));
    let Some(k) = limit.filter(|&k| k < out.len()) else { return };
    let d = out[k].blocks;
    let from = out.partition_point(|m| m.blocks > d);
    if from < k {
        let to = out.partition_point(|m| m.blocks >= d);
        let tied = &mut out[from..to];
        let start = rotation(tied.len(), k - from);
        tied.rotate_left(start);
        tied[..k - from].sort_unstable_by_key(|m| m.worker);
    }
    out.truncate(k);
}

thread_local! {
    /// Where the next cut among tied workers starts, per thread: it moves on by what each cut
    /// keeps, so consecutive lookups on a thread keep each tied worker equally often. Threads
    /// start at different places (a hash of the thread under the process seed), so that
    /// threads answering a lookup or two each do not all keep the same workers.
    static ROTATION: std::cell::Cell<usize> = std::cell::Cell::new({
        use std::hash::BuildHasher;
        crate::seeded::SeededState::default().hash_one(std::thread::current().id()) as usize
    });
}

/// Where to start keeping `want` of `n` workers tied at the cut (kept cyclically from there):
/// an offset that moves on by `want` each time, so that over lookups on a thread every tied
/// worker is kept equally often.
pub fn rotation(n: usize, want: usize) -> usize {
    if n == 0 {
        return 0;
    }
    ROTATION.with(|r| {
        let start = r.get() % n;
        r.set(start.wrapping_add(want));
        start
    })
}

/// Which backend to build; chosen by config or on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// [`runs::RunIndex`]: a tree of runs with a coverage word per worker (the default).
    Runs,
    /// [`positional::PositionalIndex`]: per-position tables, jump search.
    Positional,
    /// [`reference::ReferenceIndex`]: the simple model the tests compare against.
    Reference,
}

impl Backend {
    /// Every backend, in the order the CLI lists them.
    pub const ALL: [Backend; 3] = [Backend::Runs, Backend::Positional, Backend::Reference];

    /// The backend's config and CLI name.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Runs => "runs",
            Backend::Positional => "positional",
            Backend::Reference => "reference",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Backend::ALL.into_iter().find(|b| b.as_str() == s).ok_or_else(|| {
            let names: Vec<_> = Backend::ALL.iter().map(|b| b.as_str()).collect();
            format!("unknown backend {s:?}; one of {}", names.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `order_matches` as an owned transform, for short assertions.
    fn ordered(mut matches: Vec<WorkerMatch>, limit: Option<usize>) -> Vec<WorkerMatch> {
        order_matches(&mut matches, limit);
        matches
    }

    #[test]
    fn answers_keep_the_deepest_first() {
        let w = |id, blocks| WorkerMatch { worker: WorkerId::new(id, 0), blocks };
        let all = vec![w(3, 1), w(1, 5), w(2, 5), w(4, 2)];
        assert_eq!(ordered(all.clone(), None), vec![w(1, 5), w(2, 5), w(4, 2), w(3, 1)]);
        assert_eq!(ordered(all.clone(), Some(2)), vec![w(1, 5), w(2, 5)]);
        assert_eq!(ordered(all, Some(0)), vec![]);
    }
}
