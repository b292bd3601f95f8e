//! Hybrid models: KV-cache groups beside the primary one. A model with sliding-window or
//! state-space (Mamba) layers keeps one group of blocks per layer kind, each cached and
//! evicted on its own; a prefix is reusable only as deep as every group can serve it.
//!
//! The primary group (group 0, full attention) lives in the main index as always. Each other
//! group's blocks are named by engine hash and placed where the worker's primary group holds
//! (or held) the same hash: engines hash a block alike in every group. They are kept as
//! single-block placements keyed by (group, prefix hash) in an index of their own, so a
//! lookup can ask "does worker W hold position i in group g" for the positions it needs.
//!
//! A worker's depth is the largest `e` no deeper than its primary-group depth that every
//! other group accepts as its kind requires ([`crate::hybrid`]).

use crate::digest::{group_member, Digest};
use crate::event::{Event, Tier};
use crate::hash::{BlockHash, LocalHash, PrefixHash, StoredBlock, WorkerId};
use crate::hybrid::{fixed_point, Held};
pub use crate::hybrid::{hybrid_depth, GroupKind, MAX_GROUP};
use crate::index::{ApplyOutcome, KvIndex, MatchOptions, WorkerMatch};
use crate::seeded::SeededMap;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Most blocks a hybrid worker's engine-hash map keeps (all groups together); past it, new
/// blocks are not placed in the other groups (counted as missed), so the worker's depth can
/// only come out shallower than the engine's, never deeper.
pub const MAX_GROUPED_BLOCKS: usize = 1 << 22;

/// The point key of the prefix `p` at position `pos` in group `group`: the position too,
/// since the prefix hash alone is only unique per position.
fn point_key(p: PrefixHash, pos: u32, group: u8) -> LocalHash {
    let mut bytes = [0u8; 13];
    bytes[..8].copy_from_slice(&p.0.to_le_bytes());
    bytes[8..12].copy_from_slice(&pos.to_le_bytes());
    bytes[12] = group;
    LocalHash(xxh3_64_with_seed(&bytes, 0x6b76_6772_6f75_7073))
}

/// The engine hash a group's block goes under in the point index, apart from the same
/// block's other groups (one writer holds all of them).
fn point_hash(h: BlockHash, group: u8) -> BlockHash {
    let mut bytes = [0u8; 9];
    bytes[..8].copy_from_slice(&h.0.to_le_bytes());
    bytes[8] = group;
    BlockHash(xxh3_64_with_seed(&bytes, 0x6b76_6772_6f75_7074))
}

/// The most bits of probe results (rows and columns of holders) one batch of a hybrid lookup
/// keeps: 8 Mi bits, 1 MiB each way, whatever the fleet and the query.
pub const SCRATCH_BITS: usize = 1 << 23;

thread_local! {
    /// The most probe bits a batch of a lookup on this thread kept: for the test of the bound.
    static SCRATCH_PEAK: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The most probe bits a batch of a hybrid lookup on this thread has kept so far (rows and
/// columns), and resets it: what [`SCRATCH_BITS`] bounds.
pub fn scratch_peak() -> usize {
    SCRATCH_PEAK.with(|p| p.replace(0))
}

/// What one lookup learned of one group's positions.
#[derive(Default)]
struct Probed {
    /// The group.
    group: u8,
    /// Position `i` was probed.
    probed: Vec<bool>,
    /// Holders of position `i`: bits of the lookup's hybrid workers, a row per position.
    rows: Vec<u64>,
    /// Every position below it was probed.
    upto: usize,
    /// The same bits by worker (a column of positions each), once a walk needs to skip:
    /// empty until then.
    cols: Vec<u64>,
}

/// One hybrid worker's group as a lookup probes it.
struct At<'a, I> {
    /// The groups' point index.
    points: &'a I,
    /// The query's prefix hashes, as far as this worker's depth.
    chain: &'a [PrefixHash],
    /// The lookup's hybrid workers, sorted: a holder's bit is its place here.
    hybrid: &'a [WorkerId],
    /// Positions a column holds (the query's length).
    span: usize,
    /// What is known of the group.
    p: &'a mut Probed,
    /// The worker's bit.
    bit: usize,
}

impl Probed {
    /// Bits of holders it keeps, rows and columns.
    fn bits(&self) -> usize {
        (self.rows.capacity() + self.cols.capacity()) * 64
    }
}

impl<I: KvIndex> At<'_, I> {
    fn words(&self) -> usize {
        self.hybrid.len().div_ceil(64)
    }

    fn col_words(&self) -> usize {
        self.span.div_ceil(64)
    }

    /// Learns who holds position `i`, once per lookup.
    fn probe(&mut self, i: usize) {
        let (words, cw) = (self.words(), self.col_words());
        let p = &mut *self.p;
        if p.probed.len() <= i {
            // Grown 64 positions at a time, to exactly that: what it keeps is what it uses.
            let n = (i + 1).next_multiple_of(64).min(self.span.max(i + 1));
            p.probed.reserve_exact(n - p.probed.len());
            p.probed.resize(n, false);
            p.rows.reserve_exact(n * words - p.rows.len());
            p.rows.resize(n * words, 0);
        }
        if p.probed[i] {
            return;
        }
        p.probed[i] = true;
        let key = point_key(self.chain[i], i as u32, p.group);
        for h in self.points.find_matches(&[key], &MatchOptions::default()) {
            if let Ok(b) = self.hybrid.binary_search(&h.worker) {
                p.rows[i * words + b / 64] |= 1 << (b % 64);
                if !p.cols.is_empty() {
                    p.cols[b * cw + i / 64] |= 1 << (i % 64);
                }
            }
        }
    }
}

impl<I: KvIndex> Held for At<'_, I> {
    fn held(&mut self, i: usize) -> bool {
        self.probe(i);
        self.p.rows[i * self.words() + self.bit / 64] & (1 << (self.bit % 64)) != 0
    }

    fn below(&mut self, x: usize) -> Option<usize> {
        let (words, cw) = (self.words(), self.col_words());
        if self.p.cols.is_empty() {
            // Columns from the rows probed so far; later probes fill both.
            let p = &mut *self.p;
            p.cols = vec![0; self.hybrid.len() * cw];
            for i in (0..p.probed.len()).filter(|&i| p.probed[i]) {
                for (w, &row) in p.rows[i * words..(i + 1) * words].iter().enumerate() {
                    let mut row = row;
                    while row != 0 {
                        let b = w * 64 + row.trailing_zeros() as usize;
                        row &= row - 1;
                        p.cols[b * cw + i / 64] |= 1 << (i % 64);
                    }
                }
            }
        }
        for i in self.p.upto..x {
            self.probe(i);
        }
        self.p.upto = self.p.upto.max(x);
        let col = &self.p.cols[self.bit * cw..(self.bit + 1) * cw];
        let mut w = x.div_ceil(64);
        while w > 0 {
            w -= 1;
            let mut bits = col[w];
            if w == x / 64 {
                bits &= (1u64 << (x % 64)) - 1;
            }
            if bits != 0 {
                return Some(w * 64 + 63 - bits.leading_zeros() as usize);
            }
        }
        None
    }
}

/// A hybrid worker's non-primary groups and their kinds, by group number.
type GroupList = Arc<[(u8, GroupKind)]>;

/// The other groups of every hybrid worker, for lookups.
pub struct Groups<I> {
    /// (group, prefix) placements: each held block of a non-primary group as a one-block
    /// chain keyed by [`point_key`], so a lookup probes a position with a one-block query.
    points: I,
    /// Each hybrid worker's non-primary groups and their kinds, by group number; written
    /// when a worker's groups change (rarely), read by lookups that meet a hybrid worker.
    kinds: RwLock<SeededMap<WorkerId, GroupList>>,
    /// Workers in `kinds`: lookups skip all of this while it is 0.
    hybrid: AtomicUsize,
    /// The most probe bits a batch of a lookup keeps ([`SCRATCH_BITS`]; a setting for tests).
    scratch_bits: usize,
}

/// A block of a hybrid worker: its place, and the groups holding it.
#[derive(Clone, Copy, Debug)]
struct Grouped {
    /// Its prefix hash, from the primary group's chain.
    prefix: PrefixHash,
    /// Its position in that chain.
    pos: u32,
    /// Bit g set: group g holds it (bit 0: the primary group).
    groups: u64,
}

/// One hybrid worker's group state, owned by its apply thread.
pub struct GroupWriter<W> {
    /// The worker.
    worker: WorkerId,
    /// Its writer in the point index, made on its first group block.
    points: Option<W>,
    /// Every block it holds in any group, by engine hash: where a group's block goes, and
    /// when the last group drops it the entry goes.
    blocks: SeededMap<BlockHash, Grouped>,
    /// Its non-primary groups and their kinds, by group number (what `Groups::kinds` shows).
    kinds: Vec<(u8, GroupKind)>,
    /// The digest of the (group, hash) pairs placed in its non-primary groups, kept as they
    /// come and go ([`crate::digest::group_member`]).
    digest: Digest,
    /// A group block was left unplaced since its last clear (its primary block unknown, or
    /// the bound reached): the digest then differs from its engine's by design.
    unplaced: bool,
}

/// A hybrid worker's group state as a snapshot keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedGroups {
    /// Its non-primary groups and their kinds.
    pub kinds: Vec<(u8, GroupKind)>,
    /// Its blocks: engine hash, prefix hash, position, group mask.
    pub blocks: Vec<(u64, u64, u32, u64)>,
    /// Some group block was left unplaced: the restored digest stays unknown, as it was.
    #[serde(default)]
    pub unplaced: bool,
}

impl<I: KvIndex> Groups<I> {
    /// No hybrid worker yet; `points` holds the groups' placements.
    pub fn new(points: I) -> Self {
        Groups { points, kinds: RwLock::new(SeededMap::default()), hybrid: AtomicUsize::new(0), scratch_bits: SCRATCH_BITS }
    }

    /// The same with batches of a lookup keeping at most `bits` of probe results.
    pub fn with_scratch_bits(mut self, bits: usize) -> Self {
        self.scratch_bits = bits;
        self
    }

    /// A writer for `worker`, which has just shown groups.
    pub fn writer(&self, worker: WorkerId) -> GroupWriter<I::Writer> {
        GroupWriter {
            worker,
            points: None,
            blocks: SeededMap::default(),
            kinds: Vec::new(),
            digest: Digest::default(),
            unplaced: false,
        }
    }

    /// Whether any worker has groups (lookups need [`Groups::limit`] only then).
    pub fn any(&self) -> bool {
        self.hybrid.load(Ordering::Acquire) > 0
    }

    fn publish_kinds(&self, w: &GroupWriter<I::Writer>) {
        let mut kinds = self.kinds.write();
        let had = kinds.insert(w.worker, w.kinds.clone().into()).is_some();
        if !had {
            self.hybrid.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Applies one event of a hybrid worker: the primary group's device chains and removals
    /// are recorded (the main index applies them), the other groups' blocks are placed, a
    /// `cleared` drops every group. Other tiers' events are not the groups' business.
    pub fn apply(&self, w: &mut GroupWriter<I::Writer>, ev: &Event) -> ApplyOutcome {
        match ev {
            Event::Stored { parent, blocks, tier: Tier::Device } => {
                self.primary_stored(w, *parent, blocks);
                ApplyOutcome::default()
            }
            Event::Removed { hashes, tier: Tier::Device } => {
                self.primary_removed(w, hashes);
                ApplyOutcome::default()
            }
            Event::Cleared => self.clear(w),
            Event::GroupStored { group, kind, hashes } => self.store(w, *group, *kind, hashes),
            Event::GroupRemoved { group, hashes } => self.remove(w, *group, hashes),
            Event::Stored { .. } | Event::Removed { .. } => ApplyOutcome::default(),
        }
    }

    /// Records the primary group's chain `blocks` under `parent`, so that the other groups'
    /// blocks of the same hashes find their place. A chain under a parent of unknown place is
    /// not recorded (its blocks will be missed in the other groups).
    pub fn primary_stored(&self, w: &mut GroupWriter<I::Writer>, parent: Option<BlockHash>, blocks: &[StoredBlock]) {
        let (mut prev, mut pos) = match parent {
            None => (None, 0),
            Some(p) => match w.blocks.get(&p) {
                Some(g) => (Some(g.prefix), g.pos.saturating_add(1)),
                None => return,
            },
        };
        for b in blocks {
            let prefix = PrefixHash::child_of(prev, b.tokens_hash);
            prev = Some(prefix);
            let full = w.blocks.len() >= MAX_GROUPED_BLOCKS;
            match w.blocks.get_mut(&b.block_hash) {
                Some(g) => {
                    (g.prefix, g.pos) = (prefix, pos);
                    g.groups |= 1;
                }
                None if !full => {
                    w.blocks.insert(b.block_hash, Grouped { prefix, pos, groups: 1 });
                }
                None => {}
            }
            pos = pos.saturating_add(1);
        }
    }

    /// The primary group dropped `hashes`.
    pub fn primary_removed(&self, w: &mut GroupWriter<I::Writer>, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(g) = w.blocks.get_mut(h) {
                g.groups &= !1;
                if g.groups == 0 {
                    w.blocks.remove(h);
                }
            }
        }
    }

    /// Group `group` (1..=[`MAX_GROUP`], of `kind`) holds `hashes`. A hash the worker's
    /// primary group never placed is missed: its place is unknown.
    pub fn store(&self, w: &mut GroupWriter<I::Writer>, group: u8, kind: GroupKind, hashes: &[BlockHash]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        if group == 0 || group > MAX_GROUP {
            out.group_missed += hashes.len() as u64;
            w.unplaced |= !hashes.is_empty();
            return out;
        }
        match w.kinds.iter_mut().find(|(g, _)| *g == group) {
            Some((_, k)) if *k == kind => {}
            Some((_, k)) => {
                *k = kind;
                self.publish_kinds(w);
            }
            None => {
                w.kinds.push((group, kind));
                w.kinds.sort_unstable_by_key(|(g, _)| *g);
                self.publish_kinds(w);
            }
        }
        let pw = match w.points.as_mut() {
            Some(pw) => pw,
            None => match self.points.writer(w.worker) {
                Ok(pw) => w.points.insert(pw),
                Err(_) => {
                    out.refused += 1;
                    w.unplaced |= !hashes.is_empty();
                    return out;
                }
            },
        };
        let bit = 1u64 << group;
        for &h in hashes {
            let Some(g) = w.blocks.get_mut(&h) else {
                out.group_missed += 1;
                w.unplaced = true;
                continue;
            };
            if g.groups & bit != 0 {
                out.duplicates += 1;
                continue;
            }
            g.groups |= bit;
            w.digest.add(group_member(group, h.0));
            let block = StoredBlock { block_hash: point_hash(h, group), tokens_hash: point_key(g.prefix, g.pos, group) };
            out.stored += self.points.store(pw, None, &[block]).stored;
        }
        out
    }

    /// Group `group` dropped `hashes`; one it does not hold is missed.
    pub fn remove(&self, w: &mut GroupWriter<I::Writer>, group: u8, hashes: &[BlockHash]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let bit = if (1..=MAX_GROUP).contains(&group) { 1u64 << group } else { 0 };
        for h in hashes {
            let held = w.blocks.get_mut(h).filter(|g| g.groups & bit != 0);
            let (Some(g), Some(pw)) = (held, w.points.as_mut()) else {
                out.group_missed += 1;
                continue;
            };
            g.groups &= !bit;
            if g.groups == 0 {
                w.blocks.remove(h);
            }
            w.digest.remove(group_member(group, h.0));
            out.removed += self.points.remove(pw, &[point_hash(*h, group)]).removed;
        }
        out
    }

    /// Every group of the worker lost every block (it keeps its groups' kinds).
    pub fn clear(&self, w: &mut GroupWriter<I::Writer>) -> ApplyOutcome {
        w.blocks.clear();
        (w.digest, w.unplaced) = (Digest::default(), false);
        match w.points.as_mut() {
            Some(pw) => self.points.clear(pw),
            None => ApplyOutcome::default(),
        }
    }

    /// Forgets the worker entirely, freeing its slot in the point index.
    pub fn remove_worker(&self, w: GroupWriter<I::Writer>) -> ApplyOutcome {
        if self.kinds.write().remove(&w.worker).is_some() {
            self.hybrid.fetch_sub(1, Ordering::AcqRel);
        }
        match w.points {
            Some(pw) => self.points.remove_worker(pw),
            None => ApplyOutcome::default(),
        }
    }

    /// Blocks the worker holds in its non-primary groups (one per group holding it).
    pub fn held(&self, w: &GroupWriter<I::Writer>) -> u64 {
        w.blocks.values().map(|g| u64::from((g.groups & !1).count_ones())).sum()
    }

    /// The digest of the worker's non-primary groups, if every group block it was told of
    /// since its last clear was placed (`None`: some were not, so it would differ by design).
    pub fn digest(&self, w: &GroupWriter<I::Writer>) -> Option<Digest> {
        (!w.unplaced).then_some(w.digest)
    }

    /// The worker's group state, for a snapshot.
    pub fn save(&self, w: &GroupWriter<I::Writer>) -> SavedGroups {
        let mut blocks: Vec<(u64, u64, u32, u64)> = w.blocks.iter().map(|(h, g)| (h.0, g.prefix.0, g.pos, g.groups)).collect();
        blocks.sort_unstable();
        SavedGroups { kinds: w.kinds.clone(), blocks, unplaced: w.unplaced }
    }

    /// Rebuilds the worker's group state from [`Groups::save`] (after a clear).
    pub fn restore(&self, w: &mut GroupWriter<I::Writer>, saved: &SavedGroups) -> ApplyOutcome {
        let mut out = self.clear(w);
        for &(h, prefix, pos, groups) in saved.blocks.iter().take(MAX_GROUPED_BLOCKS) {
            w.blocks.insert(BlockHash(h), Grouped { prefix: PrefixHash(prefix), pos, groups: groups & 1 });
        }
        for &(group, kind) in &saved.kinds {
            let hashes: Vec<BlockHash> =
                saved.blocks.iter().filter(|b| group >= 1 && (b.3 >> group) & 1 == 1).map(|b| BlockHash(b.0)).collect();
            out.add(&self.store(w, group, kind, &hashes));
        }
        w.unplaced |= saved.unplaced;
        out
    }

    /// Lowers each hybrid worker's depth in `matches` (its primary-group depth for `query`) to
    /// what all its groups can serve, drops those left at 0, and sorts deepest first (ties by
    /// worker). Workers without groups keep their depth.
    ///
    /// What one lookup allocates is bounded: the probes' bits take two bits per hybrid worker,
    /// group and position (a row and a column), so the hybrid workers are taken in batches of
    /// at most `SCRATCH_BITS / (2 x groups x query length)` (at least 64, a word of bits),
    /// each batch probing for itself: a lookup keeps at most `SCRATCH_BITS`, or 128 bits per
    /// group and position of the query when a batch of 64 needs more.
    pub fn limit(&self, query: &[LocalHash], matches: &mut Vec<WorkerMatch>) {
        if !self.any() {
            return;
        }
        let kinds = self.kinds.read();
        // The hybrid workers among the matches, by worker.
        let mut hybrid: Vec<WorkerId> = matches.iter().map(|m| m.worker).filter(|w| kinds.contains_key(w)).collect();
        if hybrid.is_empty() {
            return;
        }
        hybrid.sort_unstable();
        let groups = hybrid.iter().filter_map(|w| kinds.get(w)).map(|g| g.len()).max().unwrap_or(1);
        let batch = (self.scratch_bits / (2 * groups * query.len().max(1)) / 64 * 64).max(64);
        let mut chain: Vec<PrefixHash> = Vec::new();
        let mut changed = false;
        for part in hybrid.chunks(batch) {
            changed |= self.limit_part(query, part, &kinds, &mut chain, matches);
        }
        if changed {
            matches.retain(|m| m.blocks > 0);
            matches.sort_unstable_by(|a, b| b.blocks.cmp(&a.blocks).then(a.worker.cmp(&b.worker)));
        }
    }

    /// [`Groups::limit`] for the hybrid workers of `hybrid` (sorted): a holder's bit is its
    /// place here. Whether any depth changed.
    fn limit_part(
        &self,
        query: &[LocalHash],
        hybrid: &[WorkerId],
        kinds: &SeededMap<WorkerId, GroupList>,
        chain: &mut Vec<PrefixHash>,
        matches: &mut [WorkerMatch],
    ) -> bool {
        // Per probed group: which positions were probed, and each one's holders among `hybrid`
        // (`words` words per position); each (group, position) is probed once per batch.
        let mut probes: Vec<Probed> = Vec::new();
        let mut mine: Vec<usize> = Vec::new();
        let mut changed = false;
        for m in matches.iter_mut() {
            let Some(groups) = kinds.get(&m.worker) else { continue };
            let Ok(bit) = hybrid.binary_search(&m.worker) else { continue };
            let limit = (m.blocks as usize).min(query.len());
            crate::hash::extend_chain(query, chain, limit.saturating_sub(1));
            mine.clear();
            for &(group, _) in groups.iter() {
                mine.push(match probes.iter().position(|p| p.group == group) {
                    Some(at) => at,
                    None => {
                        probes.push(Probed { group, ..Probed::default() });
                        probes.len() - 1
                    }
                });
            }
            let depth = fixed_point(limit, groups.len(), |j, e| {
                let mut at = At { points: &self.points, chain, hybrid, span: query.len(), p: &mut probes[mine[j]], bit };
                groups[j].1.reduce_held(e, &mut at)
            });
            if depth as u32 != m.blocks {
                m.blocks = depth as u32;
                changed = true;
            }
        }
        SCRATCH_PEAK.with(|p| p.set(p.get().max(probes.iter().map(Probed::bits).sum())));
        changed
    }
}
